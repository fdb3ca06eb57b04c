"""What every command line of the project shares: flag types and the error/exit-code convention.

Exit codes (README "Exit codes"): 0 ok; 2 bad usage or bad input (argparse's own code, and every
`ValueError` our code raises for input it refuses); 1 a failure while working (an OSError such as
a full disk, a `CommandFailed` such as a backend that cannot start here, a package of an optional
extra that is not installed, or a bug); 130 interrupted. Whatever goes wrong, the user reads one
`error:` line that names the flag, file or tensor, never a traceback; `GSM_EDGE_DEBUG=1` shows the
traceback of an unexpected failure for a bug report.

Every line starts `python -m <package> <command>: error:`, the prefix argparse gives its own usage
errors, so a command says who refused the same way whichever layer did.

Numeric flags are range-checked by their argparse `type`, so a bad value is refused before any
work with argparse's "argument --flag: ..." wording and exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable

from gsm.atomic import OutputExistsError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
# a missing module of these is a bug of ours, not an extra left out
OWN_PACKAGES = frozenset({"gsm", "builder", "calibration", "runtime", "jetson", "gsm_edge_plugins"})


class CommandFailed(Exception):
    """A failure while working that is not a bug: this machine lacks what the command needs (a backend that
    cannot start, TensorRT, a GPU). run_main prints the message as the error line and exits 1."""


def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer >= lo (and <= hi)."""
    what = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite float in the interval [lo, hi] (ends open as asked; hi may be inf)."""
    what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v

    parse.__name__ = what
    return parse


def tier_fractions(text: str) -> tuple[float, ...]:
    """argparse type of --tier-fractions: F16,F12,F8 or F16,F12,F8,F4, non-negative, summing to 1."""
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected three numbers like 0.25,0.25,0.5, got {text!r}") from e
    if len(parts) not in (3, 4) or any(not p >= 0 for p in parts) or abs(sum(parts) - 1.0) > 1e-6:
        raise argparse.ArgumentTypeError("expected three (FP16,INT12,INT8) or four (…,INT4) non-negative fractions "
                                         f"summing to 1, got {text!r}")
    return parts


def error(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)


def missing_package(e: ImportError, extra: str | None) -> str:
    """The error line for a package that is not installed; `extra`: the pip extra of the command."""
    if extra is not None:
        return f"this command needs the {extra} extra: pip install \"gsm-edge[{extra}]\" ({e})"
    return f"a package this command needs is not installed ({e}); README \"What each install holds\" names its extra"


def run_main(prog: str, body: Callable[[], int], *, extra: str | None = None) -> int:
    """Run a command body under the project's exit-code convention (see the module docstring).

    prog: `python -m <package> <command>`; extra: the pip extra whose packages the command imports, named
    when one is missing. A package that is not installed exits 1, not 2: the same command line works once
    it is, so it is the machine that lacks something, not the input that is wrong."""
    try:
        return body()
    except KeyboardInterrupt:
        error(prog, "interrupted; nothing was written (outputs are only renamed into place when complete)")
        return EXIT_INTERRUPTED
    except (ValueError, OutputExistsError) as e:  # every input refusal of this project is one of these
        error(prog, str(e))
        return EXIT_BAD_INPUT
    except OSError as e:
        error(prog, f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
        return EXIT_FAILED
    except CommandFailed as e:
        error(prog, str(e))
        return EXIT_FAILED
    except ImportError as e:
        if (e.name or "").split(".")[0] in OWN_PACKAGES:
            return _internal_error(prog, e)
        error(prog, missing_package(e, extra))
        return EXIT_FAILED
    except Exception as e:
        return _internal_error(prog, e)


def _internal_error(prog: str, e: BaseException) -> int:
    """A bug: still one line, the traceback on request."""
    if os.environ.get("GSM_EDGE_DEBUG"):
        traceback.print_exception(e)
    error(prog, f"internal error ({type(e).__name__}: {e}); rerun with GSM_EDGE_DEBUG=1 for the "
                "traceback and report it")
    return EXIT_FAILED


def console(*, stderr: bool = True, **kw: object):  # -> rich.console.Console (rich stays optional)
    """A rich Console that never wraps at 80 columns when the output is a file or a pipe.

    Rich assumes 80 columns without a terminal, which split paths and commands in logs and CI output;
    there, lines keep their natural length (tables too: they never expand to the width).
    """
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 100_000
    return Console(stderr=stderr, width=width, **kw)
