"""The KV-noise fallback's threshold follows the bundle's tiers (docs/serving.md "KV noise"): the calibration's
per-tier error travels from calibration_report.json into bundle.json (`kv_tier_noise`), and the engine's `auto`
threshold is max(0.05, 2 x the error of the narrowest tier the bundle's fractions use).

References: the per-tier figure is recomputed here by hand from a report written here; the thresholds are arithmetic
on those numbers. The failure this prevents: with the INT4 tier mix every re-tier pass measures ~0.1 on SmolLM2
(the INT4 grid's own error), and a fixed 0.05 refreshed every request of such a bundle at FP16.
"""

from __future__ import annotations

import json
import math

import pytest

from builder.calib import CalibrationError, tier_noise
from runtime.engine import KV_NOISE_AUTO, EngineConfig, kv_noise_limit

REPORT = {"layers": [
    {"layer": 0, "latent": "k", "rank": 10, "fp16": {"rel_rms": 1e-4}, "int8": {"rel_rms": 0.01},
     "int4": {"rel_rms": 0.10}, "int8_per_tensor": {"rel_rms": 0.5}},
    {"layer": 0, "latent": "v", "rank": 30, "fp16": {"rel_rms": 1e-4}, "int8": {"rel_rms": 0.02},
     "int4": {"rel_rms": 0.14}, "int8_per_tensor": {"rel_rms": 0.5}},
]}


def test_tier_noise_is_the_rank_weighted_rms_of_the_report(tmp_path):
    path = tmp_path / "calibration_report.json"
    path.write_text(json.dumps(REPORT))
    got = tier_noise(path)
    assert set(got) == {"fp16", "int8", "int4"}  # tier names only: int8_per_tensor is a comparison, not a tier
    assert got["int8"] == pytest.approx(math.sqrt((10 * 0.01**2 + 30 * 0.02**2) / 40))
    assert got["int4"] == pytest.approx(math.sqrt((10 * 0.10**2 + 30 * 0.14**2) / 40))
    assert tier_noise(tmp_path / "absent.json") == {}
    path.write_text(json.dumps({"layers": [{"rank": 4, "int8": {}}]}))
    with pytest.raises(CalibrationError, match="calibration_report.json: not a calibration report"):
        tier_noise(path)


def test_auto_threshold_follows_the_narrowest_tier_in_use():
    noise = {"int12": 0.003, "int8": 0.014, "int4": 0.126}
    assert kv_noise_limit(KV_NOISE_AUTO, noise, (0.0, 0.0, 0.25, 0.75)) == pytest.approx(0.252)  # INT4 mix
    assert kv_noise_limit(KV_NOISE_AUTO, noise, (0.25, 0.25, 0.5)) == 0.05  # INT8 at most: the published floor
    assert kv_noise_limit(KV_NOISE_AUTO, {}, (0.0, 0.0, 0.25, 0.75)) == 0.05  # nothing measured
    assert kv_noise_limit(0.07, noise, (0.0, 0.0, 0.25, 0.75)) == 0.07
    assert kv_noise_limit(None, noise, (1, 0, 0)) is None
    EngineConfig(max_kv_noise=KV_NOISE_AUTO)
    with pytest.raises(ValueError, match="EngineConfig.max_kv_noise"):
        EngineConfig(max_kv_noise="sometimes")


def test_bundle_carries_the_calibrations_tier_noise(tmp_path):
    from conftest import int4_copy

    from builder.build import BuildConfig, build
    from gsm import checkpoint
    from gsm.bundle_format import BundleConfig
    from gsm.synth import synth_checkpoint
    from runtime.engine import Engine

    base = int4_copy(synth_checkpoint("tiny", tmp_path / "tiny", seed=3), tmp_path / "int4")
    ckpt = checkpoint.write_checkpoint_arrays(
        tmp_path / "reported", checkpoint.load_config(base), checkpoint.load_quant(base),
        checkpoint.load_state_dict(base),
        files=checkpoint.CheckpointFiles(
            tokenizer_json=(base / checkpoint.TOKENIZER_FILE).read_text(),
            extra={checkpoint.CALIB_FILE: (base / checkpoint.CALIB_FILE).read_bytes(),
                   checkpoint.CALIB_REPORT_FILE: json.dumps(REPORT).encode()}), progress=False)
    build(BuildConfig(device="orin", checkpoint=ckpt, output=tmp_path / "b", max_seq=64))
    cfg = BundleConfig.load(tmp_path / "b")
    assert cfg.kv_tier_noise == pytest.approx(tier_noise(ckpt / checkpoint.CALIB_REPORT_FILE))
    # no report: nothing measured
    build(BuildConfig(device="orin", checkpoint=base, output=tmp_path / "b0", max_seq=64))
    assert BundleConfig.load(tmp_path / "b0").kv_tier_noise == {}

    import runtime

    rt = runtime.load(tmp_path / "b", "onnxruntime", threads=1)
    eng = Engine(rt, EngineConfig(warmup=False))
    assert rt.cfg.kv_quantization.tier_fractions[3] > 0  # the tiny INT4 copy uses the INT4 tier
    assert eng.max_kv_noise(eng.knobs) == pytest.approx(max(0.05, 2 * cfg.kv_tier_noise["int4"]))
