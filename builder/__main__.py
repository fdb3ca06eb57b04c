"""`python -m builder build|engine` — thin CLI over builder.build and builder.trt_engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from builder.build_config import BuildConfig
from builder.plan import (
    DEFAULT_GSM,
    DEFAULT_HEAD,
    DEFAULT_HEAD_CALIBRATED,
    DEFAULT_INT8_GROUP_SIZE,
    DEFAULT_WEIGHTS,
    GSM_CHOICES,
    HEAD_CHOICES,
    HEAD_GROUP_SIZES,
    INT4_GRIDS,
    PER_CHANNEL,
    ROW_CACHE_TOP_K_FACTOR,
    WEIGHT_CHOICES,
)
from gsm.cli_support import EXIT_BAD_INPUT, CommandFailed, int_at_least, run_main, tier_fractions

PROG = "python -m builder"
READ_BYTES, READ_UNIT = 1 << 20, "MiB"  # the unit of a build's progress while the checkpoint streams


def group_size_arg(text: str) -> int:
    """--group-size: an integer >= 16 (build checks the power of two) or `channel` (plan.PER_CHANNEL)."""
    if text == "channel":
        return PER_CHANNEL
    return int_at_least(16)(text)


def by_weights(default: dict[str, str], calibrated: dict[str, str] | None = None) -> str:
    """A default that depends on --weights, in words: `fp16 for fp16, int8 for int8, ...` (the dicts of plan)."""
    words = []
    for w in WEIGHT_CHOICES:
        if calibrated is not None and calibrated[w] != default[w]:
            words.append(f"{calibrated[w]} for {w} when the calibration has the head's input moment (GPTQ), "
                         f"else {default[w]}")
        else:
            words.append(f"{default[w]} for {w}")
    return ", ".join(words)


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
    b.add_argument("--weights", choices=[*WEIGHT_CHOICES, "auto"], default=DEFAULT_WEIGHTS,
                   help="projection weights (q, o, gate, up, down): fp16, INT8 or INT4 per group, or auto (the highest "
                   f"precision whose memory plan fits the device at --max-seq). Default {DEFAULT_WEIGHTS}: with no "
                   "--weights every weight stays FP16 on the device (projections, embedding / LM head, GSM side; "
                   "weights.bin holds them as float32 for ONNX Runtime); a Q4_1 source keeps its grid with "
                   "--weights int4 (docs/weights.md)")
    b.add_argument("--group-size", type=group_size_arg,
                   help="INT4/INT8 group along the input dimension, a power of two >= 16, or `channel` (INT8 only: "
                   "one group per output row); default 128 for int4 (or the detected grid's) and "
                   f"{DEFAULT_INT8_GROUP_SIZE} for int8")
    b.add_argument("--int4-grid", choices=["auto", *INT4_GRIDS], default="auto",
                   help="INT4 codes: sym (symmetric), asym-f (min/max grid with a float zero point, reproduces a "
                   "Q4_1 source), auto (asym-f when the weights already lie on such a grid, else sym)")
    b.add_argument("--head-weights", choices=list(HEAD_CHOICES),
                   help="the embedding and LM head (one tensor when tied): fp16, INT8 symmetric per group of "
                   f"{HEAD_GROUP_SIZES[8]}, or INT4 per group of {HEAD_GROUP_SIZES[4]}; default by --weights: "
                   f"{by_weights(DEFAULT_HEAD, DEFAULT_HEAD_CALIBRATED)} (an INT4 head rounded to nearest costs "
                   "far more quality); fp16 keeps the float head of a quantised build")
    b.add_argument("--gsm-weights", choices=list(GSM_CHOICES), help="the GSM-side projections of owning layers "
                   "(latent down-projections, indexer): fp16, or INT8 per output channel; default by --weights: "
                   f"{by_weights(DEFAULT_GSM)}")
    b.add_argument("--matmul-accuracy", choices=["exact", "fast"],
                   help="portable graph's quantised matmuls: exact (float32 on the dequantised weights) or fast "
                   "(ONNX Runtime quantises activations to INT8 blocks); default fast when anything is quantised, "
                   "else exact")
    b.add_argument("--awq-scales", type=Path, help="AWQ input-channel scales from `python -m calibration.awq` "
                   "(with --weights int4 --int4-grid sym)")
    b.add_argument("--max-top-k", type=int_at_least(0),
                   help="largest per-sequence selection budget the TensorRT graph takes (default: the model's "
                   "sparse_top_k; up to max-seq lets a sequence switch to dense attention there, at the cost of "
                   "larger per-layer selection outputs, docs/engine_io.md 4.2); the portable graph takes any budget")
    b.add_argument("--max-adaptation-rate", type=int_at_least(1), default=0,
                   help="room in the cache's FP16 region for re-tier passes this many decode steps apart (default: "
                        "the model's quantization_adaptation_rate), so that `runtime patch` or a server's "
                        "PATCH /admin/config may lengthen the rate up to it (docs/serving.md \"Changing knobs\")")
    b.add_argument("--row-cache-factor", type=int_at_least(1), default=ROW_CACHE_TOP_K_FACTOR,
                   help="the CPU graph keeps, per layer, the K rows of the sinks, the window and this many times a "
                        "query's top-k (default %(default)s); 1 holds less memory and makes more rows again each step "
                        "(docs/builder.md)")
    b.add_argument("--overwrite", action="store_true",
                   help="replace --output if it is a bundle directory gsm-edge wrote before")
    b.add_argument("--json", action="store_true", help="print report.json instead of the human summary")
    e = sub.add_parser("engine", help="build engine.plan into a bundle and check it against the bundle's golden probe "
                                      "(needs TensorRT and a GPU)")
    e.add_argument("bundle", type=Path)
    e.add_argument("--keep-failing", action="store_true",
                   help="install an engine that fails the golden check anyway (its failure stays recorded in "
                        "report.json, so `runtime serve` and Triton refuse it without --allow-failed-verify)")
    return p


def build_config(args: argparse.Namespace) -> BuildConfig:
    """The BuildConfig of `build`'s parsed flags (BuildError for a value the config refuses)."""
    return BuildConfig(device=args.device, checkpoint=args.checkpoint, output=args.output, max_seq=args.max_seq,
                       max_batch=args.max_batch, max_input=args.max_input, calibration=args.calibration,
                       overwrite=args.overwrite, logits=args.logits, trt_precision=args.trt_precision,
                       uncalibrated=args.uncalibrated, weights=args.weights, group_size=args.group_size,
                       int4_grid=args.int4_grid, head_weights=args.head_weights,
                       matmul_accuracy=args.matmul_accuracy, awq_scales=args.awq_scales, max_top_k=args.max_top_k,
                       tier_fractions=args.tier_fractions, index_keys=args.index_keys, gsm_weights=args.gsm_weights,
                       max_adaptation_rate=args.max_adaptation_rate, row_cache_factor=args.row_cache_factor)


