"""`python -m builder build --weights`: quantised bundles (issue 11, docs/weights.md).

References are independent of the builder's graph code: the golden model (gsm/golden, torch) loaded
with the dequantised weights `wquant.dequantize(wquant.quantize(W))` of the whole tensor (the builder
streams rows through `quantize_chunks` and packs them for ONNX Runtime), hand-made Q4_1 blocks, and
the onnx reference evaluator for the TensorRT form.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import retiering_copy
from runtime_bundles import run_module

from builder.build import BuildConfig, BuildError, build
from builder.plan import DEFAULT_INT8_GROUP_SIZE, GSM_SIDE_CONFIG, PER_CHANNEL, gsm_side_names, quantised_names
from builder.wquant import WeightQuantConfig, dequantize, on_block_grid, quantize, quantize_chunks
from gsm import checkpoint
from gsm.golden.model import GoldenModel
from gsm.golden.weights import GoldenWeights, KVCalibration
from gsm.synth import synth_checkpoint

N_MAX = 96
PROMPT_LEN, STEPS = 24, 24
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def tiny_fp16(tmp_path_factory):
    """The seeded tiny checkpoint as written: every cached latent stays FP16."""
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=5)


@pytest.fixture(scope="module")
def tiny(tiny_fp16, tmp_path_factory):
    return retiering_copy(tiny_fp16, tmp_path_factory.mktemp("ckpt") / "tiny-retier")


def golden_with(ckpt, wcfg: WeightQuantConfig | None, head: WeightQuantConfig | np.ndarray | None = None,
                gsm: WeightQuantConfig | None = None) -> GoldenModel:
    """The golden model in deployed mode on the checkpoint's weights, projections dequantised (wcfg), the
    embedding and LM head too (head: a config, or the dequantised tensor itself; a tied model's one tensor serves
    as both), and the GSM-side projections (gsm: --gsm-weights int8, GSM_SIDE_CONFIG)."""
    cfg = checkpoint.load_config(ckpt)
    sd = dict(checkpoint.load_state_dict(ckpt))
    original = GoldenWeights.from_tensors(cfg, dict(sd))
    todo = [(n, wcfg) for n in quantised_names(cfg)] + [
        (n, head) for n in ("model.embed_tokens.weight", "lm_head.weight") if n in sd] + [
        (n, gsm) for n in sorted(gsm_side_names(cfg))]
    for name, c in todo:
        if isinstance(c, np.ndarray):
            sd[name] = c
        elif c is not None:
            sd[name] = dequantize(quantize(np.asarray(sd[name], np.float32), c))
    calib_t = checkpoint.load_kv_calibration(ckpt)
    # without a calibration file, the data-free scales of the checkpoint's own latent projections, as the builder
    # computes them (not of the dequantised ones the golden runs on)
    calib = KVCalibration.from_tensors(cfg, calib_t) if calib_t is not None else KVCalibration.data_free(original)
    return GoldenModel(GoldenWeights.from_tensors(cfg, sd), mode="deployed", quant=checkpoint.load_quant(ckpt),
                       calibration=calib)


def tolerance(golden_logits) -> float:
    """The golden regression's rule (tests/test_runtime_golden.py): max(1e-3, 1e-4 x the logit scale)."""
    return max(LOGIT_TOL, 1e-4 * float(np.abs(np.asarray(golden_logits)).max()))


def run_both(bundle, golden: GoldenModel, prompt: list[int], graph: str = "auto"
             ) -> tuple[float, list[int], list[int]]:
    """Greedy prefill + decode of bundle and golden side by side, both fed the golden's token; the worst logit
    difference in units of `tolerance` (<= 1: they agree), and both token lists (stopped at the first
    disagreement). A runtime pick within twice the tolerance of the golden's best logit is a tie the logit check
    already judges (float reassociation may break it either way), so it is listed as the golden's token."""
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph=graph)
    seq, cache = rt.new_sequence(), golden.new_cache()
    with torch.no_grad():
        g = golden.prefill(cache, prompt).logits[-1]
    r = seq.prefill(prompt)
    worst, gt, rt_ = float(np.abs(r - g.numpy()).max()) / tolerance(g), [], []
    for _ in range(STEPS):
        gt.append(int(torch.argmax(g)))
        pick = int(np.argmax(r))
        rt_.append(gt[-1] if float(g[gt[-1]] - g[pick]) <= 2 * tolerance(g) else pick)
        if gt[-1] != rt_[-1]:
            break
        with torch.no_grad():
            g = golden.decode(cache, gt[-1]).logits[-1]
        r = seq.decode(rt_[-1])
        worst = max(worst, float(np.abs(r - g.numpy()).max()) / tolerance(g))
    return worst, gt, rt_


@pytest.mark.parametrize("weights,grid,group", [("int8", "auto", None), ("int8", "auto", PER_CHANNEL),
                                                ("int8", "auto", 32), ("int4", "sym", 32), ("int4", "sym", 128),
                                                ("int4", "asym-f", 32)])
