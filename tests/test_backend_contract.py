"""One contract, every backend present (runtime.backend.Backend): onnxruntime and reference here, tensorrt where
TensorRT, a GPU and the plugin library exist (scripts/gpu_check.sh runs this file there; here it skips).

Each test states a behaviour the engine relies on and checks it against an independent run of the same
backend (a sequence alone, a run without probes, a run switched by hand) and, where the numerics allow, against
onnxruntime: the bundle's plugin graph is built with fp32 activations so the plugin path computes what the
portable graph computes to float32 summation order.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from runtime_bundles import build_demo

MAX_SEQ, MAX_INPUT, ROWS = 64, 16, 4
NO_FALLBACKS = dict(min_hit_rate=0.0, max_kv_noise=None)
LONG = [1] + list(range(40, 87))  # 48 tokens: 3 prefill chunks; the pass after the third demotes 12 rows
PROMPTS = [[1, 76, 111, 120], [1] + list(range(40, 60)), [1, 40, 41], [1, 5] * 8, LONG[:30], [1, 9, 10, 11, 12]]


def _trt_reason(bundle) -> str | None:
    from builder.trt_engine import tensorrt_status

    ok, why = tensorrt_status()
    if not ok:
        return why
    from builder.trt_engine import engine_command

    if not (bundle / "engine.plan").exists():
        engine_command(bundle)
    return None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # max_top_k = max-seq: the plugin graph honours every budget, so the dense fallback and the probe's dense
    # call run on it as on onnxruntime
    return build_demo(tmp_path_factory.mktemp("contract") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                      max_batch=ROWS, extra=("--trt-precision", "fp32", "--max-top-k", str(MAX_SEQ)))


@pytest.fixture(scope="module", params=["onnxruntime", "reference", "tensorrt"])
def rt(request, bundle):
    import runtime
    from runtime.ref_backend import reference_usable

    name = request.param
    if name == "reference" and not reference_usable()[0]:
        pytest.skip(f"reference backend: {reference_usable()[1]}")
    if name == "tensorrt" and (why := _trt_reason(bundle)):
        pytest.skip(f"TensorRT backend not testable here: {why}")
    r = runtime.load(bundle, name, **({"threads": 1} if name == "onnxruntime" else {}))
    yield r
    r.backend.close()


@pytest.fixture(scope="module")
def ort(bundle):
    import runtime

    return runtime.load(bundle, "onnxruntime", threads=1)


class CountCalls:
    """Wraps backend.forward to record how many sequences each call carried."""

    def __init__(self, rt):
        self.rt, self.sizes, self.inner = rt, [], rt.backend.forward

    def __enter__(self):
        def forward(caches, *a, **kw):
            self.sizes.append(len(caches))
            return self.inner(caches, *a, **kw)

        self.rt.backend.forward = forward
        return self

    def __exit__(self, *exc):
        self.rt.backend.forward = self.inner


def test_capabilities_are_the_memory_plan(rt):
    """Every backend holds the plan's max_batch rows and no more: one call may carry all of them, the next
    sequence gets CacheFullError naming the limit and the build flag, and a released row is taken again."""
    from runtime.backend import CacheFullError

    caps = rt.capabilities
    assert (caps.max_resident, caps.max_per_call, caps.positions) == (ROWS, ROWS, MAX_SEQ)
    assert caps.hit_rate_probes and caps.kv_noise and rt.can_probe
    seqs = [rt.new_sequence() for _ in range(ROWS)]
    with pytest.raises(CacheFullError, match=f"all {ROWS} cache rows.*--max-batch"):
        rt.new_sequence()
    seqs.pop().close()
    seqs.append(rt.new_sequence())
    for s in seqs:
        s.close()


def test_different_lengths_in_one_call_equal_each_sequence_alone(rt):
    """One prefill call over prompts of 3, 16 and 21 tokens (the last in two chunks) and then one decode call
    per step over all three: each sequence's logits equal that sequence run alone, step for step."""
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[1]]
    alone = []
    for p in prompts:
        s = rt.new_sequence()
        out, toks = [s.prefill(p)], []
        for _ in range(6):
            toks.append(int(np.argmax(out[-1])))
            out.append(s.decode(toks[-1]))
        alone.append((out, toks))
        s.close()
    seqs = [rt.new_sequence() for _ in prompts]
    with CountCalls(rt) as calls:
        got = [rt.prefill_batch(seqs, prompts)]
        for i in range(6):
            got.append(rt.decode_batch(seqs, [a[1][i] for a in alone]))
    assert max(calls.sizes) == 3, "the sequences did not share a call"
    for b, (out, _) in enumerate(alone):
        for i, want in enumerate(out):
            np.testing.assert_allclose(got[i][b], want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"sequence {b}, step {i}")
    for s in seqs:
        s.close()


