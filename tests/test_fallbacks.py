"""The engine's per-sequence fallback policies (issue 10), triggered by forced thresholds, and the
measurements they act on: the sparse mask hit rate (sampled decode steps) and the KV noise of a re-tier
pass. Each test checks that the sequence really switched (dense attention: the tokens equal a run that
switches the same sequence by hand and differ from the sparse run; refresh: a new all-FP16 cache equal to
a run that never demotes), not only that a counter moved."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from runtime_bundles import build_demo

MAX_SEQ, MAX_INPUT = 64, 16
# 48 tokens: the re-tier pass after the third prefill chunk demotes positions 1..15 (outside sink 1 and
# the FP16 window 32) -- a measurable KV noise; longer than the demo's top-k 8 -- a hit rate below 1.
LONG = [1] + list(range(40, 87))


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import runtime

    r = runtime.load(build_demo(tmp_path_factory.mktemp("fb") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                                max_batch=8),
                     "onnxruntime", threads=1)
    assert r.can_probe  # onnxruntime: shadow calls leave the cache as it was
    return r


class Events:
    """An engine observer that records what the policies saw and did."""

    def __init__(self):
        from runtime.engine import Observer

        events = self.events = []

        class Rec(Observer):
            def on_hit_rate(self, req, hit_rate):
                events.append(("hit_rate", req.sequence.decode_steps, hit_rate))

            def on_kv_noise(self, req, noise):
                events.append(("kv_noise", len(req.ids), noise))

            def on_fallback(self, req, policy, value):
                events.append(("fallback", policy, value, req.sequence.cached))

        self.observer = Rec()

    def of(self, kind):
        return [e[1:] for e in self.events if e[0] == kind]


def greedy(logits):
    return int(np.argmax(logits))


def test_hit_rate_fallback_forced_switches_the_sequence_to_dense(rt, caplog):
    """Threshold 1.0, every step probed: the first decode step (49 positions, top-k 8) has a hit rate
    < 1, so the sequence is dense from its second decode step. Reference: the runtime's own sequence,
    switched by hand after the same step; the sparse run differs, so the switch changed the tokens."""
    from runtime.engine import Engine, EngineConfig

    n = 12
    seq = rt.new_sequence()
    ref, logits = [], seq.prefill(LONG)
    for i in range(n):
        ref.append(greedy(logits))
        if i == n - 1:
            break
        logits = rt.decode_batch([seq], [ref[-1]], probe=[i == 0])[0]
        if i == 0:
            first_hr = seq.last_hit_rate
            seq.use_dense()
    assert first_hr < 1.0
    sparse = rt.generate(LONG, n, stop_ids=[]).ids
    assert ref != sparse, "dense and sparse attention give the same tokens here: the test would prove nothing"

    ev = Events()
    caplog.set_level(logging.WARNING, logger="runtime.engine")
    cfg = EngineConfig(min_hit_rate=1.0, hit_rate_every=1, max_kv_noise=None)
    with Engine(rt, cfg, observer=ev.observer) as eng:
        r = eng.submit(LONG, n, stop_ids=[]).result(30)
        assert eng.fallbacks == {"hit_rate": 1, "kv_noise": 0}
    assert r.ids == ref and r.sequence.dense
    assert ev.of("hit_rate") == [(1, pytest.approx(first_hr))]  # dense from then on: no more probes
    assert [e[:2] for e in ev.of("fallback")] == [("hit_rate", pytest.approx(first_hr))]
    assert ev.of("fallback")[0][2].sparse_top_k == MAX_SEQ  # the sequence's own budget: every position
    assert f"sparse mask hit rate {first_hr:.3f} < 1.000" in caplog.text


def test_hit_rate_probed_one_step_in_n_and_off_at_zero(rt):
    """Threshold 0 (off): probes at decode steps 1, 5, 9 of 10 (every 4), nothing switches, the tokens
    equal the plain run (a probe does not change the step); every 0: no probe at all."""
    from runtime.engine import Engine, EngineConfig

    want = rt.generate(LONG, 11, stop_ids=[]).ids
    for every, probed in ((4, [1, 5, 9]), (0, [])):
        ev = Events()
        with Engine(rt, EngineConfig(min_hit_rate=0.0, hit_rate_every=every, max_kv_noise=None),
                    observer=ev.observer) as eng:
            r = eng.submit(LONG, 11, stop_ids=[]).result(30)
            assert eng.fallbacks["hit_rate"] == 0
        assert r.ids == want and not r.sequence.dense
        assert [s for s, _ in ev.of("hit_rate")] == probed
        assert all(0 < h < 1 for _, h in ev.of("hit_rate"))


def no_demotion(rt):
    """A second runtime on the same bundle whose tier policy never demotes (FP16 window = max-seq)."""
    import runtime

    other = runtime.load(rt.bundle, "onnxruntime", threads=1)
    other.knobs = dataclasses.replace(other.knobs, fp16_window=other.n_max)
    return other


def test_kv_noise_fallback_forced_refreshes_the_cache_at_fp16(rt, caplog):
    """Threshold 0.0: the re-tier pass after the prompt demotes 15 rows (noise > 0), so the cache is
    rebuilt from the prompt at FP16 and never demoted again. The tokens equal a runtime that never
    demotes, and the new cache's latents equal that runtime's, row for row."""
    from runtime.engine import Engine, EngineConfig, Observer

    fp16 = no_demotion(rt)
    want = fp16.generate(LONG, 10, stop_ids=[]).ids
    ref_seq = fp16.new_sequence()
    ref_seq.prefill(LONG)
    caches = []

    class Keep(Observer):  # the sequence's cache after each step (before the engine drops it)
        def on_step(self, engine, running):
            caches.extend((r.sequence.cached, r.sequence.cached.length, r.sequence.tiers.copy()) for r in running)

    ev = Events()
    caplog.set_level(logging.WARNING, logger="runtime.engine")
    with Engine(rt, EngineConfig(max_kv_noise=0.0, min_hit_rate=0.0)) as eng:
        eng.observers += [ev.observer, Keep()]
        r = eng.submit(LONG, 10, stop_ids=[]).result(30)
        assert eng.fallbacks == {"hit_rate": 0, "kv_noise": 1}
    assert r.ids == want and r.sequence.refreshes == 1
    (tokens, noise), = ev.of("kv_noise")  # one pass re-encoded rows: the prompt's; none after the refresh
    assert tokens == 1 and 0 < noise < 0.05
    new_seq = ev.of("fallback")[0][2]
    first, length, tier = caches[0]
    assert first is new_seq and length == len(LONG) and not tier.any()  # rebuilt, every row FP16
    assert not new_seq.state.tier.any()
    for layer in rt.cfg.owning_layers:
        for got, ref in zip(new_seq.cache.latents(layer, len(LONG)), ref_seq.cache.latents(layer, len(LONG))):
            np.testing.assert_array_equal(got, ref)
    assert "refreshing its cache at FP16 from 48 tokens" in caplog.text


def test_kv_noise_fallback_refreshes_each_request_once_when_several_ask(rt):
    """Three requests whose prompt passes all exceed the threshold in the same iteration: each cache is rebuilt once
    (three fallbacks, not one rebuild of all three per running request), and each request's tokens are those of a
    runtime that never demotes."""
    from runtime.engine import Engine, EngineConfig

    fp16 = no_demotion(rt)
    prompts = [LONG, LONG[5:] + LONG[:5], LONG[::-1]]
    want = [fp16.generate(p, 6, stop_ids=[]).ids for p in prompts]
    with Engine(rt, EngineConfig(max_kv_noise=0.0, min_hit_rate=0.0)) as eng:
        reqs = [eng.submit(p, 6, stop_ids=[]) for p in prompts]
        got = [r.result(60) for r in reqs]
        assert eng.fallbacks == {"hit_rate": 0, "kv_noise": 3}
    assert [r.sequence.refreshes for r in got] == [1, 1, 1]
    assert [r.ids for r in got] == want


def test_kv_noise_below_threshold_keeps_the_cache(rt):
    """The default 0.05 against the demo's INT12/INT8 noise (~0.01): measured, nothing refreshed; the
    tokens equal the plain runtime's."""
    from runtime.engine import Engine, EngineConfig

    ev = Events()
    with Engine(rt, EngineConfig(min_hit_rate=0.0), observer=ev.observer) as eng:
        r = eng.submit(LONG, 6, stop_ids=[]).result(30)
        assert eng.fallbacks["kv_noise"] == 0
    assert r.ids == rt.generate(LONG, 6, stop_ids=[]).ids and r.sequence.refreshes == 0
    assert len(ev.of("kv_noise")) == 1 and ev.of("kv_noise")[0][1] < 0.05


