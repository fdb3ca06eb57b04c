"""`python -m gsm verify|synth|patch|convert` — thin CLI over gsm.checker, gsm.synth, gsm.patch and gsm.convert.

Exit codes follow gsm.cli_support: 0 ok, 2 bad usage or bad input (an invalid checkpoint too),
1 a failure while working, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gsm.cli_support import run_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gsm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check that DIR is a real GSM checkpoint")
    v.add_argument("dir")
    v.add_argument("--json", action="store_true", help="print a machine-readable report")

    s = sub.add_parser("synth", help="write a seeded random GSM checkpoint")
    s.add_argument("--preset", required=True, choices=["tiny", "small", "1b"])
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a directory gsm-edge wrote before")

    pa = sub.add_parser("patch", help="change a checkpoint's run-time knobs by a JSON Patch (RFC 6902)")
    pa.add_argument("dir")
    pa.add_argument("--patch", required=True, help="JSON file: an RFC 6902 array over {\"gsm_config\": ..., "
                    "\"kv_quantization\": ...}")
    pa.add_argument("--out", help="write the patched checkpoint here (default: DIR, rewritten atomically)")
    pa.add_argument("--overwrite", action="store_true", help="replace --out if it is a directory gsm-edge wrote")

    c = sub.add_parser("convert", help="dense LLaMA-family model -> GSM checkpoint")
    from gsm.convert.cli import add_arguments

    add_arguments(c)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        from gsm.checker import verify_command

        return run_main("python -m gsm verify", lambda: verify_command(args.dir, as_json=args.json))
    if args.command == "synth":
        from gsm.synth import synth_command

        return run_main("python -m gsm synth", lambda: synth_command(args.preset, args.out, seed=args.seed,
                                                                     overwrite=args.overwrite))
    if args.command == "patch":
        from gsm.patch import patch_command

        return run_main("python -m gsm patch", lambda: patch_command(args.dir, args.patch, args.out, args.overwrite))
    from gsm.convert.cli import convert_command

    return run_main("python -m gsm convert", lambda: convert_command(args), extra="convert")


if __name__ == "__main__":
    sys.exit(main())
