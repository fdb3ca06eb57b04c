"""INT8 indexer keys (decisions "INT8 indexer keys"): the format's rules, the memory plan's
bytes counted by hand, and what a build ships from each kind of calibration file. The numerics are tested where
each engine is (golden regression of the tiny-int4 checkpoint on every graph, plugins against the reference,
the calibration's lockstep against the golden)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import int4_copy
from safetensors.numpy import load_file, save_file

from builder.build import BuildConfig, BuildError, build
from builder.plan import cpu_cache_bytes, kv_bytes_per_position, kv_pool_bytes, pool_rows
from gsm import checkpoint, names
from gsm.bundle_format import BundleConfig, IndexKeyLayout
from gsm.config import ConfigError, KVQuantConfig
from gsm.synth import PRESETS, preset_config, preset_ranks, synth_checkpoint

N_MAX = 64


def test_config_field_and_v1_files():
    assert KVQuantConfig().index_key_bits == 16
    assert "index_key_bits" not in KVQuantConfig().to_json()["kv_quantization"]  # a v1 file stays as it was
    q = KVQuantConfig.from_json({"kv_quantization": {"index_key_bits": 8}})
    assert q.int8_keys and q.to_json()["kv_quantization"]["index_key_bits"] == 8
    with pytest.raises(ConfigError, match="index_key_bits must be one of \\[16, 8\\]"):
        KVQuantConfig(index_key_bits=4)


@pytest.mark.parametrize("d_i,words,nbytes", [(32, 8, 32), (30, 8, 32), (1, 1, 4), (16, 4, 16)])
def test_key_layout_by_hand(d_i, words, nbytes):
    assert IndexKeyLayout(d_i, 16).plugin_width == d_i and IndexKeyLayout(d_i, 16).bytes == 2 * d_i
    assert IndexKeyLayout(d_i, 8).plugin_width == words and IndexKeyLayout(d_i, 8).bytes == nbytes


def test_plan_counts_one_byte_per_key_channel():
    p = PRESETS["tiny"]
    cfg = preset_config(p)
    ranks = preset_ranks(p, cfg)  # owning layers 0, 1, 2 with ranks (12,10), (14,8), (12,10); dI 16
    q16, q8 = KVQuantConfig(), KVQuantConfig(index_key_bits=8)
    avg = 0.25 * 2 + 0.25 * 1.5 + 0.5 * 1
    assert kv_bytes_per_position(cfg, ranks, q8) == pytest.approx(66 * avg + 3 * 16)
    assert kv_bytes_per_position(cfg, ranks, q16) - kv_bytes_per_position(cfg, ranks, q8) == 3 * 16
    rows = pool_rows(N_MAX, 16, cfg, q8)
    assert kv_pool_bytes(cfg, ranks, rows, N_MAX, 2, q16) - kv_pool_bytes(cfg, ranks, rows, N_MAX, 2, q8) == \
        2 * N_MAX * 3 * 16
    assert cpu_cache_bytes(cfg, ranks, rows, N_MAX, 2, q16) - cpu_cache_bytes(cfg, ranks, rows, N_MAX, 2, q8) == \
        2 * N_MAX * 3 * 16


@pytest.fixture(scope="module")
def keys8_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("keys8")
    return int4_copy(synth_checkpoint("tiny", root / "tiny", seed=3), root / "k8")


def _calibration_without(ckpt: Path, out: Path, keep: set[int] | None) -> Path:
    """The checkpoint's calibration file with the INT8 key scales of owning layers outside `keep` removed."""
    t = load_file(str(ckpt / checkpoint.CALIB_FILE))
    for n in [n for n in t if ".index_key." in n]:
        if keep is None or int(n.split(".")[1]) not in keep:
            del t[n]
    save_file(t, str(out))
    return out


