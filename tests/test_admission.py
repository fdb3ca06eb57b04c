"""Admission by memory: the engine runs no more requests than the bundle's memory plan has cache rows
(bundle.json max_batch), a burst larger than the plan waits in the queue and is all answered as if each
request ran alone, the backend never allocates past the plan, and a request that can never fit is refused
with the limit named (engine: RequestError; server: HTTP 400)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
from runtime_bundles import build_demo

MAX_SEQ, MAX_INPUT, MAX_BATCH = 64, 16, 2
NO_FALLBACKS = dict(min_hit_rate=0.0, max_kv_noise=None)  # a sequence then runs exactly as rt.generate runs it
# prompts of several lengths (one over max-input: two prefill chunks), one that ends by the context
BURST = [([1, 76, 111, 120], 12), ([1] + list(range(40, 60)), 10), ([1, 40, 41], 16), ([1, 5] * 25, 20),
         ([1, 200, 201], 8), ([1, 9, 9, 9, 9], 14), ([1, 300], 6)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build_demo(tmp_path_factory.mktemp("adm") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                      max_batch=MAX_BATCH)


@pytest.fixture
def rt(bundle):
    import runtime

    return runtime.load(bundle, "onnxruntime", threads=1)


class RowCounter:
    """Wraps the backend's new_cache / release: the most rows ever held at once, from outside the backend."""

    def __init__(self, backend):
        self.held = self.peak = self.allocations = 0
        self.lock = threading.Lock()
        new, rel = backend.new_cache, backend.release

        def new_cache():
            c = new()
            with self.lock:
                self.held += 1
                self.allocations += 1
                self.peak = max(self.peak, self.held)
            return c

        def release(cache):
            if not cache.released:
                with self.lock:
                    self.held -= 1
            rel(cache)

        backend.new_cache, backend.release = new_cache, release


def test_capabilities_state_the_plan(bundle, rt):
    plan = json.loads((bundle / "plan.json").read_text())
    caps = rt.capabilities
    assert plan["max_batch"] == MAX_BATCH and caps.max_resident == MAX_BATCH and caps.positions == MAX_SEQ
    assert caps.hit_rate_probes and caps.kv_noise
    # the bytes the buffers really hold, counted from the arrays
    assert caps.kv_budget_bytes == sum(b.nbytes for b in rt.backend.buffers.values())
    assert {b.shape[0] for b in rt.backend.buffers.values()} == {MAX_BATCH}
    # the plan states what this backend holds (builder.plan.cpu_cache_bytes): the TensorRT pools (kv_pool_bytes, from
    # the tier layout) less the slot tables (host tables here), plus each row's row cache of K rows
    assert plan["cpu_kv_bytes"] == caps.kv_budget_bytes == \
        plan["kv_pool_bytes"] - MAX_BATCH * MAX_SEQ * 4 + MAX_BATCH * plan["row_cache_bytes"]
    assert plan["row_cache_bytes"] > 0


def test_a_smaller_row_cache_factor_is_what_the_backend_holds(bundle, tmp_path):
    """--row-cache-factor 1: each layer's row cache holds the sinks, the window and one top-k of K rows (the model's
    config, worked out with the plan's formula at factor 1), the backend allocates exactly the plan's bytes, fewer than
    the default build's, and the call's tokens come out the same."""
    import runtime
    from builder.plan import row_cache_capacity
    from gsm.checkpoint import load_config

    small = build_demo(tmp_path / "f1", max_seq=MAX_SEQ, max_input=MAX_INPUT, max_batch=MAX_BATCH,
                       extra=("--row-cache-factor", "1"))
    plan, default = (json.loads((b / "plan.json").read_text()) for b in (small, bundle))
    assert plan["row_cache_factor"] == 1 and default["row_cache_factor"] == 3
    assert 0 < plan["row_cache_bytes"] < default["row_cache_bytes"]
    cfg = load_config(small)
    rt1 = runtime.load(small, "onnxruntime", threads=1)
    be = rt1.backend
    for i in range(cfg.num_hidden_layers):
        assert be.buffers[f"row_cache.{i}"].shape[1] == row_cache_capacity(cfg, i, MAX_SEQ, 1)
    assert plan["cpu_kv_bytes"] == rt1.capabilities.kv_budget_bytes == sum(b.nbytes for b in be.buffers.values())
    prompt = [1] + list(range(40, 90))
    assert rt1.generate(prompt, 12).ids == runtime.load(bundle, "onnxruntime", threads=1).generate(prompt, 12).ids


def test_plugin_backend_memory_is_the_plans_pools(bundle):
    """The reference backend holds exactly the pools the plan counts for TensorRT (kv_pool_bytes: latent pools,
    indexer keys and slot tables of every row), allocated once."""
    import runtime
    from runtime.ref_backend import reference_usable

    if not reference_usable()[0]:
        pytest.skip(reference_usable()[1])
    plan = json.loads((bundle / "plan.json").read_text())
    ref = runtime.load(bundle, "reference")
    assert ref.capabilities.kv_budget_bytes == plan["kv_pool_bytes"]
    assert ref.capabilities.kv_budget_bytes == sum(b.nbytes for b in ref.backend.buffers.values()) + \
        MAX_BATCH * MAX_SEQ * 4  # + one int32 slot table per row