def test_quantised_bundle_matches_golden_on_dequantised_weights(tiny, tmp_path, weights, grid, group):
    bundle = tmp_path / "b"
    r = build(BuildConfig(device="orin", checkpoint=tiny, output=bundle, max_seq=N_MAX, weights=weights,
                          group_size=group, int4_grid=grid, matmul_accuracy="exact"))
    int8_group = {None: DEFAULT_INT8_GROUP_SIZE, PER_CHANNEL: None}.get(group, group)
    wcfg = (WeightQuantConfig(8, int8_group) if weights == "int8" else
            WeightQuantConfig(4, group, symmetric=grid == "sym", float_zero_point=grid == "asym-f"))
    head = WeightQuantConfig(8, 64)  # embedding and untied head: INT8 symmetric at group 64 for INT8 and INT4
    prompt = np.random.default_rng(1).integers(3, 259, PROMPT_LEN).tolist()
    worst, gt, rt = run_both(bundle, golden_with(tiny, wcfg, head, GSM_SIDE_CONFIG), prompt)
    assert gt == rt, f"greedy tokens diverge: {gt} vs {rt}"
    assert worst <= 1, worst
    # and the quantisation is real: the fp32 golden's logits differ by far more than the tolerance
    worst_fp, _, _ = run_both(bundle, golden_with(tiny, None), prompt[:8])
    assert worst_fp > 10
    w = r.report["weights"]
    assert w["format"] == weights and w["bytes"] == r.plan.weight_bytes < w["fp16_bytes"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["weights"]["format"] == weights == json.loads((bundle / "bundle.json").read_text())[
        "weights"]["format"]
    if weights == "int4":
        assert (w["group_size"], w["int4_grid"]) == (group, grid)
        assert manifest["opset"] == 21  # model.onnx: INT4 DequantizeLinear with block_size
    else:
        assert w["group_size"] == int8_group  # None: per output channel
        assert manifest["opset"] == 21  # model.onnx: INT8 per channel whatever the portable group (TensorRT)
    import onnx

    portable = onnx.load(bundle / "model.portable.onnx", load_external_data=False)
    ops = [n.op_type for n in portable.graph.node]
    # 4 layers x q, o, gate+up (one node), down, the 3 owning layers' GSM-side in_proj (INT8 per channel) and the
    # (untied) LM head; the embedding a quantised gather; no float Gemm left but the asym-f offset terms
    assert ops.count("MatMulNBits") == 4 * 4 + 3 + 1 and ops.count("GatherBlockQuantized") == 1
    assert ("Gemm" in ops) == (grid == "asym-f")
    assert "Gather" not in ops[:3]
    # model.cpu.onnx: each asym-f projection's offset term (and o / down's residual) is one GsmGroupOffset node,
    # held to the golden above where the op library is built (auto takes that graph); the portable form here
    cpu = onnx.load(bundle / "model.cpu.onnx", load_external_data=False).graph.node
    cpu_ops = [n.op_type for n in cpu]
    assert cpu_ops.count("GsmGroupOffset") == (4 * 4 if grid == "asym-f" else 0)
    # no offset Gemm and no group-sum MatMul (over a `groups_*` indicator) left
    assert {n.op_type for n in cpu if any(i.endswith(".offsets") or "groups_" in i for i in n.input)} <= {
        "GsmGroupOffset"}
    if grid == "asym-f":
        with_residual = [n for n in cpu if n.op_type == "GsmGroupOffset" and len(n.input) >= 4 and n.input[3]]
        assert len(with_residual) == 2 * 4  # o and down add the residual stream in the node
        # and the RMSNorm that reads it is the node's second output: o's post-attention norm, down's next input
        # norm (not the last layer's: the final norm follows the last row's gather); no norm node left but that one
        # and the first layer's input norm
        normed = [n for n in cpu if n.op_type == "GsmGroupOffset" and len(n.output) == 2]
        assert len(normed) == 4 + 3 and all(len(n.input) == 5 for n in normed)
        assert cpu_ops.count("Sqrt") == 2 and ops.count("Sqrt") == 2 * 4 + 1
        # gate+up's node takes the SwiGLU product too: no Split / Sigmoid / product Mul after it
        swiglu = [n for n in cpu if n.op_type == "GsmGroupOffset" and any(a.name == "swiglu" and a.i == 1
                                                                            for a in n.attribute)]
        assert len(swiglu) == 4 and "Sigmoid" not in cpu_ops and "Sigmoid" in ops
        worst_p, gt_p, rt_p = run_both(bundle, golden_with(tiny, wcfg, head, GSM_SIDE_CONFIG), prompt, "portable")
        assert gt_p == rt_p and worst_p <= 1, worst_p
    trt = onnx.load(bundle / "model.onnx", load_external_data=False)
    dqs = [n for n in trt.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 4 * 4 + 3 + 2
    blocks = {a.i for n in dqs for a in n.attribute if a.name == "block_size"}
    assert blocks == (set() if weights == "int8" else {wcfg.group_size})  # INT8 head: per channel in TensorRT
    assert w["gsm_weights"] == "int8"


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The synthetic `small` model: its LM head is the embedding (tie_word_embeddings)."""
    return synth_checkpoint("small", tmp_path_factory.mktemp("tied") / "small", seed=3)


def calibration_file(ckpt, path, moment: np.ndarray | None):
    """A calibration file of the checkpoint's data-free KV scales, with `moment` as its head.input_moment."""
    from gsm.safetensors_io import StreamingSafetensorsWriter, TensorSpec

    cfg = checkpoint.load_config(ckpt)
    calib = KVCalibration.data_free(GoldenWeights.from_tensors(cfg, dict(checkpoint.load_state_dict(ckpt))))
    calib.head_input_moment = None if moment is None else torch.from_numpy(np.asarray(moment, np.float32))
    arrays = calib.to_tensors()
    specs = [TensorSpec(n, tuple(arrays[n].shape), "F32") for n in sorted(arrays)]
    with StreamingSafetensorsWriter(path, specs, {"format": "pt"}) as w:
        for s in specs:
            w.write(s.name, arrays[s.name])
    return path


def test_head_without_or_with_a_bad_moment(tied, tmp_path):
    """--head-weights int4 without the head's input moment: round-to-nearest, and the build says what that costs; a
    calibration file whose moment has the wrong shape: one error naming the file and the tensor, nothing written."""
    said: list[str] = []
    plain = calibration_file(tied, tmp_path / "plain.safetensors", None)
    r = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "rtn", max_seq=N_MAX, weights="int4",
                          group_size=32, calibration=plain), say=said.append)
    assert r.report["weights"]["head_weights"] == "int8"  # the default without a moment
    r = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "rtn4", max_seq=N_MAX, weights="int4",
                          group_size=32, head_weights="int4", calibration=plain), say=said.append)
    assert r.report["weights"]["head_quantiser"] == "round-to-nearest"
    assert any("head.input_moment" in s and "GPTQ" in s for s in said), said
    h = checkpoint.load_config(tied).hidden_size
    bad = calibration_file(tied, tmp_path / "bad.safetensors", np.eye(h + 2))
    with pytest.raises(BuildError, match=r"bad\.safetensors: head\.input_moment has shape .*expected \[" + str(h)):
        build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "bad", max_seq=N_MAX, weights="int4",
                          group_size=32, calibration=bad))
    assert not (tmp_path / "bad").exists()


def test_calibrated_int4_build_quantises_the_head_by_gptq(tied, tmp_path):
    """A calibration file with the head's input moment: `--weights int4` then defaults to an INT4 head, made by
    GPTQ on that moment (the bundle equals the golden with that head, not with round-to-nearest's), and the plan
    counts it at INT4; --head-weights int8 still keeps the INT8 head."""
    import functools

    from builder.gptq import gptq_factor, gptq_quantize
    from gsm import names

    cfg = checkpoint.load_config(tied)
    exact = GoldenModel.from_checkpoint(tied, mode="exact")
    xs = []
    exact.head_hooks.append(lambda x: xs.append(x.double()))
    with torch.no_grad():
        exact.forward(exact.new_cache(), np.random.default_rng(8).integers(3, cfg.vocab_size, 80).tolist())
    x = torch.cat(xs)
    moment = (x.T @ x / x.shape[0]).numpy()
    path = calibration_file(tied, tmp_path / "calib.safetensors", moment)

    r = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                          group_size=32, matmul_accuracy="exact", calibration=path))
    assert (r.report["weights"]["head_weights"], r.report["weights"]["head_quantiser"]) == ("int4", "gptq")
    i8 = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "i8", max_seq=N_MAX, weights="int4",
                           group_size=32, head_weights="int8", calibration=path))
    assert i8.report["weights"]["head_weights"] == "int8" and "head_quantiser" not in i8.report["weights"]
    V, H = cfg.vocab_size, cfg.hidden_size
    assert i8.plan.weight_bytes - r.plan.weight_bytes == (V * H + V * H // 64 * 2) - (V * H // 2 + V * H // 32 * 4)

    head_cfg = WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True)
    w = np.asarray(checkpoint.load_state_dict(tied)[names.EMBED], np.float32)
    q = quantize_chunks(w.shape, iter([w.reshape(-1)]), head_cfg,
                        quantize_rows=functools.partial(gptq_quantize, factor=gptq_factor(np.float32(moment))))
    prompt = np.random.default_rng(6).integers(3, 1000, PROMPT_LEN).tolist()
    worst, gt, rt = run_both(tmp_path / "b", golden_with(tied, WeightQuantConfig(4, 32), dequantize(q),
                                                         GSM_SIDE_CONFIG), prompt)
    assert gt == rt and worst <= 1, (worst, gt, rt)
    worst_rtn, _, _ = run_both(tmp_path / "b", golden_with(tied, WeightQuantConfig(4, 32), head_cfg, GSM_SIDE_CONFIG),
                               prompt[:8])
    assert worst_rtn > 10  # the bundle's head is GPTQ's, not round-to-nearest's


