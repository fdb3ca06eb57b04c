"""Held-out perplexity through built bundles (ONNX Runtime, GSM sparse attention on), one line of JSON each.

    python bench/bundle_perplexity.py B1 [B2 ...] [--text ../shared/data/tinystories_eval.txt] [--windows 4]

Each bundle reads the same `--windows` consecutive windows of `--window` tokens of the text (encoded
once with `Runtime.encode`, the bundle's tokenizer), one prefill per window, and scores every next
token. Bundles must be built with `--logits all --max-input WINDOW` (the
prefill then returns every position's logits). This is how docs/weights.md compares weight formats
through the whole deployed path (SmolLM2: fp32 weights vs INT8 / INT4 bundles).
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
    """Summed negative log-likelihood of win[1:] given its prefix, from one prefill."""
    seq = rt.new_sequence()
    seq.prefill(win)
    lg = np.asarray(seq.last.logits[0], np.float64)  # [len(win), V]
    lg = lg - lg.max(axis=1, keepdims=True)
    lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
    return -float(sum(lp[i, win[i + 1]] for i in range(len(win) - 1)))


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
        if rt.cfg.logits != "all" or rt.max_input < a.window:
            print(f"error: {b}: build it with --logits all --max-input {a.window}", file=sys.stderr)
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
        print(json.dumps({"bundle": str(b), "perplexity": math.exp(nll / count), "tokens": count,
                          "weights": rt.cfg.weights}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
