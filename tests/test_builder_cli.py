"""`python -m builder build` end to end and its refusals: each bad input is one clear error and
leaves no output directory (and no temp directory) behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builder.build import BuildConfig, BuildError, build
from gsm.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("c") / "tiny")


def nothing_left(parent: Path) -> bool:
    return not any(parent.iterdir())


def test_demo_build_and_generate_cli(tmp_path):
    r = run_cli("builder", "build", "--device", "orin", "--max-seq", "128", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "DEMO" in r.stderr and "DEMO" in r.stdout
    bundle = tmp_path / "out" / "demo-tiny-orin-agx-64"
    assert "python -m builder engine" in r.stdout  # no TensorRT here: says how to build it on the target
    manifest = json.loads((bundle / "manifest.json").read_text())
    for key in ("gsm_edge_version", "checkpoint", "device", "opset", "plugins", "files", "engine"):
        assert key in manifest
    assert manifest["device"]["name"] == "orin-agx-64" and manifest["opset"] == 17
    assert manifest["plugins"]["versions"] == {"GsmKVCacheUpdate": "3", "GsmSparseAttention": "3", "GsmKVDemote": "3"}
    assert not (bundle / "engine.plan").exists()  # no engine unless TensorRT built it
    report = json.loads((bundle / "report.json").read_text())
    assert report["demo_model"] and "estimate" in report["decode_tokens_per_s_estimate_note"]
    g = run_cli("runtime", "generate", str(bundle), "--prompt", "Once upon", "--max-new-tokens", "5", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert "5 tokens" in g.stderr


def test_runtime_never_imports_torch(tmp_path, tiny):
    out = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=64))
    code = ("import sys, runtime; rt = runtime.load(sys.argv[1], threads=1); rt.generate([1, 5, 6], 4); "
            "assert 'torch' not in sys.modules, 'runtime imported torch'")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_unknown_device(tmp_path, tiny):
    with pytest.raises(BuildError, match="unknown device 'xavier'.*orin-nx-16"):
        build(BuildConfig(device="xavier", checkpoint=tiny, output=tmp_path / "o"))
    assert nothing_left(tmp_path)
    r = run_cli("builder", "build", "--device", "xavier", "--checkpoint", str(tiny), cwd=tmp_path)
    assert r.returncode == 2 and "unknown device" in r.stderr and "Traceback" not in r.stderr
    assert nothing_left(tmp_path)


def test_max_seq_beyond_model(tmp_path, tiny):
    with pytest.raises(BuildError, match="beyond the model's max_position_embeddings \\(512\\)"):
        build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "o", max_seq=4096))
    assert nothing_left(tmp_path)


def test_plan_that_does_not_fit(tmp_path, tiny):
    with pytest.raises(BuildError, match="does not fit orin-nano-4.*short by.*fits"):
        build(BuildConfig(device="orin-nano-4", checkpoint=tiny, output=tmp_path / "o", max_batch=200_000))
    assert nothing_left(tmp_path)


def test_invalid_checkpoint_stops_with_checker_errors(tmp_path, tiny):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["gsm_config"]["sparse_top_k"] = 9  # checksum no longer matches
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BuildError, match="CHECKSUM_MISMATCH"):
        build(BuildConfig(device="orin", checkpoint=bad, output=tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_existing_output_is_not_replaced(tmp_path, tiny):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(BuildError, match="already exists"):
        build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=64))
    assert (out / "keep").read_text() == "x"


def test_corrupted_bundle_file_fails_at_load(tmp_path, tiny):
    import runtime

    out = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=64))
    data = bytearray((out / "weights.bin").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(runtime.BundleError, match="weights.bin: sha256 mismatch"):
        runtime.load(out)
    (out / "extra.txt").write_text("?")
    with pytest.raises(runtime.BundleError, match="extra.txt: present but not listed"):
        runtime.load(out)
    with pytest.raises(runtime.BundleError, match="no such bundle"):
        runtime.load(tmp_path / "nowhere")


def test_build_failure_midway_leaves_nothing(tmp_path, tiny, monkeypatch):
    import builder.build as bb

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(bb, "write_graphs", boom)
    with pytest.raises(OSError, match="disk full"):
        build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "o", max_seq=64))
    assert nothing_left(tmp_path)


def test_calibration_file_becomes_the_quant_tables(tmp_path, tiny):
    import onnx
    from onnx import numpy_helper
    from safetensors.numpy import save_file

    from gsm import checkpoint, names

    cfg = checkpoint.load_config(tiny)
    ranks = checkpoint.CheckpointTensors(tiny).ranks(cfg)
    rng = np.random.default_rng(0)
    tables = {}
    for l in cfg.owning_layers:
        for kind, r in zip(("k", "v"), ranks[l]):
            tables[names.calib_name(l, kind, "scale_int8")] = rng.uniform(0.01, 0.02, r).astype(np.float32)
            tables[names.calib_name(l, kind, "comp_int8")] = rng.uniform(-1e-3, 1e-3, r).astype(np.float32)
            if kind == "k":  # v falls back to the default INT12 scale
                tables[names.calib_name(l, kind, "scale_int12")] = rng.uniform(1e-4, 2e-4, r).astype(np.float32)
    calib = tmp_path / "kv_calibration.safetensors"
    save_file(tables, str(calib))
    out = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=64, calibration=calib))
    m = onnx.load(str(out / "model.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer if t.name.endswith(".quant")}
    for l in cfg.owning_layers:
        rk, _ = ranks[l]
        q = got[f"gsm.layers.{l}.quant"]
        s8v = tables[names.calib_name(l, "v", "scale_int8")]
        assert np.array_equal(q[1, :rk], tables[names.calib_name(l, "k", "scale_int8")])
        assert np.array_equal(q[0, :rk], tables[names.calib_name(l, "k", "scale_int12")])
        assert np.array_equal(q[0, rk:], (s8v * np.float32(127)) / np.float32(2047))
        assert np.array_equal(q[2, rk:], tables[names.calib_name(l, "v", "comp_int8")])
    assert json.loads((out / "manifest.json").read_text())["calibration"] == f"file:{calib}"
    del tables[names.calib_name(cfg.owning_layers[0], "v", "comp_int8")]
    save_file(tables, str(calib))
    with pytest.raises(BuildError, match="comp_int8"):
        build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "b2", max_seq=64, calibration=calib))
    assert not (tmp_path / "b2").exists()


def test_uncalibrated_real_checkpoint_ships_an_fp16_cache_unless_asked(tiny, tmp_path):
    """Data-free INT8 scales cost +16.5 % perplexity on SmolLM2 (issue 12): the CLI's default for a
    checkpoint without calibration tables is an FP16-only cache, said in the output and the report."""
    from gsm import checkpoint

    fractions = list(checkpoint.load_quant(tiny).tier_fractions)
    assert fractions != [1.0, 0.0, 0.0]
    r = run_cli("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(tmp_path / "a"),
                "--max-seq", "64", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no calibration tables" in r.stderr and "python -m calibration run" in r.stderr
    assert "KV tiers: fp16-only" in r.stdout
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["kv_tiers"]["mode"] == "fp16-only"
    assert json.loads((tmp_path / "a" / "bundle.json").read_text())["kv_quantization"]["tier_fractions"] == [1, 0, 0]
    r = run_cli("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(tmp_path / "b"),
                "--max-seq", "64", "--uncalibrated", "data-free", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "b" / "report.json").read_text())["kv_tiers"]["mode"] == "data-free"
    assert json.loads((tmp_path / "b" / "bundle.json").read_text())["kv_quantization"]["tier_fractions"] == fractions
    r = run_cli("builder", "build", "--device", "orin", "--output", str(tmp_path / "d"), "--max-seq", "64",
                cwd=tmp_path)  # the demo: random weights, tiers kept to show the machinery
    assert json.loads((tmp_path / "d" / "report.json").read_text())["kv_tiers"]["mode"] == "data-free"


def test_max_top_k_flag(tmp_path, tiny):
    """--max-top-k N reaches the plugin nodes and bundle.json; out of range is one error, nothing written."""
    import onnx

    r = run_cli("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--max-seq", "128",
                "--max-top-k", "129", "--output", str(tmp_path / "o"), cwd=tmp_path)
    assert r.returncode == 2 and "--max-top-k must be in [" in r.stderr and "got 129" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()
    out = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=128, max_top_k=100))
    assert json.loads((out / "bundle.json").read_text())["max_top_k"] == 100
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    got = {a.i for n in m.graph.node if n.op_type == "GsmSparseAttention" for a in n.attribute
           if a.name == "max_top_k"}
    assert got == {100}