@pytest.mark.parametrize("head_bits", [8, 4])
def test_tied_head_quantised_once(tied, tmp_path, head_bits):
    """--head-weights int8/int4 on a tied model: one quantised tensor read by both the embedding lookup
    (GatherBlockQuantized) and the head (MatMulNBits) of the portable graph, by one DequantizeLinear feeding a
    Gather and the head's MatMul in the TensorRT graph; the bundle equals the golden whose embedding (= head)
    is dequantised, and the plan counts the tensor once at its quantised size."""
    import onnx

    head = f"int{head_bits}"
    head_cfg = {8: WeightQuantConfig(8, 64),
                4: WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True)}[head_bits]
    r = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                          group_size=32, head_weights=head, matmul_accuracy="exact"))
    float_head = build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "f", max_seq=N_MAX, weights="int4",
                                   group_size=32, head_weights="fp16"))
    cfg = checkpoint.load_config(tied)
    V, H = cfg.vocab_size, cfg.hidden_size
    group = head_cfg.group_size  # INT8 heads symmetric at group 64, INT4 at 32 with a float zero point
    per_group = 2 if head_bits == 8 else 4  # FP16 scale (+ FP16 offset)
    saved = 2 * V * H - (V * H * head_bits // 8 + V * (H // group) * per_group)  # FP16 tensor -> codes + groups
    assert float_head.plan.weight_bytes - r.plan.weight_bytes == saved
    assert (r.report["weights"]["head_weights"], r.report["weights"]["tied_head"]) == (head, True)
    # no calibration file, so no head input moment: an INT4 head is rounded to nearest
    assert r.report["weights"].get("head_quantiser") == (None if head_bits == 8 else "round-to-nearest")
    assert float_head.report["weights"]["head_weights"] == "fp16"
    portable = onnx.load(tmp_path / "b" / "model.portable.onnx", load_external_data=False).graph
    gbq = [n for n in portable.node if n.op_type == "GatherBlockQuantized"]
    heads = [n for n in portable.node if n.op_type == "MatMulNBits" and n.input[1].startswith("model.embed_tokens")]
    assert len(gbq) == 1 and len(heads) == 1 and gbq[0].input[0] == heads[0].input[1]
    assert not [n for n in portable.node if n.op_type == "Gather" and n.input[0] == "model.embed_tokens.weight"]
    trt = onnx.load(tmp_path / "b" / "model.onnx", load_external_data=False).graph
    dq = [n for n in trt.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("model.embed_tokens")]
    readers = {n.op_type for n in trt.node if dq and dq[0].output[0] in n.input}
    assert len(dq) == 1 and readers == {"Gather", "MatMul"}
    float_ops = [n for n in onnx.load(tmp_path / "f" / "model.portable.onnx", load_external_data=False).graph.node]
    assert not [n for n in float_ops if n.op_type == "GatherBlockQuantized"]
    prompt = np.random.default_rng(6).integers(3, 1000, PROMPT_LEN).tolist()
    golden = golden_with(tied, WeightQuantConfig(4, 32), head_cfg, GSM_SIDE_CONFIG)
    worst, gt, rt = run_both(tmp_path / "b", golden, prompt)
    assert gt == rt and worst <= 1, (worst, gt, rt)
    worst_float, _, _ = run_both(tmp_path / "b", golden_with(tied, WeightQuantConfig(4, 32), None, GSM_SIDE_CONFIG),
                                   prompt[:8])
    assert worst_float > 10  # the head's quantisation is real


def test_tied_head_trt_form_on_the_reference_backend(tied, tmp_path):
    """model.onnx's quantised embedding (Gather over the head's DequantizeLinear), float32 activations, through
    the onnx reference evaluator and the plugins' CPU reference: equals the portable bundle (INT4 is blocked in
    both forms, so the weights are the same)."""
    import runtime
    from runtime.ref_backend import reference_usable

    ok, why = reference_usable()
    if not ok:
        pytest.skip(why)
    build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                      group_size=32, head_weights="int4", trt_precision="fp32", matmul_accuracy="exact"))
    prompt = np.random.default_rng(2).integers(3, 1000, 12).tolist()
    a = runtime.load(tmp_path / "b", backend="onnxruntime", threads=1).new_sequence().prefill(prompt)
    b = runtime.load(tmp_path / "b", backend="reference", threads=1).new_sequence().prefill(prompt)
    assert np.abs(a - b).max() <= 1e-3 and int(np.argmax(a)) == int(np.argmax(b))


@pytest.mark.parametrize("weights,group,grid", [("int4", 32, "asym-f"), ("int8", 32, "auto")])
def test_trt_form_runs_on_the_reference_backend(tiny, tmp_path, weights, group, grid):
    """model.onnx with INT4 asym-f weights (DQ + MatMul + per-group offsets), activations fp32, through the
    onnx reference evaluator and the plugins' CPU reference: equals the portable bundle. INT8 g32: the
    TensorRT form is per output channel (TensorRT takes blocked DQ for INT4 only), so it equals the golden
    on per-channel dequantised weights, and the portable graph the golden on g32 ones."""
    import runtime
    from runtime.ref_backend import reference_usable

    ok, why = reference_usable()
    if not ok:
        pytest.skip(why)
    bundle = tmp_path / "b"
    # INT4: an INT4 embedding and head as well, blocked in both forms like the projections (an INT8 one is per
    # channel in the TensorRT form)
    build(BuildConfig(device="orin", checkpoint=tiny, output=bundle, max_seq=N_MAX, weights=weights, group_size=group,
                      int4_grid=grid, trt_precision="fp32", matmul_accuracy="exact", head_weights=weights))
    prompt = np.random.default_rng(2).integers(3, 259, 12).tolist()
    a = runtime.load(bundle, backend="onnxruntime", threads=1).new_sequence().prefill(prompt)
    b = runtime.load(bundle, backend="reference", threads=1).new_sequence().prefill(prompt)
    if weights == "int4":
        assert np.abs(a - b).max() <= 1e-3 and int(np.argmax(a)) == int(np.argmax(b))
        return
    for logits, cfg in ((a, WeightQuantConfig(8, group)), (b, WeightQuantConfig(8, None))):
        # the head at group 64 portable, per channel in the TensorRT form (like every grouped INT8 weight)
        golden = golden_with(tiny, cfg, WeightQuantConfig(8, 64 if cfg.group_size else None), GSM_SIDE_CONFIG)
        with torch.no_grad():
            g = golden.prefill(golden.new_cache(), prompt).logits[-1].numpy()
        assert np.abs(logits - g).max() <= tolerance(g)
    assert np.abs(a - b).max() > 10 * LOGIT_TOL  # two different quantisations, really


