"""Held-out perplexity through built bundles (ONNX Runtime, GSM sparse attention on), one line of JSON each.

    python bench/bundle_perplexity.py B1 [B2 ...] [--text ../shared/data/tinystories_eval.txt] [--windows 4]

Each bundle reads the same `--windows` consecutive windows of `--window` tokens of the text (encoded
once with `Runtime.encode`, the bundle's tokenizer), prefilled as the runtime prefills a prompt, and scores every
next token. Bundles must be built with `--logits all`. With `--max-input WINDOW` a window is one prefill call:
how docs/weights.md compares weight formats through the whole deployed path (SmolLM2: fp32 weights vs INT8 /
INT4 bundles). With a smaller `--max-input` (64) the runtime prefills in chunks of that many tokens, each call
followed by the re-tier pass, so later chunks read rows the KV tiers have demoted: the engines' own KV tiers
measured end to end (docs/quality.md 2b, the protocol of bench/kv_frontier.py's `tiers:` rows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

import runtime

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_eval.txt"


def window_nll(rt: runtime.Runtime, win: list[int]) -> float:
    """Summed negative log-likelihood of win[1:] given its prefix, from the runtime's prefill of the window (in
    chunks of the bundle's max-input, each followed by a re-tier pass)."""
    total = 0.0

    def score(first: int, logits: np.ndarray) -> None:  # logits [n, V] of positions first .. first + n - 1
        nonlocal total
        lg = np.asarray(logits, np.float64)
        lg = lg - lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        total -= float(sum(lp[i, win[first + i + 1]] for i in range(lg.shape[0]) if first + i + 1 < len(win)))

    rt.new_sequence().prefill(win, scorer=score)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    text = a.text.read_text(encoding="utf-8")
    for b in a.bundles:
        rt = runtime.load(b, backend="onnxruntime", threads=a.threads)
        if rt.cfg.logits != "all":
            print(f"error: {b}: build it with --logits all (and --max-input {a.window} for one prefill call per "
                  "window)", file=sys.stderr)
            return 2
        ids = rt.encode(text)
        if len(ids) < a.windows * a.window:
            print(f"error: {a.text}: {len(ids)} tokens, fewer than {a.windows} x {a.window}", file=sys.stderr)
            return 2
        nll, count = 0.0, 0
        for w in range(a.windows):
            win = ids[w * a.window:(w + 1) * a.window]
            nll += window_nll(rt, win)
            count += len(win) - 1
        q = rt.cfg.kv_quantization
        plan = json.loads((b / "plan.json").read_text())
        print(json.dumps({"bundle": str(b), "perplexity": math.exp(nll / count), "tokens": count,
                          "window": a.window, "max_input": rt.max_input, "weights": rt.cfg.weights,
                          "tier_fractions": list(q.tier_fractions), "index_key_bits": q.index_key_bits,
                          "kv_bytes_per_position": plan["kv_bytes_per_position"],
                          "vs_dense_fp16": plan["kv_bytes_per_position"] / plan["dense_fp16_bytes_per_position"]}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
