"""Synthetic checkpoints and the checkpoint read/write API they go through.

The 1b preset is checked from its specs only (writing 2 GB does not belong in unit tests; its
measured cost is in the issue report). Numerical-sanity tolerances: orthonormality to 1e-5 (float32
QR), init std within 5 % (tens of thousands of samples).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gsm import names
from gsm.checker import verify
from gsm.checkpoint import (
    INDEX_FILE,
    CheckpointConfigError,
    CheckpointError,
    CheckpointFiles,
    CheckpointTensors,
    load_config,
    load_kv_calibration,
    load_quant,
    load_state_dict,
    plan_shards,
    write_checkpoint,
    write_checkpoint_arrays,
)
from gsm.config import ConfigError, KVQuantConfig
from gsm.safetensors_io import TensorSpec
from gsm.synth import PRESETS, preset_config, preset_ranks, synth_checkpoint, synth_specs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("s") / "tiny", seed=7)


def _files(d: Path) -> dict[str, str]:
    return json.loads((d / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_presets_pass_verify(tmp_path: Path, preset: str) -> None:
    d = synth_checkpoint(preset, tmp_path / preset)
    r = verify(d)
    assert r.ok, r.to_json()
    p = PRESETS[preset]
    cfg = load_config(d)
    assert CheckpointTensors(d).ranks(cfg) == preset_ranks(p, cfg)
    assert r.params == sum(math.prod(s) for s in names.expected_shapes(cfg, preset_ranks(p, cfg)).values())
    assert load_quant(d) == KVQuantConfig()
    assert (d / "tokenizer.json").exists()


def test_deterministic_per_seed_and_different_across_seeds(tmp_path: Path, tiny: Path) -> None:
    again = synth_checkpoint("tiny", tmp_path / "again", seed=7)
    other = synth_checkpoint("tiny", tmp_path / "other", seed=8)
    assert _files(again) == _files(tiny)
    assert _files(other)["model.safetensors"] != _files(tiny)["model.safetensors"]
    assert _files(other)["config.json"] == _files(tiny)["config.json"]


def test_tensor_values_independent_of_order_and_sharding(tmp_path: Path, tiny: Path) -> None:
    sharded = synth_checkpoint("tiny", tmp_path / "sh", seed=7, max_shard_bytes=100_000)
    index = json.loads((sharded / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum((sharded / s).stat().st_size for s in shards) - sum(
        8 + int.from_bytes((sharded / s).read_bytes()[:8], "little") for s in shards)
    a, b = load_state_dict(tiny), load_state_dict(sharded)
    assert list(a) == list(b)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])
    assert verify(sharded).ok


def test_weights_are_numerically_sane(tiny: Path) -> None:
    sd = load_state_dict(tiny)
    cfg = load_config(tiny)
    for n, a in sd.items():
        assert np.isfinite(a).all(), n
        if n.endswith("norm.weight"):
            assert (a == 1).all(), n
    for i in cfg.owning_layers:
        for x in ("k", "v"):
            u, s, vt = (sd[names.layer_name(f"{x}_{k}", i)] for k in ("U", "S", "Vt"))
            r = s.shape[0]
            np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-5)
            np.testing.assert_allclose(vt @ vt.T, np.eye(r), atol=1e-5)
            assert (s > 0).all()
    for i in cfg.sharing_layers:
        w = sd[names.layer_name("proj_w", i)]
        assert (sd[names.layer_name("proj_b", i)] == 0).all()
        assert abs(w.std() * math.sqrt(w.shape[1]) - 1) < 0.05
    emb = sd[names.EMBED]
    assert abs(emb.std() / 0.02 - 1) < 0.05


def test_1b_preset_specs() -> None:
    p = PRESETS["1b"]
    cfg = preset_config(p)
    specs = synth_specs(cfg, preset_ranks(p, cfg), "F16")
    n = sum(math.prod(s.shape) for s in specs)
    assert 0.95e9 < n < 1.1e9
    assert not cfg.tie_word_embeddings and cfg.vocab_size == 32000 and cfg.torch_dtype == "float16"
    assert len(cfg.sharing_layers) >= 3
    shards = plan_shards(specs, p.max_shard_bytes)
    assert len(shards) >= 2 and all(sum(s.nbytes for s in sh) <= 1 << 30 for sh in shards)


def test_write_checkpoint_streams_in_order(tmp_path: Path, tiny: Path) -> None:
    cfg, sd = load_config(tiny), load_state_dict(tiny)
    specs = [TensorSpec(n, a.shape, "F32") for n, a in sd.items()]
    calls: list[str] = []

    def produce(s: TensorSpec) -> np.ndarray:
        calls.append(s.name)
        return sd[s.name]
    d = write_checkpoint(tmp_path / "w", cfg, KVQuantConfig(), specs, produce, progress=True,
                         files=CheckpointFiles(extra={"notes/readme.txt": b"hi"}))
    assert calls == [s.name for s in specs]  # once each, in order
    assert (d / "notes" / "readme.txt").read_bytes() == b"hi"
    assert "notes/readme.txt" in _files(d)
    with pytest.raises(FileExistsError, match="already exists"):
        write_checkpoint(d, cfg, KVQuantConfig(), specs, produce)
    with pytest.raises(ValueError, match="clashes"):
        write_checkpoint(tmp_path / "x", cfg, KVQuantConfig(), specs, produce,
                         files=CheckpointFiles(extra={"config.json": b"{}"}))
    assert not (tmp_path / "x").exists()


def test_write_checkpoint_arrays_bf16(tmp_path: Path, tiny: Path) -> None:
    cfg = load_config(tiny).replace(torch_dtype="bfloat16")
    sd = load_state_dict(tiny)
    d = write_checkpoint_arrays(tmp_path / "bf", cfg, KVQuantConfig(), sd, dtype="BF16", progress=False)
    t = CheckpointTensors(d)
    assert t.dtype(names.EMBED) == "BF16"
    np.testing.assert_allclose(t.array(names.EMBED), sd[names.EMBED], rtol=2**-8)  # bf16: 8-bit mantissa
    assert verify(d).ok, verify(d).to_json()


def test_failed_produce_leaves_nothing(tmp_path: Path, tiny: Path) -> None:
    cfg = load_config(tiny)

    def produce(s: TensorSpec) -> np.ndarray:
        raise RuntimeError(f"cannot make {s.name}")
    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path / "z", cfg, KVQuantConfig(), [TensorSpec("a", (1,), "F32")], produce,
                         progress=False)
    assert list(tmp_path.iterdir()) == []


def test_loader_errors_name_the_file(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json: missing") as ei:
        load_config(tmp_path)
    assert ei.value.code == "CONFIG_MISSING"
    (tmp_path / "config.json").write_text('{"gsm_config": {}}')
    with pytest.raises(ConfigError, match="config.json") as ci:  # also a CheckpointError
        load_config(tmp_path)
    assert isinstance(ci.value, CheckpointConfigError)
    (tmp_path / "quant_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="quant_config.json: invalid JSON"):
        load_quant(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors") as wi:
        CheckpointTensors(tmp_path)
    assert wi.value.code == "WEIGHTS_MISSING"
    assert load_kv_calibration(tiny) is None


def test_cli_synth(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gsm", "synth", "--preset", "tiny", "--out", str(tmp_path / "c"),
           "--seed", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "parameters" in p.stdout and verify(tmp_path / "c").ok
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr
