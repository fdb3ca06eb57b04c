"""ONNX nodes and initializers of a weight-only quantised linear layer `y = x @ W^T` (builder/wquant.py).

Two forms, one per graph variant:
- portable (ONNX Runtime): `com.microsoft.MatMulNBits` (x [..., K] float32 -> [..., N]), the 4-/8-bit
  kernel that reads the packed weights directly, so the CPU path gets faster as well as smaller;
- tensorrt: standard `DequantizeLinear` (signed INT4 / INT8 codes stored as W^T [K, N], scales in the
  activation dtype so the strongly typed network keeps FP16) feeding `MatMul`. INT4 and grouped INT8 use
  opset-21 blocked quantisation (`axis=0`, `block_size` = group); per-channel INT8 is per axis (`axis=1`,
  scales [N]); which TensorRT versions build which: docs/weights.md. TensorRT rejects non-zero zero
  points, so a float-zero-point (asymmetric) weight becomes signed codes plus a per-group offset term.

An AWQ input scale `s` (calibration/awq.py) is applied as `x * (1/s)` before the matmul; the
quantised weight is then that of W diag(s), so the product is unchanged up to quantisation error.
(The wiring may fold 1/s into the preceding RMSNorm weight instead; see docs/weights.md.)

The parts are returned as plain NodeProtos and `QInit`s (name, ONNX type, dims, raw little-endian
bytes) so any graph writer can store them: inline, or streamed to external data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from builder.wquant import QuantizedWeight, WeightQuantConfig, WeightQuantError, _pack_low_first, pack_matmul_nbits
from gsm.probe_format import FORMS

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


@dataclass(frozen=True)
class QLayout:
    """What the nodes of a quantised projection need to know once its initializers are stored (so a
    second graph over the same weight file emits its nodes without the weights)."""

    k: int
    n: int
    bits: int
    block: int
    zero_points: bool  # MatMulNBits has a (uint8) zero_points input
    offsets: bool  # float zero point: codes taken as symmetric, plus a per-group offset term
    per_channel: bool = False  # one group per row (group_size None): TensorRT form per axis, not blocked
    offsets_f16: bool = False  # the portable form stores the offsets in float16 (each exactly: _portable_offsets)
    tiles: bool = False  # the portable form also stores GsmQuantMatMul's tiles (`<prefix>.qt.*`, quant_tiles)

    @property
    def blocked(self) -> bool:
        """The TensorRT form's DequantizeLinear is blocked along K (opset 21), not per axis."""
        return not self.per_channel

    @property
    def dq_opset(self) -> int:
        """Least ONNX opset of the TensorRT form: 21 for blocks (and INT4), 13 for per-axis INT8."""
        return DQ_BLOCK_OPSET if self.blocked or self.bits == 4 else 13

    @classmethod
    def of(cls, q: QuantizedWeight, form: str = "portable") -> QLayout:
        """form "portable" (MatMulNBits) or "tensorrt" (DequantizeLinear, offsets in the activation dtype)."""
        f16 = form == "portable" and q.cfg.float_zero_point and _portable_offsets(q).dtype == np.float16
        return cls(q.k, q.n, q.cfg.bits, q.block, not q.cfg.symmetric and not q.cfg.float_zero_point,
                   q.cfg.float_zero_point, q.cfg.group_size is None, f16)


def _exact_half(a: np.ndarray) -> np.ndarray:
    """a as float16 when every value is one exactly (a Q4_1 source's scales and offsets), else float32."""
    half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a) else a


def _portable_offsets(q: QuantizedWeight) -> np.ndarray:
    """[n_blocks, N] group offsets of the portable form: float16 when every one is a float16 exactly (a Q4_1
    source: half the bytes a decode step reads for them, nothing rounded), else float32."""
    return _exact_half(np.ascontiguousarray(q.group_offsets().T))


def nbits_inits(prefix: str, q: QuantizedWeight) -> list[QInit]:
    """MatMulNBits initializers: packed codes, float32 scales, [uint8 zero points]; with a float zero point
    no zero points (the kernel's implicit 2^(bits-1)) but per-group offsets [n_blocks, N] (float16 where exact):
    ONNX Runtime 1.32 has a float-zero-point path, but it ran 30-100x slower than the symmetric
    kernel (N=1536, K=576, M=1: 6.3 ms vs 0.21 ms), the offset term costs one small MatMul."""
    a = pack_matmul_nbits(q)
    inits = [_init(prefix + ".qweight", a.b, TensorProto.UINT8), _init(prefix + ".scales", a.scales, TensorProto.FLOAT)]
    if q.cfg.float_zero_point:
        off = _portable_offsets(q)
        inits.append(_init(prefix + ".offsets", off,
                           TensorProto.FLOAT16 if off.dtype == np.float16 else TensorProto.FLOAT))
    elif a.zero_points is not None:
        inits.append(_init(prefix + ".zero_points", a.zero_points, TensorProto.UINT8))
    return inits


