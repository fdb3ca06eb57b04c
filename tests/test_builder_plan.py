"""Memory plan: spec-6 figures, pool sizing against the tier policy, fit refusal with what would fit."""

from __future__ import annotations

import math

import pytest

from builder.plan import (
    PlanError,
    PlanRequest,
    dense_fp16_bytes_per_position,
    kv_bytes_per_position,
    make_plan,
    param_count,
    pool_rows,
    require_fit,
)
from gsm.config import KVQuantConfig
from gsm.synth import PRESETS, preset_config, preset_ranks
from jetson import get_profile


def preset(name: str):
    p = PRESETS[name]
    cfg = preset_config(p)
    return cfg, preset_ranks(p, cfg), KVQuantConfig()


def test_spec6_figures_tiny():
    cfg, ranks, q = preset("tiny")
    # tiny: owning layers 0, 1, 2 with ranks (12,10), (14,8), (12,10); dI 16; tiers .25/.25/.5
    avg = 0.25 * 2 + 0.25 * 1.5 + 0.5 * 1
    assert kv_bytes_per_position(cfg, ranks, q) == pytest.approx((22 + 22 + 22) * avg + 3 * 16 * 2)
    assert dense_fp16_bytes_per_position(cfg) == 4 * 2 * 32 * 2
    assert param_count(cfg, ranks) > cfg.vocab_size * cfg.hidden_size * 2  # untied head + embed


@pytest.mark.parametrize("fractions", [(0.25, 0.25, 0.5), (0.25, 0.125, 0.25, 0.375), (0.0, 0.0, 0.5, 0.5)])
def test_pool_rows_bound_the_golden_tier_counts(fractions):
    """Simulate re-tier passes on random hotness with the golden cache and check the pool bounds."""
    import dataclasses

    import torch

    from gsm.golden.cache import SequenceCache
    from gsm.golden.quant import FP16, INT4, INT8, INT12

    cfg, _, _ = preset("tiny")
    rate = 7
    cfg = cfg.replace(gsm=dataclasses.replace(cfg.gsm, quantization_adaptation_rate=rate))
    q = KVQuantConfig(fp16_window=4, tier_fractions=fractions, bit_widths=(16, 12, 8, 4))
    cache = SequenceCache(deployed=False, layers={})
    g = torch.Generator().manual_seed(0)
    max_seq, max_input, worst = 300, 1, {FP16: 0, INT12: 0, INT8: 0, INT4: 0}
    for step in range(max_seq):
        cache.add_positions([5])
        cache.update_hotness(torch.rand(cache.length, generator=g), q.hotness_decay)
        if step % rate == rate - 1:  # a pass every `rate` steps, as decode does
            cache.tier = torch.maximum(cache.tier, cache.ranked_tiers(q, cfg.gsm.sink_tokens))
        for t in worst:  # rows of tier t or wider, at their worst
            worst[t] = max(worst[t], int((cache.tier <= t).sum()))
    rows = pool_rows(max_seq, max_input, cfg, q)
    # a row may live in a wider region: FP16 rows fit C16, FP16 + INT12 rows fit C16 + C12, and so on
    c = rows.by_tier
    assert all(worst[t] <= sum(c[:t + 1]) for t in (FP16, INT12, INT8, INT4))
    assert rows.total == max_seq
    assert rows.fp16 == min(max_seq, 1 + 4 + int(fractions[0] * 300) + max(rate, max_input))
    assert (rows.int4 > 0) == (len(fractions) == 4 and fractions[3] > 0)
    if len(fractions) == 4:  # the ranking made INT4 rows, which the INT4 region (or a wider one) holds
        assert int((cache.tier == INT4).sum()) >= math.floor(fractions[3] * (max_seq - 1 - 4)) - 1


def test_plan_fits_and_roofline():
    cfg, ranks, q = preset("tiny")
    plan = make_plan(cfg, ranks, q, get_profile("orin"), PlanRequest(max_seq=256))
    assert plan.fits and plan.largest_fitting_seq == cfg.max_position_embeddings
    assert plan.decode_tokens_per_s_estimate == pytest.approx(204.8e9 / plan.decode_bytes_per_token)
    assert "estimate" in plan.to_json()["decode_tokens_per_s_estimate_note"]


def test_cpu_backend_memory_is_planned_and_its_fit_said():
    """The CPU backend's cache (the pools without the host slot tables, plus each row's row cache of K rows, counted
    here from the layout by hand) and whether that plan fits the device, in the plan and the build summary's words."""
    from dataclasses import replace

    from builder.plan import SLOT_ENTRY_BYTES, kv_pool_bytes, row_cache_capacity

    cfg, ranks, q = preset("tiny")
    plan = make_plan(cfg, ranks, q, get_profile("orin"), PlanRequest(max_seq=256, max_batch=2))
    rows = pool_rows(256, plan.max_input, cfg, q)
    row_cache = sum(row_cache_capacity(cfg, i, 256) * (4 * cfg.kv_dim + 3 * 4) for i in range(cfg.num_hidden_layers))
    assert plan.row_cache_bytes == row_cache
    assert plan.cpu_kv_bytes == kv_pool_bytes(cfg, ranks, rows, 256, 2, q) - 2 * 256 * SLOT_ENTRY_BYTES + 2 * row_cache
    assert plan.cpu_fits and "does not fit" not in plan.cpu_fit_line()
    tight = replace(plan, usable_bytes=plan.total_bytes)  # TensorRT's pools fit; the CPU cache (row caches) does not
    assert tight.fits and not tight.cpu_fits
    assert tight.to_json()["cpu_fits"] is False
    line = tight.cpu_fit_line()
    assert "does not fit orin" in line and "--max-seq or --max-batch" in line


