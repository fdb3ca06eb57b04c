"""Golden model: selection rules, tier policy and rounding of spec 4–5 on small random models.

Tolerances: exact comparisons (==) where the same float32 ops run in the same order; 1e-6 where
only the summation order differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gsm import names
from gsm.config import GSMParams, KVQuantConfig, ModelConfig
from gsm.golden import quant as Q
from gsm.golden.model import GoldenModel
from gsm.golden.selection import select
from gsm.golden.weights import GoldenWeights, KVCalibration


def random_model(*, top_k: int = 4, window: int = 3, sinks: int = 1, sharing: dict[int, int] | None = None,
                 seed: int = 0, layers: int = 3) -> GoldenWeights:
    sharing = {2: 0} if sharing is None else sharing
    cfg = ModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=40,
                      gsm=GSMParams(sparse_top_k=top_k, sparse_window=window, sink_tokens=sinks,
                                    indexer_heads=2, indexer_dim=8, shared_layers=tuple(set(sharing.values())),
                                    kv_sharing=sharing))
    ranks = {i: (6 + i, 5 + i) for i in range(layers)}
    g = torch.Generator().manual_seed(seed)
    t = {n: (torch.randn(s, generator=g) * 0.3).numpy() for n, s in names.expected_shapes(cfg, ranks).items()}
    for i in range(layers):
        for key in ("input_norm", "post_norm"):
            t[names.layer_name(key, i)] = np.ones(32, np.float32)
    return GoldenWeights.from_tensors(cfg, t)


def with_params(w: GoldenWeights, **kw) -> GoldenModel:
    p = GSMParams(**{**w.cfg.gsm.__dict__, **kw})
    return GoldenModel(w, params=p)


# -- selection (spec 4.1) --------------------------------------------------------------------------
def test_selection_counts_sinks_window_and_ties():
    p = GSMParams(sparse_window=3, sink_tokens=2, sparse_top_k=4)
    T = 20
    scores = torch.zeros(T, T)  # all ties: the lowest candidate positions must win
    sel = select(scores, torch.arange(T), p)
    for t in range(T):
        row = sel[t].nonzero().squeeze(1).tolist()
        assert all(s <= t for s in row)
        if t + 1 <= 2 + 3 + 4:
            assert row == list(range(t + 1))  # short context: exactly dense
        else:
            expected = sorted({0, 1} | set(range(t - 2, t + 1)) | {2, 3, 4, 5})
            assert row == expected, t


def test_selection_picks_highest_scores():
    p = GSMParams(sparse_window=1, sink_tokens=0, sparse_top_k=2)
    scores = torch.zeros(1, 10)
    scores[0, 3], scores[0, 7], scores[0, 5] = 5.0, 9.0, 1.0
    sel = select(scores, torch.tensor([9]), p)
    assert sel[0].nonzero().squeeze(1).tolist() == [3, 7, 9]


def test_short_prompts_are_exact_dense_attention():
    w = random_model(top_k=4, window=3, sinks=1)
    budget = 1 + 3 + 4
    sparse = with_params(w, sparse_top_k=4)
    dense = with_params(w, sparse_top_k=10_000)
    for T in (1, 2, budget):
        ids = list(range(3, 3 + T))
        a = sparse.forward(sparse.new_cache(), ids).logits
        b = dense.forward(dense.new_cache(), ids).logits
        assert torch.equal(a, b), T
    ids = [int(i) for i in torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(1))]
    a = sparse.forward(sparse.new_cache(), ids).logits
    b = dense.forward(dense.new_cache(), ids).logits
    assert torch.equal(a[:budget], b[:budget])
    assert not torch.allclose(a[budget:], b[budget:])  # past the budget selection really is sparse


def test_single_token_decode_matches_prefill():
    w = random_model()
    m = GoldenModel(w)
    ids = [int(i) for i in torch.randint(0, 40, (25,), generator=torch.Generator().manual_seed(2))]
    full = m.forward(m.new_cache(), ids).logits
    cache = m.new_cache()
    steps = [m.prefill(cache, ids[:5]).logits]
    steps += [m.decode(cache, t).logits for t in ids[5:]]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=0)


def test_sharing_layer_uses_source_selection():
    w = random_model(sharing={2: 0})
    m = GoldenModel(w)
    ids = list(range(1, 30))
    tr = m.forward(m.new_cache(), ids, trace=True).trace
    assert set(tr.selected) == {0, 1}  # owning layers only
    p0 = tr.probs[0] > 0
    p2 = tr.probs[2] > 0
    assert torch.equal(p0, p2)  # same support: the mask is shared with the memory


# -- rounding and packing (spec 5) ----------------------------------------------------------------------
def test_quantize_rounds_half_to_even_and_clamps():
    scale = torch.tensor([1.0])
    x = torch.tensor([[0.5], [1.5], [2.5], [-0.5], [-2.5], [300.0], [-300.0]])
    assert Q.quantize(x, scale, Q.INT8).view(-1).tolist() == [0, 2, 2, 0, -2, 127, -127]
    assert Q.quantize(x * 10, scale, Q.INT12).view(-1).tolist() == [5, 15, 25, -5, -25, 2047, -2047]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2048, 2047), min_size=0, max_size=33))
def test_int12_pack_roundtrip(values):
    packed = Q.pack_int12(np.array(values))
    assert packed.size == 3 * ((len(values) + 1) // 2)
    assert Q.unpack_int12(packed, len(values)).tolist() == values


def test_int12_pack_layout():
    # a = 0xABC (-1348), b = 0x123: byte0 = BC, byte1 = A | 3 << 4, byte2 = 12
    assert Q.pack_int12(np.array([0xABC - 4096, 0x123])).tolist() == [0xBC, 0x3A, 0x12]


def test_int4_rounds_half_to_even_clamps_and_packs():
    scale = torch.tensor([0.5])
    x = torch.tensor([[0.25], [0.75], [-0.25], [-1.25], [3.5], [-3.5], [9.0]])  # x / s: .5 1.5 -.5 -2.5 7 -7 18
    assert Q.quantize(x, scale, Q.INT4).view(-1).tolist() == [0, 2, 0, -2, 7, -7, 7]
    # code 2j in the low nibble of byte j, 4-bit two's complement; odd counts padded with a zero code
    assert Q.pack_int4(np.array([-1, 2, 7, -7, 3])).tolist() == [0x2F, 0x97, 0x03]
    assert Q.unpack_int4(np.array([0x2F, 0x97, 0x03], np.uint8), 5).tolist() == [-1, 2, 7, -7, 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-8, 7), min_size=0, max_size=33))
def test_int4_pack_roundtrip(values):
    packed = Q.pack_int4(np.array(values))
    assert packed.size == (len(values) + 1) // 2
    assert Q.unpack_int4(packed, len(values)).tolist() == values


def test_default_int4_scale_order():
    s8 = torch.tensor([0.1, 3.0e-3, 7.7e-5], dtype=torch.float32)
    assert torch.equal(Q.default_int4_scale(s8), (s8 * np.float32(127)) / np.float32(7))


def test_default_int12_scale_order():
    s8 = torch.tensor([0.1, 3.0e-3], dtype=torch.float32)
    expected = (s8 * np.float32(127)) / np.float32(2047)
    assert torch.equal(Q.default_int12_scale(s8), expected)


# -- tier policy (spec 5) ----------------------------------------------------------------------------
def deployed(w: GoldenWeights, **quant) -> GoldenModel:
    q = KVQuantConfig(**{"tier_fractions": (0.25, 0.25, 0.5), "fp16_window": 4, "hotness_decay": 0.5, **quant})
    return GoldenModel(w, mode="deployed", quant=q, params=GSMParams(**{**w.cfg.gsm.__dict__,
                                                                        "quantization_adaptation_rate": 5}))


def test_prefill_retier_keeps_window_and_sinks_fp16():
    w = random_model(sinks=2)
    m = deployed(w)
    cache = m.new_cache()
    m.prefill(cache, list(range(3, 27)))  # 24 positions
    tier = cache.tier.tolist()
    assert tier[:2] == [Q.FP16] * 2  # sinks
    assert tier[-4:] == [Q.FP16] * 4  # fp16_window
    eligible = tier[2:-4]  # 18 positions: floor(.25*18)=4 FP16, floor(.5*18)-4=5 INT12, 9 INT8
    assert (eligible.count(Q.FP16), eligible.count(Q.INT12), eligible.count(Q.INT8)) == (4, 5, 9)
    # hottest positions stay FP16
    hot = cache.hotness[2:-4]
    fp16_pos = [i for i, t in enumerate(eligible) if t == Q.FP16]
    assert min(hot[fp16_pos]) >= max(hot[[i for i, t in enumerate(eligible) if t == Q.INT8]])


def test_retier_every_adaptation_rate_steps_and_demotion_only():
    w = random_model()
    m = deployed(w)
    cache = m.new_cache()
    m.prefill(cache, list(range(3, 23)))
    history = [cache.tier.clone()]
    for step in range(1, 16):
        before = cache.tier.clone()
        m.decode(cache, 5)
        grew = cache.tier[: before.numel()]
        assert torch.all(grew >= before), "a row regained precision"
        if step % 5:
            assert torch.equal(grew, before)  # no pass between adaptation points
            assert int(cache.tier[-1]) == Q.FP16
        history.append(cache.tier.clone())
    assert int((history[-1][: history[0].numel()] > history[0]).sum()) > 0  # some demotion happened


@pytest.mark.parametrize("fractions", [(0.25, 0.25, 0.5), (0.25, 0.125, 0.25, 0.375)])
def test_demoted_rows_hold_engine_rounding(fractions):
    w = random_model()
    m = deployed(w, tier_fractions=fractions, bit_widths=(16, 12, 8, 4))
    cache = m.new_cache()
    m.prefill(cache, list(range(3, 27)))
    calib = m.calib
    assert len(set(cache.tier.tolist())) == len(fractions)  # every tier holds rows
    for i, c in cache.layers.items():
        for s, tier in enumerate(cache.tier.tolist()):
            for kv, vals, codes in (("k", c.ck, c.qk), ("v", c.cv, c.qv)):
                sc = calib.scales[(i, kv)]
                if tier == Q.FP16:
                    assert torch.equal(vals[s], Q.round_fp16(vals[s]))
                elif tier == Q.INT12:
                    assert torch.equal(vals[s], codes[s].float() * sc.scale_int12)
                    assert int(codes[s].abs().max()) <= 2047
                elif tier == Q.INT8:
                    assert torch.equal(vals[s], codes[s].float() * sc.scale_int8 + sc.comp_int8)
                    assert int(codes[s].abs().max()) <= 127
                else:
                    assert torch.equal(vals[s], codes[s].float() * sc.scale_int4 + sc.comp_int4)
                    assert int(codes[s].abs().max()) <= 7


def test_int4_demotion_requantises_the_held_int8_value():
    """INT8 -> INT4 starts from the INT8-dequantised value (all an engine still holds), not the FP16 one."""
    w = random_model()
    m = deployed(w, tier_fractions=(0.0, 0.0, 1.0))
    cache = m.new_cache()
    m.prefill(cache, list(range(3, 27)))
    held = {i: c.ck.clone() for i, c in cache.layers.items()}
    int8_rows = (cache.tier == Q.INT8).nonzero().squeeze(1)
    assert int8_rows.numel() > 0
    q4 = m.quant.with_fractions((0.0, 0.0, 0.0, 1.0))
    cache.retier(q4, m.calib, m.p.sink_tokens)
    for i, c in cache.layers.items():
        sc = m.calib.scales[(i, "k")]
        want = Q.dequantize(Q.quantize(held[i][int8_rows], sc.scale_int4, Q.INT4), sc.scale_int4, sc.comp_int4)
        assert torch.equal(c.ck[int8_rows], want)
        assert bool((cache.tier[int8_rows] == Q.INT4).all())


def test_hot_token_ids_stay_fp16():
    w = random_model()
    m = deployed(w, hot_token_ids=(7,))
    cache = m.new_cache()
    ids = [3, 4, 5, 6, 7] * 5
    m.prefill(cache, ids)
    for s, tok in enumerate(ids):
        if tok == 7:
            assert int(cache.tier[s]) == Q.FP16


def test_deployed_close_to_exact_and_cache_bytes():
    w = random_model()
    exact = GoldenModel(w)
    dep = deployed(w)
    ids = list(range(3, 35))
    ce, cd = exact.new_cache(), dep.new_cache()
    exact.prefill(ce, ids)
    dep.prefill(cd, ids)
    le = exact.decode(ce, 9, trace=True)
    ld = dep.decode(cd, 9, trace=True)
    diff = float((le.logits - ld.logits).abs().max())
    assert 0 < diff < 0.5  # quantisation changes the logits, but only a little
    r = sum(sum(w.owning(i).ranks) for i in w.cfg.owning_layers)
    n = 33
    assert le.trace.cache_bytes == pytest.approx(n * (r * 2 + 2 * 8 * 2))
    assert ld.trace.cache_bytes < le.trace.cache_bytes
    assert ld.trace.dense_fp16_bytes == 3 * 2 * w.cfg.kv_dim * 2 * n


def test_calibration_roundtrip_through_tensors():
    w = random_model()
    c = KVCalibration.data_free(w)
    back = KVCalibration.from_tensors(w.cfg, c.to_tensors())
    for key, s in c.scales.items():
        assert torch.equal(back.scales[key].scale_int8, s.scale_int8)
        assert torch.equal(back.scales[key].scale_int12, s.scale_int12)
        assert bool((s.scale_int8 > 0).all())


def reference_select(scores: torch.Tensor, q_pos: torch.Tensor, p: GSMParams) -> torch.Tensor:
    """Spec 4.1 written as literally as possible, one query and one position at a time."""
    T, n = scores.shape
    out = torch.zeros(T, n, dtype=torch.bool)
    for row in range(T):
        t = int(q_pos[row])
        if t + 1 <= p.sink_tokens + p.sparse_window + p.sparse_top_k:
            out[row, : t + 1] = True
            continue
        rest = []
        for s in range(t + 1):
            if s < p.sink_tokens or s > t - p.sparse_window:
                out[row, s] = True
            else:
                rest.append((-float(scores[row, s]), s))  # sort: higher score, then lower s
        for _, s in sorted(rest)[: p.sparse_top_k]:
            out[row, s] = True
    return out


@pytest.mark.parametrize("sinks, window, top_k", [(1, 3, 4), (0, 1, 1), (2, 5, 0), (4, 2, 7)])
def test_select_equals_literal_spec(sinks, window, top_k):
    g = torch.Generator().manual_seed(sinks * 100 + window * 10 + top_k)
    p = GSMParams(sink_tokens=sinks, sparse_window=window, sparse_top_k=top_k, max_sparse_window=max(8, window))
    n = 40
    scores = torch.randint(0, 5, (12, n), generator=g).float()  # many ties
    q_pos = torch.tensor(sorted(torch.randint(0, n, (12,), generator=g).tolist()))
    assert torch.equal(select(scores, q_pos, p), reference_select(scores, q_pos, p))
