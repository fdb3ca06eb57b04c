"""Weight-only INT8 / INT4 quantisation of linear layers: round-to-nearest per output channel and group.

Pure numpy. A linear layer `y = x @ W^T`, W [N, K] (N outputs, K inputs), is cut along K into groups
of `group_size` columns; each (row, group) has one scale (and, asymmetric, one zero point). Codes are
held *unsigned* (`u` in [0, 2^bits)) with a zero point `zp`, so every variant dequantises the same
way, `w = (u - zp) * scale`:
- symmetric (the default, and the only form TensorRT accepts: its DequantizeLinear rejects non-zero
  zero points): `zp = 2^(bits-1)` for every group, `scale = absmax / (2^(bits-1) - 1)`; the signed
  code `u - zp` lies in [-7, 7] (INT4) / [-127, 127] (INT8);
- asymmetric: `scale = (max - min) / (2^bits - 1)`, `zp = round(-min / scale)` per group;
- asymmetric with a *float* zero point (`float_zero_point`, portable graph and the TensorRT form's
  per-block correction): `scale = (max - min) / (2^bits - 1)`, `zp = -min / scale` unrounded, so the
  group's min maps to code 0 and its max to code 2^bits - 1 exactly. This is llama.cpp's Q4_1 grid
  (`w = q d + m`): a Q4_1 source re-quantised this way at group 32 gets its own codes back
  (`on_block_grid` detects such weights).

Scales are rounded to the storage dtype (float16 by default: what the TensorRT graph holds) *before*
the codes are computed, so every graph variant, at any activation precision, dequantises to the
same float32 values. K that is not a multiple of the group is padded with zero weights (codes equal
to the zero point), as ONNX Runtime's own quantiser pads.

`pack_matmul_nbits` writes ONNX Runtime's `com.microsoft.MatMulNBits` layout: B uint8
`[N, n_blocks, blob]` with `blob = group * bits / 8`, codes low-nibble-first along K; scales
`[N * n_blocks]`; zero points (asymmetric only; absent means 2^(bits-1)) packed per row into
`ceil(n_blocks * bits / 8)` bytes, low nibble first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BITS = (4, 8)
FP16_MAX = 65504.0


class WeightQuantError(ValueError):
    """A weight or a setting that cannot be quantised as asked (the message names which)."""


@dataclass(frozen=True)
class WeightQuantConfig:
    """How one linear layer is quantised. `group_size=None` means one group per row (per channel)."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: str = "float16"  # the dtype scales are stored (and therefore rounded) in
    float_zero_point: bool = False  # asymmetric only: zp = -min/scale unrounded (float32)

    def __post_init__(self) -> None:
        if self.float_zero_point and self.symmetric:
            raise WeightQuantError("a float zero point needs asymmetric quantisation")
        if self.bits not in BITS:
            raise WeightQuantError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group_size is not None and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            # MatMulNBits needs a power of two >= 16
            raise WeightQuantError(f"group size must be a power of two >= 16, got {self.group_size}")
        if self.scale_dtype not in ("float16", "float32"):
            raise WeightQuantError(f"scale_dtype must be float16 or float32, got {self.scale_dtype}")

    def block(self, k: int) -> int:
        """Columns per group for a layer with K inputs (per channel: the smallest power of two >= K)."""
        if self.group_size is not None:
            return self.group_size
        return max(16, 1 << (k - 1).bit_length())


@dataclass(frozen=True)
class QuantizedWeight:
    """W [N, K] quantised: `deq = (codes - zero_points) * scales` per (row, group), first K columns."""

    codes: np.ndarray  # [N, n_blocks * block] uint8, unsigned codes (padding columns = zero point)
    scales: np.ndarray  # [N, n_blocks] float32, values exactly representable in cfg.scale_dtype
    zero_points: np.ndarray  # [N, n_blocks] uint8 (float32 with cfg.float_zero_point)
    k: int
    block: int
    cfg: WeightQuantConfig
    mins: np.ndarray | None = None  # [N, n_blocks] float32, float zero point only: each group's min (code 0's value)

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.scales.shape[1]

    def signed_codes(self) -> np.ndarray:
        """int8 [N, K] codes - 2^(bits-1) (TensorRT's signed INT4/INT8 weights). Symmetric: exactly the
        weight / scale; with a float zero point the weight is (signed + 2^(bits-1) - zp) * scale, the
        second term a per-group offset (`group_offsets`)."""
        if not self.cfg.symmetric and not self.cfg.float_zero_point:
            raise WeightQuantError("signed codes exist only for symmetric or float-zero-point quantisation")
        return (self.codes[:, : self.k].astype(np.int16) - (1 << (self.cfg.bits - 1))).astype(np.int8)

    def group_offsets(self) -> np.ndarray:
        """float32 [N, n_blocks]: (2^(bits-1) - zp) * scale, what every weight of a group adds to
        signed_codes() * scale (zero when symmetric). With a float zero point it is min + 2^(bits-1) * scale, made
        from the group's min in one rounding: exact for a Q4_1 source (min and scale float16, the sum a float16 as
        well where |min| >= scale, which the graphs then store in float16), where (2^(bits-1) - zp) * scale carries
        zp's own rounding."""
        if self.mins is not None:
            half = float(1 << (self.cfg.bits - 1))
            return (self.mins.astype(np.float64) + half * self.scales.astype(np.float64)).astype(np.float32)
        zp = self.zero_points.astype(np.float32)
        return ((1 << (self.cfg.bits - 1)) - zp) * self.scales