def test_bundle_holds_codes_in_every_graph(keys8_checkpoint, tmp_path):
    r = build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "b", max_seq=N_MAX))
    cfg = BundleConfig.load(tmp_path / "b")
    assert cfg.index_keys == IndexKeyLayout(16, 8) and cfg.graph_revision >= 9
    assert "INT8 indexer keys" in r.report["kv_tiers"]["note"]
    want = {"model.portable.onnx": (onnx.TensorProto.INT8, 16), "model.cpu.onnx": (onnx.TensorProto.INT32, 4),
            "model.onnx": (onnx.TensorProto.INT32, 4)}  # the pools' graphs: codes four to an int32 word
    for f, (elem, width) in want.items():
        g = onnx.load(str(tmp_path / "b" / f), load_external_data=False).graph
        v = next(i for i in g.input if i.name == "index_keys.0")
        assert v.type.tensor_type.elem_type == elem and v.type.tensor_type.shape.dim[-1].dim_value == width, f
    trt = onnx.load(str(tmp_path / "b" / "model.onnx"), load_external_data=False).graph
    attrs = [(n.op_type, {a.name: a.i for a in n.attribute}) for n in trt.node
             if n.op_type in ("GsmKVCacheUpdate", "GsmSparseAttention")]
    key_readers = [(op, a.get("index_key_bits")) for op, a in attrs if a.get("layer_kind", 0) == 0]
    assert sorted(set(key_readers)) == [("GsmKVCacheUpdate", 8), ("GsmSparseAttention", 8)]
    assert len(key_readers) == 6  # three owning layers; the sharing layer's node reads no key
    assert all("index_key_bits" not in a for _, a in attrs if a.get("layer_kind", 0) == 1)
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    ranks = {int(k): tuple(v) for k, v in cfg.ranks.items()}
    avg = sum(f * b for f, b in zip((0.25, 0.125, 0.25, 0.375), (2, 1.5, 1, 0.5)))
    assert plan["kv_bytes_per_position"] == pytest.approx(sum(rk + rv for rk, rv in ranks.values()) * avg + 3 * 16)


def test_calibration_without_key_scales_ships_fp16_keys(keys8_checkpoint, tmp_path):
    cal = _calibration_without(keys8_checkpoint, tmp_path / "old.safetensors", None)
    r = build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "b", max_seq=N_MAX,
                          calibration=cal))
    assert BundleConfig.load(tmp_path / "b").index_keys.bits == 16
    assert "indexer keys stay FP16" in r.report["kv_tiers"]["note"] and str(cal) in r.report["kv_tiers"]["note"]


def test_key_scales_for_some_layers_are_refused(keys8_checkpoint, tmp_path):
    cal = _calibration_without(keys8_checkpoint, tmp_path / "part.safetensors", {0, 2})
    with pytest.raises(BuildError, match="INT8 indexer-key scales for some owning layers only.*layers.1.index_key"):
        build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "b", max_seq=N_MAX,
                          calibration=cal))
    assert not (tmp_path / "b").exists()
    bad = load_file(str(keys8_checkpoint / checkpoint.CALIB_FILE))
    bad[names.index_key_scale_name(0)] = np.zeros(16, np.float32)
    save_file(bad, str(tmp_path / "zero.safetensors"))
    with pytest.raises(BuildError, match="layers.0.index_key.scale_int8 must be 16 positive finite values"):
        build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "b", max_seq=N_MAX,
                          calibration=tmp_path / "zero.safetensors"))


def test_checkpoint_claiming_int8_keys_without_calibration_is_refused(keys8_checkpoint, tmp_path):
    d = tmp_path / "nocal"
    shutil.copytree(keys8_checkpoint, d)
    (d / checkpoint.CALIB_FILE).unlink()
    (d / "manifest.json").unlink()
    with pytest.raises(BuildError, match="kv_calibration.safetensors is missing, but quant_config.json index_key_bits"):
        build(BuildConfig(device="orin", checkpoint=d, output=tmp_path / "b", max_seq=N_MAX))
    assert not (tmp_path / "b").exists()


def test_build_flags_override_the_checkpoint(keys8_checkpoint, tmp_path):
    """--tier-fractions and --index-keys replace the checkpoint's kv_quantization in the bundle (and its plan)."""
    build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "b", max_seq=N_MAX,
                      tier_fractions=(0.0, 0.0, 0.0, 1.0), index_keys="fp16"))
    cfg = BundleConfig.load(tmp_path / "b")
    assert cfg.kv_quantization.tier_fractions == (0.0, 0.0, 0.0, 1.0) and cfg.index_keys.bits == 16
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["kv_bytes_per_position"] == pytest.approx(sum(rk + rv for rk, rv in cfg.ranks.values()) * 0.5
                                                          + 3 * 16 * 2)
    with pytest.raises(BuildError, match="--tier-fractions: kv_quantization.tier_fractions must be three"):
        build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "c", max_seq=N_MAX,
                          tier_fractions=(0.5, 0.6, 0.0)))
    cal = _calibration_without(keys8_checkpoint, tmp_path / "old.safetensors", None)
    with pytest.raises(BuildError, match="--index-keys int8: .*indexer keys stay FP16"):
        build(BuildConfig(device="orin", checkpoint=keys8_checkpoint, output=tmp_path / "c", max_seq=N_MAX,
                          calibration=cal, index_keys="int8"))
    assert not (tmp_path / "c").exists()
