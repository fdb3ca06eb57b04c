"""Wall time of one `GsmCachedAttention` decode call (the ONNX Runtime CPU op of model.cpu.onnx) in isolation.

One node, SmolLM2-135M's geometry by default (9 heads over 3 key heads of 64, 3 indexer heads of 32, ranks 187 /
192, INT8 index keys, V from cached V rows as model.cpu.onnx has it; `--latent-v`: from the latents, the op's
form without attribute v_rows), inputs bound once, the best mean of --repeats runs of --calls calls. `--cold` gives
every call another sequence row of a cache far larger than the CPU's caches and another copy of U_k / U_v, so its
K rows, V rows (or latents) and U come from memory, as they do in a model step after the layer's weights went
through.

    python bench/attention_op_cpu.py [--past 8,256,512] [--top-k 294] [--threads 1] [--cold] [--half-up] [--latent-v]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

# the op's one-node model and input names are declared once, beside the tests that check it against NumPy
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--past", default="8,256,512", help="cached positions before the decoded one")
    ap.add_argument("--top-k", type=int, default=294, help="indexer picks (SmolLM2's default conversion: 294 mean)")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--geometry", default="9,3,64,3,32,187,192", help="nH,nKV,D,nI,dI,rk,rv")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="a different cache row each call (rows from memory)")
    ap.add_argument("--cache-mib", type=int, default=256, help="size of the --cold cache (well above the CPU's caches)")
    ap.add_argument("--half-up", action="store_true", help="U_k / U_v as float16 (U on the FP16 grid)")
    ap.add_argument("--latent-v", action="store_true", help="V from the latents (the op without v_rows)")
    a = ap.parse_args(argv)

    import onnxruntime as ort
    import test_ort_ops as T
    from onnx import TensorProto

    if T.LIB is None:
        print("libgsm_ort_ops.so is not built", file=sys.stderr)
        return 2
    geo = tuple(int(v) for v in a.geometry.split(","))
    _, nKV, D, _, _, _, rv = geo
    pasts = [int(v) for v in a.past.split(",")]
    N = max(pasts) + 1
    R = max(1, (a.cache_mib << 20) // (N * (nKV * D + (rv if a.latent_v else nKV * D)) * 4)) if a.cold else 1
    rng = np.random.default_rng(0)
    x = T.int8_keys(T.make_inputs(rng, geo, [pasts[0]], [1], 1, a.window, [a.top_k], rows=R, positions=N), rng)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(T.LIB))
    so.intra_op_num_threads = a.threads
    so.log_severity_level = 3
    model = T.model_bytes(geo, 1, TensorProto.INT8, v_rows=None if a.latent_v else 1)
    if not a.latent_v:
        x = T.with_v_rows(x, rng)
    if a.half_up:
        x.update({n: x[n].astype(np.float16) for n in T.UP_INPUTS})
        model = T.retyped(model, dict.fromkeys(T.UP_INPUTS, TensorProto.FLOAT16))
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    b = s.io_binding()
    for k, v in x.items():
        b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
    rows = [ort.OrtValue.ortvalue_from_numpy(np.array([i], np.int32)) for i in range(R)]
    # cold: U_k / U_v from memory too, as in a model step (each layer its own): copies over a quarter of the cache size
    n_up = max(1, (a.cache_mib << 18) // sum(x[n].nbytes for n in T.UP_INPUTS)) if a.cold else 1
    ups = [{n: ort.OrtValue.ortvalue_from_numpy(x[n] + np.zeros_like(x[n])) for n in T.UP_INPUTS} for _ in range(n_up)]
    print(f"GsmCachedAttention decode, geometry {a.geometry}, top-k {a.top_k}, window {a.window}, "
          f"{a.threads} thread(s), {'cold' if a.cold else 'hot'} rows ({R} cache rows), "
          f"{'float16' if a.half_up else 'float32'} U, V from {'the latents' if a.latent_v else 'V rows'}")
    for past in pasts:
        b.bind_ortvalue_input("past_lengths", ort.OrtValue.ortvalue_from_numpy(np.array([past], np.int32)))
        b.clear_binding_outputs()  # the outputs' shapes follow the context
        for o in s.get_outputs():
            b.bind_output(o.name)
        n = 0

        def call():
            nonlocal n
            if R > 1:
                b.bind_ortvalue_input("cache_rows", rows[n % R])
            if n_up > 1:
                for k, v in ups[n % n_up].items():
                    b.bind_ortvalue_input(k, v)
            n += 1
            s.run_with_iobinding(b)

        for _ in range(20):
            call()
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                call()
            best = min(best, (time.perf_counter() - t0) / a.calls * 1e6)
        picked = min(past + 1, 1 + a.window + a.top_k)
        print(f"  past {past:6d}: {best:7.1f} us per call, {picked} positions attended "
              f"({best / picked * 1e3:.0f} ns per position)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
