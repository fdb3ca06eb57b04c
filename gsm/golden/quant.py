"""Rounding of the mixed-precision latent cache (spec 5), defined once, exactly.

Engines (CPU reference, CUDA kernels, ONNX graphs) must reproduce these float32 operations in this
order to agree bit for bit on dequantised latents:

- FP16 tier:  v = float32(float16_rne(x))
- INT12 tier: q = clamp(rint_half_even(x / s12), -2047, 2047); v = float32(q) * s12
- INT8 tier:  q = clamp(rint_half_even(x / s8), -127, 127);    v = (float32(q) * s8) + comp
  (two separately rounded fp32 operations, no fused multiply-add: CUDA code uses __fmul_rn and
  __fadd_rn, ONNX uses Mul then Add)
- INT4 tier:  q = clamp(rint_half_even(x / s4), -7, 7);        v = (float32(q) * s4) + comp4
- `x / s` is an IEEE float32 division (not a multiply by a reciprocal).
- Demotion re-quantises the value the engine still holds: FP16 -> INT8 quantises the FP16 value,
  INT12 -> INT8 the INT12-dequantised one, INT8 -> INT4 the INT8-dequantised one (compensation included).
- Default scales when calibration has none: s12 = float32(float32(s8 * 127) / 2047),
  s4 = float32(float32(s8 * 127) / 7), comp4 = 0.

INT8 indexer keys (decisions "INT8 indexer keys"): per channel of the key e [dI] (float32, not rounded to
FP16 first), q = clamp(rint_half_even(e * inv), -127, 127) with inv = float32(1 / s) (an IEEE float32
division, once per channel: engines fold it into the multiply that follows their projection); the index
score then reads q as float32 against the query scaled per channel, q_hat * s (one float32 multiply), which is
q_hat . (s * q) in real arithmetic.

INT12 packing: two values a, b (12-bit two's complement) in three bytes
    byte0 = a & 0xFF, byte1 = ((a >> 8) & 0x0F) | ((b & 0x0F) << 4), byte2 = (b >> 4) & 0xFF
an odd count is padded with a zero value.

INT4 packing: code 2j in the low nibble, 2j + 1 in the high nibble of byte j, each as q & 0xF (4-bit
two's complement); an odd count is padded with a zero code. Engines pack c_k's and c_v's codes separately.
"""

from __future__ import annotations

import numpy as np
import torch

from gsm.tiers import BYTES as TIER_BYTES  # noqa: F401  (re-exported: the golden's names for gsm.tiers)
from gsm.tiers import FP16, INT4, INT8, INT12, QMAX  # noqa: F401
from gsm.tiers import NAMES as TIER_NAMES  # noqa: F401


def round_fp16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest float16 (ties to even) -> float32."""
    return x.float().half().float()


def quantize(x: torch.Tensor, scale: torch.Tensor, tier: int) -> torch.Tensor:
    """x: [..., r] float32, scale: [r] -> integer codes (int32) of the INT12, INT8 or INT4 tier."""
    qmax = QMAX[tier]
    q = torch.round(x.float() / scale.float())  # torch.round is round-half-to-even
    return q.clamp_(-qmax, qmax).to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, comp: torch.Tensor | None = None) -> torch.Tensor:
    """codes [..., r] -> float32; comp (INT8 and INT4) is added after the scale multiply."""
    v = q.float() * scale.float()
    if comp is not None:
        v = v + comp.float()
    return v


def key_inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """float32(1 / s) per channel of an INT8 indexer key."""
    return torch.ones_like(scale, dtype=torch.float32) / scale.float()


def quantize_keys(e: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Indexer keys [..., dI] float32 -> their INT8 codes as float32 (what the score reads)."""
    return torch.round(e.float() * key_inverse_scale(scale)).clamp_(-127, 127)


def default_int12_scale(scale_int8: torch.Tensor) -> torch.Tensor:
    """Spec 5 default, with the float32 operation order fixed."""
    s = scale_int8.float() * torch.tensor(127.0, dtype=torch.float32)
    return s / torch.tensor(2047.0, dtype=torch.float32)


def default_int4_scale(scale_int8: torch.Tensor) -> torch.Tensor:
    """Decisions "A 4-bit tier": the data-free INT4 scale, float32 operations in this order."""
    s = scale_int8.float() * torch.tensor(127.0, dtype=torch.float32)
    return s / torch.tensor(7.0, dtype=torch.float32)


def _code_pairs(q: np.ndarray, bits: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes in the `bits`-bit two's-complement range, flattened, zero padded to pairs -> (first, second) of each
    pair as unsigned `bits`-bit fields."""
    v = np.asarray(q, dtype=np.int32).ravel()
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if v.size and (v.min() < lo or v.max() > hi):
        raise ValueError(f"{name} codes must lie in [{lo}, {hi}]")
    if v.size % 2:
        v = np.concatenate([v, np.zeros(1, np.int32)])
    u = (v & ((1 << bits) - 1)).astype(np.uint32)
    return u[0::2], u[1::2]


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int codes in [-8, 7], any shape -> uint8 bytes, one per pair (flattened, zero padded)."""
    a, b = _code_pairs(q, 4, "INT4")
    return (a | (b << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of pack_int4: the first `count` int32 codes."""
    p = np.asarray(packed, dtype=np.uint8).astype(np.int32)
    v = np.empty(p.size * 2, np.int32)
    v[0::2], v[1::2] = p & 0xF, p >> 4
    return np.where(v >= 8, v - 16, v)[:count]


def pack_int12(q: np.ndarray) -> np.ndarray:
    """int codes in [-2048, 2047], any shape -> uint8 bytes, 3 per pair (flattened, zero padded)."""
    a, b = _code_pairs(q, 12, "INT12")
    out = np.empty((a.size, 3), np.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = ((a >> 8) & 0x0F) | ((b & 0x0F) << 4)
    out[:, 2] = (b >> 4) & 0xFF
    return out.ravel()


def unpack_int12(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of pack_int12: the first `count` int32 codes."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    a = p[:, 0] | ((p[:, 1] & 0x0F) << 8)
    b = (p[:, 1] >> 4) | (p[:, 2] << 4)
    v = np.empty(a.size * 2, np.int32)
    v[0::2], v[1::2] = a, b
    v = np.where(v >= 2048, v - 4096, v)
    return v[:count]