TILE_ROWS, SUB_BLOCK = 16, 32  # GsmQuantMatMul's tile of rows and sub-block of inputs (plugins/ortCpu/GsmQuantMatMul/)


def tiles_fit(q: QuantizedWeight) -> bool:
    """Whether GsmQuantMatMul runs `q`: symmetric 4- or 8-bit, or 4-bit on the float-zero-point grid, in groups of a
    multiple of 32 (integer zero points other than the implicit one are not its form)."""
    grid = q.cfg.symmetric or (q.cfg.bits == 4 and q.cfg.float_zero_point)
    return grid and q.block % SUB_BLOCK == 0


def quant_tiles(q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GsmQuantMatMul's weight: (codes [NT, S, 256 | 512] uint8, scales [NT, G, 16], offsets [NT, G, 16] or None),
    NT = ceil(N / 16) tiles of 16 rows (zero rows pad N), G groups, S = G * block / 32 sub-blocks of 32 inputs. 4-bit:
    byte (t, s, p, r, j) at 64 p + 4 r + j holds u(16t+r, 32s+8p+j) in its low nibble and u(16t+r, 32s+8p+4+j) in its
    high one; 8-bit: u(16t+r, 32s+4p+j). One 64-byte load is 8 or 4 inputs of 16 rows. w = scale * (u - 2^(bits-1))
    [+ offset]: the offsets are a float zero point's, the portable form's (QuantizedWeight.group_offsets,
    min + 8 * scale). Scales and offsets float16 where each is one exactly, else float32."""
    if not tiles_fit(q):
        raise WeightQuantError("GsmQuantMatMul takes symmetric 4-/8-bit or 4-bit float-zero-point weights in groups "
                               f"of a multiple of {SUB_BLOCK}")
    n, g, bits = q.n, q.n_blocks, q.cfg.bits
    nt, s = -(-n // TILE_ROWS), g * q.block // SUB_BLOCK
    u = np.zeros((nt * TILE_ROWS, s * SUB_BLOCK), np.uint8)
    u[:n] = q.codes
    if bits == 4:
        u = u.reshape(nt, TILE_ROWS, s, 4, 2, 4)  # t, r, s, p, half, j
        packed = (u[:, :, :, :, 0, :] | (u[:, :, :, :, 1, :] << 4)).transpose(0, 2, 3, 1, 4)  # t, s, p, r, j
    else:
        packed = u.reshape(nt, TILE_ROWS, s, 8, 4).transpose(0, 2, 3, 1, 4)
    codes = np.ascontiguousarray(packed).reshape(nt, s, -1)

    def per_tile(a: np.ndarray) -> np.ndarray:
        full = np.zeros((nt * TILE_ROWS, g), np.float32)
        full[:n] = a
        return _exact_half(np.ascontiguousarray(full.reshape(nt, TILE_ROWS, g).transpose(0, 2, 1)))

    return codes, per_tile(q.scales), per_tile(q.group_offsets()) if q.cfg.float_zero_point else None


def tiles_inits(prefix: str, q: QuantizedWeight) -> list[QInit]:
    """GsmQuantMatMul's initializers `<prefix>.qt.codes|scales[|offsets]` (quant_tiles)."""
    codes, scales, offsets = quant_tiles(q)
    ft = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}
    inits = [_init(prefix + ".qt.codes", codes, TensorProto.UINT8),
             _init(prefix + ".qt.scales", scales, ft[scales.dtype])]
    return inits + ([] if offsets is None else [_init(prefix + ".qt.offsets", offsets, ft[offsets.dtype])])


