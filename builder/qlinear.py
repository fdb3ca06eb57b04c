"""ONNX nodes and initializers of a weight-only quantised linear layer `y = x @ W^T` (builder/wquant.py).

Two forms, one per graph variant:
- portable (ONNX Runtime): `com.microsoft.MatMulNBits` (x [..., K] float32 -> [..., N]), the 4-/8-bit
  kernel that reads the packed weights directly, so the CPU path gets faster as well as smaller;
- tensorrt: standard `DequantizeLinear` (signed INT4 / INT8 codes stored as W^T [K, N], scales in the
  activation dtype so the strongly typed network keeps FP16) feeding `MatMul`. INT4 uses opset-21
  blocked quantisation (`axis=0`, `block_size` = group); INT8 per output channel (`axis=1`, scales
  [N]), the weight-only forms TensorRT 10 builds (docs/weights.md). Symmetric only: TensorRT rejects
  non-zero zero points.

An AWQ input scale `s` (calibration/awq.py) is applied as `x * (1/s)` before the matmul; the
quantised weight is then that of W diag(s), so the product is unchanged up to quantisation error.
(The wiring may fold 1/s into the preceding RMSNorm weight instead; see docs/weights.md.)

The parts are returned as plain NodeProtos and `QInit`s (name, ONNX type, dims, raw little-endian
bytes) so any graph writer can store them: inline, or streamed to external data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from builder.wquant import QuantizedWeight, WeightQuantError, _pack_low_first, pack_matmul_nbits

MS_DOMAIN = "com.microsoft"
DQ_BLOCK_OPSET = 21  # DequantizeLinear gained block_size (and INT4 inputs) in opset 21


@dataclass(frozen=True)
class QInit:
    """One initializer: raw little-endian bytes of an ONNX tensor (INT4 packed two per byte, low first)."""

    name: str
    data_type: int  # onnx.TensorProto enum
    dims: tuple[int, ...]
    raw: bytes

    def proto(self) -> TensorProto:
        return helper.make_tensor(self.name, self.data_type, list(self.dims), self.raw, raw=True)


@dataclass
class QLinearParts:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[QInit] = field(default_factory=list)
    output: str = ""
    opsets: dict[str, int] = field(default_factory=dict)  # domains (and least versions) the nodes need


def _init(name: str, a: np.ndarray, data_type: int) -> QInit:
    a = np.ascontiguousarray(a)
    return QInit(name, data_type, tuple(a.shape), a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def _input_scale(parts: QLinearParts, x: str, prefix: str, input_scale: np.ndarray | None, dtype: np.dtype,
                 onnx_type: int) -> str:
    if input_scale is None:
        return x
    inv = (1.0 / np.asarray(input_scale, np.float64)).astype(dtype)
    parts.inits.append(_init(prefix + ".awq_inv_scale", inv, onnx_type))
    out = prefix + ".awq_x"
    parts.nodes.append(helper.make_node("Mul", [x, prefix + ".awq_inv_scale"], [out], name=prefix + "/awq_Mul"))
    return out


def matmul_nbits(x: str, out: str, prefix: str, q: QuantizedWeight, *, input_scale: np.ndarray | None = None,
                 accuracy_level: int = 0) -> QLinearParts:
    """Portable form: [Mul(x, 1/s)] -> com.microsoft.MatMulNBits, float32 activations.

    `accuracy_level` 0 keeps ONNX Runtime's float32 compute on the dequantised weights (the numbers
    the tests pin); 4 lets it quantise activations to INT8 blocks (faster, not bit-comparable)."""
    parts = QLinearParts(opsets={MS_DOMAIN: 1})
    a = pack_matmul_nbits(q)
    xin = _input_scale(parts, x, prefix, input_scale, np.dtype(np.float32), TensorProto.FLOAT)
    names = [prefix + ".qweight", prefix + ".scales"]
    parts.inits += [_init(names[0], a.b, TensorProto.UINT8), _init(names[1], a.scales, TensorProto.FLOAT)]
    if a.zero_points is not None:
        names.append(prefix + ".zero_points")
        parts.inits.append(_init(names[2], a.zero_points, TensorProto.UINT8))
    attrs = {"K": a.k, "N": a.n, "bits": a.bits, "block_size": a.block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    parts.nodes.append(helper.make_node("MatMulNBits", [xin, *names], [out], name=prefix + "/MatMulNBits",
                                        domain=MS_DOMAIN, **attrs))
    parts.output = out
    return parts


def dq_matmul(x: str, out: str, prefix: str, q: QuantizedWeight, *, act_dtype: str = "float16",
              input_scale: np.ndarray | None = None) -> QLinearParts:
    """TensorRT form: DequantizeLinear(W^T codes [K, N], scales) -> MatMul(x, .), activations `act_dtype`.

    INT4: blocked along K (axis 0, block_size = group, scales [ceil(K/g), N]); INT8 must be per output
    channel (axis 1, scales [N]): TensorRT 10 blocks INT4 only."""
    if not q.cfg.symmetric:
        raise WeightQuantError(f"{prefix}: the TensorRT form needs symmetric quantisation (zero points must be 0)")
    dt = np.dtype(act_dtype)
    onnx_act = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}[dt]
    parts = QLinearParts(opsets={"": DQ_BLOCK_OPSET})
    xin = _input_scale(parts, x, prefix, input_scale, dt, onnx_act)
    codes_t = np.ascontiguousarray(q.signed_codes().T)  # [K, N] int8
    scales_t = np.ascontiguousarray(q.scales.T).astype(dt)  # [n_blocks, N]
    w, s = prefix + ".qweight", prefix + ".scales"
    if q.cfg.bits == 4:
        raw = _pack_low_first((codes_t.reshape(-1).view(np.uint8) & 0x0F), 4).tobytes()
        parts.inits += [QInit(w, TensorProto.INT4, codes_t.shape, raw), _init(s, scales_t, onnx_act)]
        attrs = {"axis": 0, "block_size": q.block}
    else:
        if q.n_blocks != 1:
            raise WeightQuantError(f"{prefix}: INT8 for TensorRT must be per channel (group_size None), "
                                   f"got {q.n_blocks} groups per row")
        parts.inits += [_init(w, codes_t, TensorProto.INT8), _init(s, scales_t[0], onnx_act)]
        attrs = {"axis": 1}
    deq = prefix + ".weight_dq"
    parts.nodes.append(helper.make_node("DequantizeLinear", [w, s], [deq], name=prefix + "/DequantizeLinear",
                                        **attrs))
    parts.nodes.append(helper.make_node("MatMul", [xin, deq], [out], name=prefix + "/MatMul"))
    parts.output = out
    return parts


def standalone_model(parts: QLinearParts, x: str, k: int, n: int, elem: int = TensorProto.FLOAT,
                     opset: int = 21) -> onnx.ModelProto:
    """A one-layer model x [M, K] -> parts.output [M, N] (tests and benchmarks)."""
    g = helper.make_graph(parts.nodes, "qlinear", [helper.make_tensor_value_info(x, elem, ["M", k])],
                          [helper.make_tensor_value_info(parts.output, elem, ["M", n])],
                          initializer=[i.proto() for i in parts.inits])
    ops = [helper.make_opsetid("", max(opset, parts.opsets.get("", 0)))]
    ops += [helper.make_opsetid(d, v) for d, v in parts.opsets.items() if d]
    return helper.make_model(g, opset_imports=ops, producer_name="gsm-edge qlinear")