def quantize(w: np.ndarray, cfg: WeightQuantConfig, *, name: str = "weight") -> QuantizedWeight:
    """Round-to-nearest (half to even) quantisation of W [N, K]."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or 0 in w.shape:
        raise WeightQuantError(f"{name}: expected a non-empty 2-D weight [N, K], got shape {list(w.shape)}")
    if not np.isfinite(w).all():
        raise WeightQuantError(f"{name}: holds non-finite values")
    n, k = w.shape
    block = cfg.block(k)
    nb = math.ceil(k / block)
    wp = np.zeros((n, nb * block), np.float32)
    wp[:, :k] = w
    g = wp.reshape(n, nb, block)
    levels = (1 << cfg.bits) - 1
    if cfg.symmetric:
        qmax = (1 << (cfg.bits - 1)) - 1
        scale = np.abs(g).max(axis=2) / qmax
        zp = np.full((n, nb), 1 << (cfg.bits - 1), np.int32)
    elif cfg.float_zero_point:
        lo, hi = _group_range(g, k, block)
        scale = (hi - lo) / levels
    else:
        lo, hi = np.minimum(g.min(axis=2), 0.0), np.maximum(g.max(axis=2), 0.0)  # keep 0 exact
        scale = (hi - lo) / levels
    scale = _storable(scale, cfg, name)
    if cfg.float_zero_point:
        zpf = (-lo / scale).astype(np.float32)
        # codes from the distance to the group's min: min -> 0 and max -> 2^bits - 1 exactly
        u = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, levels)
        return QuantizedWeight(u.reshape(n, nb * block).astype(np.uint8), scale, zpf, k, block, cfg,
                               lo.astype(np.float32))
    if not cfg.symmetric:
        zp = np.clip(np.rint(-lo / scale), 0, levels).astype(np.int32)
    u = np.clip(np.rint(g / scale[..., None]) + zp[..., None], 0, levels)
    return QuantizedWeight(u.reshape(n, nb * block).astype(np.uint8), scale, zp.astype(np.uint8), k, block, cfg)


def _group_range(g: np.ndarray, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """min and max of each group over its real columns (the zero padding of the last group excluded)."""
    pad = g.shape[1] * block - k
    if not pad:
        return g.min(axis=2), g.max(axis=2)
    real = np.ones(g.shape[1:], bool)
    real[-1, block - pad:] = False
    return np.where(real, g, np.inf).min(axis=2), np.where(real, g, -np.inf).max(axis=2)


def on_block_grid(w: np.ndarray, bits: int = 4, group: int = 32, tol: float = 1e-3) -> bool:
    """Whether every group of `group` columns of W [N, K] already lies on an asymmetric `bits`-bit grid
    with its min at code 0 and its max at code 2^bits - 1 (llama.cpp Q4_1 / Q5_1 style weights): then
    float-zero-point quantisation at that group reproduces the weights (within float rounding)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % group:
        return False
    b = w.reshape(-1, group)
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    step = (hi - lo) / ((1 << bits) - 1)
    r = (b - lo) / np.where(step > 0, step, 1.0)
    return bool(np.abs(r - np.rint(r)).max() <= tol)


def _storable(scale: np.ndarray, cfg: WeightQuantConfig, name: str) -> np.ndarray:
    """Scales rounded to the storage dtype; an all-zero group gets scale 1 (its codes are all zero)."""
    if cfg.scale_dtype == "float16":
        if scale.max() > FP16_MAX:
            raise WeightQuantError(f"{name}: a group scale of {scale.max():.3g} overflows float16 scales")
        scale = scale.astype(np.float16).astype(np.float32)
    scale = scale.astype(np.float32)
    scale[scale == 0] = 1.0
    return scale


def dequantize(q: QuantizedWeight) -> np.ndarray:
    """float32 [N, K]: (codes - zero point) * scale, one multiplication per weight."""
    n, nb, b = q.n, q.n_blocks, q.block
    u = q.codes.reshape(n, nb, b).astype(np.float32) - q.zero_points[..., None].astype(np.float32)
    return (u * q.scales[..., None]).reshape(n, nb * b)[:, : q.k]


