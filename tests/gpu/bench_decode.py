"""GPU decode-attention figures for scripts/gpu_check.sh (not a test: prints, asserts nothing).

For contexts 4K and 32K, one GsmSparseAttention decode step (B = 1, owning layer, tiers 25/25/50 %)
is timed with CUDA events and compared with dense PyTorch SDPA over an FP16 K/V cache of the same
layer shape. Bandwidth = bytes the step must move / time, where the bytes are the indexer keys of
every cached position, the selected latent rows (at their tiers' widths), the float32
reconstruction weights, and the score workspace (written once, read by 4 radix passes and the
compaction); "% of peak" divides by the device's theoretical DRAM bandwidth when torch reports
the memory clock and bus width, else by a measured device-to-device copy.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from gsm_edge_plugins import cuda as gcuda
from gsm_edge_plugins.testing import make_scenario


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def peak_gbps() -> tuple[float, str]:
    props = torch.cuda.get_device_properties(0)
    clock = getattr(props, "memory_clock_rate", 0)  # kHz
    bus = getattr(props, "memory_bus_width", 0)  # bits
    if clock and bus:
        return 2.0 * clock * 1e3 * bus / 8 / 1e9, "theoretical (memory clock x bus width x 2)"
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() / (ms * 1e-3) / 1e9, "measured device-to-device copy (read + write)"


def bench(context: int, *, heads: int, kv_heads: int, head_dim: int, rank: int, top_k: int, iters: int) -> dict:
    rng = np.random.default_rng(context)
    sc = make_scenario(rng, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rank_k=rank, rank_v=rank,
                       index_heads=4, index_dim=32, sink_tokens=1, top_k=top_k, max_sparse_window=8, window=3,
                       n_max=context, past=[context - 1], new=[1], tier_mix=(0.25, 0.25, 0.5, 0.0), poison=False)
    call = gcuda.prepare_attention(sc)
    ms = _time_ms(call.run, iters)
    sel = call.result().selected[0, 0]
    sel = sel[sel >= 0]
    d = sc.dims
    tier = sc.slots[0, sel] >> 24
    row_bytes = np.where(tier == 0, 2 * d.rank, np.where(tier == 1, 3 * ((rank + 1) // 2) * 2, d.rank))
    moved = (context * d.index_dim * 2  # indexer keys
             + int(row_bytes.sum())  # selected latent rows
             + (sc.w0.size + sc.w1.size) * 4  # U_k, U_v (float32)
             + context * 4 * 6)  # scores: 1 write, 4 radix passes, 1 compaction read
    # dense SDPA over an FP16 K/V cache of the same layer (GQA expanded once, outside the timing)
    q = torch.randn(1, heads, 1, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(1, kv_heads, context, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    g = heads // kv_heads
    ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    sdpa_ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, ke, ve), iters)
    return {"context": context, "ms": ms, "bytes": moved, "gbps": moved / (ms * 1e-3) / 1e9, "sdpa_ms": sdpa_ms,
            "selected": int(sel.size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    shape = {"heads": 32, "kv_heads": 8, "head_dim": 128, "rank": 320, "top_k": 64}
    peak, how = peak_gbps()
    print(f"device: {torch.cuda.get_device_name(0)}; kernels for SMs {gcuda.architectures()}; "
          f"peak {peak:.0f} GB/s ({how})")
    print(f"layer: nH={shape['heads']} nKV={shape['kv_heads']} D={shape['head_dim']} r_k=r_v={shape['rank']} "
          f"nI=4 dI=32 sinks 1 window 3 top-k {shape['top_k']}, B=1, float32 activations")
    for ctx in args.contexts:
        r = bench(ctx, iters=args.iters, **shape)
        print(f"  context {r['context']:>6}: GSM decode {r['ms'] * 1e3:8.1f} us, {r['bytes'] / 1e6:6.2f} MB moved, "
              f"{r['gbps']:7.1f} GB/s = {100 * r['gbps'] / peak:5.1f} % of peak; dense SDPA (FP16 K/V) "
              f"{r['sdpa_ms'] * 1e3:8.1f} us; speed-up {r['sdpa_ms'] / r['ms']:.2f}x ({r['selected']} positions read)")


if __name__ == "__main__":
    main()
