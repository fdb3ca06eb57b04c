"""Slot tables of the TensorRT backend (docs/engine_io.md section 3), driven by the real tier policy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from builder.plan import pool_rows
from gsm.config import KVQuantConfig
from gsm.synth import PRESETS, preset_config
from runtime.policy import SequenceState, TierPolicy, retier
from runtime.slots import FP16, INT8, INT12, ROW_MASK, CacheOverflowError, SlotTable


def check_table(t: SlotTable, state: SequenceState) -> None:
    live = t.entries[: state.length]
    assert (live >= 0).all()
    rows = live & ROW_MASK
    assert len(set(rows.tolist())) == rows.size  # no row shared by two positions
    tiers = live >> 24
    assert np.array_equal(tiers, state.tier.astype(np.int32))
    for tier, row in zip(tiers, rows):
        assert t.region(int(row)) <= tier  # a row lives in a region as wide as its tier or wider
    free = {r for f in t.free for r in f}
    assert not free & set(rows.tolist())


@pytest.mark.parametrize("rate,chunk,fractions", [(8, 16, (0.25, 0.25, 0.5)), (5, 1, (0.25, 0.25, 0.5)),
                                                 (64, 64, (0.25, 0.25, 0.5)), (8, 16, (0.125, 0.125, 0.25, 0.5)),
                                                 (5, 1, (0.0, 0.25, 0.25, 0.5))])
def test_policy_never_overflows_the_planned_pools(rate, chunk, fractions):
    cfg = preset_config(PRESETS["tiny"])
    cfg = cfg.replace(gsm=dataclasses.replace(cfg.gsm, quantization_adaptation_rate=rate))
    q = KVQuantConfig(fp16_window=8).with_fractions(fractions)
    n_max = 300
    rows = pool_rows(n_max, chunk, cfg, q)
    t = SlotTable(n_max, rows.by_tier)
    p = TierPolicy(cfg.gsm.sink_tokens, q.fp16_window, q.tier_fractions, q.hotness_decay, rate)
    s = SequenceState()
    rng = np.random.default_rng(rate)
    seen = set()

    def step(n_new: int, prefill: bool) -> None:
        for old, new in t.compaction(n_new):
            assert old >> 24 == new >> 24  # compaction keeps tiers
        t.allocate(range(s.length, s.length + n_new))
        s.add_positions([5] * n_new)
        s.update_hotness(rng.random(s.length).astype(np.float32), p.hotness_decay)
        if prefill or (s.decode_steps + 1) % rate == 0:
            nt = retier(s, p, n_max)
            if nt is not None:
                t.demote(nt)
        if not prefill:
            s.decode_steps += 1
        check_table(t, s)
        seen.update(t.region(int(e) & ROW_MASK) for e in t.entries[: s.length])

    step(chunk, True)
    while s.length < n_max:
        step(1, False)
    # every region holds rows by the end (the INT4 region exists only with an INT4 fraction)
    assert seen == set(range(len(fractions))) and (rows.int4 > 0) == (len(fractions) == 4)


def test_demotion_moves_to_the_narrowest_free_region():
    t = SlotTable(8, (4, 2, 2))
    t.allocate(range(4))
    moves = t.demote(np.array([-1, INT8, INT12, INT8, -1, -1, -1, -1]))
    assert [(o >> 24, n >> 24) for o, n in moves] == [(FP16, INT8), (FP16, INT12), (FP16, INT8)]
    assert [t.region(n & ROW_MASK) for _, n in moves] == [2, 1, 2]
    assert sorted(t.free[0]) == [1, 2, 3]  # the old rows come back only after the pass


def test_compaction_moves_borrowed_rows_out_of_the_fp16_region():
    t = SlotTable(6, (3, 1, 2))
    t.allocate(range(3))
    t.free[2].clear()  # pretend the INT8 region is in use
    t.demote(np.array([INT8, INT8, -1, -1, -1, -1]))  # position 0 -> INT12 region, 1 stays (borrowed)
    assert t.region(int(t.entries[1]) & ROW_MASK) == 0 and len(t.free[0]) == 1
    t.free[2].append(5)
    moves = t.compaction(2)  # two new positions: the borrowed row must leave the FP16 region
    assert len(moves) == 1 and moves[0][1] >> 24 == INT8 and t.region(moves[0][1] & ROW_MASK) == 2
    t.allocate(range(3, 5))
    with pytest.raises(CacheOverflowError, match="FP16 region .* full"):
        t.compaction(1)


def test_promotion_is_refused():
    t = SlotTable(4, (2, 1, 1))
    t.allocate(range(1))
    t.demote(np.array([INT8, -1, -1, -1]))
    with pytest.raises(ValueError, match="promote"):
        t.demote(np.array([INT12, -1, -1, -1]))
