"""Scales and compensation tables from latent statistics: pure functions of tensors.

Per owning layer and latent (c_k, c_v), per channel j (spec 5):
- `scale_int8[j]`  = clip_j / 127, clip_j chosen by the method:
  `absmax` (clip = running abs-max, no clipping on calibration data),
  `percentile` (clip = the p-th percentile of |x|, pytorch-quantization's default p = 99.99),
  `mse` (clip = alpha * abs-max, alpha on a grid, minimising the mean squared INT8 error *after*
  compensation, i.e. the error the deployed dequantisation q*s + comp actually makes);
- `scale_int12[j]` = its own clip / 2047 for every method: INT12_HEADROOM (1.5) x abs-max. With 16x
  finer steps than INT8, rounding error is tiny, and the INT12 error on text calibration has not
  seen is dominated by values beyond the calibration maximum: split in halves, the second half of
  the stories260K calibration text exceeds the first half's per-channel maximum by up to 1.39x.
  1.5x headroom costs 0.6 of INT12's 11 magnitude bits (docs/calibration.md has the measurement);
- `comp_int8[j]`   = mean over calibration rows of x - q*s (the "lookup-table compensation": the
  systematic part of the INT8 error, removed on dequantisation);
- `scale_int4[j]`, `comp_int4[j]` (decisions "A 4-bit tier") = the `mse` method at 4 bits for every
  method, on a wider alpha grid (INT4_ALPHAS): with 7 steps a side, clipping the tails always pays,
  and abs-max scales would spend most codes on values that are rare; comp the same mean error.

All arithmetic that must match an engine goes through gsm.golden.quant (IEEE float32 division,
round-half-even); scales are float32 numbers computed as float32(clip) / float32(qmax).
The naive baseline (`per_tensor_scales`) is TensorRT-LLM's legacy `kv_cache_scaling_factor`: one
scale per layer and latent for all channels, abs-max / 127, no compensation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from calibration.stats import ChannelStats
from gsm.golden.quant import INT4, INT8, INT12, QMAX, default_int12_scale, dequantize, quantize
from gsm.golden.weights import KVCalibration, LatentScales

METHODS = ("absmax", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
MSE_ALPHAS = torch.linspace(0.30, 1.00, 71)  # clip / abs-max candidates of the MSE search
INT4_ALPHAS = torch.linspace(0.10, 1.00, 91)  # the INT4 search: its optimum clips far more than INT8's
INT12_HEADROOM = 1.5  # INT12 clip / calibration abs-max (see the module docstring)
REL_FLOOR = 1e-6  # a channel that never moved gets clip = REL_FLOOR * the latent's largest clip


def quant_error(x: torch.Tensor, scale: torch.Tensor, tier: int, comp: torch.Tensor | None = None) -> torch.Tensor:
    """x - dequant(quant(x)) of one INT tier, with the golden model's exact rounding. x: [N, r]."""
    return x - dequantize(quantize(x, scale, tier), scale, comp)


def scale_of(clip: torch.Tensor, tier: int) -> torch.Tensor:
    """float32(clip) / float32(qmax), with dead channels floored so every scale is positive."""
    clip = clip.float()
    top = float(clip.max()) if clip.numel() else 0.0
    floor = REL_FLOOR * top if top > 0 else 1.0
    clip = torch.where(clip > 0, clip, torch.tensor(floor, dtype=torch.float32))
    return clip / torch.tensor(float(QMAX[tier]), dtype=torch.float32)


def compensation(rows: torch.Tensor, scale: torch.Tensor, tier: int = INT8) -> torch.Tensor:
    """comp [r] = mean over rows of the tier's error x - q*s (float64 sum, then float32)."""
    if rows.shape[0] == 0:
        return torch.zeros(rows.shape[1])
    return quant_error(rows, scale, tier).double().mean(dim=0).float()


