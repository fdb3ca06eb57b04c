"""runtime.Engine (issue 10): concurrency equals sequential runs (greedy and seeded), requests join
between steps, cancellation, deadline, queue limit, warm-up before the first request, asyncio use;
the KV byte figures against hand computation."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from runtime_bundles import build_demo

MAX_SEQ, MAX_INPUT = 64, 16
# The fallback policies off: a sequence then always runs as `rt.generate` runs it (probes still measure).
NO_FALLBACKS = dict(min_hit_rate=0.0, max_kv_noise=None)


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import runtime

    # 8 rows in the memory plan: the engine's default of 8 interleaved requests fits it
    return runtime.load(build_demo(tmp_path_factory.mktemp("eng") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                                   max_batch=8),
                        "onnxruntime", threads=1)


class SlowStepper:
    """A stepper with a pause per call, so tests can act while requests run; counts calls and batch sizes."""

    def __init__(self, rt, delay=0.0, batched=False):
        from runtime.engine import BatchedStepper, SequentialStepper

        if batched and not hasattr(rt, "decode_batch"):
            pytest.skip("this runtime has no batched step API (Runtime.prefill_batch / decode_batch) yet")
        inner = BatchedStepper(rt) if batched else SequentialStepper(rt)
        self.inner, self.delay, self.calls, self.batches = inner, delay, 0, []

    def new_sequence(self, knobs=None):
        return self.inner.new_sequence(knobs)

    def step(self, work):
        self.calls += 1
        self.batches.append(len(work))
        time.sleep(self.delay)
        return self.inner.step(work)


# prompts of several lengths (one over max-input: two prefill chunks), text and ids, greedy and seeded
REQUESTS = [
    ([1, 76, 111, 120], 20, dict(temperature=0.0, stop_ids=[])),
    ("Once upon a time", 12, dict(temperature=0.0)),
    ([1] + list(range(40, 60)), 30, dict(temperature=0.0, stop_ids=[])),  # 21 tokens: prefill in 2 chunks
    ([1, 40, 41], 16, dict(temperature=0.9, top_p=0.9, seed=3, stop_ids=[])),
    ("The cat", 25, dict(temperature=0.0, stop_ids=[])),
    ([1, 5] * 25, 20, dict(temperature=0.0, stop_ids=[])),  # 50 + 20 > 64: ends by "context"
    ([1, 200, 201], 8, dict(temperature=1.2, top_k=20, seed=11)),
]


@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
def test_concurrent_requests_equal_sequential_runs(rt, batched):
    from runtime.engine import Engine, EngineConfig

    alone = [rt.generate(p, n, **kw) for p, n, kw in REQUESTS]
    assert {g.finish_reason for g in alone} >= {"length", "context"}
    stepper = SlowStepper(rt, batched=batched)
    with Engine(rt, EngineConfig(max_running=4, **NO_FALLBACKS), stepper=stepper) as eng:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:  # submitted from several threads at once
            reqs = list(pool.map(lambda r: eng.submit(r[0], r[1], **r[2]), REQUESTS))
            got = [r.result(60) for r in reqs]
    for g, a in zip(got, alone):
        assert g.ids == a.ids and g.text == a.text and g.finish_reason == a.finish_reason
    assert max(stepper.batches) == 4  # several sequences per iteration, capped at max_running
    assert stepper.calls < sum(len(a.ids) + 1 for a in alone)  # interleaved, not one after another


def test_request_joins_a_running_batch_between_steps(rt):
    from runtime.engine import Engine, EngineConfig

    stepper = SlowStepper(rt, delay=0.002)
    with Engine(rt, EngineConfig(max_running=4, **NO_FALLBACKS), stepper=stepper) as eng:
        a = eng.submit([1, 76, 111], 40, stop_ids=[])
        it = iter(a)
        for _ in range(5):
            next(it)
        b = eng.submit([1, 9, 10], 10, stop_ids=[])
        b.result(30)
        assert not a.done  # b joined while a was running and left before it
        a.result(30)
    assert a.ids == rt.generate([1, 76, 111], 40, stop_ids=[]).ids
    assert b.ids == rt.generate([1, 9, 10], 10, stop_ids=[]).ids
    assert 2 in stepper.batches


def test_cancel_ends_request_and_frees_its_sequence(rt):
    from runtime.engine import Engine

    with Engine(rt, stepper=SlowStepper(rt, delay=0.01)) as eng:
        r = eng.submit([1, 76, 111], 60, stop_ids=[])
        it = iter(r)
        next(it), next(it)
        r.cancel()
        r.result(10)
        assert r.finish_reason == "cancelled" and 2 <= len(r.ids) < 60
        assert r.sequence.cached is None and eng.running == []
        q = eng.submit([1, 5], 5, stop_ids=[])  # the engine goes on serving
        assert q.result(10).finish_reason == "length" and len(q.ids) == 5


def test_deadline_running_and_waiting(rt):
    from runtime.engine import Engine, EngineConfig

    with Engine(rt, EngineConfig(max_running=1), stepper=SlowStepper(rt, delay=0.01)) as eng:
        t0 = time.monotonic()
        a = eng.submit([1, 76, 111], 60, stop_ids=[], deadline_s=0.15)
        b = eng.submit([1, 7], 60, stop_ids=[], deadline_s=0.05)  # still queued behind a at its deadline
        a.result(10), b.result(10)
        assert a.finish_reason == "deadline" and 0 < len(a.ids) < 60
        assert b.finish_reason == "deadline" and b.ids == []
        assert time.monotonic() - t0 < 1.0
    from runtime import RequestError

    with pytest.raises(RequestError, match="deadline_s"):
        Engine(rt, EngineConfig(warmup=False)).submit([1, 5], 2, deadline_s=-1)


def test_queue_limit(rt):
    from runtime.engine import Engine, EngineConfig, QueueFullError

    with Engine(rt, EngineConfig(max_running=1, max_queue=2), stepper=SlowStepper(rt, delay=0.01)) as eng:
        eng.ready.wait(10)
        first = eng.submit([1, 5], 50, stop_ids=[])
        while first.t_first is None:  # running, so the queue is empty again
            time.sleep(0.005)
        queued = [eng.submit([1, 6], 3, stop_ids=[]), eng.submit([1, 7], 3, stop_ids=[])]
        with pytest.raises(QueueFullError, match="queue is full") as e:
            eng.submit([1, 8], 3)
        assert e.value.retry_after_s >= 1
        first.cancel()
        assert [q.result(10).finish_reason for q in queued] == ["length", "length"]
        assert eng.submit([1, 8], 2).result(10).finish_reason in ("length", "stop")


def test_bad_requests_are_refused_at_submit(rt):
    from runtime import RequestError
    from runtime.engine import Engine, EngineConfig

    eng = Engine(rt, EngineConfig(warmup=False))  # not started: submit checks before queueing
    with pytest.raises(RequestError, match="temperature"):
        eng.submit([1, 5], 2, temperature=-1)
    with pytest.raises(RequestError, match=f"more than the bundle's max-seq {MAX_SEQ}"):
        eng.submit([5] * (MAX_SEQ + 1), 2)
    with pytest.raises(RequestError, match="max_new_tokens"):
        eng.submit([1, 5], -1)
    assert eng.queue_depth == 0
    with pytest.raises(ValueError, match="max_queue"):
        EngineConfig(max_queue=0)


def test_warmup_runs_before_ready_and_first_request(rt):
    from runtime.engine import Engine

    stepper = SlowStepper(rt)
    eng = Engine(rt, stepper=stepper).start()
    try:
        assert eng.ready.wait(10) and eng.warmup_s is not None and eng.warmup_error is None
        assert stepper.calls == 3 and eng.steps == 0  # prefill chunk, decode, one-token prefill
        r = eng.submit([1, 5], 0)
        assert r.result(5).finish_reason == "length" and r.ids == []
    finally:
        eng.close()


def test_asyncio_consumers(rt):
    from runtime.engine import Engine, EngineConfig

    prompts = [[1, 76, 111], [1, 40], [1, 9, 9, 9]]

    async def consume(eng, p):
        r = eng.submit(p, 10, stop_ids=[])
        return [t.id async for t in r.aiter()], r

    async def main(eng):
        return await asyncio.gather(*(consume(eng, p) for p in prompts))

    with Engine(rt, EngineConfig(**NO_FALLBACKS)) as eng:
        out = asyncio.run(main(eng))
    for (ids, r), p in zip(out, prompts):
        assert ids == r.ids == rt.generate(p, 10, stop_ids=[]).ids


def test_close_cancels_what_is_left(rt):
    from runtime.engine import Engine, EngineClosedError, EngineConfig

    eng = Engine(rt, EngineConfig(max_running=1), stepper=SlowStepper(rt, delay=0.01)).start()
    a, b = eng.submit([1, 5], 60, stop_ids=[]), eng.submit([1, 6], 60, stop_ids=[])
    eng.close()
    assert a.wait(5) and b.wait(5) and {a.finish_reason, b.finish_reason} == {"cancelled"}
    with pytest.raises(EngineClosedError):
        eng.submit([1, 5], 2)
    done = threading.Event()
    threading.Thread(target=lambda: (list(a), done.set())).start()
    assert done.wait(2)  # iteration of a finished request ends


def test_cache_bytes_against_hand_computation():
    """Demo geometry (bundle.json ranks {0: 12+10, 1: 14+8, 2: 12+10}, index_dim 16; config 4 layers,
    2 KV heads of 16): dense 4*2*32*2 = 512 B/position; FP16 position 66*2 + 3*16*2 = 228 B."""
    from types import SimpleNamespace

    from gsm.bundle_format import IndexKeyLayout
    from runtime.metrics import CacheGeometry, cache_bytes, compression_ratio, tier_counts

    model = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    ranks = {0: (12, 10), 1: (14, 8), 2: (12, 10)}
    bundle_cfg = SimpleNamespace(ranks=ranks, index_keys=IndexKeyLayout(16, 16))  # BundleConfig's fields
    geo = CacheGeometry.from_bundle(bundle_cfg, model)
    assert (geo.latent_values, geo.index_bytes, geo.dense_fp16_bytes) == (66, 96, 512)
    # INT8 indexer keys: one byte per channel, 3 layers x 16
    assert CacheGeometry.from_bundle(SimpleNamespace(ranks=ranks, index_keys=IndexKeyLayout(16, 8)),
                                     model).index_bytes == 48
    counts = tier_counts([np.zeros(10, np.int8), np.array([0, 1, 2, 2, 3, 3, 3], np.int8)])
    assert counts.tolist() == [11, 1, 2, 3]
    b = cache_bytes(counts, geo)
    # INT4: half a byte per latent value, 66 * 0.5 = 33 B a position
    assert b == {"fp16": 11 * 132, "int12": 99.0, "int8": 132.0, "int4": 3 * 33.0, "index": 17 * 96}
    assert compression_ratio(counts, geo) == pytest.approx(17 * 512 / (1452 + 99 + 132 + 99 + 17 * 96))
    assert compression_ratio([0, 0, 0, 0], geo) is None


def test_engine_reports_live_tiers(rt):
    """A 48-token prompt: re-tier after prefill demotes positions 1..15 (outside sink 1 and the FP16
    window 32): N=15, n16 = floor(0.25*15) = 3, n12 = floor(0.5*15) - 3 = 4, INT8 8."""
    from runtime.engine import Engine, Observer
    from runtime.metrics import tier_counts

    seen = []

    class Watch(Observer):
        def on_step(self, engine, running):
            seen.append(tier_counts([r.sequence.tiers for r in running]).tolist())

    with Engine(rt, observer=Watch()) as eng:
        eng.submit([1] + list(range(40, 87)), 2, stop_ids=[]).result(10)
    assert seen[0] == [48 - 4 - 8, 4, 8, 0]  # v1 fractions: no INT4 row


def test_failed_warmup_refuses_requests(rt):
    from runtime.engine import Engine, EngineClosedError

    class Broken:
        def new_sequence(self, knobs=None):
            return rt.new_sequence(knobs)

        def step(self, work):
            return [RuntimeError("graph input missing") for _ in work]

    eng = Engine(rt, stepper=Broken()).start()
    assert eng.ready.wait(10) and "graph input missing" in str(eng.warmup_error)
    with pytest.raises(EngineClosedError):
        eng.submit([1, 5], 2)
    eng.close()
