"""`python -m runtime verify` (runtime/verify.py, docs/verify.md): correct bundles pass on onnxruntime and reference;
a bundle whose weights were perturbed, a graph with one wrong node attribute and a backend forced to dense selection
where the golden's is sparse each fail, naming the check. What a failure recorded in a bundle's report does to
`builder engine`'s install, `runtime serve` and the Triton repository.

Bundles: the demo model (synthetic tiny) at fp16 / int8 / int4 with the default options (int8 and int4 run INT8
activation blocks in the ONNX Runtime graphs); SmolLM2 at fp16 / int8 / int4, built at --max-seq 512 from the first
8 of its 30 layers (conftest `smollm2_small`: real weights and tokenizer, converted and calibrated in about 40 s;
skipped only where ../shared/data lacks the GGUF) and, where $GSM_EDGE_SMOLLM2_CHECKPOINT names a calibrated GSM
checkpoint of the whole model (`python -m calibration run`: many minutes to make, so CI has none), from that too.
The reference is the golden probe the builder stored (tests/test_golden_probe.py checks it against the golden model
itself).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import SMOLLM2_LAYERS, need_ort_ops_library
from runtime_bundles import run_module
from verify_mutations import perturb_weight, restamp, wrong_attribute

from builder.build import BuildConfig, build
from gsm.bundle_format import FILES
from runtime.ref_backend import reference_usable
from runtime.verify import verify
from runtime.verify_checks import GREEDY, LOGITS_MAX, LOGITS_MEAN, SELECTION

N_MAX = 320  # the probe's 256 + 8 - 1 positions fit
BACKENDS = ["onnxruntime", "reference"]
SMOLLM2 = os.environ.get("GSM_EDGE_SMOLLM2_CHECKPOINT")


def need(backend: str) -> None:
    if backend == "reference" and not reference_usable()[0]:
        pytest.skip(reference_usable()[1])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model's bundles by weight format; `dense` is the fp16 one whose plugin graph takes any budget (the
    reference backend then runs the dense selection the mutation forces)."""
    root = tmp_path_factory.mktemp("demo")
    out = {w: build(BuildConfig(device="orin", output=root / w, max_seq=N_MAX, weights=w)).bundle
           for w in ("fp16", "int8", "int4")}
    out["dense"] = build(BuildConfig(device="orin", output=root / "dense", max_seq=N_MAX, max_top_k=N_MAX)).bundle
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights,precision", [("fp16", {"onnxruntime": "fp32", "reference": "fp16"}),
                                               ("int8", {"onnxruntime": "int8-activations", "reference": "fp16"}),
                                               ("int4", {"onnxruntime": "int8-activations", "reference": "fp16"})])
def test_demo_bundles_pass(demo, weights, precision, backend):
    need(backend)
    v = verify(demo[weights], backend, threads=1)
    assert v.passed, v.table()
    assert v.precision == precision[backend]
    assert v.backend.startswith(backend) and v.device and v.versions


def mutated(src: Path, tmp_path: Path, mutation: str, backend: str) -> tuple[Path, dict]:
    """A copy of bundle `src` with `mutation` applied, and the verify options it needs."""
    b = tmp_path / mutation
    shutil.copytree(src, b)
    if mutation == "weights":
        perturb_weight(b, 1.25)
    elif mutation == "attribute":
        wrong_attribute(b, FILES.model_cpu if backend == "onnxruntime" else FILES.model_trt, "sink_tokens", 32)
    else:
        return b, {"sparse_top_k": json.loads((b / FILES.config).read_text())["n_max"]}
    return b, {}