def percentile_clip(rows: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per-channel percentile of |x| (linear interpolation, deterministic)."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    if rows.shape[0] == 0:
        return torch.zeros(rows.shape[1])
    return torch.quantile(rows.abs().double(), percentile / 100.0, dim=0).float()


def mse_clip(rows: torch.Tensor, absmax: torch.Tensor, tier: int, *, with_comp: bool,
             alphas: torch.Tensor = MSE_ALPHAS) -> torch.Tensor:
    """Per channel, the clip alpha*absmax minimising mean squared error (after comp if with_comp).

    Ties go to the largest alpha (least clipping: safest on text not seen in calibration).
    """
    if rows.shape[0] == 0:
        return absmax.clone()
    losses = []
    for a in alphas.tolist():
        e = quant_error(rows, scale_of(absmax * a, tier), tier).double()
        if with_comp:
            e = e - e.mean(dim=0)
        losses.append((e * e).mean(dim=0))
    loss = torch.stack(losses)  # [A, r]
    best = loss.shape[0] - 1 - torch.argmin(loss.flip(0), dim=0)  # last index of the minimum
    return (absmax * alphas[best]).float()


def channel_scales(st: ChannelStats, method: str, *, percentile: float = DEFAULT_PERCENTILE) -> LatentScales:
    """Per-channel scale_int8, scale_int12, comp_int8, scale_int4 and comp_int4 of one latent."""
    if method == "absmax":
        s8 = scale_of(st.absmax, INT8)
    elif method == "percentile":
        s8 = scale_of(percentile_clip(st.rows, percentile), INT8)
    elif method == "mse":
        s8 = scale_of(mse_clip(st.rows, st.absmax, INT8, with_comp=True), INT8)
    else:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    s12 = scale_of(st.absmax * INT12_HEADROOM, INT12)
    s4 = scale_of(mse_clip(st.rows, st.absmax, INT4, with_comp=True, alphas=INT4_ALPHAS), INT4)
    return LatentScales(scale_int8=s8, scale_int12=s12, comp_int8=compensation(st.rows, s8),
                        scale_int4=s4, comp_int4=compensation(st.rows, s4, INT4))


def per_tensor_scales(st: ChannelStats) -> LatentScales:
    """Naive baseline: one abs-max scale for all channels, spec-default INT12 scale, no comp."""
    s8 = scale_of(st.absmax.max().reshape(1), INT8).expand(st.r).clone()
    return LatentScales(scale_int8=s8, scale_int12=default_int12_scale(s8), comp_int8=torch.zeros(st.r))


def calibrate(stats: dict[tuple[int, str], ChannelStats], method: str, *,
              percentile: float = DEFAULT_PERCENTILE, advance: Callable[[int], None] | None = None) -> KVCalibration:
    """KVCalibration of every owning layer's c_k and c_v (advance(1) after each latent: the INT4 MSE search over
    the reservoir makes each take seconds on a real model)."""
    out = {}
    for key, st in sorted(stats.items()):
        out[key] = channel_scales(st, method, percentile=percentile)
        if advance is not None:
            advance(1)
    return KVCalibration(out, calibrated=True)


def key_scales(key_absmax: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """INT8 indexer-key scales per owning layer: abs-max / 127 per channel (decisions "INT8 indexer keys": a clip
    search buys nothing measurable, 0.5 % of top-k picks move at 2K on SmolLM2 with plain abs-max)."""
    return {i: scale_of(m, INT8) for i, m in sorted(key_absmax.items())}


def with_key_scales(calib: KVCalibration, scales: dict[int, torch.Tensor]) -> KVCalibration:
    """The same latent scales plus INT8 indexer-key scales."""
    return replace(calib, index_key_scales=dict(scales))


def naive_calibration(stats: dict[tuple[int, str], ChannelStats]) -> KVCalibration:
    return KVCalibration({key: per_tensor_scales(st) for key, st in sorted(stats.items())}, calibrated=True)


def without_compensation(calib: KVCalibration) -> KVCalibration:
    """The same scales with comp_int8 = comp_int4 = 0 (to measure what the compensation buys)."""
    return KVCalibration({k: LatentScales(s.scale_int8, s.scale_int12, torch.zeros_like(s.comp_int8),
                                          s.scale_int4, torch.zeros_like(s.comp_int4))
                          for k, s in calib.scales.items()}, calibrated=calib.calibrated,
                         index_key_scales=calib.index_key_scales)
