"""Weight-only INT8/INT4 quantisation (builder/wquant.py), its ONNX forms (builder/qlinear.py), AWQ
(calibration/awq.py) and the plan's quantised weight bytes (builder/plan.py).

References are independent of the code under test: hand-computed codes and bit layouts, numpy
float64 products of the dequantised weights, ONNX Runtime's MatMulNBits kernel and onnx's
reference evaluator, the fp32 layer output on real SmolLM2 activations.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from builder.qlinear import dq_matmul, matmul_nbits, standalone_model
from builder.wquant import (
    WeightQuantConfig,
    WeightQuantError,
    dequantize,
    pack_matmul_nbits,
    quantize,
    quantized_bytes,
    unpack_low_first,
)

ort = pytest.importorskip("onnxruntime")

CASES = [  # bits, group (None = per channel), symmetric, K
    (4, 32, True, 96), (4, 32, True, 100), (4, 64, True, 200), (4, 128, True, 576), (4, 128, True, 300),
    (4, 32, False, 100), (4, 128, False, 576), (8, None, True, 576), (8, None, True, 70), (8, 32, True, 100),
    (8, 64, False, 130), (8, 128, True, 576), (8, 32, True, 576), (8, 128, True, 1536), (8, 16, True, 70),
]


def _w(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[:, rng.integers(0, k, 3)] *= 20  # a few outlier input channels, as real layers have
    return w


# -- quantise / dequantise ---------------------------------------------------------------------------
def test_hand_computed_int4_symmetric_group():
    w = np.array([[0.7, -0.35, 0.1, 0.0] * 4], np.float32)  # one row, one group of 16
    q = quantize(w, WeightQuantConfig(4, 16, scale_dtype="float32"))
    assert q.scales[0, 0] == pytest.approx(0.1)  # absmax 0.7 / 7
    # signed codes rint(w / 0.1): 7, -4 (-3.5 rounds half to even), 1, 0
    np.testing.assert_array_equal(q.signed_codes()[0, :4], [7, -4, 1, 0])
    np.testing.assert_array_equal(q.codes[0, :4], [15, 4, 9, 8])
    np.testing.assert_allclose(dequantize(q)[0, :4], [0.7, -0.4, 0.1, 0.0], rtol=1e-6)


def test_hand_computed_int4_asymmetric_group():
    w = np.array([np.linspace(-0.5, 1.0, 16)], np.float32)
    q = quantize(w, WeightQuantConfig(4, 16, symmetric=False, scale_dtype="float32"))
    assert q.scales[0, 0] == pytest.approx(0.1)  # (1.0 - -0.5) / 15
    assert q.zero_points[0, 0] == 5  # round(0.5 / 0.1)
    assert q.codes[0, 0] == 0 and q.codes[0, -1] == 15


@pytest.mark.parametrize("bits,group,sym,k", CASES)
def test_round_trip_error_bound(bits, group, sym, k):
    """|w - deq| <= scale / 2 for symmetric groups (the clip never bites); asymmetric <= scale (the
    rounded integer zero point can push a group's end one code past the range); padding is zero."""
    w = _w(40, k)
    cfg = WeightQuantConfig(bits, group, sym)
    q = quantize(w, cfg)
    d = dequantize(q)
    assert d.shape == w.shape
    block = q.block
    per_col_scale = np.repeat(q.scales, block, axis=1)[:, :k]
    err = np.abs(d - w)
    assert (err <= per_col_scale * ((0.5 if sym else 1.0) + 1e-5)).all()
    # relative RMS error: the size of a uniform rounding error of scale / sqrt(12)
    assert np.sqrt((err**2).mean()) <= np.sqrt((per_col_scale**2).mean() / 12) * 1.3
    pad = q.codes[:, k:].astype(int) - np.repeat(q.zero_points, block, axis=1)[:, k:]
    assert (pad == 0).all()
    # scales are float16 values (the TensorRT graph stores them so)
    np.testing.assert_array_equal(q.scales, q.scales.astype(np.float16).astype(np.float32))
    # re-quantising the dequantised weight is a fixed point for symmetric (same scales, same codes)
    if sym:
        np.testing.assert_array_equal(quantize(d, cfg).codes, q.codes)


def test_int8_groups_by_hand():
    """Two INT8 groups of 16 with absmax 1.27 and 0.0127: each gets its own scale (0.01 / 0.0001 before
    FP16 rounding), so the small group keeps 127 levels instead of rounding to 0 under one per-row scale."""
    w = np.concatenate([np.linspace(-1.27, 1.27, 16), np.linspace(-0.0127, 0.0127, 16)])[None].astype(np.float32)
    q = quantize(w, WeightQuantConfig(8, 16))
    np.testing.assert_array_equal(q.scales, np.float16([[0.01, 0.0001]]).astype(np.float32))
    assert q.codes[0, 0] == 128 - 127 and q.codes[0, 15] == 128 + 127  # signed -127 / 127 around zp 128
    assert q.codes[0, 16] == 1 and q.codes[0, 31] == 255
    per_row = dequantize(quantize(w, WeightQuantConfig(8, None)))
    grouped = dequantize(q)
    assert np.abs(grouped - w)[0, 16:].max() <= q.scales[0, 1] / 2  # half a step of the small group's scale
    assert np.abs(per_row - w)[0, 16:].max() > 20 * q.scales[0, 1]  # the per-row step is 100x coarser


def test_int8_much_closer_than_int4():
    w = _w(64, 256)
    e8 = np.abs(dequantize(quantize(w, WeightQuantConfig(8, None))) - w).mean()
    e4 = np.abs(dequantize(quantize(w, WeightQuantConfig(4, 32))) - w).mean()
    assert e8 * 4 < e4


def test_zero_group_and_bad_input():
    w = np.zeros((2, 32), np.float32)
    np.testing.assert_array_equal(dequantize(quantize(w, WeightQuantConfig(4, 32))), w)
    with pytest.raises(WeightQuantError, match="power of two"):
        WeightQuantConfig(4, 48)
    with pytest.raises(WeightQuantError, match="bits"):
        WeightQuantConfig(3, 32)
    with pytest.raises(WeightQuantError, match="q_proj: holds non-finite"):
        quantize(np.array([[np.nan] * 16], np.float32), WeightQuantConfig(), name="q_proj")


# -- packed layout -----------------------------------------------------------------------------------
def test_matmul_nbits_layout_by_hand():
    """Codes 0..15 then 15..0 in one 32-wide block: byte j = code[2j] | code[2j+1] << 4."""
    q = quantize(np.zeros((1, 32), np.float32), WeightQuantConfig(4, 32, symmetric=False))
    codes = np.array([list(range(16)) + list(range(15, -1, -1))], np.uint8)
    q = type(q)(codes, np.ones((1, 1), np.float32), np.array([[3]], np.uint8), 32, 32, q.cfg)
    a = pack_matmul_nbits(q)
    assert a.b.shape == (1, 1, 16) and a.b.dtype == np.uint8
    assert a.b[0, 0, 0] == 0x10 and a.b[0, 0, 1] == 0x32 and a.b[0, 0, 8] == 0xEF
    assert a.zero_points.tolist() == [3]
    np.testing.assert_array_equal(unpack_low_first(a.b.reshape(1, -1), 4, 32), codes)


@pytest.mark.parametrize("bits,group,sym,k", CASES)
def test_packed_shapes(bits, group, sym, k):
    q = quantize(_w(10, k), WeightQuantConfig(bits, group, sym))
    a = pack_matmul_nbits(q)
    nb = math.ceil(k / q.block)
    assert a.b.shape == (10, nb, q.block * bits // 8)
    assert a.scales.shape == (10 * nb,)
    assert (a.zero_points is None) == sym
    if not sym:
        assert a.zero_points.shape == (10 * math.ceil(nb * bits / 8),)


# -- ONNX forms against numpy ------------------------------------------------------------------------
def _reference(x: np.ndarray, q, input_scale=None) -> np.ndarray:
    xs = x.astype(np.float64) if input_scale is None else x.astype(np.float64) / input_scale
    return xs @ dequantize(q).astype(np.float64).T


def _rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("bits,group,sym,k", CASES)
def test_matmul_nbits_equals_numpy(bits, group, sym, k):
    n = 48
    q = quantize(_w(n, k), WeightQuantConfig(bits, group, sym))
    x = np.random.default_rng(1).standard_normal((7, k)).astype(np.float32)
    m = standalone_model(matmul_nbits("x", "y", "L0.q_proj", q), "x", k, n)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    y = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert y.shape == (7, n)
    assert _rel(y, _reference(x, q)) <= 1e-4


def test_fast_int8_error_shrinks_with_the_group():
    """accuracy_level 4 (`--matmul-accuracy fast`): ONNX Runtime quantises the activations to INT8 in blocks
    of the weight group, so smaller INT8 groups also mean finer activation scales (docs/weights.md
    "INT8 groups"): the error vs the float64 product of the same dequantised weights falls from per
    channel to g128 to g32 on activations with a few outlier channels."""
    n, k = 256, 576
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, k)).astype(np.float32)
    x[:, rng.integers(0, k, 4)] *= 30
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    errs = []
    for group in (None, 128, 32):
        q = quantize(_w(n, k), WeightQuantConfig(8, group))
        m = standalone_model(matmul_nbits("x", "y", "p", q, accuracy_level=4), "x", k, n)
        y = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        errs.append(_rel(y, _reference(x, q)))
    assert errs[0] > errs[1] > errs[2] > 1e-4, errs  # and still activation quantisation, not exact