def test_q4_1_blocks_are_reproduced_exactly():
    """Hand-made llama.cpp Q4_1 blocks (w = q d + m, fp16 d and m): asym-f at group 32 gets q back and
    dequantises to w within float32 rounding; symmetric INT4 cannot."""
    rng = np.random.default_rng(0)
    n, k = 48, 160
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's min maps to 0 and max to 15
    d = (rng.random((n, k // 32, 1)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32, 1)) * 0.1).astype(np.float16).astype(np.float32)
    w = (q * d + m).astype(np.float32).reshape(n, k)
    assert on_block_grid(w, 4, 32) and not on_block_grid(rng.standard_normal((n, k)), 4, 32)
    qw = quantize(w, WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True))
    assert np.array_equal(qw.codes.reshape(n, k // 32, 32), q)
    assert np.abs(dequantize(qw) - w).max() <= 4e-7 * np.abs(w).max()
    sym = dequantize(quantize(w, WeightQuantConfig(4, 32)))
    assert np.abs(sym - w).max() > 1e-3


def test_q4_1_group_offsets_are_float16_exactly():
    """The float zero point's per-group offset min + 8 d, made from the group's min: for Q4_1 blocks (fp16 d and m)
    whose offsets are float16 values the bundle stores them in float16
    (half the bytes) with nothing rounded, and the portable form equals the float64 product; a float source's
    offsets are not float16 values and stay float32."""
    import onnxruntime as ort
    from onnx import TensorProto

    from builder.qlinear import QLayout, matmul_nbits, nbits_inits, standalone_model

    rng = np.random.default_rng(1)
    n, k = 64, 192
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = (rng.random((n, k // 32, 1)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    # 0 near the middle of each block's range, as in real weights (SmolLM2: every offset of 148 of its 150 INT4
    # projections is a float16), so |m + 8 d| <= d
    m = (-d * rng.uniform(7.0, 9.0, (n, k // 32, 1))).astype(np.float16).astype(np.float32)
    w = (q * d + m).astype(np.float32).reshape(n, k)
    qw = quantize(w, WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True))
    off = qw.group_offsets()
    assert np.array_equal(off, (m + 8 * d)[..., 0])  # exactly the source's m + 8 d
    assert np.array_equal(off.astype(np.float16).astype(np.float32), off)
    types = {i.name: i.data_type for i in nbits_inits("p", qw)}
    assert types == {"p.qweight": TensorProto.UINT8, "p.scales": TensorProto.FLOAT, "p.offsets": TensorProto.FLOAT16}
    assert QLayout.of(qw).offsets_f16 and not QLayout.of(qw, "tensorrt").offsets_f16
    x = rng.standard_normal((5, k)).astype(np.float32)
    model = standalone_model(matmul_nbits("x", "y", "p", qw), "x", k, n)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    noisy = quantize(w + rng.standard_normal(w.shape).astype(np.float32) * 1e-4,
                     WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True))
    assert {i.name: i.data_type for i in nbits_inits("p", noisy)}["p.offsets"] == TensorProto.FLOAT
    assert not QLayout.of(noisy).offsets_f16


@pytest.mark.parametrize("cfg", [WeightQuantConfig(4, 32), WeightQuantConfig(8, None),
                                 WeightQuantConfig(4, 64, symmetric=False, float_zero_point=True)])
def test_streamed_quantisation_equals_whole_tensor(cfg):
    w = np.random.default_rng(3).standard_normal((37, 100)).astype(np.float32)
    flat = w.reshape(-1)
    chunks = [flat[i:i + 333] for i in range(0, flat.size, 333)]  # not row-aligned
    a, b = quantize(w, cfg), quantize_chunks(w.shape, iter(chunks), cfg, rows_per_step=5)
    for x, y in ((a.codes, b.codes), (a.scales, b.scales), (a.zero_points, b.zero_points)):
        assert np.array_equal(x, y)
    assert (a.mins is None) == (b.mins is None) == (not cfg.float_zero_point)
    assert a.mins is None or np.array_equal(a.mins, b.mins)


def test_streamed_build_bound(tiny, tmp_path):
    """With 4 KiB chunks the build never holds a projection's float32 tensor: the largest array is a
    chunk or a quantised projection's 1-byte codes (both graphs' forms written at its first read)."""
    from builder.graphs import write_graphs
    from builder.network import CheckpointSource, NetSpec
    from builder.plan import pool_rows
    from builder.qlinear import BundleWeights

    cfg = checkpoint.load_config(tiny)
    tensors = checkpoint.CheckpointTensors(tiny)
    ranks = tensors.ranks(cfg)
    quant = checkpoint.load_quant(tiny)
    names = quantised_names(cfg)
    spec = NetSpec(cfg, ranks, 64, quantised=frozenset(names))
    tmp_path.joinpath("g").mkdir()
    from builder.calib import quant_tables

    qt = quant_tables(cfg, ranks, tensors, tiny, None).tables
    info = write_graphs(tmp_path / "g", spec, CheckpointSource(tensors, chunk_bytes=4096), qt,
                        pool_rows(64, 16, cfg, quant),
                        weights=BundleWeights(dict.fromkeys(names, WeightQuantConfig(4, 32))))
    shapes = [tensors.shape(n) for n in names]
    gate_up = (2 * cfg.intermediate_size, cfg.hidden_size)  # gate and up quantised as one node
    codes = max(n * -(-k // 32) * 32 for n, k in [*shapes, gate_up])  # one byte per weight, K padded to the group
    assert info.largest_tensor_bytes <= max(4096, codes)
    assert info.largest_tensor_bytes < max(4 * n * k for n, k in shapes)


def _tiny_profile(monkeypatch, usable: int):
    """A fake device whose usable memory lies between the tiny model's INT4/INT8 and FP16 plans."""
    import dataclasses

    import builder.build as bb
    from jetson.profiles import PROFILES

    fake = dataclasses.replace(PROFILES["orin-nano-8"], name="tiny-dev", reserve_bytes=0, memory_bytes=usable)
    monkeypatch.setitem(PROFILES, "tiny-dev", fake)
    monkeypatch.setattr(bb, "resolve_device", lambda name: fake)


def _plan_totals(ckpt) -> dict[str, int]:
    from builder.plan import PlanRequest, make_plan
    from jetson.profiles import PROFILES

    cfg = checkpoint.load_config(ckpt)
    ranks = checkpoint.CheckpointTensors(ckpt).ranks(cfg)
    return {w: make_plan(cfg, ranks, checkpoint.load_quant(ckpt), PROFILES["orin-nano-8"],
                         PlanRequest(max_seq=N_MAX, weights=w)).total_bytes
            for w in ("fp16", "int8", "int4")}


def test_refusal_names_the_weights_that_fit_and_auto_picks_it(tiny, tmp_path, monkeypatch):
    tot = _plan_totals(tiny)
    assert tot["fp16"] > tot["int8"] > tot["int4"]
    _tiny_profile(monkeypatch, (tot["fp16"] + tot["int8"]) // 2)  # int8 fits, fp16 does not
    with pytest.raises(BuildError) as e:
        build(BuildConfig(device="tiny-dev", checkpoint=tiny, output=tmp_path / "no", max_seq=N_MAX))
    assert "With --weights int8 it fits" in str(e.value)
    assert not (tmp_path / "no").exists()
    r = build(BuildConfig(device="tiny-dev", checkpoint=tiny, output=tmp_path / "auto", max_seq=N_MAX, weights="auto"))
    w = r.report["weights"]
    assert (w["requested"], w["format"]) == ("auto", "int8")
    assert "int8 is the highest precision" in w["why"] and "fp16 did not fit" in w["why"]
    _tiny_profile(monkeypatch, (tot["int8"] + tot["int4"]) // 2)
    r = build(BuildConfig(device="tiny-dev", checkpoint=tiny, output=tmp_path / "auto4", max_seq=N_MAX, weights="auto"))
    assert r.report["weights"]["format"] == "int4"
    assert r.report["weights"]["int4_grid"] == "sym"  # random weights are not on a 4-bit grid


@pytest.mark.parametrize("args,needle", [
    (["--weights", "int3"], "invalid choice: 'int3'"),
    (["--weights", "int4", "--group-size", "100"], "--group-size must be a power of two"),
    (["--weights", "int4", "--group-size", "8"], "--group-size"),
    (["--int4-grid", "asym"], "invalid choice: 'asym'"),
    (["--head-weights", "int2"], "invalid choice: 'int2'"),
    (["--weights", "int4", "--group-size", "channel"], "--group-size channel (one group per output row) is for "
     "--weights int8 only"),
    (["--weights", "int8", "--group-size", "chan"], "--group-size"),
])
def test_cli_flag_errors(tmp_path, args, needle):
    r = run_module("builder", "build", "--device", "orin", "--output", str(tmp_path / "b"), *args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "error" in ln]) == 1
    assert not (tmp_path / "b").exists()


def test_cli_int4_build_report(tmp_path):
    r = run_module("builder", "build", "--device", "orin", "--output", str(tmp_path / "b"), "--max-seq", "64",
                   "--weights", "int4", "--group-size", "32", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    w = rep["weights"]
    assert (w["format"], w["group_size"], w["int4_grid"]) == ("int4", 32, "sym")
    assert "not on a 4-bit group-32 grid" in w["grid_note"]
    assert rep["engine_weight_bytes"] == w["bytes"] and 0.2 < w["ratio_vs_fp16"] < 0.7
    assert w["matmul_accuracy"] == "fast"  # quantised weights default to INT8 activations (docs/weights.md)


def test_int8_defaults_to_fast_matmuls(tiny, tmp_path):
    """ONNX Runtime's exact INT8 MatMulNBits is slower than FP32 (docs/weights.md), so INT8 builds use
    accuracy_level 4 unless --matmul-accuracy exact, at group 32 unless --group-size."""
    import onnx

    r = build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "b", max_seq=64, weights="int8"))
    w = r.report["weights"]
    assert (w["matmul_accuracy"], w["group_size"]) == ("fast", 32)  # g32 fast: +0.06 % on SmolLM2, docs/weights.md
    assert "per output channel" in w["tensorrt_note"]  # TensorRT documents blocked DQ for INT4 only
    m = onnx.load(tmp_path / "b" / "model.portable.onnx", load_external_data=False)
    levels = {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    assert levels == {4}


@pytest.fixture(scope="module")
def q4_1_checkpoint(tmp_path_factory):
    """The tiny synthetic model (FFN width 192, so every projection's K is a multiple of 32) with its
    projections snapped to llama.cpp's Q4_1 grid by hand: per 32 inputs, d = (max - min)/15 and m = min
    in FP16, w = q d + m with q = round((w - m)/d) in 0..15."""
    import dataclasses

    from gsm.synth import PRESETS

    root = tmp_path_factory.mktemp("q41")
    mp = pytest.MonkeyPatch()
    mp.setitem(PRESETS, "tiny192", dataclasses.replace(PRESETS["tiny"], intermediate_size=192))
    try:
        base = synth_checkpoint("tiny192", root / "base", seed=9)
    finally:
        mp.undo()
    cfg = checkpoint.load_config(base)
    sd = {k: np.asarray(v, np.float32) for k, v in checkpoint.load_state_dict(base).items()}
    for name in quantised_names(cfg):
        w = sd[name]
        b = w.reshape(-1, 32).astype(np.float64)
        m = b.min(axis=1, keepdims=True).astype(np.float16).astype(np.float64)
        d = ((b.max(axis=1, keepdims=True) - m) / 15).astype(np.float16).astype(np.float64)
        q = np.clip(np.rint((b - m) / d), 0, 15)
        sd[name] = (q * d + m).astype(np.float32).reshape(w.shape)
    tok = (base / "tokenizer.json").read_text()
    return checkpoint.write_checkpoint_arrays(root / "q41", cfg, checkpoint.load_quant(base), sd,
                                              files=checkpoint.CheckpointFiles(tokenizer_json=tok), progress=False)


def test_q4_1_source_int4_bundle_equals_the_unquantised_golden(q4_1_checkpoint, tmp_path):
    """`--weights int4` detects the Q4_1 grid (asym-f, group 32) and loses nothing: the bundle matches the
    golden on the checkpoint's own weights; symmetric INT4 does not."""
    r = build(BuildConfig(device="orin", checkpoint=q4_1_checkpoint, output=tmp_path / "b", max_seq=N_MAX,
                          weights="int4", head_weights="fp16", gsm_weights="fp16",
                          matmul_accuracy="exact"))  # float32 activations, as the golden
    w = r.report["weights"]
    assert (w["int4_grid"], w["group_size"]) == ("asym-f", 32) and "Q4_1" in w["grid_note"]
    prompt = np.random.default_rng(4).integers(3, 259, PROMPT_LEN).tolist()
    golden = golden_with(q4_1_checkpoint, None)
    worst, gt, rt = run_both(tmp_path / "b", golden, prompt)
    assert gt == rt and worst <= 1, (worst, gt, rt)
    build(BuildConfig(device="orin", checkpoint=q4_1_checkpoint, output=tmp_path / "s", max_seq=N_MAX, weights="int4",
                      int4_grid="sym", head_weights="fp16", gsm_weights="fp16", matmul_accuracy="exact"))
    worst_sym, _, _ = run_both(tmp_path / "s", golden, prompt[:8])
    assert worst_sym > 10


def test_q4_1_source_fast_cpu_graph_runs_gsm_quant_matmul(q4_1_checkpoint, tmp_path):
    """A `fast` INT4 build of a Q4_1 source: model.cpu.onnx runs each 4-bit projection as one GsmQuantMatMul (offset
    term, residual, SwiGLU and next norm inside) over tiles holding the checkpoint's weights exactly; the portable graph
    keeps MatMulNBits + the offset Gemm. Both quantise activations to INT8 per block of 32, so each follows the
    golden, and the other, to that error, not to the float32 tolerance."""
    import onnx

    import runtime
    from builder.qlinear import TILE_ROWS

    b = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=q4_1_checkpoint, output=b, max_seq=N_MAX, weights="int4",
                      head_weights="fp16", gsm_weights="fp16"))
    cpu = onnx.load(b / "model.cpu.onnx")
    ops = [n.op_type for n in cpu.graph.node]
    assert ops.count("GsmQuantMatMul") == 4 * 4 and "GsmGroupOffset" not in ops and "MatMulNBits" not in ops
    assert "Sigmoid" not in ops and ops.count("Sqrt") == 2  # SwiGLU and the folded norms inside the node
    portable = [n.op_type for n in onnx.load(b / "model.portable.onnx", load_external_data=False).graph.node]
    assert portable.count("MatMulNBits") == 4 * 4 and "GsmQuantMatMul" not in portable
    # the tiles of layer 1's down_proj unpacked by hand: scale * (u - 8) + offset is the checkpoint's Q4_1 weight
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in cpu.graph.initializer if ".qt." in i.name}
    prefix = "model.layers.1.mlp.down_proj.weight.nbits.qt"
    codes, scales, offsets = (inits[f"{prefix}.{k}"].astype(np.float32) for k in ("codes", "scales", "offsets"))
    nt, g = scales.shape[:2]
    by = codes.reshape(nt, g, 4, TILE_ROWS, 4).astype(np.int64)  # t, b, p, r, j
    u = np.stack([by & 15, by >> 4], axis=3)  # t, b, p, half, r, j
    u = u.transpose(0, 4, 1, 2, 3, 5).reshape(nt * TILE_ROWS, g * 32)
    w = (u - 8) * np.repeat(scales.transpose(0, 2, 1).reshape(-1, g), 32, 1) + np.repeat(
        offsets.transpose(0, 2, 1).reshape(-1, g), 32, 1)
    want = np.asarray(checkpoint.load_state_dict(q4_1_checkpoint)["model.layers.1.mlp.down_proj.weight"], np.float32)
    assert np.allclose(w[:want.shape[0], :want.shape[1]], want, rtol=1e-6, atol=1e-7)
    prompt = np.random.default_rng(4).integers(3, 259, PROMPT_LEN).tolist()
    golden = golden_with(q4_1_checkpoint, None)
    with torch.no_grad():
        g_logits = golden.prefill(golden.new_cache(), prompt).logits[-1].numpy()
    got = {graph: runtime.load(b, backend="onnxruntime", threads=1, graph=graph).new_sequence().prefill(prompt)
           for graph in ("cpu", "portable")}
    scale = np.abs(g_logits).max()
    for graph, logits in got.items():  # 0.36 % for both on this draw
        assert np.abs(logits - g_logits).max() <= 0.01 * scale, graph
    # the same activation rounding as MLAS's: the two graphs agree to float32 reassociation (7e-8 on this draw),
    # where the same tiles taken uncentred (scale * u + min) were 2.3x as far from the golden
    assert np.abs(got["cpu"] - got["portable"]).max() <= 1e-4 * scale


def _awq_file(path, scales: dict, group: int):
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in scales.items()}, str(path),
              metadata={"format": "gsm-edge-awq-scales", "group_size": str(group), "bits": "4"})
    return path


def test_awq_scales_bundle_matches_golden(tiny_fp16, tmp_path):
    """--awq-scales: the bundle computes x/s @ Q(W diag(s))^T; the golden holds Q(W diag(s)) diag(1/s).

    The two orders round differently by design (float32, ~1e-7 relative), and a latent that lands on the other
    side of a rounding boundary is deployed one step apart in the cache: one INT8/INT12 step moves later logits by
    up to 5x the tolerance (the re-tiering copy, some scale draws), one FP16 step by 0.15x at most. So this test,
    whose subject is the weights, runs on FP16 rows; the tiers' agreement is the other tests' subject. The scales
    are drawn in sorted name order (a set's order changes with PYTHONHASHSEED, and the test with it)."""
    tiny = tiny_fp16
    cfg = checkpoint.load_config(tiny)
    sd = dict(checkpoint.load_state_dict(tiny))
    rng = np.random.default_rng(8)
    scales = {n: rng.uniform(0.25, 4.0, np.asarray(sd[n]).shape[1]) for n in sorted(quantised_names(cfg))}
    f = _awq_file(tmp_path / "awq.safetensors", scales, 32)
    r = build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                          group_size=32, int4_grid="sym", awq_scales=f, head_weights="fp16", gsm_weights="fp16",
                          matmul_accuracy="exact"))
    assert r.report["weights"]["awq"]["projections"] == 20
    wcfg = WeightQuantConfig(4, 32)
    for n, s in scales.items():
        s32 = s.astype(np.float32)
        sd[n] = dequantize(quantize(np.asarray(sd[n], np.float32) * s32[None, :], wcfg)) / s32[None, :]
    golden = GoldenModel(GoldenWeights.from_tensors(cfg, sd), mode="deployed", quant=checkpoint.load_quant(tiny))
    prompt = np.random.default_rng(9).integers(3, 259, PROMPT_LEN).tolist()
    worst, gt, rt = run_both(tmp_path / "b", golden, prompt)
    assert gt == rt and worst <= 1, (worst, gt, rt)
    # refusals: wrong group, a missing projection, another grid
    for bad, kw, needle in ((f, {"group_size": 64}, "searched for group 32"),
                            (_awq_file(tmp_path / "m.safetensors", dict(list(scales.items())[1:]), 32),
                             {"group_size": 32}, "no scale for"),
                            (f, {"group_size": 32, "int4_grid": "asym-f"}, "--int4-grid sym")):
        with pytest.raises(BuildError, match=needle):
            build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "x", max_seq=N_MAX, weights="int4",
                              awq_scales=bad, **{"int4_grid": "sym", **kw}))
        assert not (tmp_path / "x").exists()


def test_awq_cli_scales_build(tiny, tmp_path):
    """`python -m calibration.awq` on the tiny checkpoint writes scales `builder build` accepts; the search
    never does worse than RTN on its own sample (alpha 0 is RTN)."""
    from conftest import CALIB_TEXT

    if not CALIB_TEXT.is_file():
        pytest.skip("real data not found (../shared/data)")
    out = tmp_path / "awq.safetensors"
    r = run_module("calibration.awq", "--checkpoint", str(tiny), "--data", str(CALIB_TEXT), "--out", str(out),
                   "--samples", "3", "--seq-len", "96", "--group-size", "32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "20 projections" in r.stdout
    errs = [float(ln.split("error ")[1].split("x")[0]) for ln in r.stderr.splitlines() if "x RTN" in ln]
    assert len(errs) == 4 * 4 and max(errs) <= 1.0
    b = build(BuildConfig(device="orin", checkpoint=tiny, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                          group_size=32, int4_grid="sym", awq_scales=out))
    assert b.report["weights"]["awq"]["alpha_mean"] is not None
    r = run_module("calibration.awq", "--checkpoint", str(tiny), "--data", str(CALIB_TEXT), "--out", str(out),
                   cwd=tmp_path)
    assert r.returncode == 2 and "already exists" in r.stderr


@pytest.mark.parametrize("bits,k", [(4, 64), (4, 70), (8, 70)])
def test_quantised_gather_rows_equal_the_dequantised_weight(bits, k):
    """The portable embedding lookup (GatherBlockQuantized over the MatMulNBits initializer, K padded to the
    group when it must be) returns exactly wquant.dequantize's rows, the values the golden is loaded with; and
    the head's MatMulNBits reads the same initializer."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from builder.qlinear import MS_DOMAIN, QLayout, nbits_gather_nodes, nbits_inits, nbits_nodes

    rng = np.random.default_rng(bits + k)
    w = rng.standard_normal((50, k)).astype(np.float32)
    q = quantize(w, WeightQuantConfig(bits, 32))
    lay = QLayout.of(q)
    inits = [i.proto() for i in nbits_inits("E", q)]
    nodes = nbits_gather_nodes("ids", "rows", "E", lay) + nbits_nodes("x", "logits", "E", lay)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
                                       helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 7, 49], [3, 3, 12]])
    x = rng.standard_normal((1, k)).astype(np.float32)
    rows, logits = s.run(None, {"ids": ids, "x": x})
    deq = dequantize(q)
    assert rows.shape == (6, k) and np.array_equal(rows, deq[ids.reshape(-1)])
    assert np.abs(logits - x @ deq.T).max() <= 1e-5 * np.abs(x @ deq.T).max()
    assert {n.input[0] for n in nodes if n.op_type == "GatherBlockQuantized"} == {
        n.input[1] for n in nodes if n.op_type == "MatMulNBits"}


def _q4_1_like(rng, n: int, k: int, group: int = 32) -> np.ndarray:
    """W [N, K] on a Q4_1-like grid (w = q d + m, float16 d and m, code 0 and 15 in every group, the last one
    cut to K): its float zero point's offsets m + 8 d are float16 values (stored so by the portable form)."""
    nb = -(-k // group)
    q = rng.integers(0, 16, (n, nb, group))
    q[..., 0], q[..., 1] = 0, 15
    d = (rng.random((n, nb, 1)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(7.0, 9.0, (n, nb, 1))).astype(np.float16).astype(np.float32)
    return (q * d + m).astype(np.float32).reshape(n, nb * group)[:, :k]


@pytest.mark.parametrize("offsets", ["float16", "float32"])
@pytest.mark.parametrize("k", [64, 70])
def test_quantised_gather_rows_float_zero_point(k, offsets):
    """asym-f (float zero point) embedding lookup: the portable gather (GatherBlockQuantized's symmetric part plus
    the gathered offsets, through ONNX Runtime) and the TensorRT form (Gather on the DequantizeLinear output plus
    the gathered offsets, onnx's reference evaluator) equal (codes - 8) * scale + (min + 8 scale) per group,
    computed here in float64 from the quantised codes, scales and mins, within float32 rounding (1e-6 of the
    largest weight: two float32 roundings, 2^-24 each, of terms within 16/15 of it; a Q4_1 source's rows are
    exact). The offsets are float16 exactly for a Q4_1-like source, float32 for a random one. The tied head in
    the same graph reads the same initializers (every name unique: the checker and ONNX Runtime refuse the model
    otherwise)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from builder.qlinear import (
        MS_DOMAIN,
        QLayout,
        dq_gather_nodes,
        dq_inits,
        dq_nodes,
        group_indicator,
        nbits_gather_nodes,
        nbits_inits,
        nbits_nodes,
    )

    n = 50
    rng = np.random.default_rng(k + len(offsets))
    w = _q4_1_like(rng, n, k) if offsets == "float16" else rng.standard_normal((n, k)).astype(np.float32) + 0.05
    q = quantize(w, WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True))
    lay = QLayout.of(q)
    assert lay.offsets and lay.offsets_f16 == (offsets == "float16")
    nb = -(-k // 32)
    u = q.codes.reshape(n, nb, 32).astype(np.float64)
    s, lo = q.scales.astype(np.float64)[..., None], q.mins.astype(np.float64)[..., None]
    want_w = ((u - 8) * s + (lo + 8 * s)).reshape(n, nb * 32)[:, :k]
    if offsets == "float16":
        assert np.abs(want_w - w).max() <= 1e-6 * np.abs(w).max()  # the source's own values
    ids = np.array([[0, 7, 49], [3, 3, 12]])
    want = want_w[ids.reshape(-1)]
    tol = 1e-6 * np.abs(want_w).max()
    x = rng.standard_normal((1, k)).astype(np.float32)
    groups = helper.make_tensor("groups", TensorProto.FLOAT, [k, nb], group_indicator(k, 32).reshape(-1))

    def graph(nodes, inits, rows_type=TensorProto.FLOAT):
        return helper.make_graph(
            [helper.make_node("MatMul", ["x", "groups"], ["sums"], name="group_sums"), *nodes], "g",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
             helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
            [helper.make_tensor_value_info("rows", rows_type, [6, k])] + (
                [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, n])] if rows_type == TensorProto.FLOAT
                else []), [groups, *inits])

    # portable: ONNX Runtime
    nodes = nbits_gather_nodes("ids", "rows", "E", lay) + nbits_nodes("x", "logits", "E", lay, group_sums="sums")
    inits = [i.proto() for i in nbits_inits("E", q)]
    assert {i.name: i.data_type for i in inits}["E.offsets"] == (
        TensorProto.FLOAT16 if offsets == "float16" else TensorProto.FLOAT)
    m = helper.make_model(graph(nodes, inits), opset_imports=[helper.make_opsetid("", 17),
                                                              helper.make_opsetid(MS_DOMAIN, 1)])
    onnx.checker.check_model(m)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rows, logits = sess.run(None, {"ids": ids, "x": x})
    assert rows.shape == (6, k) and rows.dtype == np.float32
    assert np.abs(rows - want).max() <= tol
    assert np.abs(logits - x @ want_w.T).max() <= 1e-5 * np.abs(x @ want_w.T).max()
    assert {nd.input[0] for nd in nodes if nd.op_type == "Gather"} == {"E.offsets"}

    if offsets == "float16":  # every term and sum a float32 value: nothing rounded
        assert np.array_equal(rows, want)
    portable = rows

    # TensorRT form: onnx's reference evaluator
    lay_t = QLayout.of(q, "tensorrt")
    nodes = dq_gather_nodes("ids", "rows", "E", lay_t) + dq_nodes("x", "logits", "E", lay_t, with_dq=False,
                                                                   group_sums="sums")
    assert [nd.op_type for nd in nodes].count("DequantizeLinear") == 1
    m = helper.make_model(graph(nodes, [i.proto() for i in dq_inits("E", q, "float32")]),
                          opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(m)
    rows, logits = ReferenceEvaluator(m).run(None, {"ids": ids, "x": x})
    assert rows.shape == (6, k) and rows.dtype == np.float32
    assert np.abs(rows - want).max() <= tol and np.array_equal(rows, portable)
    assert np.abs(logits - x @ want_w.T).max() <= 1e-5 * np.abs(x @ want_w.T).max()
    # float16 activations (the TensorRT graph's): offsets and rows in float16, within three float16 roundings
    g = graph(dq_gather_nodes("ids", "rows", "E", lay_t), [i.proto() for i in dq_inits("E", q, "float16")],
              TensorProto.FLOAT16)
    rows = ReferenceEvaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])).run(
        None, {"ids": ids, "x": x})[0]
    assert rows.dtype == np.float16 and np.abs(rows - want).max() <= 2e-3 * np.abs(want_w).max()

def test_gsm_side_int8_bytes_by_hand():
    """--gsm-weights int8 (the default with quantised --weights): each owning layer's latent and indexer
    projections at one byte per weight plus one FP16 scale per output row, instead of two bytes per weight."""
    from builder.plan import gsm_choice, weight_bytes
    from gsm import names
    from gsm.synth import PRESETS, preset_config, preset_ranks

    p = PRESETS["tiny"]
    cfg = preset_config(p)
    ranks = preset_ranks(p, cfg)
    shapes = names.expected_shapes(cfg, ranks)
    side = sorted(gsm_side_names(cfg))
    assert len(side) == 5 * len(cfg.owning_layers)
    saved = sum(2 * shapes[n][0] * shapes[n][1] - (shapes[n][0] * shapes[n][1] + 2 * shapes[n][0]) for n in side)
    assert weight_bytes(cfg, ranks, weights="int4", gsm_weights="fp16") - weight_bytes(cfg, ranks, weights="int4") \
        == saved
    assert weight_bytes(cfg, ranks, weights="fp16", gsm_weights="int8") == weight_bytes(cfg, ranks) - saved
    assert (gsm_choice("int4", None), gsm_choice("int8", None), gsm_choice("fp16", None)) == ("int8", "int8", "fp16")
    with pytest.raises(Exception, match="--gsm-weights must be one of fp16, int8"):
        gsm_choice("int4", "int4")


def test_gsm_side_int8_forms_follow_the_matmul_accuracy(tiny, tmp_path):
    """The TensorRT graph always takes the INT8 GSM side per channel with float activations (DequantizeLinear +
    MatMul); the ONNX Runtime graphs per channel with float activations in an exact build (the golden's weights),
    per group of 32 inputs with INT8 activations in a fast one (MatMulNBits quantises the activations in blocks of
    the weight group: per channel the block is the whole row, +0.50 % perplexity on SmolLM2 where group 32 gives
    -0.01 %, docs/weights.md). The fast form's weights are exactly the group-32 INT8 of the checkpoint's rows."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from builder.network import GSM_SIDE
    from gsm.names import layer_name

    cfg = checkpoint.load_config(tiny)
    sd = checkpoint.load_state_dict(tiny)
    H = cfg.hidden_size
    for acc, block, level in (("fast", 32, 4), ("exact", None, 0)):
        b = tmp_path / acc
        r = build(BuildConfig(device="orin", checkpoint=tiny, output=b, max_seq=N_MAX, weights="int4",
                              matmul_accuracy=acc))
        assert (r.report["weights"]["gsm_weights"], r.report["weights"]["gsm_group_size"]) == ("int8", block)
        for f in ("model.portable.onnx", "model.cpu.onnx"):
            g = onnx.load(b / f, load_external_data=False).graph
            # a fast build's CPU graph runs it as GsmQuantMatMul over its tiles (8 bits, the same group), with the
            # INT8 activations of MatMulNBits' level 4 (tests/test_ort_quant_matmul.py)
            op = "GsmQuantMatMul" if (acc, f) == ("fast", "model.cpu.onnx") else "MatMulNBits"
            nbits = [n for n in g.node if n.op_type == op and ".in_proj." in n.input[1]]
            assert len(nbits) == len(cfg.owning_layers), (acc, f)
            attrs = {a.name: a.i for n in nbits for a in n.attribute if a.name in ("block_size", "accuracy_level",
                                                                                  "bits")}
            if op == "GsmQuantMatMul":
                assert attrs["bits"] == 8 and attrs["block_size"] == block
                continue
            assert attrs.get("accuracy_level", 0) == level
            if block is not None:
                assert attrs["block_size"] == block
            else:  # per channel: one block over the whole (padded) row
                assert attrs["block_size"] >= H
        trt = onnx.load(b / "model.onnx", load_external_data=False).graph
        dqs = [n for n in trt.node if n.op_type == "DequantizeLinear" and ".in_proj." in n.input[0]]
        assert len(dqs) == len(cfg.owning_layers)
        assert all(a.name != "block_size" for n in dqs for a in n.attribute)  # per channel
    # the fast form's dequantised weights: its node at accuracy 0 on the identity gives W^T exactly
    m = onnx.load(tmp_path / "fast" / "model.portable.onnx")
    layer = cfg.owning_layers[0]
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and f"layers.{layer}.in_proj" in n.input[1])
    keep = {a.name: a.i for a in node.attribute if a.name != "accuracy_level"}
    inits = [i for i in m.graph.initializer if i.name in node.input[1:]]
    sub = helper.make_graph([helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft",
                                              **keep)], "w", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                            [H, H])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    sess = ort.InferenceSession(helper.make_model(sub, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(
        "com.microsoft", 1)]).SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": np.eye(H, dtype=np.float32)})[0].T
    rows = np.concatenate([np.asarray(sd[layer_name(k, layer)], np.float32) for k in GSM_SIDE])
    want = dequantize(quantize(rows, WeightQuantConfig(8, 32)))
    assert got.shape == want.shape and np.array_equal(got, want)
    assert not np.array_equal(want, dequantize(quantize(rows, GSM_SIDE_CONFIG)))  # not the per-channel grid


def test_cpu_graph_weights_are_read_into_memory_the_session_uses(q4_1_checkpoint, tmp_path, monkeypatch):
    """model.cpu.weights.json names every initializer the custom ops read, where weights.bin holds it (against onnx's
    own external-data loader); the backend reads them into arrays of its own, and the session computes with those very
    arrays (changing one changes the logits), giving the logits of ONNX Runtime's own file mappings bit for bit."""
    import onnx

    import runtime
    from builder.graph_cpu import CPU_DOMAIN
    from gsm.bundle_format import FILES, CpuWeightTable
    from runtime.ort_backend import OrtBackend, read_weight_spans

    b = tmp_path / "b"
    build(BuildConfig(device="orin", checkpoint=q4_1_checkpoint, output=b, max_seq=N_MAX, weights="int4",
                      head_weights="fp16", gsm_weights="fp16"))
    table = CpuWeightTable.from_json(json.loads((b / FILES.cpu_weights).read_text()), "test")
    cpu = onnx.load(b / FILES.model_cpu)
    read = {i for n in cpu.graph.node if n.domain == CPU_DOMAIN for i in n.input}
    # every weights.bin tensor they read (inline constants, e.g. GsmSideSplit's key-type template, are in the graph)
    external = {t.name for t in onnx.load(b / FILES.model_cpu, load_external_data=False).graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in cpu.graph.initializer if t.name in read & external}
    assert {w.name for w in table.spans} == set(inits) and any(".qt.codes" in n for n in inits)
    arrays = read_weight_spans(b / FILES.weights, table)
    for name, want in inits.items():
        assert arrays[name].dtype == want.dtype and np.array_equal(arrays[name], want), name
    assert all(a.ctypes.data % 64 == 0 for a in arrays.values())

    prompt = np.random.default_rng(5).integers(3, 259, PROMPT_LEN).tolist()
    rt = runtime.load(b, backend="onnxruntime", threads=1, graph="cpu")
    ours = rt.new_sequence().prefill(prompt)
    held = rt.backend._weight_arrays
    assert set(held) == set(inits)
    with monkeypatch.context() as m:
        m.setattr(OrtBackend, "cpu_weights", lambda self: {})  # ONNX Runtime's file mappings
        mapped = runtime.load(b, backend="onnxruntime", threads=1, graph="cpu").new_sequence().prefill(prompt)
    assert np.array_equal(ours, mapped)
    held["model.layers.0.mlp.down_proj.weight.nbits.qt.scales"][...] = 0  # the session reads these very bytes
    assert not np.array_equal(rt.new_sequence().prefill(prompt), ours)


def test_tied_head_tiles_serve_the_cpu_graphs_embedding(tied, tmp_path):
    """A fast build of a tied model: model.cpu.onnx looks the embedding up in the LM head's own tiles (one
    GsmTileGather over the codes the head's GsmQuantMatMul reads; no GatherBlockQuantized over the plain codes, which
    the process would hold as a second copy), and its logits follow the portable graph's, within what the fast
    matmuls' summation order moves them (the op's rows themselves: bit for bit, tests/test_ort_quant_matmul.py)."""
    import onnx

    import runtime
    from builder.graph_cpu import GATHER_OP, QUANT_OP

    build(BuildConfig(device="orin", checkpoint=tied, output=tmp_path / "b", max_seq=N_MAX, weights="int4",
                      group_size=32, head_weights="int4", matmul_accuracy="fast"))
    cpu = onnx.load(tmp_path / "b" / "model.cpu.onnx", load_external_data=False).graph
    gathers = [n for n in cpu.node if n.op_type == GATHER_OP]
    heads = [n for n in cpu.node if n.op_type == QUANT_OP and n.input[1].startswith("model.embed_tokens")]
    assert len(gathers) == 1 and len(heads) == 1 and gathers[0].input[1:4] == heads[0].input[1:4]
    assert not [n for n in cpu.node if n.op_type == "GatherBlockQuantized"]
    prompt = np.random.default_rng(7).integers(3, 1000, 12).tolist()
    a = runtime.load(tmp_path / "b", backend="onnxruntime", threads=1, graph="cpu").new_sequence().prefill(prompt)
    b = runtime.load(tmp_path / "b", backend="onnxruntime", threads=1, graph="portable").new_sequence().prefill(prompt)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max() and int(np.argmax(a)) == int(np.argmax(b))