def nbits_nodes(x: str, out: str, prefix: str, lay: QLayout, *, accuracy_level: int = 0,
                group_sums: str | None = None) -> list[onnx.NodeProto]:
    """MatMulNBits (+ the float zero point's offset term over `group_sums`, x's group sums: see _offset_nodes)."""
    names = [prefix + ".qweight", prefix + ".scales"] + ([prefix + ".zero_points"] if lay.zero_points else [])
    attrs = {"K": lay.k, "N": lay.n, "bits": lay.bits, "block_size": lay.block}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    main = prefix + ".main" if lay.offsets else out
    nodes = [helper.make_node("MatMulNBits", [x, *names], [main], name=prefix + "/MatMulNBits", domain=MS_DOMAIN,
                              **attrs)]
    return nodes + (_offset_nodes(main, out, prefix, lay, group_sums) if lay.offsets else [])


def matmul_nbits(x: str, out: str, prefix: str, q: QuantizedWeight, *, input_scale: np.ndarray | None = None,
                 accuracy_level: int = 0) -> QLinearParts:
    """Portable form: [Mul(x, 1/s)] -> com.microsoft.MatMulNBits, float32 activations.

    `accuracy_level` 0 keeps ONNX Runtime's float32 compute on the dequantised weights (the numbers
    the tests pin); 4 lets it quantise activations to INT8 blocks (faster, not bit-comparable)."""
    parts = QLinearParts(opsets={MS_DOMAIN: 1})
    xin = _input_scale(parts, x, prefix, input_scale, np.dtype(np.float32), TensorProto.FLOAT)
    parts.inits += nbits_inits(prefix, q)
    lay = QLayout.of(q)
    sums = _group_sums(parts, xin, prefix, lay, np.dtype(np.float32), TensorProto.FLOAT)
    parts.nodes += nbits_nodes(xin, out, prefix, lay, accuracy_level=accuracy_level, group_sums=sums)
    parts.output = out
    return parts


def _act_type(act_dtype: str) -> tuple[np.dtype, int]:
    dt = np.dtype(act_dtype)
    return dt, {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}[dt]


def dq_inits(prefix: str, q: QuantizedWeight, act_dtype: str = "float16") -> list[QInit]:
    """TensorRT-form initializers: signed codes W^T [K, N] (INT4 packed / INT8), scales in the activation
    dtype, and with a float zero point the per-group offsets [n_blocks, N] (see dq_nodes)."""
    if not q.cfg.symmetric and not q.cfg.float_zero_point:
        raise WeightQuantError(f"{prefix}: the TensorRT form needs symmetric quantisation (zero points must be 0) "
                               "or a float zero point (folded into a per-group offset)")
    dt, onnx_act = _act_type(act_dtype)
    codes_t = np.ascontiguousarray(q.signed_codes().T)  # [K, N] int8
    scales_t = np.ascontiguousarray(q.scales.T).astype(dt)  # [n_blocks, N]
    w, s = prefix + ".qweight", prefix + ".scales"
    if q.cfg.bits == 4:
        raw = _pack_low_first((codes_t.reshape(-1).view(np.uint8) & 0x0F), 4).tobytes()
        inits = [QInit(w, TensorProto.INT4, codes_t.shape, raw), _init(s, scales_t, onnx_act)]
    elif q.cfg.group_size is None:  # per channel: per-axis scales [N]
        inits = [_init(w, codes_t, TensorProto.INT8), _init(s, scales_t[0], onnx_act)]
    else:  # blocked along K like INT4
        inits = [_init(w, codes_t, TensorProto.INT8), _init(s, scales_t, onnx_act)]
    if q.cfg.float_zero_point:
        inits.append(_init(prefix + ".offsets", np.ascontiguousarray(q.group_offsets().T).astype(dt), onnx_act))
    return inits


def dq_nodes(x: str, out: str, prefix: str, lay: QLayout, *, with_dq: bool = True,
             group_sums: str | None = None) -> list[onnx.NodeProto]:
    """DequantizeLinear(W^T codes, scales) -> MatMul(x, .); with a float zero point also
    `+ group_sums [M, n_blocks] @ offsets [n_blocks, N]`: w = s (u - 8) + s (8 - zp), the
    second term constant per group, since TensorRT's DequantizeLinear takes no zero points. with_dq False:
    the DequantizeLinear is in the graph already (a tied embedding's gather made it)."""
    deq = prefix + ".weight_dq"
    nodes = [_dq_node(prefix, lay)] if with_dq else []
    main = prefix + ".main" if lay.offsets else out
    nodes.append(helper.make_node("MatMul", [x, deq], [main], name=prefix + "/MatMul"))
    return nodes + (_offset_nodes(main, out, prefix, lay, group_sums) if lay.offsets else [])


