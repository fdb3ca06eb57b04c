"""Standard ONNX operators the reference backend evaluates its own way (ONNX's reference evaluator runs the rest).

Why each:
- MatMul / Gemm on FP16: numpy has no BLAS for float16 (a SmolLM2 prefill call took 30 s in its matmuls alone),
  and TensorRT's FP16 GEMMs accumulate in float32 and round the result to FP16 once; both are done so here, each
  weight converted to float32 once (as_f32).
- MatMul / Gemm in a call of at most VERIFY_ROWS tokens a sequence (a decode step, a speculative verification:
  `ProductRows.exact`): a row of a product must have the same bits whatever rows the call holds, so that a
  verification's rows are one-token steps bit for bit (Capabilities.verify_rows). BLAS does not promise it: numpy
  hands a one-row product to gemv and more rows to gemm, whose sums differ, and OpenBLAS's sgemm picks its kernels by
  the product's size (a row of a 2-row [2, 64] x [64, 344] product differs from the same row's in an 8-row one).
  Such a call's products are therefore one gemv per row, what a one-token step of one sequence always ran
  (tests/test_runtime_plugin_ref.py checks the rows on the BLAS at hand). Fixed-size gemm blocks would be exact too
  and read each weight once, but OpenBLAS runs them on its threads, which made a decode step 8x slower on a loaded
  2-core machine. A longer prefill chunk's products are one gemm each.
- Sigmoid on FP16: computed in float32 and rounded once, as TensorRT's FP16 activations are, without numpy's
  overflow warnings for large |x| (whose limits are right anyway).
- DequantizeLinear: a weight's dequantisation is the same every call, so each node keeps its last result while its
  inputs are the same arrays (the evaluator hands the same initializer objects to every run); activations are new
  arrays every call and are dequantised afresh.
- GatherElements: ONNX's evaluator gathers with np.choose, which takes at most 64 choices (the head's row gather of
  a call of 64 tokens or more failed); np.take_along_axis has no such bound.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np


def as_f32(node: Any, b: np.ndarray) -> np.ndarray:
    """b as float32, kept on `node` while b is the same array (a weight: its conversion is the same every call)."""
    memo = getattr(node, "_b32", None)
    if memo is not None and memo[0]() is b:
        return memo[1]
    out = b.astype(np.float32)
    node._b32 = (weakref.ref(b), out)
    return out


@dataclass
class ProductRows:
    """How the products of the call about to run are computed: `exact` (RefBackend.forward sets it per call) one
    row at a time, else as one gemm."""

    exact: bool = False


def rows_matmul(a: np.ndarray, b: np.ndarray, exact: bool) -> np.ndarray:
    """a [..., K] @ b [K, N]; exact: one vector-matrix product (gemv) per row of a, each row's result the same bits
    whatever rows it is computed with."""
    if not exact or a.ndim < 2 or b.ndim != 2 or a.size == 0:
        return np.matmul(a, b)
    x = a.reshape(-1, a.shape[-1])
    out = np.stack([np.matmul(row, b) for row in x])
    return out.reshape(*a.shape[:-1], b.shape[1])


def standard_ops(rows: ProductRows) -> list[type]:
    """OpRun classes overriding the evaluator's own for the operators above; their products follow `rows`."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_dequantize_linear import _CommonDequantizeLinear

    f32 = np.float32

    class MatMul(OpRun):
        op_domain = ""

        def _run(self, a, b):  # type: ignore[override]
            if a.dtype == np.float16:
                return (rows_matmul(a.astype(f32), as_f32(self, b), rows.exact).astype(np.float16),)
            return (rows_matmul(a, b, rows.exact),)

    class Gemm(OpRun):
        op_domain = ""

        def _run(self, a, b, c=None, alpha=None, beta=None, transA=None, transB=None, **_: Any):  # type: ignore[override]
            x, w = a.astype(f32), as_f32(self, b)
            out = rows_matmul(x.T if transA else x, w.T if transB else w, rows.exact) * f32(
                1.0 if alpha is None else alpha)
            if c is not None:
                out = out + c.astype(f32) * f32(1.0 if beta is None else beta)
            return (out.astype(a.dtype),)

    class Sigmoid(OpRun):
        op_domain = ""

        def _run(self, x):  # type: ignore[override]
            with np.errstate(over="ignore"):
                return ((1.0 / (1.0 + np.exp(-x.astype(f32)))).astype(x.dtype),)

    class DequantizeLinear(_CommonDequantizeLinear):
        op_domain = ""

        def _run(self, *args, **kw):  # type: ignore[override]
            memo = getattr(self, "_memo", None)
            if memo is not None and len(memo[0]) == len(args) and all(r() is a for r, a in zip(memo[0], args)):
                return memo[1]
            out = super()._run(*args, **kw)
            self._memo = ([weakref.ref(a) if a is not None else (lambda: None) for a in args], out)
            return out

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None, **_: Any):  # type: ignore[override]
            ax = 0 if axis is None else int(axis)
            idx = indices.astype(np.int64)
            return (np.take_along_axis(data, np.where(idx < 0, idx + data.shape[ax], idx), axis=ax),)

    return [MatMul, Gemm, Sigmoid, DequantizeLinear, GatherElements]