def test_concurrent_greedy_equals_sequential(rt):
    """The engine with the backend's default stepper and six requests (two more than the rows, different
    lengths, one prompt in two chunks, one ending by context): each answer equals the request run alone, and
    the backend carried several sequences per call."""
    from runtime.engine import Engine, EngineConfig

    reqs = [(p, 20) for p in PROMPTS] + [([1, 5] * 25, 20)]  # 50 + 20 > 64: ends by "context"
    alone = [rt.generate(p, n, stop_ids=[]) for p, n in reqs]
    assert {g.finish_reason for g in alone} == {"length", "context"}
    with CountCalls(rt) as calls, Engine(rt, EngineConfig(**NO_FALLBACKS)) as eng:
        got = [eng.submit(p, n, stop_ids=[]) for p, n in reqs]
        got = [r.result(120) for r in got]
    for g, a in zip(got, alone):
        assert (g.ids, g.finish_reason) == (a.ids, a.finish_reason)
    assert max(calls.sizes) == ROWS  # as many per call as the plan holds, never more


def test_drafting_gives_the_tokens_of_one_token_steps(rt):
    """Every backend verifies drafts (Capabilities.verify_rows > 1: its graph returns each logit row's query_mass):
    greedy, alone and in the engine, the tokens of `speculative="off"` token for token, and the answer of each request
    alone; the repeating prompt's drafts were verified and some kept."""
    from runtime.engine import Engine, EngineConfig
    from runtime.request import TokenStream

    assert rt.capabilities.verify_rows == MAX_INPUT
    reqs = [(p, 20) for p in PROMPTS] + [([1, 5, 9] * 6, 24)]
    off = [rt.generate(p, n, stop_ids=[], speculative="off").ids for p, n in reqs]
    on = [rt.request(p, n, stop_ids=[], speculative="auto") for p, n in reqs]
    assert [TokenStream(rt, r).collect().ids for r in on] == off
    assert on[-1].draft_length.drafted > 0 and on[-1].draft_length.accepted > 0
    with Engine(rt, EngineConfig(**NO_FALLBACKS)) as eng:
        got = [r.result(120).ids for r in [eng.submit(p, n, stop_ids=[], speculative="auto") for p, n in reqs]]
    assert got == off


def test_retier_passes_in_a_batch_equal_alone(rt):
    """A 48-token prompt next to short ones: its re-tier passes (every tier reached) give the same tiers, KV
    noise and tokens in a shared call as alone; the noise is measured on every backend."""
    alone = rt.new_sequence()
    logits, toks = alone.prefill(LONG), []
    noise = alone.last_kv_noise
    for _ in range(8):
        toks.append(int(np.argmax(logits)))
        logits = alone.decode(toks[-1])
    tiers = alone.state.tier.copy()
    assert noise is not None and 0 < noise < 0.05
    alone.close()
    seqs = [rt.new_sequence() for _ in range(3)]
    out = rt.prefill_batch(seqs, [LONG, PROMPTS[0], PROMPTS[2]])
    assert seqs[0].last_kv_noise == pytest.approx(noise, rel=1e-5)
    got = []
    for _ in range(8):
        got.append(int(np.argmax(out[0])))
        out = rt.decode_batch(seqs, [got[-1], 7, 8])
    assert got == toks
    assert np.array_equal(seqs[0].state.tier, tiers) and set(tiers[:len(LONG)].tolist()) >= {0, 1}
    for s in seqs:
        s.close()


