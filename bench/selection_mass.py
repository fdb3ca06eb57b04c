"""How much of the dense model's attention a checkpoint's selection catches, beside other selections of the same rows.

    OMP_NUM_THREADS=1 python bench/selection_mass.py --checkpoint CK --dense GGUF --eval-text EVAL \
        [--length 8192] [--sequences 2] [--rows 256] [--first 1024] [--windows 32,128,256] [--per-layer] [--out J]

For every owning layer whose selection has an indexer (top-k > 0), query rows t sampled uniformly from
[--first, --length) of the held-out windows (bench/long_context.py ppl's windows), each row's budget is the
checkpoint's own: B(t) = sinks + window_l + top_k_l(t) rows (top_k_l(t) grown by the layer's divisor). At that
budget, the captured mass (the sum over the selected rows of the dense attention averaged over the query heads,
gsm.convert.budget.selected_mass) of:
  checkpoint     sinks + the layer's window + the indexer's top-k (what the checkpoint selects)
  indexer+wW     sinks + a window of W + the indexer's top-(B - sinks - W) (recency where W >= B - sinks)
  recency        sinks + a window of B - sinks
  oracle         sinks + the B - sinks rows the dense attention itself weighs most (no selection catches more)
The indexer's inputs are the dense pass's normed layer inputs (as the converter's budget search does), in
float32. Rows are reported by position bucket, the mean over layers (and per layer with --per-layer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_real import Setup  # noqa: E402

from gsm.convert.budget import chunk_row_attention, selected_mass  # noqa: E402
from gsm.convert.long_sample import sample_rows  # noqa: E402
from gsm.golden import attention as A  # noqa: E402
from gsm.golden.selection import index_scores  # noqa: E402

CHUNK = 512  # prefill chunk of the dense pass
BUCKETS = ((1024, 2048, "1-2K"), (2048, 4096, "2-4K"), (4096, 8192, "4-8K"))


def _mass(scores: torch.Tensor, probs: torch.Tensor, q_pos: torch.Tensor, sinks: int, window: int,
          k: torch.Tensor) -> torch.Tensor:
    """selected_mass with a top-k per row: [b]."""
    out = torch.empty(len(q_pos), dtype=torch.float64)
    for kk in sorted(set(k.tolist())):
        g = k == kk
        out[g] = selected_mass(scores[g], probs[g], q_pos[g], sinks, window, [kk])[:, 0].double()
    return out


def selection_masses(scores: torch.Tensor, probs: torch.Tensor, q_pos: torch.Tensor, sinks: int, window: int,
                     budget: torch.Tensor, windows: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Captured mass [b] of each selection of `budget` [b] rows (sinks included) for query rows at q_pos [b];
    scores [b, n] the indexer's, probs [b, n] the head-mean dense attention, window the layer's own."""
    n = probs.shape[-1]
    position = torch.arange(n, dtype=torch.float32)[None].expand_as(probs)
    extra = budget - sinks  # rows beyond the sinks
    out = {"checkpoint": _mass(scores, probs, q_pos, sinks, window, extra - window),
           "recency": _mass(position, probs, q_pos, sinks, 0, extra),
           "oracle": _mass(probs, probs, q_pos, sinks, 0, extra)}
    for w in windows:
        res = out["recency"].clone()
        ok = extra > w
        if ok.any():
            res[ok] = _mass(scores[ok], probs[ok], q_pos[ok], sinks, w, extra[ok] - w)
        out[f"indexer+w{w}"] = res
    return out


@torch.no_grad()
def window_masses(s: Setup, ids: torch.Tensor, rows: torch.Tensor, layers: list[int], windows: tuple[int, ...]
                  ) -> dict[int, dict[str, np.ndarray]]:
    """selection_masses of every layer for the sampled rows of one held-out window ids [T]."""
    dense, cfg, p = s.dense, s.cfg, s.cfg.gsm
    T = ids.numel()
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    keys = {i: torch.zeros(0, p.indexer_dim) for i in layers}
    x_rows = {i: torch.zeros(len(rows), cfg.hidden_size) for i in layers}
    probs = {i: torch.zeros(len(rows), T) for i in layers}
    for a in range(0, T, CHUNK):
        q_pos = torch.arange(a, min(a + CHUNK, T))
        _, caps = dense.run_cached(ids[None, a:a + CHUNK], kv, capture=True)
        here = (rows >= a) & (rows < a + CHUNK)
        cos, sin = A.rope_tables(q_pos, cfg.head_dim, cfg.rope_theta)
        for i in layers:
            x = caps[i].x[0].float()
            keys[i] = torch.cat([keys[i], x @ s.gsm.w.layers[i].kv.idx_k.T])
            if here.any():
                pick = rows[here] - a
                pr = chunk_row_attention(cfg, caps[i].q[0], kv[i][0][0], q_pos, pick, cos, sin)
                probs[i][here, :pr.shape[1]] = pr
                x_rows[i][here] = x[pick]
        del caps
    out = {}
    for i in layers:
        ls = p.selection_of(i)
        kvw = s.gsm.w.layers[i].kv
        scores = index_scores(x_rows[i], kvw.idx_q, kvw.idx_w, keys[i], p.indexer_heads)
        budget = torch.tensor([p.sink_tokens + ls.rows_at(int(t)) for t in rows])
        m = selection_masses(scores, probs[i], rows, p.sink_tokens, ls.sparse_window, budget, windows)
        out[i] = {k: v.numpy() for k, v in m.items()} | {"rows": budget.numpy().astype(np.float64)}
    return out


