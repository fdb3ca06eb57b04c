"""`python -m calibration run` — thin argparse front end over calibration.pipeline."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from calibration.scales import DEFAULT_PERCENTILE, METHODS
from gsm.cli_support import float_in, int_at_least, tier_fractions

PROG = "python -m calibration"

_INT0, _INT1 = int_at_least(0), int_at_least(1)
_NONNEG, _STEP, _DECAY = float_in(0, math.inf), float_in(0, 1, lo_open=True), float_in(0, 1, hi_open=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="calibrate the latent KV cache of a GSM checkpoint on real text")
    r.add_argument("--checkpoint", type=Path, required=True, help="GSM checkpoint directory")
    r.add_argument("--data", type=Path, help="calibration text (.txt) or token ids (.npy, .bin int32), or a "
                   "directory holding one '*calib*' file (default: the text the converter used)")
    r.add_argument("--eval-data", type=Path, help="held-out data for the report, never fitted on (default: "
                   "the single '*eval*' file beside the calibration file)")
    r.add_argument("--tokenizer", type=Path, help="tokenizer for text data (default: the checkpoint's "
                   "tokenizer.json)")
    r.add_argument("--samples", type=_INT1, default=64, help="calibration sequences (default %(default)s)")
    r.add_argument("--seq-len", type=int_at_least(3), default=256, help="tokens per sequence (default %(default)s)")
    r.add_argument("--method", default="absmax", help=f"INT8 scale method: {' | '.join(METHODS)} "
                   "(default %(default)s)")
    r.add_argument("--percentile", type=float_in(0, 100, lo_open=True), default=DEFAULT_PERCENTILE,
                   help="percentile of |x| for --method percentile (default %(default)s)")
    r.add_argument("--error-budget", type=_NONNEG, default=0.01, help="allowed relative perplexity increase of "
                   "deployed over exact mode when choosing tier fractions (default %(default)s)")
    r.add_argument("--tier-fractions", type=tier_fractions, help="fix FP16,INT12,INT8[,INT4] fractions "
                   "(skips the search)")
    r.add_argument("--fraction-step", type=_STEP, default=0.25, help="grid step of the fraction search")
    r.add_argument("--int4", action="store_true", help="let the search choose the 4-bit tier too (INT4 scales are "
                   "fitted and written either way; off by default: INT4 rows cost +0.8 %% perplexity on SmolLM2 but "
                   "copied 5 of 9 serial numbers at 2K tokens where FP16 rows copied 8, docs/quality.md 2b)")
    r.add_argument("--index-keys", choices=("int8", "fp16"), default="int8", help="indexer keys in the cache: INT8 "
                   "codes with per-channel scales fitted here (half the key's bytes; on SmolLM2 0.5 %% of top-k picks "
                   "move at 2K) or FP16 as before (default %(default)s)")
    r.add_argument("--confidence-z", type=_NONNEG, default=2.0, help="a candidate passes when its perplexity "
                   "increase plus this many standard errors (over sequences) is within the budget; 0 = point "
                   "estimate (default %(default)s)")
    r.add_argument("--sweep", action="store_true", help="also measure every candidate on calibration and "
                   "held-out text and report what each budget would pick (slow; for documentation)")
    r.add_argument("--search-samples", type=_INT1, default=8, help="calibration sequences measured per "
                   "candidate (default %(default)s)")
    r.add_argument("--eval-samples", type=_INT0, default=8, help="held-out sequences for the report; 0 = none")
    r.add_argument("--prefill-len", type=_INT1, help="prefill tokens before the measured decode steps "
                   "(default seq-len / 4)")
    r.add_argument("--adaptation-rate", type=_INT1, default=16, help="decode steps between re-tier passes while "
                   "measuring (default %(default)s; the engine's own rate is gsm_config's)")
    r.add_argument("--fp16-window", type=_INT0, help="quant_config fp16_window (default: keep the checkpoint's)")
    r.add_argument("--hotness-decay", type=_DECAY, help="quant_config hotness_decay (default: keep)")
    r.add_argument("--reservoir", type=_INT1, default=16384, help="latent rows kept per layer for percentile/MSE "
                   "and compensation (default %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="seed of the latent-row reservoir")
    r.add_argument("--threads", type=_INT1, default=1, help="torch threads (default 1, for shared build machines; "
                   "the measurements are batched matrix products and use more threads when cores are free)")
    r.add_argument("--out", type=Path, help="write a calibrated copy here instead of rewriting --checkpoint")
    r.add_argument("--overwrite", action="store_true",
                   help="replace --out (and --report) if they exist and gsm-edge wrote them")
    r.add_argument("--report", type=Path, help="also write the report JSON here")
    return p


def run_command(args: argparse.Namespace) -> int:
    from calibration.data import CalibrationInputError
    from calibration.pipeline import CalibrateOptions, calibrate_checkpoint
    from calibration.report import print_report
    from calibration.writer import CheckpointStateError
    from gsm.atomic import OutputExistsError
    from gsm.checkpoint import CheckpointError
    from gsm.config import ConfigError
    from gsm.outputs import OutputPathError, write_text_atomic

    opts = CalibrateOptions(
        checkpoint=args.checkpoint, data=args.data, eval_data=args.eval_data, tokenizer=args.tokenizer,
        samples=args.samples, seq_len=args.seq_len, method=args.method, percentile=args.percentile,
        error_budget=args.error_budget, search_samples=args.search_samples, eval_samples=args.eval_samples,
        prefill_len=args.prefill_len, adaptation_rate=args.adaptation_rate, fraction_step=args.fraction_step,
        int4=args.int4, index_keys=args.index_keys, confidence_z=args.confidence_z, sweep=args.sweep,
        tier_fractions=args.tier_fractions, fp16_window=args.fp16_window, hotness_decay=args.hotness_decay,
        reservoir=args.reservoir, seed=args.seed, out=args.out, overwrite=args.overwrite)
    try:
        if not args.checkpoint.is_dir():
            raise CalibrationInputError(f"--checkpoint {args.checkpoint}: not a directory")
        check_outputs(args)
        report = calibrate_checkpoint(opts, progress=lambda m: print(f"[calibration] {m}", file=sys.stderr))
    except (CalibrationInputError, CheckpointStateError, CheckpointError, ConfigError, OutputExistsError,
            OutputPathError) as e:
        print(f"{PROG} run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} run: interrupted: {args.checkpoint} is unchanged", file=sys.stderr)
        return 130
    if args.report:
        write_text_atomic(args.report, json.dumps(report, indent=1) + "\n")
    print_report(report)
    if report.get("sweep"):
        from calibration.sweep import print_sweep

        print_sweep(report["sweep"])
    return 0


def check_outputs(args: argparse.Namespace) -> None:
    """--out and --report are safe to write (gsm.outputs), checked before any work."""
    from gsm.outputs import check_output_dir, check_output_file

    inputs = [("--checkpoint", args.checkpoint), ("--data", args.data), ("--eval-data", args.eval_data),
              ("--tokenizer", args.tokenizer)]
    out = args.out if args.out is not None and args.out.resolve() != args.checkpoint.resolve() else None
    if out is not None:
        check_output_dir(out, flag="--out", overwrite=args.overwrite, inputs=inputs)
    if args.report is not None:
        check_output_file(args.report, flag="--report", overwrite=args.overwrite, inputs=inputs,
                          beside=("--out", out) if out is not None else ("--checkpoint", args.checkpoint))


def main(argv: list[str] | None = None) -> int:
    from gsm.cli_support import run_main

    args = build_parser().parse_args(argv)

    def body() -> int:
        import torch

        torch.set_num_threads(args.threads)
        return run_command(args)

    return run_main(f"{PROG} run", body, extra="convert")