def test_kv_noise_agrees_with_onnxruntime(rt, ort):
    """The same prompt's end-of-prefill pass: the KV noise the backend reads back equals onnxruntime's, which
    measures it on its float32 latents (tests/test_fallbacks.py checks that one against a hand computation)."""
    a, b = rt.new_sequence(), ort.new_sequence()
    a.prefill(LONG)
    b.prefill(LONG)
    assert a.last_kv_noise == pytest.approx(b.last_kv_noise, rel=1e-3)
    a.close()
    b.close()


def test_probe_leaves_the_cache_as_it_was(rt, ort):
    """A probed decode step (the dense shadow call first, then the real one) in a batch: the same logits and
    the same next steps as without the probe, for the probed sequence and its neighbours; the hit rate is in
    (0, 1) and equals onnxruntime's."""
    prompts = [LONG[:40], PROMPTS[1], PROMPTS[0]]

    def run(probe_at):
        seqs = [rt.new_sequence() for _ in prompts]
        out, rates = [rt.prefill_batch(seqs, prompts)], None
        for i in range(5):
            out.append(rt.decode_batch(seqs, [3 + i, 4, 5], probe=[i == probe_at, False, False]))
            if i == probe_at:
                rates = seqs[0].last_hit_rate, dict(seqs[0].last_hit_rates)
        for s in seqs:
            s.close()
        return out, rates

    plain, _ = run(-1)
    probed, (rate, per_layer) = run(1)
    for i, (x, y) in enumerate(zip(plain, probed)):
        assert np.array_equal(x, y), f"step {i} changed by the probe"
    assert 0 < rate < 1
    b = ort.new_sequence()
    b.prefill(prompts[0])
    b.decode(3)
    b.decode(4, probe=True)
    assert rate == pytest.approx(b.last_hit_rate, abs=1e-4)
    assert per_layer == pytest.approx(b.last_hit_rates, abs=1e-4)
    b.close()


def test_cancellation_frees_its_row(rt):
    """A cancelled request gives its row back at once: with every row taken by running requests, a cancel lets
    the waiting request start, and afterwards no row is left in use."""
    from runtime.engine import Engine, EngineConfig

    pool = rt.backend.plugin_rows.pool if hasattr(rt.backend, "plugin_rows") else rt.backend.pool
    with Engine(rt, EngineConfig(**NO_FALLBACKS)) as eng:
        long = [eng.submit([1, 7 + i], 40, stop_ids=[]) for i in range(ROWS)]
        for r in long:
            next(iter(r))
        waiting = eng.submit([1, 30], 5, stop_ids=[])
        assert pool.in_use == ROWS and not waiting.done
        long[0].cancel()
        assert waiting.result(60).finish_reason == "length"
        assert long[0].result(10).finish_reason == "cancelled"
        for r in long[1:]:
            r.result(120)
    assert pool.in_use == 0


def test_admission_never_exceeds_the_rows(rt):
    """More requests than rows, max_running asked above them: the engine runs at most the plan's rows at once
    (the rest wait and all complete), and a request that can never fit is refused at submit naming max-seq."""
    from runtime.engine import Engine, EngineConfig, Observer
    from runtime.sampling import RequestError

    seen = []

    class Watch(Observer):
        def on_step(self, engine, running):
            seen.append(len(running))

    with Engine(rt, EngineConfig(max_running=16, **NO_FALLBACKS), observer=Watch()) as eng:
        assert eng.budget.max_running == ROWS and eng.budget.clamped
        reqs = [eng.submit([1, 20 + i], 6, stop_ids=[]) for i in range(2 * ROWS + 1)]
        assert all(r.result(120).finish_reason == "length" for r in reqs)
        with pytest.raises(RequestError, match="max-seq"):
            eng.submit(list(range(1, MAX_SEQ + 2)), 4)
    assert max(seen) == ROWS


