"""The bundle format declared once (gsm/bundle_format.py): what `builder build` writes is what the runtime
reads, bundle.json is parsed once and checked field by field, and a bundle of another engine_io revision (or one
from before bundle.json stated it) is refused with the rebuild command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from runtime_bundles import ROOT, run_module

from builder.build import BuildConfig, build
from gsm.atomic import MANIFEST_NAME, write_manifest
from gsm.bundle_format import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    FILES,
    GRAPH_REVISION,
    BundleConfig,
    BundleError,
)
from gsm.onnx_names import onnx_input_names
from gsm.synth import synth_checkpoint

COPIED_FROM_CHECKPOINT = {"config.json", "quant_config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fmt")
    out = root / "b"
    build(BuildConfig(device="orin", checkpoint=synth_checkpoint("tiny", root / "tiny"), output=out, max_seq=64,
                      max_input=16))
    return out


def rewritten(src: Path, dst: Path, edit) -> Path:
    """A copy of bundle `src` whose bundle.json is edit(parsed bundle.json), the manifest re-hashed so only
    bundle.json's contents differ."""
    shutil.copytree(src, dst)
    d = edit(json.loads((dst / FILES.config).read_text()))
    (dst / FILES.config).write_text(json.dumps(d))
    meta = json.loads((dst / MANIFEST_NAME).read_text())
    write_manifest(dst, {k: v for k, v in meta.items() if k not in ("format", "version", "files")})
    return dst


def test_a_built_bundle_round_trips_through_the_reader(bundle):
    written = json.loads((bundle / FILES.config).read_text())
    cfg = BundleConfig.load(bundle)
    assert cfg.to_json() == written  # every key the builder wrote, no more, same values
    assert written["graph_revision"] == cfg.graph_revision == GRAPH_REVISION
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    assert (manifest["bundle_format"], manifest["bundle_version"]) == (BUNDLE_FORMAT, BUNDLE_VERSION)
    assert manifest["graphs"] == FILES.graphs()
    named = {getattr(FILES, f) for f in FILES.__dataclass_fields__}
    assert set(manifest["files"]) - COPIED_FROM_CHECKPOINT <= named  # every file the builder wrote is in the table


def test_runtime_reads_bundle_json_once_and_hands_the_backend_that_object(bundle, monkeypatch):
    import runtime

    reads = []
    read_text = Path.read_text

    def counting(self, *a, **kw):
        if self.name == FILES.config:
            reads.append(self)
        return read_text(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", counting)
    rt = runtime.load(bundle, "onnxruntime", threads=1)
    assert len(reads) == 1, reads
    assert rt.backend.cfg is rt.cfg and rt.cfg == BundleConfig.load(bundle)


@pytest.mark.parametrize("edit, words", [
    (lambda d: {k: v for k, v in d.items() if k != "n_max"}, "no field 'n_max' (an integer >= 1)"),
    (lambda d: {**d, "n_max": "64"}, "field 'n_max' must be an integer >= 1, got '64'"),
    (lambda d: {**d, "max_batch": 0}, "field 'max_batch' must be an integer >= 1, got 0"),
    (lambda d: {**d, "debug_outputs": 1}, "field 'debug_outputs' must be true or false, got 1"),
    (lambda d: {**d, "logits": "every"}, "field 'logits' must be 'last' or 'all', got 'every'"),
    (lambda d: {**d, "ranks": {"0": [12]}}, "field 'ranks' must be an object layer -> [rank_k, rank_v]"),
    (lambda d: {**d, "pool_rows": {"fp16": 64}}, "field 'pool_rows' must be an object with integers fp16, int12"),
    (lambda d: {**d, "graph_revision": GRAPH_REVISION - 1}, f"field 'graph_revision' must be engine_io revision "
                                                           f"{GRAPH_REVISION}, the one this runtime runs (rebuild "
                                                           "the bundle with `python -m builder build"),
    (lambda d: {**d, "graph_revision": GRAPH_REVISION + 1}, "field 'graph_revision' must be engine_io revision"),
    (lambda d: {**d, "graph_revision": None}, "field 'graph_revision' must be engine_io revision"),
    (lambda d: {k: v for k, v in d.items() if k != "graph_revision"}, "states no graph_revision (built by an older "
                                                                      "builder, whose graphs this runtime does not "
                                                                      "run); rebuild the bundle with `python -m"),
    (lambda d: {**d, "kv_quantization": {**d["kv_quantization"], "tier_fractions": [1, 1, 1]}},
     "field 'kv_quantization': kv_quantization.tier_fractions must be three (FP16/INT12/INT8) or four"),
    (lambda d: {**d, "owning_layers": [0, 1]}, "ranks has layers [0, 1, 2], owning_layers [0, 1]"),
    (lambda d: [d], "expected a JSON object, got list"),
])
def test_a_bad_field_is_one_error_naming_the_file_and_the_field(bundle, tmp_path, edit, words):
    import runtime

    bad = rewritten(bundle, tmp_path / "bad", edit)
    with pytest.raises(BundleError) as e:
        runtime.load(bad, "onnxruntime", threads=1)
    assert str(e.value).startswith(f"{bad / FILES.config}: {words}") and "\n" not in str(e.value), str(e.value)


def test_a_bad_field_through_the_cli_is_exit_2_and_one_line(bundle, tmp_path):
    bad = rewritten(bundle, tmp_path / "bad", lambda d: {k: v for k, v in d.items() if k != "sink_tokens"})
    r = run_module("runtime", "generate", str(bad), "--ids", "1,5", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"python -m runtime generate: error: bundle {bad / FILES.config}: no field 'sink_tokens' (an integer >= 0); "
        "rebuild the bundle with `python -m builder build --device DEVICE --checkpoint CHECKPOINT --output BUNDLE`"]


def test_onnx_input_names_equal_the_onnx_packages(bundle):
    for name in (FILES.model_portable, FILES.model_cpu, FILES.model_trt, FILES.demote_portable, FILES.demote_trt):
        want = [i.name for i in onnx.load(str(bundle / name), load_external_data=False).graph.input]
        assert onnx_input_names(bundle / name) == want and want, name


def test_the_format_module_imports_neither_torch_nor_numpy():
    code = ("import sys, gsm.bundle_format, gsm.onnx_names\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'onnx', 'onnxruntime'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
