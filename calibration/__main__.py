"""`python -m calibration run ...` (see calibration.cli)."""

import sys

from calibration.cli import main

if __name__ == "__main__":
    sys.exit(main())
