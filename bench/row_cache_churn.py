"""Churn of the CPU graph's row caches: K rows a decode step makes again from the pools, by context.

    python bench/row_cache_churn.py --bundle out/smollm2-int4 --contexts 1024,4096,8000 --steps 64

A bundle's model.cpu.onnx keeps each layer's K rows of recently selected positions in a bounded row cache
(plugins/ortCpu/GsmPoolAttention, capacity builder/plan.py row_cache_capacity); a step reconstructs the rows its
selection reads that the cache does not hold (new picks of the indexer, rows a re-tier pass re-encoded). This
prefills held-out text to each context, decodes greedily, and counts per step the slots whose (position, slot
entry) tags changed, less the one new position each layer stores: the rows made from the pools. Prints per context
the mean and largest rows per step (all layers), per layer, the selection's size, ms per step and the row caches'
bytes per sequence.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from gsm import graph_io as io

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def tags_of(rt, row: int) -> list[np.ndarray]:
    b = rt.backend.buffers
    return [b[io.ROW_CACHE_TAGS.at(i)][row, :2].copy() for i in rt.backend.pools.row_cache_layers]


def made(before: list[np.ndarray], after: list[np.ndarray]) -> list[int]:
    """Per layer: slots whose (position, entry) changed, less the step's new position."""
    return [max(int(np.any(a != b, axis=0).sum()) - 1, 0) for b, a in zip(before, after)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=DATA / "tinystories_eval.txt")
    a = ap.parse_args()
    import runtime

    rt = runtime.load(a.bundle, backend="onnxruntime", threads=a.threads, graph="cpu")
    ids = rt.encode(a.text.read_text(encoding="utf-8"))
    layers = len(rt.backend.pools.row_cache_layers)
    print(f"{a.bundle}: row caches {rt.backend.pools.bytes().row_cache / 2**20:.1f} MiB per sequence, {layers} layers; "
          f"capacity {rt.backend.buffers[io.ROW_CACHE.at(0)].shape[1]} rows (layer 0)")
    print("context | K rows made per step, all layers: mean / max | per layer | selected per layer | ms per step")
    for n in (int(x) for x in a.contexts.split(",")):
        seq = rt.new_sequence()
        logits = seq.prefill(ids[:n])
        per_step, ms, sel = [], [], []
        for _ in range(a.steps):
            before = tags_of(rt, seq.cache.row)
            t0 = time.perf_counter()
            logits = seq.decode(int(np.argmax(logits)))
            ms.append((time.perf_counter() - t0) * 1e3)
            per_step.append(sum(made(before, tags_of(rt, seq.cache.row))))
        probe = seq.decode(int(np.argmax(logits)), probe=True) if rt.can_probe else None
        if probe is not None and seq.last is not None and seq.last.selected:
            sel = [int((s[0, -1] >= 0).sum()) for s in seq.last.selected.values()]
        seq.close()
        steady = per_step[1:]  # the first step after the prefill makes the prefill's selection once
        print(f"{n:7d} | {np.mean(steady):7.1f} / {max(steady):5d} | {np.mean(steady) / layers:6.2f} | "
              f"{np.mean(sel) if sel else float('nan'):7.1f} | {np.median(ms):6.2f} (first step {per_step[0]} rows)")


if __name__ == "__main__":
    main()
