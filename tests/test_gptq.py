"""builder/gptq.py against independent references: round-to-nearest where GPTQ must reduce to it, the textbook
OBS recursion (explicit inverse-Hessian downdates, no Cholesky factor) for the codes, and the output error it is
for."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from builder.gptq import gptq_factor, gptq_quantize
from builder.wquant import WeightQuantConfig, WeightQuantError, quantize, quantize_chunks

SYM = WeightQuantConfig(4, 32)
ASYM_F = WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True)


def correlated_inputs(rng: np.random.Generator, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows of one distribution (fixed by `seed`) with a few dominant directions and outlier channels, as a
    transformer's hidden states have; `rng` draws the rows."""
    shape = np.random.default_rng(seed)
    basis, outliers = shape.standard_normal((8, k)), shape.choice(k, 4, replace=False)
    x = rng.standard_normal((rows, 8)) @ basis * 3 + rng.standard_normal((rows, k)) * 0.3
    x[:, outliers] *= 10
    return x


def dequant(q) -> np.ndarray:
    """What the graphs compute with: signed codes x scale + the group offset (float64)."""
    sig = q.signed_codes().astype(np.float64).reshape(q.n, q.n_blocks, q.block)
    return (sig * q.scales[..., None] + q.group_offsets()[..., None]).reshape(q.n, -1)


def output_error(w: np.ndarray, wq: np.ndarray, gram: np.ndarray) -> float:
    e = w.astype(np.float64) - wq
    return float(np.einsum("nk,kl,nl->", e, gram, e))


def textbook(w: np.ndarray, gram: np.ndarray, cfg: WeightQuantConfig, damp: float = 0.01) -> np.ndarray:
    """OBS one column at a time (Frantar & Alistarh's recursion, GPTQ's ancestor): after quantising column j,
    the remaining weights move by -e/[H^-1]_jj [H^-1]_j,: and H^-1 loses row and column j by the downdate
    H^-1 - [H^-1]_:j [H^-1]_j: / [H^-1]_jj. Group parameters from the group's columns when reached. Codes."""
    h = gram + damp * np.mean(np.diag(gram)) * np.eye(len(gram))
    codes = np.empty(w.shape, np.uint8)
    for r in range(w.shape[0]):
        row, hinv = w[r].astype(np.float64).copy(), np.linalg.inv(h)
        for j in range(w.shape[1]):
            if j % cfg.group_size == 0:
                g = row[j:j + cfg.group_size]
                if cfg.symmetric:
                    s = float(np.float16(np.abs(g).max() / 7))
                    lo = 0.0
                else:
                    s = float(np.float16((g.max() - g.min()) / 15))
                    lo = float(np.float32(float(np.float16(g.min() + 8 * s)) - 8 * s))
            if cfg.symmetric:
                u = np.clip(np.rint(row[j] / s) + 8, 0, 15)
                q = (u - 8) * s
            else:
                u = np.clip(np.rint((row[j] - lo) / s), 0, 15)
                q = lo + u * s
            codes[r, j] = u
            e = (row[j] - q) / hinv[j, j]
            row[j + 1:] -= e * hinv[j, j + 1:]
            hinv = hinv - np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return codes


@pytest.mark.parametrize("cfg", [SYM, ASYM_F], ids=["sym", "asym-f"])
def test_codes_follow_the_textbook_recursion(cfg):
    rng = np.random.default_rng(0)
    k = 64
    x = correlated_inputs(rng, 512, k)
    gram = x.T @ x
    w = rng.standard_normal((24, k)).astype(np.float32) * 0.05
    q = gptq_quantize(w, cfg, gptq_factor(gram))
    np.testing.assert_array_equal(q.codes, textbook(w, gram, cfg))


def test_a_diagonal_gram_is_round_to_nearest():
    """Uncorrelated inputs: no column's error has anywhere to go, so GPTQ is RTN (the symmetric grid is
    wquant.quantize's own; the float-zero-point grid is RTN on its group parameters of the original weights)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    gram = np.diag(rng.uniform(0.5, 4.0, 96))
    fac = gptq_factor(gram)
    a, b = gptq_quantize(w, SYM, fac), quantize(w, SYM)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.scales, b.scales)
    f = gptq_quantize(w, ASYM_F, fac)
    g = w.reshape(40, 3, 32).astype(np.float64)
    np.testing.assert_array_equal(f.scales, ((g.max(2) - g.min(2)) / 15).astype(np.float16).astype(np.float32))
    u = np.clip(np.rint((g - f.mins[..., None]) / f.scales[..., None]), 0, 15)
    np.testing.assert_array_equal(f.codes, u.reshape(40, 96))


@pytest.mark.parametrize("cfg", [SYM, ASYM_F], ids=["sym", "asym-f"])
def test_output_error_well_below_round_to_nearest(cfg):
    rng = np.random.default_rng(2)
    k = 128
    fit, held = correlated_inputs(rng, 2048, k), correlated_inputs(rng, 2048, k)
    w = rng.standard_normal((64, k)).astype(np.float32) * 0.05
    q = gptq_quantize(w, cfg, gptq_factor(fit.T @ fit))
    gram = held.T @ held  # inputs the quantiser did not see
    ratio = output_error(w, dequant(q), gram) / output_error(w, dequant(quantize(w, cfg)), gram)
    assert ratio < 0.2, ratio


def test_streamed_rows_equal_the_whole_and_offsets_are_float16():
    rng = np.random.default_rng(3)
    x = correlated_inputs(rng, 256, 64)
    fac = gptq_factor(x.T @ x)
    w = rng.standard_normal((37, 64)).astype(np.float32) * 0.1
    whole = gptq_quantize(w, ASYM_F, fac)
    chunks = np.array_split(w.reshape(-1), 7)  # chunks cut mid-row
    streamed = quantize_chunks(w.shape, iter(chunks), ASYM_F, rows_per_step=5,
                               quantize_rows=functools.partial(gptq_quantize, factor=fac))
    for f in ("codes", "scales", "zero_points", "mins"):
        np.testing.assert_array_equal(getattr(streamed, f), getattr(whole, f))
    off = whole.group_offsets()
    np.testing.assert_array_equal(off.astype(np.float16).astype(np.float32), off)


def test_unusable_gram_is_refused_by_name():
    with pytest.raises(WeightQuantError, match="head.*square"):
        gptq_factor(np.ones((3, 4)), name="head")
    with pytest.raises(WeightQuantError, match="negative diagonal"):
        gptq_factor(-np.eye(4))
    # an input channel no row ever reached (a zero column of H) is RTN for its column, not an error
    gram = np.diag([1.0, 0.0, 2.0, 3.0] * 8)
    assert np.isfinite(gptq_factor(gram)).all()