def quantize_chunks(shape: tuple[int, ...], chunks, cfg: WeightQuantConfig, *, name: str = "weight",
                    rows_per_step: int | None = None, quantize_rows=None) -> QuantizedWeight:
    """`quantize` of W [N, K] given as flat float32 chunks in C order, a block of rows at a time (rows
    quantise independently), so the float tensor is never held whole: only the uint8 codes (1 byte per
    weight) and one block of rows. Same result as quantize(W) (tests check). quantize_rows: another
    row-independent quantiser `(rows, cfg, name=) -> QuantizedWeight` in quantize's place (builder/gptq.py)."""
    quantize_rows = quantize_rows or quantize
    if len(shape) != 2 or 0 in shape:
        raise WeightQuantError(f"{name}: expected a non-empty 2-D weight [N, K], got shape {list(shape)}")
    n, k = shape
    block = cfg.block(k)
    nb = math.ceil(k / block)
    step = rows_per_step or max(1, (16 << 20) // (4 * k))
    codes = np.empty((n, nb * block), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zps = np.empty((n, nb), np.float32 if cfg.float_zero_point else np.uint8)
    mins = np.empty((n, nb), np.float32) if cfg.float_zero_point else None
    pending: list[np.ndarray] = []
    have = row = 0

    def flush(rows: np.ndarray) -> None:
        nonlocal row
        q = quantize_rows(rows, cfg, name=name)
        r = rows.shape[0]
        codes[row:row + r], scales[row:row + r], zps[row:row + r] = q.codes, q.scales, q.zero_points
        if mins is not None:
            mins[row:row + r] = q.mins
        row += r

    def take(rows: int) -> None:
        nonlocal pending, have
        flat = np.concatenate(pending) if len(pending) > 1 else pending[0]
        flush(flat[: rows * k].reshape(rows, k))
        rest = flat[rows * k:]
        pending, have = ([rest] if rest.size else []), rest.size

    for c in chunks:
        pending.append(np.asarray(c, np.float32).reshape(-1))
        have += pending[-1].size
        while have >= step * k and row + step <= n:
            take(step)
    if have and have % k == 0 and row + have // k == n:
        take(have // k)
    if row != n or have:
        raise WeightQuantError(f"{name}: streamed {row * k + have} values, shape {list(shape)} needs {n * k}")
    return QuantizedWeight(codes, scales, zps, k, block, cfg, mins)


def fake_quantize(w: np.ndarray, cfg: WeightQuantConfig, *, name: str = "weight") -> np.ndarray:
    """dequantize(quantize(w)): the weight the quantised graph computes with."""
    return dequantize(quantize(w, cfg, name=name))


@dataclass(frozen=True)
class MatMulNBitsArrays:
    """The initializers of one com.microsoft MatMulNBits node (attributes K, N, bits, block_size)."""

    b: np.ndarray  # uint8 [N, n_blocks, blob]
    scales: np.ndarray  # float32 [N * n_blocks]
    zero_points: np.ndarray | None  # uint8 [N * ceil(n_blocks * bits / 8)] (float32 [N * n_blocks] when float),
    # None when symmetric
    k: int
    n: int
    bits: int
    block_size: int


def _pack_low_first(u: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., m] -> bytes [..., ceil(m * bits / 8)], element 2j in the low nibble (4 bits)."""
    if bits == 8:
        return u.astype(np.uint8)
    if u.shape[-1] % 2:
        u = np.concatenate([u, np.zeros((*u.shape[:-1], 1), u.dtype)], axis=-1)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def unpack_low_first(packed: np.ndarray, bits: int, m: int) -> np.ndarray:
    """Inverse of the packing: bytes [..., ceil(m * bits / 8)] -> uint8 codes [..., m]."""
    if bits == 8:
        return packed[..., :m].astype(np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out[..., :m]


def pack_matmul_nbits(q: QuantizedWeight) -> MatMulNBitsArrays:
    n, nb, bits = q.n, q.n_blocks, q.cfg.bits
    b = _pack_low_first(q.codes.reshape(n, nb, q.block), bits)
    if q.cfg.symmetric:
        zp = None
    elif q.cfg.float_zero_point:  # MatMulNBits takes zero points of the scales' type unpacked, [N * n_blocks]
        zp = q.zero_points.reshape(-1).astype(np.float32)
    else:
        zp = _pack_low_first(q.zero_points, bits).reshape(-1)
    return MatMulNBitsArrays(b, q.scales.reshape(-1).astype(np.float32), zp, q.k, n, bits, q.block)


def quantized_bytes(n: int, k: int, cfg: WeightQuantConfig) -> int:
    """Device bytes of one quantised [N, K] weight: packed codes (unpadded, as TensorRT holds them),
    one scale per group in the scale dtype, and packed zero points when asymmetric."""
    nb = math.ceil(k / cfg.block(k))
    scale_bytes = 2 if cfg.scale_dtype == "float16" else 4
    if cfg.symmetric:
        zp = 0
    elif cfg.float_zero_point:  # one float per group (the TensorRT form's FP16 per-group offset)
        zp = n * nb * scale_bytes
    else:
        zp = n * math.ceil(nb * cfg.bits / 8)
    return n * math.ceil(k * cfg.bits / 8) + n * nb * scale_bytes + zp
