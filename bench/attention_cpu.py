"""CPU reference decode step: GSM sparse attention (top-k 64) vs dense attention over all positions.

Both run the same C++ reference (gsm_edge_plugins.ref) on the same mixed-precision latent cache;
"dense" is the same node with top_k >= context, which selects every position (spec 4.1), so the
difference is exactly what token selection saves. Prints wall times (median of repeats), the
speed-up, and KV-cache bytes per position vs a dense FP16 cache (spec 6).

    python bench/attention_cpu.py [--context 4096] [--top-k 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(*, context: int, top_k: int, threads: int, repeats: int, num_heads: int, num_kv_heads: int, head_dim: int,
        rank: int, index_heads: int, index_dim: int, tier_fractions: tuple[float, float, float]) -> dict[str, float]:
    from gsm_edge_plugins import ref
    from gsm_edge_plugins.testing import make_scenario

    rng = np.random.default_rng(0)
    # one decode step at position context-1; the cache holds tiers in the given fractions
    f16, f12, f8 = tier_fractions
    sc = make_scenario(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rank_k=rank,
                       rank_v=rank, index_heads=index_heads, index_dim=index_dim, sink_tokens=1, top_k=top_k,
                       max_sparse_window=8, window=3, n_max=context, past=[context - 1], new=[1],
                       tier_mix=(f16, f12, f8, 0.0), poison=False)
    sparse_dims = sc.dims
    dense_dims = dataclasses.replace(sc.dims, top_k=context)  # selects every position

    def call(d: ref.Dims) -> ref.AttentionResult:
        return ref.sparse_attention(d, sc.q, sc.pool, sc.slots, sc.past, sc.new, sc.quant, sc.rope_cos,
                                    sc.rope_sin, sc.w0, sc.w1, index_q=sc.index_q, index_w=sc.index_w,
                                    index_keys=sc.index_keys, sparse_window=sc.window, threads=threads)

    n_sel = int((call(sparse_dims).selected[0, 0] >= 0).sum())
    t_sparse = _median_ms(lambda: call(sparse_dims), repeats)
    t_dense = _median_ms(lambda: call(dense_dims), repeats)

    # a conventional dense FP16 K/V cache for scale: K/V already materialised (no latent
    # reconstruction), NumPy float32 GQA attention over all positions
    g = num_heads // num_kv_heads
    k = rng.standard_normal((num_kv_heads, context, head_dim)).astype(np.float16)
    v = rng.standard_normal((num_kv_heads, context, head_dim)).astype(np.float16)
    q = rng.standard_normal((num_kv_heads, g, head_dim)).astype(np.float32)

    def dense_plain() -> np.ndarray:
        logits = np.einsum("hgd,hnd->hgn", q, k.astype(np.float32)) / np.float32(np.sqrt(head_dim))
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hgn,hnd->hgd", p, v.astype(np.float32))

    t_plain = _median_ms(dense_plain, repeats)

    kvd = num_kv_heads * head_dim
    r = 2 * rank
    dense_fp16 = 2 * kvd * 2  # K and V, FP16, per layer and position (spec 6)
    avg_bytes = 2.0 * f16 + 1.5 * f12 + 1.0 * f8
    gsm_bytes = r * avg_bytes + index_dim * 2  # latents under the tier fractions + FP16 indexer key
    return {"context": context, "selected": n_sel, "sparse_ms": t_sparse, "dense_ms": t_dense, "plain_ms": t_plain,
            "speedup": t_dense / t_sparse, "dense_fp16_bytes": dense_fp16, "gsm_bytes": gsm_bytes,
            "gsm_fp16_only_bytes": r * 2.0 + index_dim * 2, "kv_ratio": dense_fp16 / gsm_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="reference threads (0 = all cores)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=160, help="r_k = r_v (kvD / rank = 3.2 with the defaults)")
    args = ap.parse_args()
    res = run(context=args.context, top_k=args.top_k, threads=args.threads, repeats=args.repeats,
              num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, rank=args.rank,
              index_heads=4, index_dim=32, tier_fractions=(0.25, 0.25, 0.5))
    print(f"decode step, one layer: nH={args.heads} nKV={args.kv_heads} D={args.head_dim} r_k=r_v={args.rank} "
          f"nI=4 dI=32, context {res['context']}, {args.threads} thread(s), median of {args.repeats}")
    print(f"  GSM sparse (sinks 1 + window 3 + top-k {args.top_k} = {res['selected']} positions): "
          f"{res['sparse_ms']:.3f} ms")
    print(f"  dense over all {res['context']} positions (same node, top_k >= context): {res['dense_ms']:.3f} ms")
    print(f"  speed-up of selection: {res['speedup']:.1f}x")
    print(f"  for scale, a dense FP16 K/V cache (K/V materialised, NumPy float32 attention): {res['plain_ms']:.3f} ms;"
          " the reference reconstructs K/V from latents per selected position, so selection is what makes"
          " latent attention affordable")
    print(f"  KV bytes per position and layer: dense FP16 {res['dense_fp16_bytes']:.0f}, GSM latents at tier "
          f"fractions 0.25/0.25/0.5 + FP16 indexer key {res['gsm_bytes']:.0f} ({res['kv_ratio']:.2f}x smaller); "
          f"all-FP16 latents {res['gsm_fp16_only_bytes']:.0f}")


if __name__ == "__main__":
    main()