def summarise(per: dict[int, dict[str, np.ndarray]], pos: np.ndarray, length: int) -> dict[str, Any]:
    """Mean captured mass by bucket: over layers, and per layer."""
    sel = {"all": (pos >= 0)} | {name: (pos >= lo) & (pos < hi) for lo, hi, name in BUCKETS if lo < length}
    out: dict[str, Any] = {}
    for name, m in sel.items():
        if not m.any():
            continue
        layer = {i: {k: float(v[m].mean()) for k, v in d.items()} for i, d in per.items()}
        cols = next(iter(layer.values())).keys()
        out[name] = {"query_rows": int(m.sum()),
                     "mean": {c: float(np.mean([layer[i][c] for i in layer])) for c in cols},
                     "layers": layer}
    return out


def print_table(summary: dict[str, Any], per_layer: bool) -> None:
    cols = [c for c in next(iter(summary.values()))["mean"] if c != "rows"]
    print("\ncaptured dense attention (head mean) at the checkpoint's rows per query; mean over indexer layers")
    print(f"{'positions':<10}{'queries':>8}{'rows':>7}" + "".join(f"{c:>15}" for c in cols))
    for name, b in summary.items():
        mean = b["mean"]
        print(f"{name:<10}{b['query_rows']:>8}{mean['rows']:>7.0f}" + "".join(f"{mean[c]:>15.4f}" for c in cols))
        if per_layer:
            for i, v in b["layers"].items():
                print(f"{'  L' + str(i):<10}{'':>8}{v['rows']:>7.0f}" + "".join(f"{v[c]:>15.4f}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--dense", type=Path, required=True, help="the dense source (.gguf, HF dir)")
    ap.add_argument("--eval-text", type=Path, required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256, help="query rows sampled per window")
    ap.add_argument("--first", type=int, default=1024, help="the lowest query position sampled")
    ap.add_argument("--windows", default="32,128,256", help="windows beside the indexer to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--out", type=Path, help="write the summary JSON here")
    a = ap.parse_args(argv)
    if not 0 <= a.first < a.length:
        ap.error(f"--first {a.first} must be within [0, --length {a.length})")
    try:
        windows = tuple(int(w) for w in a.windows.split(","))
    except ValueError:
        ap.error(f"--windows must be comma-separated integers, got {a.windows!r}")
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    p = s.cfg.gsm
    layers = [i for i in s.cfg.owning_layers if p.selection_of(i).sparse_top_k > 0]
    seqs = s.sequences(a.length, a.sequences)
    print(f"{len(layers)} indexer layers; {len(seqs)} held-out windows of {a.length}; {a.rows} query rows each "
          f"from position {a.first}", flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    per: dict[int, dict[str, list[np.ndarray]]] = {i: {} for i in layers}
    positions = []
    for b, ids in enumerate(seqs):
        t1 = time.perf_counter()
        rows = sample_rows(a.length, a.first, a.rows, gen)
        positions.append(rows.numpy())
        for i, d in window_masses(s, ids, rows, layers, windows).items():
            for k, v in d.items():
                per[i].setdefault(k, []).append(v)
        print(f"window {b + 1}/{len(seqs)}: {time.perf_counter() - t1:.0f} s", flush=True)
    merged = {i: {k: np.concatenate(v) for k, v in d.items()} for i, d in per.items()}
    summary = summarise(merged, np.concatenate(positions), a.length)
    print_table(summary, a.per_layer)
    print(f"\n{time.perf_counter() - t0:.0f} s", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
