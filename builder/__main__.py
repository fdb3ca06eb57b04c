"""`python -m builder build|engine` — thin CLI over builder.build and builder.trt_engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from builder.plan import (
    DEFAULT_INT8_GROUP_SIZE,
    GSM_CHOICES,
    HEAD_CHOICES,
    HEAD_GROUP_SIZES,
    INT4_GRIDS,
    PER_CHANNEL,
    WEIGHT_CHOICES,
)
from gsm.cli_support import EXIT_BAD_INPUT, CommandFailed, int_at_least, run_main, tier_fractions

PROG = "python -m builder"


def group_size_arg(text: str) -> int:
    """--group-size: an integer >= 16 (build checks the power of two) or `channel` (plan.PER_CHANNEL)."""
    if text == "channel":
        return PER_CHANNEL
    return int_at_least(16)(text)


def build_parser() -> argparse.ArgumentParser:
    from jetson import device_names

    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="GSM checkpoint -> bundle (ONNX graphs, weights, plan, engine if possible)")
    b.add_argument("--device", required=True, help=f"target: auto, {', '.join(device_names())}")
    b.add_argument("--checkpoint", type=Path, help="GSM checkpoint directory (default: a synthetic demo model)")
    b.add_argument("--output", type=Path, help="bundle directory (default: out/<checkpoint>-<device>)")
    b.add_argument("--max-seq", type=int_at_least(1), help="engine max sequence length (default: the model's)")
    b.add_argument("--max-batch", type=int_at_least(1), default=1)
    b.add_argument("--max-input", type=int_at_least(1),
                   help="most new tokens per call (prefill chunk; default min(max-seq, 512))")
    b.add_argument("--calibration", type=Path, help="kv_calibration.safetensors to use instead of the checkpoint's")
    b.add_argument("--tier-fractions", type=tier_fractions, help="KV tier fractions F16,F12,F8[,F4] instead of the "
                   "checkpoint's (calibrated tables still required for INT4 rows)")
    b.add_argument("--index-keys", choices=["int8", "fp16"], help="indexer keys in the cache (default: the "
                   "checkpoint's index_key_bits; int8 needs the calibration's index_key.scale_int8 tables)")
    b.add_argument("--logits", choices=["last", "all"], default="last")
    b.add_argument("--trt-precision", choices=["fp16", "fp32"], default="fp16",
                   help="activations of model.onnx (fp32: to check the plugin path against the portable graph)")
    b.add_argument("--uncalibrated", choices=["fp16", "data-free"], default="fp16",
                   help="a checkpoint without calibration tables: keep the KV cache FP16 (default, safe) or use "
                   "INT12/INT8 tiers with data-free scales (measurably worse on real models)")
    b.add_argument("--weights", choices=[*WEIGHT_CHOICES, "auto"], default="fp16",
                   help="projection weights (q, o, gate, up, down): fp16, INT8 per channel, INT4 per group, or auto "
                   "(the highest precision whose memory plan fits the device at --max-seq)")
    b.add_argument("--group-size", type=group_size_arg,
                   help="INT4/INT8 group along the input dimension, a power of two >= 16, or `channel` (INT8 only: "
                   "one group per output row); default 128 for int4 (or the detected grid's) and "
                   f"{DEFAULT_INT8_GROUP_SIZE} for int8")
    b.add_argument("--int4-grid", choices=["auto", *INT4_GRIDS], default="auto",
                   help="INT4 codes: sym (symmetric), asym-f (min/max grid with a float zero point, reproduces a "
                   "Q4_1 source), auto (asym-f when the weights already lie on such a grid, else sym)")
    b.add_argument("--head-weights", choices=list(HEAD_CHOICES),
                   help="the embedding and LM head (one tensor when tied): fp16, or INT8 / INT4 symmetric per group "
                   f"of {HEAD_GROUP_SIZES[8]} / {HEAD_GROUP_SIZES[4]}; default int8 for --weights int8 and int4 "
                   "(an INT4 head costs far more "
                   "quality), fp16 for fp16; fp16 keeps the float head of a quantised build")
    b.add_argument("--gsm-weights", choices=list(GSM_CHOICES), help="the GSM-side projections of owning layers "
                   "(latent down-projections, indexer): fp16, or INT8 per output channel (default: int8 with "
                   "--weights int8|int4, else fp16)")
    b.add_argument("--matmul-accuracy", choices=["exact", "fast"],
                   help="portable graph's quantised matmuls: exact (float32 on the dequantised weights) or fast "
                   "(ONNX Runtime quantises activations to INT8 blocks); default exact, fast for int8")
    b.add_argument("--awq-scales", type=Path, help="AWQ input-channel scales from `python -m calibration.awq` "
                   "(with --weights int4 --int4-grid sym)")
    b.add_argument("--max-top-k", type=int_at_least(0),
                   help="largest per-sequence selection budget the TensorRT graph takes (default: the model's "
                   "sparse_top_k; up to max-seq lets a sequence switch to dense attention there, at the cost of "
                   "larger per-layer selection outputs, docs/engine_io.md 4.2); the portable graph takes any budget")
    b.add_argument("--overwrite", action="store_true",
                   help="replace --output if it is a bundle directory gsm-edge wrote before")
    b.add_argument("--json", action="store_true", help="print report.json instead of the human summary")
    e = sub.add_parser("engine", help="build engine.plan into a bundle (needs TensorRT and a GPU)")
    e.add_argument("bundle", type=Path)
    return p


def _build(args: argparse.Namespace) -> int:
    from builder.build import BuildError, build, summary
    from gsm.cli_support import console

    err = console(highlight=False)
    status = err.status("starting") if sys.stderr.isatty() and not args.json else None

    def step(msg: str) -> None:
        if status is not None:
            status.update(msg)
        elif not args.json:
            err.print(f"[dim]... {msg}[/]")

    def say(msg: str) -> None:
        err.print(f"[yellow]{msg}[/]")

    try:
        if status is not None:
            status.start()
        r = build(device=args.device, checkpoint_dir=args.checkpoint, output=args.output, max_seq=args.max_seq,
                  max_batch=args.max_batch, max_input=args.max_input, calibration=args.calibration,
                  overwrite=args.overwrite, logits=args.logits, trt_precision=args.trt_precision,
                  uncalibrated=args.uncalibrated, weights=args.weights, group_size=args.group_size,
                  int4_grid=args.int4_grid, head_weights=args.head_weights, matmul_accuracy=args.matmul_accuracy,
                  awq_scales=args.awq_scales, max_top_k=args.max_top_k, tier_fractions=args.tier_fractions,
                  index_keys=args.index_keys, gsm_weights=args.gsm_weights,
                  say=say, step=step)
    except BuildError as e:  # a refusal: bad input, nothing written
        if status is not None:
            status.stop()
        err.print(f"[red]{PROG} build: error:[/] {e}", markup=True)
        return EXIT_BAD_INPUT
    finally:
        if status is not None:
            status.stop()
    if args.json:
        sys.stdout.write(json.dumps(r.report, indent=2, sort_keys=True) + "\n")
    else:
        print(summary(r))
    return 0


def _engine(args: argparse.Namespace) -> int:
    from builder.trt_engine import EngineUnavailable, engine_command

    try:
        rec = engine_command(args.bundle)
    except EngineUnavailable as e:  # no TensorRT or no GPU here: the environment, not the input
        raise CommandFailed(str(e)) from None
    print(f"built {args.bundle / rec['file']} with TensorRT {rec['tensorrt']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "build":
        return run_main(f"{PROG} build", lambda: _build(args), extra="builder")
    return run_main(f"{PROG} engine", lambda: _engine(args))


if __name__ == "__main__":
    sys.exit(main())
