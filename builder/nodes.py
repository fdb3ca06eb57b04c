"""Standard-op blocks shared by both graph variants: RMSNorm, linear, SwiGLU, RoPE, positions.

Each block mirrors the golden model's operation order (gsm/golden/blocks.py, rope.py), so the
portable fp32 graph differs from the golden only by float32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from builder.onnx_util import GraphBuilder

F32, F16, I32, I64, BOOL, U8, I8 = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.INT64,
                                    TensorProto.BOOL, TensorProto.UINT8, TensorProto.INT8)


@dataclass(frozen=True)
class AttentionCall:
    """One layer's GsmSparseAttention as the network hands it to every variant's `ops.attention` (PortableOps,
    CpuOps, PluginOps): an owning layer (index_q given) selects and attends; a sharing layer (selected given)
    attends over its source's selection with K/V projected from the source's latents."""

    layer: int
    q: str  # the layer's queries, float32
    cache: dict[str, str]  # the cache tensors of the layer (sharing: of its source) after this call's update
    past: str  # past_lengths [B]
    new: str  # new_lengths [B]
    rope: tuple[str, str]  # cos, sin tables
    up: tuple[str, str]  # the up-projection of the latents to K/V (owning: k_U and ""; sharing: proj_w, proj_b)
    quant: str  # the calibration table of the layer (sharing: of its source)
    # owning layers: the indexer's queries and head weights, the per-sequence window and top-k inputs
    index_q: str | None = None
    index_w: str | None = None
    sparse_window: str | None = None
    top_k: str | None = None
    # sharing layers: the source's selection, and the source layer
    selected: str | None = None
    source: int | None = None

    @property
    def owning(self) -> bool:
        return self.selected is None

    @property
    def owner(self) -> int:
        """The layer whose latents (ranks, window) the attention reads: itself, or its source."""
        if self.owning:
            return self.layer
        assert self.source is not None
        return self.source


def rope_tables(n_max: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_max, D] by the recipe of decisions "RoPE tables": float64 angles, one rounding."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(n_max, dtype=np.float64)[:, None] * inv_freq  # [N, D/2]
    ang = np.concatenate([ang, ang], axis=1)  # [N, D], HF rotate-half layout
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def cast(g: GraphBuilder, x: str, to: int) -> str:
    return g.op("Cast", [x], to=to)


def key_codes(g: GraphBuilder, key: str, to: int | None = None, outputs: list[str] | None = None) -> str:
    """INT8 indexer-key codes from the key already multiplied by float32(1 / s) (in_proj's column scale):
    clip(round_half_even(.), -127, 127), as float32 or cast to `to` (decisions "INT8 indexer keys")."""
    codes = g.op("Clip", [g.op("Round", [key]), g.const(np.float32(-127), np.float32, "key_qmin"),
                          g.const(np.float32(127), np.float32, "key_qmax")], outputs=None if to else outputs)
    return codes if to is None else g.op("Cast", [codes], to=to, outputs=outputs)


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, act: int, out: int | None = None) -> str:
    """x (of type act) / sqrt(mean(x^2) + eps) * w, computed in float32; returned as `out` (default act).

    The exact form Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul is the one ONNX Runtime's
    SimplifiedLayerNormFusion matches: one SimplifiedLayerNormalization kernel instead of seven nodes
    (Mul(x, x) or Reciprocal + Mul are not matched; docs/runtime.md "Layer-stack fusions")."""
    x32 = x if act == F32 else cast(g, x, F32)
    ms = g.op("ReduceMean", [g.op("Pow", [x32, g.const(2.0, np.float32, "two")])], axes=[-1], keepdims=1)
    rms = g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32, "eps")])])
    y = g.op("Mul", [g.op("Div", [x32, rms]), weight])
    out = act if out is None else out
    return y if out == F32 else cast(g, y, out)


def linear(g: GraphBuilder, x2d: str, weight: str, bias: str | None = None) -> str:
    """x [M, in] @ W[out, in]^T (+ b): Gemm with transB, so the checkpoint's layout is stored as is. b is
    Gemm's C: a bias [out] or a residual [M, out] added in the same node."""
    return g.op("Gemm", [x2d, weight] + ([bias] if bias else []), transB=1)


def silu_mul(g: GraphBuilder, a: str, b: str) -> str:
    """silu(a) * b, the SwiGLU product between the gate/up and the down projections."""
    return g.op("Mul", [g.op("Mul", [a, g.op("Sigmoid", [a])]), b])


def positions(g: GraphBuilder, past_lengths: str, like_bs: str) -> tuple[str, str]:
    """pos [B, S] int32 = past_lengths[b] + j, and j [S] int32, for a tensor `like_bs` of shape [B, S, ...]."""
    s = g.op("Cast", [g.op("Gather", [g.op("Shape", [like_bs]), g.const(1, np.int64, "one")], axis=0)], to=I32)
    j = g.op("Range", [g.const(0, np.int32, "zero_i32"), s, g.const(1, np.int32, "one_i32")])
    pos = g.op("Add", [g.op("Unsqueeze", [past_lengths, g.const([1], np.int64, "ax1")]),
                       g.op("Unsqueeze", [j, g.const([0], np.int64, "ax0")])])
    return pos, j


def valid_rows(g: GraphBuilder, j: str, new_lengths: str) -> str:
    """[B, S] bool: j < new_lengths[b] (padding rows are False)."""
    return g.op("Less", [g.op("Unsqueeze", [j, g.const([0], np.int64, "ax0")]),
                         g.op("Unsqueeze", [new_lengths, g.const([1], np.int64, "ax1")])])