def test_kv_noise_measure_against_hand_computation(rt):
    """docs/serving.md: ||x_new - x_old||_F / ||x_old||_F over the rows a re-tier pass re-encodes, K and V
    of every owning layer together: the 12 rows of positions 1..15 of a 48-token prompt that the pass
    demotes, read from the cache before and after it."""
    from runtime.policy import retier

    seq = rt.new_sequence()
    seq.prefill(LONG[:32])  # no row outside the FP16 window yet: nothing demoted
    assert not seq.state.tier.any()
    seq.worker.forward_batch([seq], [LONG[32:]])  # the third chunk, without its re-tier pass
    layers = rt.cfg.owning_layers
    before = [np.array(a) for l in layers for a in seq.cache.latents(l, len(LONG))]
    state = dataclasses.replace(seq.state, tier=seq.state.tier.copy())
    rows = np.nonzero(retier(state, rt.policy, rt.n_max) >= 0)[0]
    assert len(rows) == 12 and set(rows) < set(range(1, 16))  # 15 eligible, the 3 hottest stay FP16
    seq.retier()
    after = [np.array(a) for l in layers for a in seq.cache.latents(l, len(LONG))]
    num = sum(float(np.sum((a[rows].astype(np.float64) - b[rows]) ** 2)) for a, b in zip(after, before))
    den = sum(float(np.sum(b[rows].astype(np.float64) ** 2)) for b in before)
    assert seq.last_kv_noise == pytest.approx((num / den) ** 0.5, rel=1e-6)


