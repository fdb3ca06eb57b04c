"""GPTQ (Frantar et al. 2022): weight quantisation that corrects for the inputs the weight will see.

Round-to-nearest (builder/wquant.py) makes each weight's own error small; GPTQ makes the layer's *output*
error small on real inputs. It quantises the K input columns of W [N, K] in order, and after each one spreads
that column's error over the columns not yet quantised, in proportion to how the inputs correlate (the Gram
matrix H = sum x x^T of the layer's inputs over calibration text). Rows are independent, so W streams a block
of rows at a time (`wquant.quantize_chunks(..., quantize_rows=...)`): memory holds H's factor ([K, K]) and one
block, whatever N.

Used for the tied embedding / LM head at INT4 (SmolLM2: round-to-nearest on the float-zero-point grid costs
+6 % held-out perplexity through the logits, GPTQ +0.2 %; docs/weights.md). The result is an ordinary
QuantizedWeight on wquant's grids, so every graph form reads it as it reads a round-to-nearest one:
- symmetric: scale = absmax / (2^(bits-1) - 1) of the group's columns *as updated* when the group is reached
  (later columns of the group can grow past it and clip, as in the reference implementation);
- float zero point: scale = (max - min) / (2^bits - 1) and the group offset `min + 2^(bits-1) scale` (what the
  graphs add, `QuantizedWeight.group_offsets`) rounded to the scale dtype, then min = offset - 2^(bits-1) scale:
  the offsets are then float16 values exactly and the graphs store them in half the bytes, as for a Q4_1 source.
The group's parameters are fixed from its columns when the first of them is reached (GPTQ with groups,
`static_groups=False`); the columns are taken in their natural order (no act-order, which would need a
permutation the group scales cannot follow).
"""

from __future__ import annotations

import numpy as np

from builder.wquant import QuantizedWeight, WeightQuantConfig, WeightQuantError

DEFAULT_DAMP = 0.01  # the reference implementation's `percdamp`: H + 0.01 mean(diag H) I


def gptq_factor(gram: np.ndarray, damp: float = DEFAULT_DAMP, *, name: str = "weight") -> np.ndarray:
    """Upper Cholesky factor U of (H + damp mean(diag H) I)^-1, float64 [K, K] (H^-1 = U^T U): row j of U holds
    how column j's error spreads to the columns after it. A column no input ever reached (diagonal 0) gets a unit
    diagonal: its error then spreads nowhere, which is round-to-nearest for it."""
    h = np.array(gram, np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1] or not np.isfinite(h).all():
        raise WeightQuantError(f"{name}: the GPTQ Gram matrix must be a finite square [K, K], "
                               f"got shape {list(h.shape)}")
    d = np.diag(h).copy()
    if (d < 0).any():
        raise WeightQuantError(f"{name}: the GPTQ Gram matrix has a negative diagonal (not x^T x of inputs)")
    dead = d == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diag(h)))
    try:
        inv = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, H = L L^T
    except np.linalg.LinAlgError:
        raise WeightQuantError(f"{name}: the GPTQ Gram matrix is not positive definite after damping") from None
    hinv = inv.T @ inv  # H^-1
    return np.linalg.cholesky(hinv).T  # U, upper


def _group_grid(wg: np.ndarray, cfg: WeightQuantConfig) -> tuple[np.ndarray, np.ndarray]:
    """(scale, min) of a group's current columns [n, g]; min is None-like zeros when symmetric."""
    dt = np.float16 if cfg.scale_dtype == "float16" else np.float32
    half = float(1 << (cfg.bits - 1))
    if cfg.symmetric:
        scale = (np.abs(wg).max(axis=1) / (half - 1)).astype(dt).astype(np.float64)
        scale[scale == 0] = 1.0
        return scale, np.zeros_like(scale)
    lo, hi = wg.min(axis=1), wg.max(axis=1)
    scale = ((hi - lo) / ((1 << cfg.bits) - 1)).astype(dt).astype(np.float64)
    scale[scale == 0] = 1.0
    offset = (lo + half * scale).astype(dt).astype(np.float64)
    return scale, (offset - half * scale).astype(np.float32).astype(np.float64)


def gptq_quantize(w: np.ndarray, cfg: WeightQuantConfig, factor: np.ndarray, *,
                  name: str = "weight") -> QuantizedWeight:
    """GPTQ of rows W [n, K] on cfg's grid (symmetric, or asymmetric with a float zero point), `factor` from
    gptq_factor over the layer's inputs. K a multiple of the group (the heads this is for are)."""
    if not (cfg.symmetric or cfg.float_zero_point):
        raise WeightQuantError(f"{name}: GPTQ here takes the symmetric or the float-zero-point grid")
    w = np.array(w, np.float64)
    n, k = w.shape
    block = cfg.block(k)
    if k % block or factor.shape != (k, k):
        raise WeightQuantError(f"{name}: GPTQ needs K ({k}) a multiple of the group ({block}) and a [K, K] factor, "
                               f"got {list(factor.shape)}")
    nb, levels, half = k // block, (1 << cfg.bits) - 1, 1 << (cfg.bits - 1)
    codes = np.empty((n, k), np.uint8)
    scales = np.empty((n, nb), np.float32)
    mins = np.empty((n, nb), np.float32)
    for b in range(nb):
        c0, c1 = b * block, (b + 1) * block
        scale, lo = _group_grid(w[:, c0:c1], cfg)
        scales[:, b], mins[:, b] = scale, lo
        err = np.empty((n, block))
        for j in range(c0, c1):
            col = w[:, j]
            if cfg.symmetric:
                u = np.clip(np.rint(col / scale) + half, 0, levels)
                q = (u - half) * scale
            else:
                u = np.clip(np.rint((col - lo) / scale), 0, levels)
                q = lo + u * scale
            codes[:, j] = u
            e = (col - q) / factor[j, j]
            w[:, j + 1:c1] -= np.outer(e, factor[j, j + 1:c1])
            err[:, j - c0] = e
        w[:, c1:] -= err @ factor[c0:c1, c1:]
    if cfg.symmetric:
        return QuantizedWeight(codes, scales, np.full((n, nb), half, np.uint8), k, block, cfg)
    return QuantizedWeight(codes, scales, (-mins / scales).astype(np.float32), k, block, cfg, mins)


__all__ = ["DEFAULT_DAMP", "gptq_factor", "gptq_quantize"]
