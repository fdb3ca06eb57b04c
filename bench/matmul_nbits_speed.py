"""ONNX Runtime: one projection as fp32 MatMul vs com.microsoft.MatMulNBits (INT8 / INT4), same threads.

    python bench/matmul_nbits_speed.py [--n 1536 --k 576] [--threads 1] [--rows 1,512]

Default shape: SmolLM2-135M's gate/up projection (N=1536 outputs, K=576 inputs); rows 1 = a decode
step, 512 = a prefill chunk. Weights are seeded random (speed does not depend on their values).
Reports the median of `--repeat` timed runs after warm-up, microseconds per call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from builder.qlinear import matmul_nbits, standalone_model
from builder.wquant import WeightQuantConfig, quantize


def _session(model, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(sess: ort.InferenceSession, x: np.ndarray, repeat: int) -> float:
    for _ in range(5):
        sess.run(None, {"x": x})
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, {"x": x})
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,512")
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((a.n, a.k)) * 0.05).astype(np.float32)
    fp32 = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["y"])], "fp32",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", a.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", a.n])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")]),
        opset_imports=[helper.make_opsetid("", 17)])
    variants = {"fp32 MatMul": fp32}
    for name, cfg in (("int8 per-channel", WeightQuantConfig(8, None)), ("int4 g128", WeightQuantConfig(4, 128)),
                      ("int4 g32", WeightQuantConfig(4, 32))):
        q = quantize(w, cfg)
        for level in (0, 4):
            variants[f"{name} acc{level}"] = standalone_model(matmul_nbits("x", "y", "p", q, accuracy_level=level),
                                                              "x", a.k, a.n)
    print(f"projection N={a.n} K={a.k}, {a.threads} thread(s), onnxruntime {ort.__version__}; median us/call")
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{'variant':<24}" + "".join(f"{'M=' + str(m):>12}" for m in rows))
    sessions = {k: _session(m, a.threads) for k, m in variants.items()}
    for name, sess in sessions.items():
        cells = [_time(sess, rng.standard_normal((m, a.k)).astype(np.float32), a.repeat if m < 64 else 20)
                 for m in rows]
        print(f"{name:<24}" + "".join(f"{c:12.1f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