def test_matmul_nbits_with_awq_input_scale():
    k, n = 192, 32
    s = np.random.default_rng(2).uniform(0.3, 3.0, k)
    w = _w(n, k)
    q = quantize(w * s[None, :].astype(np.float32), WeightQuantConfig(4, 64))
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
    m = standalone_model(matmul_nbits("x", "y", "L0.o_proj", q, input_scale=s), "x", k, n)
    y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _rel(y, _reference(x, q, s)) <= 1e-4
    assert _rel(y, x.astype(np.float64) @ w.T) < 0.2  # and it still is the layer (INT4 error)


@pytest.mark.parametrize("bits,group,k", [(4, 32, 96), (4, 32, 100), (4, 128, 576), (4, 64, 130),
                                          (8, None, 576), (8, None, 70), (8, 32, 96), (8, 128, 576), (8, 64, 130)])
def test_dq_matmul_reference_evaluator(bits, group, k):
    """The TensorRT form (DequantizeLinear opset 21 + MatMul) run by onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    n = 24
    q = quantize(_w(n, k), WeightQuantConfig(bits, group))
    x = np.random.default_rng(4).standard_normal((6, k)).astype(np.float32)
    parts = dq_matmul("x", "y", "L0.gate_proj", q, act_dtype="float32")
    dq = next(nd for nd in parts.nodes if nd.op_type == "DequantizeLinear")
    attrs = {a.name: a.i for a in dq.attribute}
    assert attrs == ({"axis": 0, "block_size": group} if group is not None else {"axis": 1})
    scales = next(i for i in parts.inits if i.name.endswith(".scales"))
    assert scales.dims == ((math.ceil(k / group), n) if group is not None else (n,))
    y = ReferenceEvaluator(standalone_model(parts, "x", k, n)).run(None, {"x": x})[0]
    assert _rel(y, _reference(x, q)) <= 1e-5


FLOAT_ZP = WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True)


@pytest.mark.parametrize("k", [96, 100, 576])
def test_float_zero_point_forms_equal_numpy(k):
    """asym-f (float zero point): ONNX Runtime's MatMulNBits (float32 zero points, unpacked) and the
    TensorRT form (signed codes + per-group offsets; K = 100 pads x) against the float64 product."""
    from onnx.reference import ReferenceEvaluator

    n = 40
    q = quantize(_w(n, k) + 0.05, FLOAT_ZP)  # a shifted weight: the groups' ranges exclude 0
    x = np.random.default_rng(5).standard_normal((6, k)).astype(np.float32)
    m = standalone_model(matmul_nbits("x", "y", "L0.up_proj", q), "x", k, n)
    y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _rel(y, _reference(x, q)) <= 1e-4
    y = ReferenceEvaluator(standalone_model(dq_matmul("x", "y", "p", q, act_dtype="float32"), "x", k, n)).run(
        None, {"x": x})[0]
    assert _rel(y, _reference(x, q)) <= 1e-5


def test_dq_matmul_fp16_scales_and_refusals():
    from onnx import TensorProto

    q = quantize(_w(8, 64), WeightQuantConfig(4, 32))
    parts = dq_matmul("x", "y", "p", q, act_dtype="float16")
    types = {i.name: i.data_type for i in parts.inits}
    assert types == {"p.qweight": TensorProto.INT4, "p.scales": TensorProto.FLOAT16}
    with pytest.raises(WeightQuantError, match="symmetric"):
        dq_matmul("x", "y", "p", quantize(_w(8, 64), WeightQuantConfig(4, 32, symmetric=False)))
    parts = dq_matmul("x", "y", "p", quantize(_w(8, 64), WeightQuantConfig(8, 32)))  # INT8 blocked along K
    assert {i.name: (i.data_type, i.dims) for i in parts.inits} == {
        "p.qweight": (TensorProto.INT8, (64, 8)), "p.scales": (TensorProto.FLOAT16, (2, 8))}


# -- bytes -------------------------------------------------------------------------------------------
def test_quantized_bytes_by_hand():
    # 4096 x 4096 INT4 g128 symmetric: 8 MiB codes + 4096*32 fp16 scales
    assert quantized_bytes(4096, 4096, WeightQuantConfig(4, 128)) == 4096 * 2048 + 4096 * 32 * 2
    # INT8 per channel: K bytes + one fp16 scale per row
    assert quantized_bytes(4096, 14336, WeightQuantConfig(8, None)) == 4096 * 14336 + 4096 * 2
    # INT8 g128 / g32: K bytes + K/g fp16 scales per row (SmolLM2's down_proj, K = 1536)
    assert quantized_bytes(576, 1536, WeightQuantConfig(8, 128)) == 576 * 1536 + 576 * 12 * 2
    assert quantized_bytes(576, 1536, WeightQuantConfig(8, 32)) == 576 * 1536 + 576 * 48 * 2
    # asymmetric INT4, 3 groups: two packed zero-point bytes per row
    assert quantized_bytes(10, 96, WeightQuantConfig(4, 32, symmetric=False)) == 10 * 48 + 10 * 3 * 2 + 10 * 2


# -- memory plan -------------------------------------------------------------------------------------
def _llama3_8b():
    """LLaMA-3-8B dimensions with GSM defaults (every layer owning, ranks from the 3.2 ratio)."""
    from gsm.config import GSMParams, ModelConfig

    cfg = ModelConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False, gsm=GSMParams())
    r = int(2 * 1024 / 3.2) // 2  # 320 + 320 latent channels per layer
    return cfg, {i: (r, r) for i in cfg.owning_layers}


def _hand_weight_bytes(cfg, ranks, bits: int | None, group: int | None = 128, head: int | None | str = "same",
                       gsm: int | None | str = "same") -> int:
    """By hand: projections q, o, gate, up, down quantised, the embedding and LM head at `head` bits
    (8: symmetric, one FP16 scale per 64; 4: one FP16 scale and one FP16 offset per 32; "same": 8 when `bits` is
    given), the GSM-side projections (latent Vt,
    indexer key / query / weight) at `gsm` bits (8: one byte a weight and one FP16 scale per row; "same": 8 when
    `bits` is given), every other parameter FP16 (group None: one FP16 scale per row)."""
    H, I, L, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.q_dim, cfg.kv_dim
    g = cfg.gsm
    proj = [(qd, H), (H, qd), (I, H), (I, H), (H, I)]  # [N, K] of q, o, gate, up, down
    head = (None if bits is None else 8) if head == "same" else head
    gsm = (None if bits is None else 8) if gsm == "same" else gsm
    gsm_bytes = 0
    n_head = 1 if cfg.tie_word_embeddings else 2
    V = cfg.vocab_size
    head_group = {8: 64, 4: 32}.get(head)
    per_group = {8: 2, 4: 4}.get(head)  # the scale, and at 4 bits the float zero point's offset
    head_bytes = n_head * (V * H * 2 if head is None else V * H * head // 8 + V * math.ceil(H / head_group) * per_group)
    other = H + L * 2 * H
    for i in range(L):
        if cfg.is_owning(i):
            rk, rv = ranks[i]
            side = rk + rv + g.indexer_heads * g.indexer_dim + g.indexer_dim + g.indexer_heads  # in_proj rows
            other += kvd * (rk + rv) + rk + rv
            gsm_bytes += side * H * 2 if gsm is None else side * H + side * 2
        else:
            rk, rv = ranks[g.kv_sharing[i]]
            other += 2 * kvd * (rk + rv) + 2 * kvd
    if bits is None:
        q = sum(n * k for n, k in proj) * 2
    elif bits == 8:
        q = sum(n * k + n * (1 if group is None else math.ceil(k / group)) * 2 for n, k in proj)
    else:
        q = sum(n * k // 2 + n * math.ceil(k / group) * 2 for n, k in proj)
    return other * 2 + L * q + head_bytes + gsm_bytes


@pytest.mark.parametrize("which", ["1b", "8b"])
def test_weight_bytes_by_hand(which):
    from builder.plan import DEFAULT_INT8_GROUP_SIZE, PER_CHANNEL, weight_bytes

    if which == "1b":
        from gsm.synth import PRESETS, preset_config, preset_ranks

        cfg = preset_config(PRESETS["1b"])
        ranks = preset_ranks(PRESETS["1b"], cfg)
    else:
        cfg, ranks = _llama3_8b()
    fp16 = weight_bytes(cfg, ranks)
    assert fp16 == _hand_weight_bytes(cfg, ranks, None)
    assert weight_bytes(cfg, ranks, weights="int8", group_size=PER_CHANNEL) == _hand_weight_bytes(cfg, ranks, 8, None)
    assert weight_bytes(cfg, ranks, weights="int8", group_size=32) == _hand_weight_bytes(cfg, ranks, 8, 32)
    assert weight_bytes(cfg, ranks, weights="int8") == _hand_weight_bytes(cfg, ranks, 8, DEFAULT_INT8_GROUP_SIZE)
    assert weight_bytes(cfg, ranks, weights="int4") == _hand_weight_bytes(cfg, ranks, 4)
    assert weight_bytes(cfg, ranks, weights="int4", group_size=32) == _hand_weight_bytes(cfg, ranks, 4, 32)
    for head in (None, 8, 4):
        hw = {None: "fp16", 8: "int8", 4: "int4"}[head]
        assert weight_bytes(cfg, ranks, weights="int4", head_weights=hw) == _hand_weight_bytes(cfg, ranks, 4, head=head)
    assert weight_bytes(cfg, ranks, weights="int4", gsm_weights="fp16") == _hand_weight_bytes(cfg, ranks, 4, gsm=None)
    assert weight_bytes(cfg, ranks, gsm_weights="int8") == _hand_weight_bytes(cfg, ranks, None, gsm=8)
    assert weight_bytes(cfg, ranks, head_weights="int8") == _hand_weight_bytes(cfg, ranks, None, head=8)
    if which == "8b":  # about 14.7 GiB at FP16; at INT4 5.4 GiB with the FP16 embedding and head, 4.4 INT8, 4.0 INT4
        assert 14.5 < fp16 / 2**30 < 14.9
        assert 5.2 < weight_bytes(cfg, ranks, weights="int4", head_weights="fp16") / 2**30 < 5.6
        assert 4.3 < weight_bytes(cfg, ranks, weights="int4") / 2**30 < 4.5
        assert 3.9 < weight_bytes(cfg, ranks, weights="int4", head_weights="int4") / 2**30 < 4.1


def test_8b_plan_on_orin_nano_and_agx():
    from builder.plan import PlanError, PlanRequest, choose_weights, make_plan, require_fit
    from gsm.config import KVQuantConfig
    from jetson.profiles import PROFILES

    cfg, ranks = _llama3_8b()
    q = KVQuantConfig()
    nano, agx = PROFILES["orin-nano-8"], PROFILES["orin-agx-64"]
    fits = {(dev.name, w): make_plan(cfg, ranks, q, dev, PlanRequest(max_seq=4096, weights=w)).fits
            for dev in (nano, agx) for w in ("fp16", "int8", "int4")}
    assert fits == {("orin-nano-8", "fp16"): False, ("orin-nano-8", "int8"): False, ("orin-nano-8", "int4"): True,
                    ("orin-agx-64", "fp16"): True, ("orin-agx-64", "int8"): True, ("orin-agx-64", "int4"): True}
    with pytest.raises(PlanError, match="weights .* FP16"):
        require_fit(make_plan(cfg, ranks, q, nano, PlanRequest(max_seq=4096)), cfg, ranks, q)
    # auto picks the highest precision that fits
    assert choose_weights(cfg, ranks, q, nano, PlanRequest(max_seq=4096, weights="auto")).weights == "int4"
    assert choose_weights(cfg, ranks, q, agx, PlanRequest(max_seq=4096, weights="auto")).weights == "fp16"
    # the roofline reads fewer bytes: decode estimate grows by at least 2.5x fp16 -> int4
    p16 = make_plan(cfg, ranks, q, agx, PlanRequest(max_seq=4096))
    p4 = make_plan(cfg, ranks, q, agx, PlanRequest(max_seq=4096, weights="int4"))
    assert p4.decode_tokens_per_s_estimate > 2.5 * p16.decode_tokens_per_s_estimate
    p4f = make_plan(cfg, ranks, q, agx, PlanRequest(max_seq=4096, weights="int4", head_weights="fp16"))
    assert p16.decode_bytes_per_token - p4f.decode_bytes_per_token == pytest.approx(
        p16.weight_bytes - p4f.weight_bytes, rel=1e-9)  # embedding (one row read) is FP16 in both
    # an untied embedding is read one row per step, so quantising it saves memory, not decode bytes
    embed16, embed8 = 2 * cfg.vocab_size * cfg.hidden_size, cfg.vocab_size * cfg.hidden_size * (1 + 2 / 64)
    assert p4f.decode_bytes_per_token - p4.decode_bytes_per_token == pytest.approx(
        p4f.weight_bytes - p4.weight_bytes - (embed16 - embed8), rel=1e-9)
    # a model too big for any precision: auto returns the INT4 plan, which require_fit refuses
    huge = cfg.replace(num_hidden_layers=32, intermediate_size=14336 * 4)
    p = choose_weights(huge, ranks, q, nano, PlanRequest(max_seq=4096, weights="auto"))
    assert p.weights == "int4" and not p.fits
    with pytest.raises(PlanError, match="INT4"):
        require_fit(p, huge, ranks, q)


# -- AWQ on real activations -------------------------------------------------------------------------
@pytest.mark.slow
def test_awq_beats_rtn_on_held_out_smollm2_activations():
    """SmolLM2-135M layers on calibration text: scales searched on some windows reduce the INT4 g128
    output error on other windows' activations, compared with plain RTN of the same weights."""
    import torch
    from conftest import CALIB_TEXT, DATA

    from calibration.awq import GROUPS, collect_inputs, output_error, search_scales
    from gsm import names
    from gsm.dense import DenseLlama
    from gsm.sources.gguf import read_gguf
    from gsm.tokenizer import tokenizer_from_json

    gguf = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file() or not CALIB_TEXT.is_file():
        pytest.skip(f"real data not found at {DATA}")
    src = read_gguf(gguf)
    model = DenseLlama(src)
    ids = tokenizer_from_json(src.tokenizer_json).encode(CALIB_TEXT.read_text()).ids
    wins = [torch.tensor(ids[i * 160:(i + 1) * 160]) for i in range(4)]
    search = collect_inputs(model, wins[:2], rows_per_sequence=96, seed=0)
    held = collect_inputs(model, wins[2:], rows_per_sequence=128, seed=1)
    cfg = WeightQuantConfig(4, 128)
    better, total_awq, total_rtn = 0, 0.0, 0.0
    keys = [(i, g) for i in (0, 14, 29) for g in GROUPS]
    for i, group in keys:
        ws = [model.w[names.layer_name(k, i)].numpy() for k in GROUPS[group]]
        r = search_scales(search[(i, group)].sample, search[(i, group)].mean_abs, ws, cfg)
        x = held[(i, group)].sample
        e_awq, e_rtn = output_error(x, ws, cfg, r.scales), output_error(x, ws, cfg, None)
        better += e_awq < e_rtn
        total_awq += e_awq / e_rtn
        total_rtn += 1.0
    assert better >= len(keys) - 2  # nearly every projection group
    assert total_awq / total_rtn < 0.9  # on average at least 10 % less output error