def _build(args: argparse.Namespace) -> int:
    from builder.build import BuildError, build, summary
    from gsm.cli_support import console
    from gsm.progress import track

    err = console(highlight=False)
    bar = sys.stderr.isatty()

    def line(msg: str) -> None:
        err.print(f"[dim]... {msg}[/]")

    def say(msg: str) -> None:
        err.print(f"[yellow]{msg}[/]")

    # one progress for the whole build: the step that runs now, and while the checkpoint streams into weights.bin,
    # MiB read of its total with the time left (a bar on a terminal, else a line every few seconds)
    with track("starting", unit=f"{READ_UNIT} of the checkpoint read", log=line, bar=bar) as prog:
        def step(msg: str) -> None:
            if prog.total is None or prog.done >= prog.total:  # nothing streaming: the step is timed on its own
                prog.restart(msg)
            else:
                prog.describe(msg)
            if not bar:
                line(msg)

        def read(done: int, total: int) -> None:
            if prog.total is None and done < total:
                prog.set_total(total / READ_BYTES)
            if prog.total is not None:
                prog.advance(done / READ_BYTES - prog.done)

        try:
            r = build(build_config(args), say=say, step=step, read=read)
        except BuildError as e:  # a refusal: bad input, nothing written
            err.print(f"[red]{PROG} build: error:[/] {e}", markup=True)
            return EXIT_BAD_INPUT
    if args.json:
        sys.stdout.write(json.dumps(r.report, indent=2, sort_keys=True) + "\n")
    else:
        print(summary(r))
    return 0


def _engine(args: argparse.Namespace) -> int:
    """Exit 0 with the engine installed and its check passed (or --keep-failing), 1 when it failed the check."""
    from builder.trt_engine import EngineUnavailable, engine_command

    try:
        out = engine_command(args.bundle, keep_failing=args.keep_failing)
    except EngineUnavailable as e:  # no TensorRT or no GPU here: the environment, not the input
        raise CommandFailed(str(e)) from None
    print(out.verdict.table())
    rec = out.record
    if out.kept_aside is not None:
        raise CommandFailed(f"the engine TensorRT {rec['tensorrt']} built failed the golden check "
                            f"({out.verdict.failure_line()}); kept aside in {out.kept_aside}, not installed "
                            f"(--keep-failing installs it anyway)")
    if not out.verdict.passed:
        print(f"WARNING: installed {args.bundle / rec['file']} although it failed the golden check (--keep-failing); "
              "runtime serve and Triton refuse it without --allow-failed-verify", file=sys.stderr)
        return 0
    print(f"built {args.bundle / rec['file']} with TensorRT {rec['tensorrt']}; golden check passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "build":
        return run_main(f"{PROG} build", lambda: _build(args), extra="builder")
    return run_main(f"{PROG} engine", lambda: _engine(args))


if __name__ == "__main__":
    sys.exit(main())