@pytest.mark.parametrize("asked, want", [(0, MAX_BATCH), (1, 1), (MAX_BATCH, MAX_BATCH), (8, MAX_BATCH)])
def test_max_running_is_clamped_to_the_rows(rt, asked, want, caplog):
    from runtime.engine import Engine, EngineConfig

    with caplog.at_level("INFO", logger="runtime.engine"):
        eng = Engine(rt, EngineConfig(max_running=asked, warmup=False))
    assert eng.max_running == want
    line = next(r for r in caplog.records if "cache row" in r.getMessage())
    assert f"{MAX_BATCH} cache row(s) of {MAX_SEQ} positions" in line.getMessage()
    assert ("clamped" in line.getMessage()) == (asked > MAX_BATCH)  # 0: the bundle's max_batch, nothing to clamp


def test_burst_past_the_plan_is_all_answered_as_alone(rt):
    from runtime.engine import Engine, EngineConfig, Observer

    alone = [rt.generate(p, n, temperature=0.0, stop_ids=[]) for p, n in BURST]
    assert "context" in {g.finish_reason for g in alone}
    rows = RowCounter(rt.backend)

    class Order(Observer):
        def __init__(self):
            self.started, self.widest = [], 0

        def on_step(self, engine, running):
            self.widest = max(self.widest, len(running))
            self.started += [r.id for r in running if r.id not in self.started]

    order = Order()
    with Engine(rt, EngineConfig(max_running=8, **NO_FALLBACKS), observer=order) as eng:  # 8 asked, 2 rows
        reqs = [eng.submit(p, n, temperature=0.0, stop_ids=[]) for p, n in BURST]
        got = [r.result(120) for r in reqs]
    for g, a in zip(got, alone):
        assert g.ids == a.ids and g.finish_reason == a.finish_reason
    assert rows.peak <= MAX_BATCH and order.widest == MAX_BATCH  # the plan filled, never exceeded
    assert rows.held == 0  # every finished request gave its row back
    assert rows.allocations == len(BURST) + 2  # one row per request, and warm-up's two sequences one after another
    assert order.started == sorted(order.started) == [r.id for r in reqs]  # first come, first served


def test_cancelled_requests_free_their_row(rt):
    from runtime.engine import Engine, EngineConfig

    rows = RowCounter(rt.backend)
    with Engine(rt, EngineConfig(warmup=False, **NO_FALLBACKS)) as eng:
        long = [eng.submit([1, 7], 60, temperature=0.0, stop_ids=[]) for _ in range(MAX_BATCH)]
        last = eng.submit([1, 8, 9], 5, temperature=0.0, stop_ids=[])
        t0 = time.monotonic()
        while len(eng.running) < MAX_BATCH:
            assert time.monotonic() - t0 < 30
            time.sleep(0.005)
        assert eng.queue_depth == 1  # the third waits: no row for it
        for r in long:
            r.cancel()
        assert last.result(60).ids == rt.generate([1, 8, 9], 5, temperature=0.0, stop_ids=[]).ids
    assert {r.finish_reason for r in long} <= {"cancelled", "length"} and rows.peak <= MAX_BATCH
    assert rows.held == 0


def test_a_prompt_longer_than_a_row_is_refused_at_submit(rt):
    from runtime.engine import Engine, EngineConfig
    from runtime.sampling import RequestError

    with Engine(rt, EngineConfig(warmup=False)) as eng:
        with pytest.raises(RequestError, match=f"the prompt is {MAX_SEQ + 1} tokens, more than the bundle's "
                                               f"max-seq {MAX_SEQ}.*--max-seq"):
            eng.submit([1] * (MAX_SEQ + 1), 4)
        assert eng.submit([1] * MAX_SEQ, 4).result(30).finish_reason == "context"  # a full row still runs


def test_server_refuses_what_never_fits_and_answers_a_burst(rt):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    from runtime.engine import Engine, EngineConfig
    from runtime.serve.app import Server

    prompts = [p for p, _ in BURST[:5]]
    alone = [rt.generate(p, 10, temperature=0.0) for p in prompts]
    rows = RowCounter(rt.backend)
    eng = Engine(rt, EngineConfig(**NO_FALLBACKS)).start()
    assert eng.ready.wait(30)
    srv = Server(eng, model_name="demo")

    async def burst():
        transport = httpx.ASGITransport(app=srv.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in prompts]
            bodies.insert(2, {"prompt": [1] * (MAX_SEQ + 20), "max_tokens": 10})
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    async def health():
        transport = httpx.ASGITransport(app=srv.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            return (await c.get("/health")).json()

    try:
        res = asyncio.run(burst())
        h = asyncio.run(health())
    finally:
        eng.close()
    assert h["kv_rows"] == h["max_running"] == MAX_BATCH
    assert h["kv_budget_bytes"] == sum(b.nbytes for b in rt.backend.buffers.values())
    refused = res.pop(2)
    assert refused.status_code == 400
    e = refused.json()["error"]
    assert e["param"] == "prompt" and f"more than the bundle's max-seq {MAX_SEQ}" in e["message"]
    assert [r.status_code for r in res] == [200] * len(prompts)
    assert [r.json()["usage"]["completion_tokens"] for r in res] == [len(a.ids) for a in alone]
    assert [r.json()["choices"][0]["text"] for r in res] == [a.text for a in alone]
    assert rows.peak <= MAX_BATCH and rows.held == 0
    assert np.all(np.array([b.shape[0] for b in rt.backend.buffers.values()]) == MAX_BATCH)