def nbits_gather_nodes(ids: str, out: str, prefix: str, lay: QLayout) -> list[onnx.NodeProto]:
    """Rows `ids` of a quantised [N, K] weight, dequantised to float32 [M, K] (M = ids' size), read from the
    MatMulNBits initializers themselves (a tied embedding and LM head share one copy): ONNX Runtime's
    GatherBlockQuantized over the codes viewed as [N, n_blocks, blob] (one block per blob along the last
    axis) with the scales as [N, n_blocks, 1], giving scale (u - 2^(bits-1)) per [M, n_blocks, block].

    Symmetric codes or a float zero point; not integer zero points (the op's uint8 zero points would have to
    match the data's packing). A float zero point's weight is scale (u - 2^(bits-1)) + offset per (row, group)
    (`_offset_nodes`), and GatherBlockQuantized takes integer zero points only, so its symmetric part is
    gathered as above and the offsets added after: Gather(offsets [n_blocks, N], ids, axis=1) -> [n_blocks, M]
    -> [Cast float32 when stored float16] -> Transpose -> Reshape [M, n_blocks, 1] -> Add (broadcast over the
    block), then the rows as in the symmetric case."""
    if lay.zero_points:
        raise WeightQuantError(f"{prefix}: a quantised gather needs symmetric codes or a float zero point")
    nb = -(-lay.k // lay.block)
    shape3, scales3, flat, rows, deq = (prefix + t for t in (".scale_shape", ".scales3", ".flat_ids", ".rows_shape",
                                                             ".gathered"))
    nodes = [
        _const_i64(shape3, [lay.n, nb, 1]),
        helper.make_node("Reshape", [prefix + ".scales", shape3], [scales3], name=prefix + "/scales3"),
        _const_i64(prefix + ".ids_shape", [-1]),
        helper.make_node("Reshape", [ids, prefix + ".ids_shape"], [flat], name=prefix + "/flat_ids"),
        helper.make_node("GatherBlockQuantized", [prefix + ".qweight", flat, scales3], [deq],
                         name=prefix + "/GatherBlockQuantized", domain=MS_DOMAIN, gather_axis=0, quantize_axis=2,
                         block_size=lay.block, bits=lay.bits),  # [M, n_blocks, block]
    ]
    if lay.offsets:
        nodes += _gathered_offset_nodes(flat, prefix, nb, lay.offsets_f16)
        sym, deq = deq, prefix + ".gathered_asym"
        nodes.append(helper.make_node("Add", [sym, prefix + ".gathered_offsets3"], [deq],
                                      name=prefix + "/gather_offset_Add"))  # [M, n_blocks, block]
    nodes.append(_const_i64(rows, [-1, nb * lay.block]))
    if nb * lay.block == lay.k:
        return nodes + [helper.make_node("Reshape", [deq, rows], [out], name=prefix + "/rows")]
    padded = prefix + ".padded_rows"
    return nodes + [helper.make_node("Reshape", [deq, rows], [padded], name=prefix + "/rows"),
                    _const_i64(prefix + ".k0", [0]), _const_i64(prefix + ".k1", [lay.k]),
                    _const_i64(prefix + ".ax1", [1]),
                    helper.make_node("Slice", [padded, prefix + ".k0", prefix + ".k1", prefix + ".ax1"], [out],
                                     name=prefix + "/unpad")]


def _gathered_offset_nodes(flat: str, prefix: str, nb: int, f16: bool) -> list[onnx.NodeProto]:
    """The float zero point's offsets of rows `flat` [M] as float32 `prefix.gathered_offsets3` [M, n_blocks, 1]
    (the portable form's offsets are [n_blocks, N], float16 when f16)."""
    t = prefix + ".gathered_offsets_t"  # [n_blocks, M]
    nodes = [helper.make_node("Gather", [prefix + ".offsets", flat], [t], name=prefix + "/gather_offsets", axis=1)]
    if f16:
        nodes.append(helper.make_node("Cast", [t], [t + "_f32"], name=prefix + "/gathered_offsets_f32",
                                      to=TensorProto.FLOAT))
        t += "_f32"
    return nodes + [
        helper.make_node("Transpose", [t], [prefix + ".gathered_offsets"], name=prefix + "/gathered_offsets",
                         perm=[1, 0]),  # [M, n_blocks]
        _const_i64(prefix + ".offsets3_shape", [-1, nb, 1]),
        helper.make_node("Reshape", [prefix + ".gathered_offsets", prefix + ".offsets3_shape"],
                         [prefix + ".gathered_offsets3"], name=prefix + "/gathered_offsets3"),
    ]


def dq_gather_nodes(ids: str, out: str, prefix: str, lay: QLayout, *, with_dq: bool = True) -> list[onnx.NodeProto]:
    """TensorRT form of nbits_gather_nodes: Gather(DequantizeLinear(W^T codes), ids, axis=1) -> [K, M] ->
    Transpose -> [M, K] in the scales' dtype, over the same DequantizeLinear output the LM head's MatMul
    reads (with_dq False: that node is in the graph already).

    With a float zero point that DequantizeLinear gives the symmetric part only (TensorRT takes no zero
    points; dq_nodes), so the offsets [n_blocks, N] (in the activation dtype) of the rows are added before the
    Transpose: Gather(offsets, ids, axis=1) -> [n_blocks, M] -> Gather(., k // block, axis=0) -> [K, M] (the
    group of each input, a constant; K need not be a multiple of the block) -> Add."""
    nodes = [_dq_node(prefix, lay)] if with_dq else []
    flat, cols = prefix + ".flat_ids", prefix + ".gathered_t"
    nodes += [
        _const_i64(prefix + ".ids_shape", [-1]),
        helper.make_node("Reshape", [ids, prefix + ".ids_shape"], [flat], name=prefix + "/flat_ids"),
        helper.make_node("Gather", [prefix + ".weight_dq", flat], [cols], name=prefix + "/Gather", axis=1),
    ]
    if lay.offsets:
        g, gk, k_groups = prefix + ".gathered_offsets_t", prefix + ".gathered_offsets_k", prefix + ".k_groups"
        nodes += [
            helper.make_node("Gather", [prefix + ".offsets", flat], [g], name=prefix + "/gather_offsets", axis=1),
            _const_i64(k_groups, (np.arange(lay.k) // lay.block).tolist()),
            helper.make_node("Gather", [g, k_groups], [gk], name=prefix + "/gathered_offsets_k", axis=0),
            helper.make_node("Add", [cols, gk], [prefix + ".gathered_asym_t"], name=prefix + "/gather_offset_Add"),
        ]
        cols = prefix + ".gathered_asym_t"
    return nodes + [helper.make_node("Transpose", [cols], [out], name=prefix + "/rows", perm=[1, 0])]


def _dq_node(prefix: str, lay: QLayout) -> onnx.NodeProto:
    attrs = {"axis": 0, "block_size": lay.block} if lay.blocked else {"axis": 1}
    return helper.make_node("DequantizeLinear", [prefix + ".qweight", prefix + ".scales"], [prefix + ".weight_dq"],
                            name=prefix + "/DequantizeLinear", **attrs)


def _const_i64(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=helper.make_tensor(name, TensorProto.INT64,
                                                                                          [len(values)], values))


def group_indicator(k: int, block: int, dtype=np.float32) -> np.ndarray:
    """E [K, n_blocks], E[k, g] = 1 where input k is in group g: x @ E are x's group sums (a last short group
    sums its real columns only)."""
    nb = -(-k // block)
    e = np.zeros((k, nb), dtype)
    e[np.arange(k), np.arange(k) // block] = 1
    return e


def _offset_nodes(main: str, out: str, prefix: str, lay: QLayout,
                  group_sums: str | None) -> list[onnx.NodeProto]:
    """out = Gemm(group sums of x [M, n_blocks], offsets [n_blocks, N], C = main): the float zero point's
    per-group constant `scale (2^(bits-1) - zp)` times the sum of the inputs it multiplies. `group_sums`:
    x @ group_indicator(K, block), made once by the caller for every projection that reads the same x."""
    if group_sums is None:
        raise ValueError(f"{prefix}: a float-zero-point weight needs the group sums of its input")
    if not lay.offsets_f16:
        return [helper.make_node("Gemm", [group_sums, prefix + ".offsets", main], [out], name=prefix + "/offset_Gemm")]
    # float16 offsets widened for the Gemm (a constant Cast, folded when the session is made)
    return [helper.make_node("Cast", [prefix + ".offsets"], [prefix + ".offsets_f32"], name=prefix + "/offsets_f32",
                             to=TensorProto.FLOAT),
            helper.make_node("Gemm", [group_sums, prefix + ".offsets_f32", main], [out], name=prefix + "/offset_Gemm")]


def _group_sums(parts: QLinearParts, x: str, prefix: str, lay: QLayout, dt: np.dtype, onnx_t: int) -> str | None:
    """A standalone layer's x @ group_indicator (an initializer and a MatMul), None without a float zero point."""
    if not lay.offsets:
        return None
    name = prefix + ".x_group_sums"
    parts.inits.append(_init(prefix + ".groups", group_indicator(lay.k, lay.block, dt), onnx_t))
    parts.nodes.append(helper.make_node("MatMul", [x, prefix + ".groups"], [name], name=prefix + "/group_sums"))
    return name


def dq_matmul(x: str, out: str, prefix: str, q: QuantizedWeight, *, act_dtype: str = "float16",
              input_scale: np.ndarray | None = None) -> QLinearParts:
    """TensorRT form: DequantizeLinear(W^T codes [K, N], scales) -> MatMul(x, .), activations `act_dtype`.

    Blocked along K (axis 0, block_size = group, scales [ceil(K/g), N]) for INT4 and grouped INT8; per
    output channel (axis 1, scales [N]) for per-channel INT8 (group_size None). x is 2-D [M, K]."""
    dt, onnx_act = _act_type(act_dtype)
    parts = QLinearParts(opsets={"": DQ_BLOCK_OPSET})
    xin = _input_scale(parts, x, prefix, input_scale, dt, onnx_act)
    parts.inits += dq_inits(prefix, q, act_dtype)
    lay = QLayout.of(q, "tensorrt")
    parts.nodes += dq_nodes(xin, out, prefix, lay, group_sums=_group_sums(parts, xin, prefix, lay, dt, onnx_act))
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


class ProjectionStore:
    """Quantised projections streamed into a bundle's weight file once, in both forms.

    The first graph that uses a projection reads its checkpoint tensor a block of rows at a time
    (`quantize_chunks`: only the uint8 codes are held whole, 1 byte per weight), writes the
    MatMulNBits initializers (`<name>.nbits.*`) and the TensorRT ones (`<name>.dq.*`), and drops
    everything; the other graph finds them stored and only emits its nodes. `configs` holds each
    quantised tensor's config by checkpoint name (the embedding / LM head have their own).

    Grouped INT8 is the exception: TensorRT documents blocked dequantisation for INT4 only, so the
    TensorRT form of a grouped INT8 config is per output channel (`trt_config`), quantised in a second
    streamed pass when the TensorRT graph first asks for it (docs/weights.md "INT8 groups").
    """

    FORMS = ("portable", "tensorrt")

    def __init__(self, store, configs: Mapping[str, WeightQuantConfig], *, trt_act_dtype: str = "float16",
                 input_scales: dict[str, np.ndarray] | None = None,
                 row_quantizers: Mapping[str, Callable[..., Any]] | None = None, tiles: bool = False) -> None:
        """input_scales: AWQ scale s [K] per weight name: W diag(s) is quantised and x / s fed to it.
        row_quantizers: per weight name, a row-block quantiser in round-to-nearest's place (builder/gptq.py).
        tiles: the portable form of a weight GsmQuantMatMul runs (tiles_fit) also holds its tiles, for the CPU graph
        (its INT8 activations are those of MatMulNBits accuracy_level 4: only for `fast` matmuls)."""
        self.store, self.configs, self.trt_act_dtype = store, dict(configs), trt_act_dtype
        self.tiles = tiles
        self.input_scales = input_scales or {}
        self.row_quantizers = dict(row_quantizers or {})
        self.layouts: dict[tuple[str, str], QLayout] = {}
        self.init_names: dict[tuple[str, str], list[str]] = {}
        self.trt_act_dtypes: dict[str, str] = {}  # per-tensor override of trt_act_dtype

    def register(self, name: str, cfg: WeightQuantConfig, *, trt_act_dtype: str | None = None) -> None:
        """A tensor beyond the checkpoint's (a row-concatenation of quantised ones) and its config; trt_act_dtype:
        its TensorRT form's activation type when not the graph's (float32 for the GSM-side projections)."""
        self.configs[name] = cfg
        if trt_act_dtype is not None:
            self.trt_act_dtypes[name] = trt_act_dtype

    def input_scale_name(self, name: str, form: str) -> str | None:
        """The stored 1/s of `name` in `form`, or None without AWQ."""
        return self.prefix(name, form) + ".awq_inv_scale" if name in self.input_scales else None

    @staticmethod
    def prefix(name: str, form: str) -> str:
        return name + (".nbits" if form == "portable" else ".dq")

    def config(self, name: str, form: str) -> WeightQuantConfig:
        cfg = self.configs[name]
        return cfg if form == "portable" else trt_config(cfg)

    def ensure(self, name: str, source, form: str) -> QLayout:
        """Quantise and store `name` (from a TensorSource) for `form` unless done (for both forms at once
        when they share the config); its layout in `form`."""
        if (name, form) in self.layouts:
            return self.layouts[(name, form)]
        from builder.wquant import quantize_chunks

        forms = [f for f in self.FORMS if self.config(name, f) == self.config(name, form)]
        shape = tuple(source.shape(name))
        chunks = source.chunks(name)
        s = self.input_scales.get(name)
        if s is not None:
            chunks = _scale_columns(chunks, np.asarray(s, np.float32), shape[1])
        q = quantize_chunks(shape, chunks, self.config(name, form), name=name,
                            quantize_rows=self.row_quantizers.get(name))
        self.store.note_held(q.codes.nbytes)
        trt_act = self.trt_act_dtypes.get(name, self.trt_act_dtype)
        tiles = self.tiles and tiles_fit(q)
        makers = {"portable": lambda p: nbits_inits(p, q) + (tiles_inits(p, q) if tiles else []),
                  "tensorrt": lambda p: dq_inits(p, q, trt_act)}
        for f in forms:
            inits = makers[f](self.prefix(name, f))
            if s is not None:
                dt, onnx_t = _act_type("float32" if f == "portable" else trt_act)
                inv = (1.0 / np.asarray(s, np.float64)).astype(dt)
                inits.append(_init(self.input_scale_name(name, f), inv, onnx_t))
            for i in inits:
                self.store.put_raw(i.name, i.data_type, i.dims, i.raw)
            self.init_names[(name, f)] = [i.name for i in inits]
            del inits
            self.layouts[(name, f)] = dataclasses.replace(QLayout.of(q, f), tiles=tiles and f == "portable")
        return self.layouts[(name, form)]


PORTABLE, TENSORRT = FORMS  # the golden's forms of a bundle's weights (gsm.probe_format)


def trt_config(cfg: WeightQuantConfig) -> WeightQuantConfig:
    """The config of the TensorRT form: grouped INT8 becomes per channel (TensorRT 10 documents blocked
    DequantizeLinear for INT4 only); everything else is the same as the portable form."""
    if cfg.bits == 8 and cfg.group_size is not None:
        return dataclasses.replace(cfg, group_size=None)
    return cfg


@dataclass(frozen=True)
class BundleWeights:
    """How a bundle holds its weights: each quantised checkpoint tensor's quantisation (by name; empty: none), the
    AWQ scales of some of them, and the row quantisers that replace round-to-nearest for some (GPTQ)."""

    configs: Mapping[str, WeightQuantConfig] = field(default_factory=dict)
    input_scales: Mapping[str, np.ndarray] = field(default_factory=dict)
    row_quantizers: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    int8_activations: bool = False  # the ONNX Runtime graphs' quantised matmuls are `fast` (accuracy level 4)

    def config(self, name: str, form: str) -> WeightQuantConfig:
        cfg = self.configs[name]
        return cfg if form == PORTABLE else trt_config(cfg)

    def emulated(self, form: str) -> bool:
        """Whether the golden of `form` quantises the quantised projections' inputs as the form's kernels do."""
        return form == PORTABLE and self.int8_activations and bool(self.configs)

    @property
    def forms(self) -> tuple[str, ...]:
        """The golden's forms whose computations differ: portable, and tensorrt where any tensor's TensorRT form
        differs or the ONNX Runtime graphs' activations are quantised (TensorRT's are not)."""
        differs = any(trt_config(c) != c for c in self.configs.values()) or self.emulated(PORTABLE)
        return (PORTABLE, TENSORRT) if differs else (PORTABLE,)


def _scale_columns(chunks, s: np.ndarray, k: int):
    """Flat C-order chunks of W [N, K] -> those of W diag(s) (a chunk may start mid-row)."""
    pos = 0
    for c in chunks:
        c = np.asarray(c, np.float32).reshape(-1)
        yield c * s[(pos + np.arange(c.size)) % k]
        pos += c.size