def test_max_seq_beyond_model():
    cfg, ranks, q = preset("tiny")
    with pytest.raises(PlanError, match="max_position_embeddings"):
        make_plan(cfg, ranks, q, get_profile("orin"), PlanRequest(max_seq=cfg.max_position_embeddings + 1))


def test_plan_that_does_not_fit_says_what_would():
    cfg, ranks, q = preset("1b")
    plan = make_plan(cfg, ranks, q, get_profile("orin-nano-4"), PlanRequest(max_seq=4096, max_batch=64))
    assert not plan.fits and 0 < plan.largest_fitting_seq < 4096
    with pytest.raises(PlanError) as e:
        require_fit(plan, cfg, ranks, q)
    msg = str(e.value)
    assert "short by" in msg and f"--max-seq {plan.largest_fitting_seq} fits" in msg
    assert "at --max-batch 1, --max-seq 4096 fits" in msg
    # the suggestion is right: the largest fitting context fits, one more does not
    nano4 = get_profile("orin-nano-4")
    ok = make_plan(cfg, ranks, q, nano4, PlanRequest(max_seq=plan.largest_fitting_seq, max_batch=64))
    no = make_plan(cfg, ranks, q, nano4, PlanRequest(max_seq=plan.largest_fitting_seq + 1, max_batch=64))
    assert ok.fits and not no.fits


def test_weights_alone_too_big_names_devices_that_fit():
    cfg, ranks, q = preset("1b")
    big = cfg.replace(num_hidden_layers=20, intermediate_size=5632 * 4)
    plan = make_plan(big, ranks, q, get_profile("orin-nano-4"), PlanRequest(max_seq=4096))
    with pytest.raises(PlanError, match="it fits on: .*h200"):
        require_fit(plan, big, ranks, q)


def _llama3_8b():
    """LLaMA-3-8B dimensions with GSM defaults (every layer owning, r_k = r_v = 320)."""
    from gsm.config import GSMParams, ModelConfig

    cfg = ModelConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False)
    assert cfg.gsm == GSMParams()
    return cfg, {i: (320, 320) for i in cfg.owning_layers}


def test_fp16_refusal_names_the_weights_that_fit():
    cfg, ranks = _llama3_8b()
    nano = get_profile("orin-nano-8")
    plan = make_plan(cfg, ranks, KVQuantConfig(), nano, PlanRequest(max_seq=4096))
    with pytest.raises(PlanError, match=r"With --weights int4 it fits at --max-seq 4096\.") as e:
        require_fit(plan, cfg, ranks, KVQuantConfig())
    assert "weights 14.69 GiB FP16" in str(e.value)
    # INT4 itself fits: no suggestion to go lower
    require_fit(make_plan(cfg, ranks, KVQuantConfig(), nano, PlanRequest(max_seq=4096, weights="int4")), cfg, ranks,
                KVQuantConfig())


def test_asym_f_grid_bytes_by_hand():
    """asym-f: packed codes + an FP16 scale and an FP16 offset (the float zero point) per group."""
    from builder.plan import weight_bytes

    cfg, ranks = _llama3_8b()
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    proj = [(H, H), (H, H), (I, H), (I, H), (H, I)]  # q, o, gate, up, down [N, K]
    sym = weight_bytes(cfg, ranks, weights="int4", group_size=32)
    asym = weight_bytes(cfg, ranks, weights="int4", group_size=32, int4_grid="asym-f")
    assert asym - sym == L * sum(n * (k // 32) * 2 for n, k in proj)
    with pytest.raises(PlanError, match="--int4-grid"):
        weight_bytes(cfg, ranks, weights="int4", int4_grid="asym")


def test_max_top_k_outputs_counted_by_hand_and_refusal_names_the_flag():
    """The TensorRT graph outputs selected.{l} [B, T, K_sel] int32 and attn_mass.{l}
    [B, S] float32 for every owning layer; K_sel = sinks + max_sparse_window + max_top_k."""
    cfg, ranks, q = preset("tiny")
    g, L = cfg.gsm, len(cfg.owning_layers)
    orin = get_profile("orin")
    base = make_plan(cfg, ranks, q, orin, PlanRequest(max_seq=256, max_batch=2, max_input=32))
    assert base.max_top_k == g.sparse_top_k  # the default
    wide = make_plan(cfg, ranks, q, orin, PlanRequest(max_seq=256, max_batch=2, max_input=32, max_top_k=256))
    assert wide.activation_bytes - base.activation_bytes == L * 2 * 32 * (256 - g.sparse_top_k) * 4
    with pytest.raises(PlanError, match=r"--max-top-k must be in \[8 .*max-seq=256\], got 257"):
        make_plan(cfg, ranks, q, orin, PlanRequest(max_seq=256, max_top_k=257))
    # a device where only the default maximum fits: the refusal says so
    import dataclasses

    need_default = make_plan(cfg, ranks, q, orin, PlanRequest(max_seq=256, max_batch=2, max_input=32)).total_bytes
    tight = dataclasses.replace(orin, memory_bytes=orin.reserve_bytes + need_default + 1)
    from jetson.profiles import PROFILES

    plan = make_plan(cfg, ranks, q, tight, PlanRequest(max_seq=256, max_batch=2, max_input=32, max_top_k=256))
    assert not plan.fits
    orig, PROFILES[orin.name] = PROFILES[orin.name], tight
    try:
        with pytest.raises(PlanError, match=rf"With --max-top-k {g.sparse_top_k} it fits"):
            require_fit(plan, cfg, ranks, q)
    finally:
        PROFILES[orin.name] = orig
