"""The golden probe every bundle carries (gsm/probe_format.py, builder/golden_probe.py, docs/verify.md).

References, none of them the probe code: the golden model built from the checkpoint by GoldenModel.from_checkpoint
(and, for quantised weights, tests/test_builder_weights.py's golden_with, which quantises whole tensors), replaying
the calls the probe file names; ONNX Runtime's own MatMulNBits kernel for the INT8-activation emulation; the file's
bound from its declared budgets.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import retiering_copy
from test_builder_weights import golden_with

from builder.build import BuildConfig, build
from builder.golden_probe import logit_budget, plan_case
from builder.plan import GSM_SIDE_CONFIG
from builder.probe_weights import FileMatrix, Int8ActivationLinear, symmetric_part
from builder.wquant import WeightQuantConfig, dequantize, quantize
from gsm.bundle_format import FILES, REBUILD
from gsm.golden.model import GoldenModel
from gsm.probe_format import (
    FIELDS,
    LOGIT_BYTES,
    MAX_PROBE_BYTES,
    PROBE_KNOBS,
    GoldenProbe,
    ProbeError,
    ProbeRecord,
    read_probe,
    write_probe,
)
from gsm.synth import synth_checkpoint

N_MAX = 160


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=3), root / "retier")


@pytest.fixture(scope="module")
def fp16_bundle(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "fp16"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=N_MAX))
    return out


@torch.no_grad()
def replay(golden: GoldenModel, rec: ProbeRecord) -> tuple[np.ndarray, np.ndarray]:
    """Every output's logits [K, V] and the stored rows' selections [Ls, Q, N] of the golden making the record's
    calls (prefill calls, then one decode step per token but the last)."""
    cache, outs, pos = golden.new_cache(), [], 0
    sel = np.zeros((len(rec.sel_layers), len(rec.sel_rows), rec.positions), bool)
    rows = {int(r): q for q, r in enumerate(rec.sel_rows)}

    def keep(out, n):
        for r in (r for r in range(pos, pos + n) if r in rows):
            for j, l in enumerate(rec.sel_layers):
                m = out.trace.selected[int(l)][r - pos].numpy()
                sel[j, rows[r], :m.size] = m
        outs.append(out.logits[-1].numpy())

    for c in rec.calls:
        keep(golden.prefill(cache, rec.ids[pos:pos + c].tolist(), trace=True), int(c))
        pos += int(c)
    for t in rec.tokens[:-1]:
        keep(golden.decode(cache, int(t), trace=True), 1)
        pos += 1
    return np.stack(outs), sel


def assert_record_is(rec: ProbeRecord, logits: np.ndarray, sel: np.ndarray) -> None:
    assert np.array_equal(rec.logits, logits[rec.logit_outputs].astype(np.float16))
    assert np.array_equal(rec.top1, logits.argmax(axis=1))
    assert np.array_equal(rec.tokens, logits[len(rec.calls) - 1:].argmax(axis=1))  # the greedy continuation
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.allclose(rec.margin, top2[:, 1] - top2[:, 0], rtol=1e-6)
    assert np.array_equal(rec.selected(), sel)


def test_bundle_carries_the_golden_of_its_deployed_mode(tiny, fp16_bundle):
    """The fp16 bundle's probe is GoldenModel.from_checkpoint in deployed mode making the probe's calls: the same
    logits (to the file's float16), tokens, margins and selections; a re-tier pass demoted rows before the last
    prefill call and the selection is sparse; the manifest lists the file and the report sums it up."""
    probe = read_probe(fp16_bundle / FILES.probe)
    rec = probe.records[0]
    assert (rec.case, rec.form) == ("text", "portable") and len(probe.records) == 1  # no chat template
    assert len(rec.calls) >= 2 and len(rec.ids) + len(rec.tokens) - 1 <= N_MAX
    logits, sel = replay(GoldenModel.from_checkpoint(tiny, mode="deployed"), rec)
    assert_record_is(rec, logits, sel)
    assert rec.tiers[1:].sum() > 0 and probe.golden["demoted_rows"] == int(rec.tiers[1:].sum())
    assert 0 < probe.golden["selection_density"] < 0.5
    manifest = json.loads((fp16_bundle / "manifest.json").read_text())
    assert FILES.probe in manifest["files"]
    summary = json.loads((fp16_bundle / FILES.report).read_text())["golden_probe"]
    assert summary["bytes"] == (fp16_bundle / FILES.probe).stat().st_size <= MAX_PROBE_BYTES
    assert summary["cases"]["text"]["calls"] == rec.calls.tolist()


def test_quantised_bundle_probe_runs_on_its_dequantised_weights(tiny, tmp_path):
    """An INT4 build with exact matmuls: the probe's portable form is the golden on the whole-tensor dequantised
    weights (test_builder_weights.golden_with), INT4 projections and an INT8 g64 head."""
    out = tmp_path / "int4"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=N_MAX, weights="int4", group_size=32,
                      int4_grid="sym", matmul_accuracy="exact"))
    rec = read_probe(out / FILES.probe).for_form("portable")[0]
    golden = golden_with(tiny, WeightQuantConfig(4, 32), WeightQuantConfig(8, 64), GSM_SIDE_CONFIG)
    assert_record_is(rec, *replay(golden, rec))


def test_fast_bundle_has_a_tensorrt_form_without_activation_quantisation(tiny, tmp_path):
    """--matmul-accuracy fast (INT8 activations in the ONNX Runtime graphs, not in TensorRT's): two forms; the
    tensorrt one is the plain golden on the dequantised weights, the portable one differs from it."""
    out = tmp_path / "int8"
    build(BuildConfig(device="orin", checkpoint=tiny, output=out, max_seq=N_MAX, weights="int8", group_size=32))
    probe = read_probe(out / FILES.probe)
    forms = {r.form: r for r in probe.records}
    assert set(forms) == {"portable", "tensorrt"}
    trt_weights = WeightQuantConfig(8, None)  # TensorRT's INT8 is per output channel (builder/qlinear.trt_config)
    golden = golden_with(tiny, trt_weights, WeightQuantConfig(8, None), WeightQuantConfig(8, None))
    assert_record_is(forms["tensorrt"], *replay(golden, forms["tensorrt"]))
    assert not np.array_equal(forms["portable"].logits, forms["tensorrt"].logits)


@pytest.mark.parametrize("cfg", [WeightQuantConfig(4, 32), WeightQuantConfig(4, 128),
                                 WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True),
                                 WeightQuantConfig(8, 32), WeightQuantConfig(8, None)])
def test_int8_activation_emulation_is_onnxruntime_accuracy_level_4(cfg):
    """The golden's emulation of a fast matmul against ONNX Runtime's MatMulNBits kernel itself: float32 agreement
    (the dequantised product differs from it by far more)."""
    import onnxruntime as ort

    from builder.qlinear import matmul_nbits, standalone_model

    rng = np.random.default_rng(0)
    k, n = 200, 48
    q = quantize(rng.standard_normal((n, k)).astype(np.float32), cfg)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[:, 3] *= 20  # one outlier channel: its block's step is coarse
    model = standalone_model(matmul_nbits("x", "y", "w", q, accuracy_level=4), "x", k, n)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    offsets = None if cfg.symmetric else torch.from_numpy(q.group_offsets())
    got = (torch.from_numpy(x) @ Int8ActivationLinear(torch.from_numpy(symmetric_part(q)), offsets, cfg.block(k),
                                                       None).T).numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-6 * scale
    assert np.abs(x @ dequantize(q).T - want).max() > 1e-3 * scale


def full_record(case: str, vocab: int, outputs: int, rows: int) -> ProbeRecord:
    """A record of `outputs` outputs storing `rows` logit rows, its arrays of the declared dtypes."""
    ids = np.arange(200, dtype=np.int32) % vocab
    return ProbeRecord(case, "portable", ids, np.array([100, 100], np.int32), np.zeros(outputs - 1, np.int32),
                       np.zeros(outputs, np.int32), np.ones(outputs, np.float32), np.ones(outputs, np.float32),
                       np.zeros(outputs, np.float32), np.arange(rows, dtype=np.int32),
                       np.zeros((rows, vocab), np.float16), np.arange(30, dtype=np.int32),
                       np.array([99, 199], np.int32), np.zeros((30, 2, -(-(198 + outputs) // 8)), np.uint8),
                       np.zeros(4, np.int32))


@pytest.mark.parametrize("vocab", [384, 49_152, 128_256, 256_000, 1_000_000])
def test_probe_size_is_bounded_whatever_the_vocabulary(vocab, tmp_path):
    """The logit budget keeps the rows of all records within LOGIT_BYTES, so the file of two cases on two forms
    stays under MAX_PROBE_BYTES whatever the vocabulary (the first record keeps a row while one fits)."""
    outputs = [9, 7, 9, 7]
    rows = logit_budget(outputs, vocab)
    assert sum(rows) * 2 * vocab <= LOGIT_BYTES and all(0 <= r <= k for r, k in zip(rows, outputs))
    assert rows[0] >= 1 or 2 * vocab > LOGIT_BYTES
    recs = tuple(full_record(case, vocab, k, r) for case, k, r in zip(("text", "chat", "text", "chat"), outputs, rows))
    recs = tuple(ProbeRecord(**{**r.__dict__, "form": form}) for r, form in
                 zip(recs, ("portable", "portable", "tensorrt", "tensorrt")))
    size = write_probe(tmp_path / "p.npz", GoldenProbe(vocab, recs, {PROBE_KNOBS: {}}))
    assert size <= MAX_PROBE_BYTES and len(read_probe(tmp_path / "p.npz").records) == 4


def test_probe_fits_a_short_max_seq():
    """A bundle of max-seq 24 and max-input 8: the prompt is cut to fit the continuation, in calls of <= 8."""
    cfg = SimpleNamespace(n_max=24, max_input=8)  # the two fields plan_case reads of a BundleConfig
    plan = plan_case("text", list(range(100)), cfg, new_tokens=8, least_calls=2)
    assert len(plan.ids) + plan.new_tokens - 1 == 24 and max(plan.calls) <= 8 and sum(plan.calls) == len(plan.ids)
    assert all(r < 24 for r in plan.sel_rows)


def test_reader_names_the_file_and_what_is_wrong(fp16_bundle, tmp_path):
    with pytest.raises(ProbeError, match=rf"no golden probe.*{REBUILD.split()[0]}"):
        read_probe(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ProbeError, match="junk.npz: not a readable golden probe"):
        read_probe(tmp_path / "junk.npz")
    for key, value in (("meta", json.dumps({"format": "gsm-edge-golden-probe", "version": 99}).encode()),
                       ("text.portable.calls", np.array([1, 2], np.int32))):
        with zipfile.ZipFile(fp16_bundle / FILES.probe) as z, zipfile.ZipFile(tmp_path / f"{key}.npz", "w") as out:
            for info in z.infolist():
                data = z.read(info)
                if info.filename == f"{key}.npy":
                    buf = io.BytesIO()
                    arr = np.frombuffer(value, np.uint8) if isinstance(value, bytes) else value
                    np.lib.format.write_array(buf, arr, allow_pickle=False)
                    data = buf.getvalue()
                out.writestr(info, data)
        with pytest.raises(ProbeError, match="version 99" if key == "meta" else "text.portable: calls"):
            read_probe(tmp_path / f"{key}.npz")
    assert set(FIELDS) <= {f.name for f in ProbeRecord.__dataclass_fields__.values()}


def test_file_matrix_multiplies_and_gathers_block_by_block(tmp_path, monkeypatch):
    """Several row blocks (a 4 KiB block here) give the product and rows of the whole matrix."""
    monkeypatch.setattr("builder.probe_weights.ROWS_PER_BLOCK_BYTES", 4096)
    w = np.random.default_rng(0).standard_normal((300, 48)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    m, x = FileMatrix(tmp_path / "w.npy"), torch.randn(5, 48)
    assert m.shape == (300, 48)
    assert torch.allclose(x @ m.T, x @ torch.from_numpy(w).T, atol=1e-5)
    assert torch.allclose(torch.nn.functional.linear(x, m), x @ torch.from_numpy(w).T, atol=1e-5)
    assert torch.equal(m[torch.tensor([3, 299, 3])], torch.from_numpy(w[[3, 299, 3]]))


_PEAK_GROWTH = """
import resource, sys
import numpy as np, torch
from pathlib import Path
from builder.probe_weights import FileMatrix
m, x = FileMatrix(Path(sys.argv[1])), torch.randn(1, 1024)
x @ torch.randn(1024, 4096)  # the BLAS's own buffers, before the figure
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
y = x @ m.T
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_file_matrix_product_holds_a_block_not_the_matrix(tmp_path):
    """A 96 MiB matrix multiplies in a fresh process whose peak grows by about one 16 MiB block (a mapped or loaded
    matrix grows it by the 96 MiB): the build-memory bound of a model whose head is this size."""
    rows = 96 * 2**20 // (4 * 1024)
    with (tmp_path / "w.npy").open("wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, 1024)})
        for _ in range(6):
            f.write(np.ones((rows // 6, 1024), np.float32).data)
    growth = int(subprocess.run([sys.executable, "-c", _PEAK_GROWTH, str(tmp_path / "w.npy")], check=True,
                                capture_output=True, text=True).stdout)
    assert growth < 40 * 2**20, f"peak grew {growth / 2**20:.0f} MiB"
