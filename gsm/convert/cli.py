"""`python -m gsm convert` — thin CLI over gsm.convert.pipeline.convert."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from gsm.cli_support import float_in, int_at_least
from gsm.config import GSMParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source_format", required=True, choices=["llama2c", "hf", "gguf"],
                   help="format of SRC: a llama2.c .bin checkpoint, a Hugging Face LLaMA directory or a "
                   "llama.cpp .gguf file (docs/sources.md)")
    p.add_argument("src", help="the dense model (file for llama2c, directory for hf)")
    p.add_argument("--out", required=True, help="output GSM checkpoint directory (written atomically)")
    p.add_argument("--tokenizer", help="llama2.c tokenizer.bin or SentencePiece .model "
                   "(default: tok{vocab}.bin or tokenizer.bin beside a llama2c SRC; tokenizer.json of an hf SRC)")
    p.add_argument("--layers", type=int_at_least(1), metavar="N",
                   help="keep only the first N decoder layers of SRC (embedding, final norm, LM head and tokenizer "
                   "unchanged): a small model of real weights for quick end-to-end tests, not a model to deploy "
                   "(default: all)")
    p.add_argument("--tolerance", type=float_in(0, 1, lo_open=True, hi_open=True),
                   default=GSMParams.kv_compression_tolerance,
                   help="relative K/V output error allowed when picking ranks (default %(default)s)")
    p.add_argument("--kv-budget", type=int_at_least(1), help="bytes per position of the FP16 latent cache; "
                   "overrides --tolerance")
    p.add_argument("--sharing", default="none",
                   help="none (default) | auto | MAP like '3:1,4:2' (layer:source); auto scores each trial on 8 "
                   "calibration sequences, which on SmolLM2 accepted layers that cost +11.5 %% more on held-out text")
    p.add_argument("--sharing-budget", type=float_in(0, math.inf), default=0.05,
                   help="auto sharing keeps a layer only if calibration perplexity rises <= this (relative)")
    p.add_argument("--calib-text", type=Path, help="text to fit on (default: the one *calib*.txt beside SRC)")
    p.add_argument("--eval-text", type=Path, help="held-out text to measure on (default: the one "
                   "*eval*.txt beside SRC); never fitted on")
    p.add_argument("--report", type=Path, help="write the quality report JSON here")
    p.add_argument("--seq-len", type=int_at_least(2), default=256)
    p.add_argument("--calib-tokens", type=int_at_least(1), default=16384)
    p.add_argument("--eval-tokens", type=int_at_least(1), default=4096)
    p.add_argument("--indexer-steps", type=int_at_least(0), default=200,
                   help="Adam steps of the indexer's fit on the short calibration sequences (0: the long fit "
                   "starts from the initialisation)")
    p.add_argument("--long-fit", type=int_at_least(0), metavar="TOKENS",
                   help="the indexer's second fit, on sampled query rows of long calibration windows of this many "
                   "tokens (default gsm.convert.pipeline.LONG_FIT_LEN, clamped to the model's context; 0 skips it)")
    p.add_argument("--long-fit-windows", type=int_at_least(1), help="windows of the long fit")
    p.add_argument("--long-fit-rows", type=int_at_least(1), help="query rows sampled per window")
    p.add_argument("--long-fit-steps", type=int_at_least(0), help="Adam steps per layer")
    p.add_argument("--top-k-divisor", type=int_at_least(0), default=None, metavar="D",
                   help="each indexer layer's top-k grows with the context: the query at position t picks "
                   "max(top-k, (t + 1) // D) (gsm_config sparse_top_k_divisor; default with --top-k auto "
                   "gsm.convert.budget.TOP_K_DIVISOR, with --top-k N 0: a fixed count)")
    p.add_argument("--top-k", type=top_k_arg, default="auto",
                   help="gsm_config.sparse_top_k, or 'auto' (default): the smallest top-k of a ladder "
                   "whose mean indexer hit rate on calibration sequences of 2K tokens (at most the model's "
                   "context) reaches --hit-rate-target (docs/convert.md)")
    p.add_argument("--hit-rate-target", type=float_in(0, 1, lo_open=True, hi_open=True),
                   help="--top-k auto: mean mask hit rate to reach (default gsm.convert.budget.HIT_RATE_TARGET; "
                   "docs/quality.md: what it costs in perplexity on SmolLM2)")
    p.add_argument("--selection", choices=("per-layer", "uniform"), default=None,
                   help="--top-k auto: 'per-layer' (default) gives each layer its own selector (indexer top-k "
                   "beside the window, or a longer window) and budget, the fewest mean rows reaching "
                   "--hit-rate-target; 'uniform': one top-k for every layer (docs/convert.md)")
    p.add_argument("--long-check", type=lengths_arg, default=None,
                   help="held-out window lengths of the report's long-context check (default 2048,4096; '' skips "
                   "it): dense and GSM perplexity where the selection is sparse, one window each")
    p.add_argument("--window", default="auto", type=window_arg,
                   help="gsm_config.sparse_window, or 'auto' (default): split the budget sinks + "
                   f"{GSMParams.sparse_window} + top-k between window and top-k by calibration hit rate")
    p.add_argument("--sinks", type=int_at_least(0), default=GSMParams.sink_tokens, help="gsm_config.sink_tokens")
    p.add_argument("--indexer-heads", type=int_at_least(1),
                   help=f"gsm_config.indexer_heads (default: min({GSMParams.indexer_heads}, num_key_value_heads): "
                   "the initialisation gives head j KV group j mod nKV, so heads beyond nKV would start, and stay, "
                   "copies)")
    p.add_argument("--indexer-dim", type=int_at_least(1),
                   help="gsm_config.indexer_dim (default: min(32, max(8, kvD/4)), "
                   "so the indexer key stays small next to the K/V it selects from)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where calibration statistics, SVDs and indexer fits run (auto: cuda when visible)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out (and --report) if they exist and gsm-edge wrote them")


def default_indexer_heads(num_kv_heads: int) -> int:
    """Spec default 4, but at most one head per KV group: the indexer's head j starts from group j mod nKV's mean
    query (gsm.convert.indexer.init_from_projections), and two heads that start alike stay alike through the fit."""
    return min(GSMParams.indexer_heads, num_kv_heads)


def default_indexer_dim(kv_dim: int) -> int:
    """Spec default 32, but at most a quarter of kvD (DeepSeek-V3.2's indexer key is ~1/4 of its latent)."""
    return min(GSMParams.indexer_dim, max(8, kv_dim // 4))


def top_k_arg(text: str) -> str | int:
    """--top-k: 'auto' or gsm_config.sparse_top_k (>= 0)."""
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return v


def lengths_arg(text: str) -> tuple[int, ...]:
    """--long-check: comma-separated lengths >= 2 ('' for none)."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(n < 2 for n in out):
        raise argparse.ArgumentTypeError(f"lengths must be >= 2, got {text!r}")
    return out


def window_arg(text: str) -> str | int:
    """--window: 'auto' or gsm_config.sparse_window (>= 1)."""
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return v


def min_kv_budget(n_layers: int, indexer_dim: int) -> int:
    """Least FP16 bytes per position any ranks give (pipeline.ranks_at): rank-1 K and V latents and
    the indexer key in every layer."""
    return n_layers * (2 * indexer_dim + 2 * 2)


def check_paths(args: argparse.Namespace, src: Path, calib: Path, ev: Path) -> None:
    """Every input exists and every output is safe to write, before any work (gsm.outputs)."""
    from gsm.outputs import check_output_dir, check_output_file

    for flag, f in (("--calib-text", calib), ("--eval-text", ev)):
        if not f.is_file():
            raise ValueError(f"{flag} {f}: no such file")
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no such file")
    inputs = [("SRC", src), ("--tokenizer", Path(args.tokenizer) if args.tokenizer else None),
              ("--calib-text", calib), ("--eval-text", ev)]
    out = Path(args.out)
    check_output_dir(out, flag="--out", overwrite=args.overwrite, inputs=inputs)
    if args.report:
        check_output_file(args.report, flag="--report", overwrite=args.overwrite, inputs=inputs,
                          beside=("--out", out))


def default_text(src: Path, flag: str, pattern: str) -> Path:
    """The single file matching `pattern` beside SRC; the flag must be given otherwise."""
    folder = src if src.is_dir() else src.parent
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        what = "none" if not found else ", ".join(f.name for f in found)
        raise ValueError(f"{flag} not given and {folder} holds {what} matching {pattern!r}; pass {flag} FILE")
    return found[0]


def read_source(fmt: str, src: Path, tokenizer: Path | None) -> Any:
    """--from decides the reader (a directory or file alone could be either by mistake)."""
    if fmt == "llama2c":
        if src.is_dir():
            raise ValueError(f"--from llama2c expects a .bin file, {src} is a directory")
        from gsm.sources.llama2c import read_llama2c

        return read_llama2c(src, tokenizer=tokenizer)
    if fmt == "gguf":
        if src.is_dir():
            raise ValueError(f"--from gguf expects a .gguf file, {src} is a directory")
        from gsm.sources.gguf import read_gguf

        return read_gguf(src, tokenizer=tokenizer)
    if not src.is_dir():
        raise ValueError(f"--from hf expects a Hugging Face model directory, {src} is a file")
    from gsm.sources import read_source as read_dir

    return read_dir(src, tokenizer)


def kv_bytes_line(b: dict[str, Any]) -> str:
    """The KV bytes per position the checkpoint implies, saying which tiers each figure assumes: every latent in
    FP16 can exceed dense (the indexer key is extra, and the ranks keep the K/V error within --tolerance); the
    tiers that bring it below dense are chosen by `calibration run`, so the tiered figure is only the default
    fractions' estimate."""
    tiers = "/".join(f"{f:g}" for f in b["tier_fractions"])
    return (f"KV bytes/position: dense FP16 {b['dense_fp16']:.0f}; GSM with every latent FP16 {b['gsm_fp16']:.0f} "
            f"({b['ratio_fp16']:.2f}x dense, the indexer key included); at the default tier fractions {tiers} "
            f"(FP16/INT12/INT8) {b['gsm_tiered']:.1f} ({b['ratio_tiered']:.2f}x) - `python -m calibration run` "
            "chooses the tiers, and its report the bytes")


def print_summary(report: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    from gsm.cli_support import console

    con = console()
    if "layers" in report:
        t = Table(title="GSM conversion (held-out text)")
        for col in ("layer", "role", "rank k/v", "K/V err", "hit rate idx/rand/recent", "noise KL"):
            t.add_column(col)
        for row in report["layers"]:
            if row["role"] == "owning":
                h = row["mask_hit_rate"]
                t.add_row(str(row["layer"]), "owning", f"{row['rank_k']}/{row['rank_v']} of {row['full_rank']}",
                          f"{row['rel_error_k_heldout']:.4f}/{row['rel_error_v_heldout']:.4f}",
                          f"{h['indexer']:.3f}/{h['random']:.3f}/{h['recency']:.3f}", "")
            else:
                t.add_row(str(row["layer"]), f"shares {row['source']}", "", "",
                          f"{row['gsm_mask_hit_rate']:.3f}", f"{row['kv_noise_kl']:.4f}")
        con.print(t)
        p, b, g = report["perplexity"], report["kv_bytes_per_position"], report["greedy_agreement"]
        con.print(f"perplexity dense {p['dense']:.3f} | GSM {p['gsm']:.3f} ({p['relative_increase']:+.1%}) | "
                  f"GSM without sharing {p['gsm_no_sharing']:.3f}")
        con.print(f"greedy agreement over {g['steps']} steps: {g['teacher_forced']:.1%} teacher-forced, "
                  f"identical prefix {g['free_running_identical_prefix_mean']:.1f} tokens")
        con.print(kv_bytes_line(b))
        con.print("trade-off: " + ", ".join(f"tol {r['tolerance']}: {r['kv_bytes_per_position_fp16']:.0f} B "
                                             f"ppl {r['perplexity']:.3f}" for r in report["tradeoff"]))
    sel = report.get("selection_budget", {})
    if sel.get("rows_per_step"):
        how = "per layer" if sel.get("layers") else f"top-k {sel.get('sparse_top_k')} in every layer"
        con.print(f"selection ({how}): rows read per decode step " + ", ".join(
            f"{n}: {v['rows']:.0f} ({v['fraction_of_dense']:.1%} of dense)" for n, v in sel["rows_per_step"].items()))
    con.print(f"wrote {out} in {report['convert_seconds']:.1f} s")


def convert_command(args: argparse.Namespace) -> int:
    """CLI body: validate every flag and path, then convert; refusals raise ValueError (exit 2)."""
    from gsm.convert.budget import HIT_RATE_TARGET
    from gsm.convert.pipeline import ConvertOptions, convert
    from gsm.convert.sharing import parse_sharing_map
    from gsm.outputs import write_text_atomic

    src = Path(args.src)
    if not src.exists():
        raise ValueError(f"SRC {src}: no such file or directory")
    calib = args.calib_text or default_text(src, "--calib-text", "*calib*.txt")
    ev = args.eval_text or default_text(src, "--eval-text", "*eval*.txt")
    check_paths(args, src, calib, ev)
    if calib.resolve() == ev.resolve():
        raise ValueError(f"--calib-text and --eval-text are the same file ({calib}); "
                         "quality must be measured on text the converter did not fit on")
    source = read_source(args.source_format, src, Path(args.tokenizer) if args.tokenizer else None)
    if args.layers is not None:
        from gsm.sources import first_layers

        source = first_layers(source, args.layers)
    n_layers = source.config.num_hidden_layers
    if args.sharing not in ("auto", "none"):
        parse_sharing_map(args.sharing, n_layers)
    auto_window = args.window == "auto"
    window = GSMParams.sparse_window if auto_window else args.window
    auto_top_k = args.top_k == "auto"
    if not auto_top_k and args.hit_rate_target is not None:
        raise ValueError(f"--hit-rate-target applies to --top-k auto only, not --top-k {args.top_k}")
    if not auto_top_k and args.selection == "per-layer":
        raise ValueError(f"--selection per-layer chooses each layer's budget: it needs --top-k auto, not "
                         f"--top-k {args.top_k}")
    params = GSMParams(sparse_top_k=GSMParams.sparse_top_k if auto_top_k else args.top_k, sparse_window=window,
                       max_sparse_window=max(GSMParams.max_sparse_window, window),
                       sink_tokens=args.sinks,
                       indexer_heads=args.indexer_heads or default_indexer_heads(source.config.num_key_value_heads),
                       indexer_dim=args.indexer_dim or default_indexer_dim(source.config.kv_dim),
                       kv_compression_tolerance=args.tolerance)
    if args.kv_budget is not None and args.kv_budget < min_kv_budget(n_layers, params.indexer_dim):
        raise ValueError(f"--kv-budget {args.kv_budget}: this model needs at least "
                         f"{min_kv_budget(n_layers, params.indexer_dim)} bytes per position ({n_layers} layers x "
                         f"(rank-1 K and V latents + the {params.indexer_dim}-dim indexer key) at FP16)")
    opts = ConvertOptions(calib_text=calib, eval_text=ev, tolerance=args.tolerance,
                          kv_budget=args.kv_budget, sharing=args.sharing,
                          sharing_budget=args.sharing_budget, seq_len=args.seq_len,
                          calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens,
                          indexer_steps=args.indexer_steps, seed=args.seed, gsm=params,
                          **{f: v for f, v in (("long_fit_len", args.long_fit), ("long_fit_rows", args.long_fit_rows),
                                               ("long_fit_windows", args.long_fit_windows),
                                               ("long_fit_steps", args.long_fit_steps)) if v is not None},
                          auto_window=auto_window, auto_top_k=auto_top_k,
                          per_layer_selection=args.selection != "uniform",
                          top_k_divisor=args.top_k_divisor,
                          **({} if args.long_check is None else {"long_check": args.long_check}),
                          hit_rate_target=HIT_RATE_TARGET if args.hit_rate_target is None else args.hit_rate_target,
                          device=args.device)
    report = convert(source, Path(args.out), opts, overwrite=args.overwrite,
                     progress=lambda msg: print(f"[convert] {msg}", file=sys.stderr))
    if args.report:
        write_text_atomic(args.report, json.dumps(report, indent=1) + "\n")
    print_summary(report, Path(args.out))
    return 0