def _events(eng_cfg, rt, prompt, n):
    from runtime.engine import Engine, Observer

    events = []

    class Rec(Observer):
        def on_fallback(self, req, policy, value):
            events.append((policy, len(req.ids), round(float(value), 3)))

    with Engine(rt, eng_cfg, observer=Rec()) as eng:
        r = eng.submit(prompt, n, stop_ids=[]).result(120)
        counts = dict(eng.fallbacks)
    return r, counts, events


def test_hit_rate_fallback_fires_as_on_onnxruntime(rt, ort):
    """Forced threshold (1.0, every step probed): the first probed step falls back to dense attention, at the
    same step with the same hit rate and the same tokens as on onnxruntime; the tokens equal the backend's own
    sequence switched to dense by hand after that step."""
    from runtime.engine import EngineConfig

    cfg = EngineConfig(min_hit_rate=1.0, hit_rate_every=1, max_kv_noise=None)
    r, counts, events = _events(cfg, rt, LONG, 10)
    assert counts == {"hit_rate": 1, "kv_noise": 0} and r.sequence.dense
    r_ort, _, events_ort = _events(cfg, ort, LONG, 10)
    assert events == events_ort and r.ids == r_ort.ids
    seq = rt.new_sequence()
    logits, ref = seq.prefill(LONG), []
    for i in range(10):
        ref.append(int(np.argmax(logits)))
        if i < 9:
            logits = seq.decode(ref[-1])
        if i == 0:
            seq.use_dense()
    seq.close()
    assert r.ids == ref
    assert ref != rt.generate(LONG, 10, stop_ids=[]).ids, "dense and sparse agree: the test would prove nothing"


def test_kv_noise_fallback_fires_as_on_onnxruntime(rt, ort):
    """Forced threshold (0.0): the end-of-prefill pass re-encodes rows, so the cache is rebuilt at FP16, once,
    as on onnxruntime; the tokens equal onnxruntime's and a run whose tier policy never demotes."""
    import dataclasses

    import runtime
    from runtime.engine import EngineConfig

    cfg = EngineConfig(min_hit_rate=0.0, max_kv_noise=0.0)
    r, counts, events = _events(cfg, rt, LONG, 10)
    r_ort, _, events_ort = _events(cfg, ort, LONG, 10)
    assert counts == {"hit_rate": 0, "kv_noise": 1} and r.sequence.refreshes == 1
    assert [e[:2] for e in events] == [e[:2] for e in events_ort] == [("kv_noise", 1)]
    assert events[0][2] == pytest.approx(events_ort[0][2], abs=2e-3)
    fp16 = runtime.load(rt.bundle, rt.backend.name, **({"threads": 1} if rt.backend.name == "onnxruntime" else {}))
    fp16.knobs = dataclasses.replace(fp16.knobs, fp16_window=fp16.n_max)
    assert r.ids == r_ort.ids == fp16.generate(LONG, 10, stop_ids=[]).ids


def test_serve_reference_eight_concurrent_equal_sequential(bundle, tmp_path):
    """`python -m runtime serve BUNDLE --backend reference`: 8 concurrent greedy completions over HTTP equal
    the same 8 sent one after another, token for token."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    from runtime.ref_backend import reference_usable

    if not reference_usable()[0]:
        pytest.skip(reference_usable()[1])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bundle), "--backend", "reference",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read())
            time.sleep(0.2)
        prompts = ["Once upon a time", "The cat", "A dog ran", "Hello", "It was", "She said", "In the", "Tom"]

        def ask(p):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        one_by_one = [ask(p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, prompts))
        assert together == one_by_one
        assert len(set(one_by_one)) > 1
    finally:
        proc.terminate()
        proc.wait(30)