# the checks that may see each mutation (one must fail; others may fail too): perturbed weights move the logits; a
# wrong sink count moves one layer's selection, and the logits as far as that layer matters; a dense budget selects
# every position where the golden's is sparse
EXPECTED = {"weights": {LOGITS_MAX, LOGITS_MEAN}, "attribute": {LOGITS_MAX, LOGITS_MEAN, SELECTION},
            "dense": {SELECTION}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutation", list(EXPECTED))
def test_mutations_fail_naming_the_check(demo, mutation, backend, tmp_path):
    """Each mutation fails the bundle that passes above, and the failure names the check that saw it."""
    need(backend)
    if mutation == "attribute" and backend == "onnxruntime":
        need_ort_ops_library()  # the attribute is model.cpu.onnx's fused attention op's
    bundle, kw = mutated(demo["dense"], tmp_path, mutation, backend)
    assert verify(demo["dense"], backend, threads=1).passed
    v = verify(bundle, backend, threads=1, **kw)
    assert not v.passed and EXPECTED[mutation] & {c.name for c in v.failed}, v.table()


def test_cli_table_exit_codes_and_failure_line(demo, tmp_path):
    """Exit 0 with the table on a pass; exit 1 with the table and one error line naming the failed check."""
    r = run_module("runtime", "verify", str(demo["fp16"]), "--backend", "onnxruntime", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for row in ("backend    onnxruntime", "versions   onnxruntime", "device", "precision  fp32", LOGITS_MAX,
                GREEDY, "verdict: PASS"):
        assert row in r.stdout
    r = run_module("runtime", "verify", str(demo["fp16"]), "--backend", "onnxruntime", "--json", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "pass"
    bad, _ = mutated(demo["fp16"], tmp_path, "weights", "onnxruntime")
    r = run_module("runtime", "verify", str(bad), "--backend", "onnxruntime", cwd=tmp_path)
    assert r.returncode == 1 and "verdict: FAIL" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m runtime verify: error: backend onnxruntime")
    assert LOGITS_MAX in lines[0]


def test_bundle_without_probe_is_refused_with_the_rebuild_command(demo, tmp_path):
    """A bundle built before the probe existed: exit 2, one line naming the file and the command that makes it."""
    old = tmp_path / "old"
    shutil.copytree(demo["fp16"], old)
    (old / FILES.probe).unlink()
    m = json.loads((old / "manifest.json").read_text())
    del m["files"][FILES.probe]
    (old / "manifest.json").write_text(json.dumps(m))
    before = sorted(p.name for p in old.iterdir())
    r = run_module("runtime", "verify", str(old), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert FILES.probe in r.stderr and "python -m builder build" in r.stderr
    assert sorted(p.name for p in old.iterdir()) == before
    r = run_module("runtime", "verify", str(demo["fp16"]), "--backend", "reference", "--sparse-top-k", "999",
                   cwd=tmp_path)
    assert r.returncode == 2 and "--sparse-top-k" in r.stderr  # above max-seq: refused by name


def record_verdict(bundle: Path, backend: str, passed: bool) -> None:
    """report.json's recorded verdict for `backend` (as `builder engine` writes tensorrt's), re-stamped."""
    report = json.loads((bundle / FILES.report).read_text())
    report.setdefault("verify", {})[backend] = {"status": "pass" if passed else "fail", "versions": "x",
                                                "checks": [{"name": LOGITS_MAX, "passed": passed}]}
    (bundle / FILES.report).write_text(json.dumps(report))
    restamp(bundle, FILES.report)


def test_serve_refuses_a_recorded_failure_and_health_shows_the_verdict(demo, tmp_path):
    from starlette.testclient import TestClient

    import runtime
    from runtime.engine import Engine
    from runtime.serve.app import Server
    from runtime.verdict import VerdictRefused, refuse_failed

    bundle = tmp_path / "b"
    shutil.copytree(demo["fp16"], bundle)
    record_verdict(bundle, "onnxruntime", passed=False)
    r = run_module("runtime", "serve", str(bundle), "--backend", "onnxruntime", "--port", "0", cwd=tmp_path,
                   timeout=60)
    assert r.returncode == 2 and "--allow-failed-verify" in r.stderr and LOGITS_MAX in r.stderr
    with pytest.raises(VerdictRefused):
        refuse_failed(bundle, "onnxruntime", flag="--allow-failed-verify", allow=False)
    status = refuse_failed(bundle, "onnxruntime", flag="--allow-failed-verify", allow=True)
    eng = Engine(runtime.load(bundle, "onnxruntime", threads=1)).start()
    with TestClient(Server(eng, model_name="b", verify=status).app) as tc:
        assert eng.ready.wait(30)
        health = tc.get("/health").json()["verify"]
        assert health["status"] == "fail" and health["failed"] == [LOGITS_MAX]
    eng.close()
    record_verdict(bundle, "onnxruntime", passed=True)
    assert refuse_failed(bundle, "onnxruntime", flag="--allow-failed-verify", allow=False)["status"] == "pass"
    assert refuse_failed(demo["fp16"], "onnxruntime", flag="x", allow=False)["status"] == "not verified"


def test_triton_repository_refuses_a_recorded_failure(demo, tmp_path):
    from runtime.triton.repository import TritonModelSpec, write_repository
    from runtime.verdict import VerdictRefused

    bundle = tmp_path / "b"
    shutil.copytree(demo["fp16"], bundle)
    record_verdict(bundle, "onnxruntime", passed=False)
    with pytest.raises(VerdictRefused, match="--allow-failed-verify"):
        write_repository([TritonModelSpec(bundle, backend="onnxruntime")], tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    write_repository([TritonModelSpec(bundle, backend="onnxruntime", allow_failed_verify=True)], tmp_path / "repo")
    config = (tmp_path / "repo" / "b" / "config.pbtxt").read_text()
    assert 'key: "allow_failed_verify"' in config and '\\"status\\": \\"fail\\"' in config


def test_engine_failing_the_check_is_kept_aside_unless_asked(demo, tmp_path):
    """builder engine's last step on a real verdict (the demo with perturbed weights, on the reference backend, which
    runs the plugin graph TensorRT would): failing, the engine goes to BUNDLE.failed-engine/ and the report records
    the failure; --keep-failing installs it, and serving on tensorrt is then refused. The engine files are placeholder
    bytes: no TensorRT runs here, only what happens to its output is under test."""
    from builder.trt_engine import FAILED_SUFFIX, VERDICT_FILE, settle_engine
    from runtime.bundle import verify_bundle
    from runtime.verdict import VerdictRefused, recorded_verdicts, refuse_failed

    need("reference")
    bundle, _ = mutated(demo["fp16"], tmp_path, "weights", "reference")
    verdict = verify(bundle, "reference")
    assert not verdict.passed
    record = {"status": "built", "file": FILES.engine, "tensorrt": "placeholder"}
    for keep in (False, True):
        plan, demote = tmp_path / f"e{keep}.plan", tmp_path / f"d{keep}.plan"
        plan.write_bytes(b"engine"), demote.write_bytes(b"demote")
        out = settle_engine(bundle, plan, demote, record, verdict, keep_failing=keep)
        verify_bundle(bundle)  # every file listed and hashed, the report included
        assert recorded_verdicts(bundle)["tensorrt"]["status"] == "fail"
        assert (bundle / FILES.engine).is_file() == keep
        if not keep:
            assert out.kept_aside == bundle.parent / f"{bundle.name}{FAILED_SUFFIX}"
            assert (out.kept_aside / FILES.engine).read_bytes() == b"engine"
            assert json.loads((out.kept_aside / VERDICT_FILE).read_text())["status"] == "fail"
    assert json.loads((bundle / "manifest.json").read_text())["engine"]["verify"]["status"] == "fail"
    with pytest.raises(VerdictRefused):
        refuse_failed(bundle, "tensorrt", flag="--allow-failed-verify", allow=False)


@pytest.fixture(scope="module", params=[f"{SMOLLM2_LAYERS}-layers", "full"])
def smollm2(request, tmp_path_factory):
    """SmolLM2's fp16 / int8 / int4 bundles: of its first layers (always, where the GGUF is), or of the whole
    calibrated model at $GSM_EDGE_SMOLLM2_CHECKPOINT (skipped without it). Deleted after the module's tests."""
    if request.param == "full":
        if not SMOLLM2:
            pytest.skip("no calibrated SmolLM2 GSM checkpoint at $GSM_EDGE_SMOLLM2_CHECKPOINT")
        checkpoint = Path(SMOLLM2)
    else:
        checkpoint = request.getfixturevalue("smollm2_small")
    root = tmp_path_factory.mktemp(f"smollm2-{request.param}")
    yield {w: build(BuildConfig(device="orin-nano-8", checkpoint=checkpoint, output=root / w, max_seq=512,
                                weights=w)).bundle for w in ("fp16", "int8", "int4")}
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", ["fp16", "int8", "int4"])
def test_smollm2_bundles_pass(smollm2, weights, backend):
    need(backend)
    v = verify(smollm2[weights], backend)
    assert v.passed, v.table()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutation", list(EXPECTED))
def test_smollm2_int4_mutations_fail(smollm2, mutation, backend, tmp_path):
    """The INT4 bundle that passes above, mutated: each mutation fails, naming a check that sees it."""
    need(backend)
    if mutation == "attribute" and backend == "onnxruntime":
        need_ort_ops_library()
    if mutation == "dense" and backend == "reference":
        pytest.skip("the INT4 bundle's plugin graph selects at most the model's top-k (--max-top-k)")
    bundle, kw = mutated(smollm2["int4"], tmp_path, mutation, backend)
    try:
        v = verify(bundle, backend, **kw)
    finally:
        shutil.rmtree(bundle)  # a copy of the bundle, 117 MiB for 8 layers
    assert not v.passed and EXPECTED[mutation] & {c.name for c in v.failed}, v.table()