def test_engine_config_ranges(rt):
    from runtime.engine import EngineConfig

    for bad in (dict(min_hit_rate=1.5), dict(min_hit_rate=-0.1), dict(hit_rate_every=-1),
                dict(max_kv_noise=-0.01), dict(max_kv_noise=float("inf"))):
        with pytest.raises(ValueError, match="EngineConfig." + next(iter(bad))):
            EngineConfig(**bad)
    # unset thresholds are the bundle's run_time (gsm.bundle_knobs.RunTime), as built: 0.85, every 64, auto
    knobs = EngineConfig().knobs(rt.knobs).run_time
    assert (knobs.min_hit_rate, knobs.hit_rate_every, knobs.max_kv_noise) == (0.85, 64, "auto")
    assert EngineConfig(min_hit_rate=0.5, max_kv_noise=None).knobs(rt.knobs).run_time.max_kv_noise is None


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_kv_noise_refresh_mid_decode_continues_the_same_stream(rt, sampling):
    """A runtime that re-tiers every 4 decode steps behind an 8-row FP16 window: a 9-token prompt has
    nothing to demote, the pass after decode step 4 demotes 3 of positions 1..4 (13 cached). Threshold
    0.0: the cache is rebuilt from the prompt and the first 4 generated tokens, FP16, then decoding goes
    on with the same sampler. Reference: a runtime that never demotes (before step 4 nothing was demoted
    either), same seed; the rebuilt rows were computed by a prefill instead of single-token steps, so
    they are compared with a float tolerance, the tokens exactly."""
    import runtime
    from runtime.engine import Engine, EngineConfig

    short = runtime.load(rt.bundle, "onnxruntime", threads=1)
    short.knobs = dataclasses.replace(short.knobs, quantization_adaptation_rate=4, fp16_window=8)
    prompt = [1, 50, 51, 52, 53, 54, 55, 56, 57]
    want = no_demotion(rt).generate(prompt, 14, stop_ids=[], **sampling).ids
    ev = Events()
    with Engine(short, EngineConfig(max_kv_noise=0.0, min_hit_rate=0.0), observer=ev.observer) as eng:
        r = eng.submit(prompt, 14, stop_ids=[], **sampling).result(30)
        assert eng.fallbacks["kv_noise"] == 1
    (tokens, noise), = ev.of("kv_noise")
    assert tokens == 5 and noise > 0  # after decode step 4 (the prefill's token + 4)
    assert r.ids == want and r.sequence.refreshes == 1
    seq = ev.of("fallback")[0][2]  # closed with its request; its rows stay readable (nothing reused them)
    assert seq.length == len(prompt) + 13 and not seq.state.tier.any()  # FP16 to the end: no pass ran on it
    ref = rt.new_sequence()
    ref.prefill(prompt + want[:-1])
    for layer in rt.cfg.owning_layers:
        for got, exp in zip(seq.cache.latents(layer, seq.length), ref.cache.latents(layer, seq.length)):
            # the cache holds FP16-rounded values: a value on a rounding boundary may land one FP16 ulp
            # (<= 2^-10 relative) apart under another summation order (prefill vs decode forms)
            np.testing.assert_allclose(got, exp, rtol=2.0**-10, atol=1e-5)
