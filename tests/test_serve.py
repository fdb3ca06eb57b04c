"""`python -m runtime serve` (issue 10): the OpenAI client library against a uvicorn server on
127.0.0.1 (streaming and not, completions and chat, concurrent clients equal sequential runs), every
bad input of the issue as a 400 with an OpenAI error body, queue full as 429 with Retry-After, a
client disconnect that cancels, /health before and after warm-up, /metrics parsed with
prometheus_client's parser, and no torch import."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from runtime_bundles import ROOT, SERVE_MAX_INPUT, SERVE_MAX_SEQ, SERVE_VOCAB, run_module

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MAX_SEQ, MAX_INPUT, VOCAB = SERVE_MAX_SEQ, SERVE_MAX_INPUT, SERVE_VOCAB  # the conftest `bundles` / `rts`


class SlowStepper:
    def __init__(self, rt, delay):
        from runtime.engine import SequentialStepper

        self.inner, self.delay = SequentialStepper(rt), delay

    def new_sequence(self, knobs=None):
        return self.inner.new_sequence(knobs)

    def step(self, work):
        time.sleep(self.delay)
        return self.inner.step(work)


@contextlib.contextmanager
def live_server(rt, name="demo", *, config=None, stepper=None, start=True, guard=None):
    """Engine + Server on uvicorn at 127.0.0.1 on a free port, in a thread; yields (server, base url)."""
    import uvicorn

    from runtime.engine import Engine, EngineConfig
    from runtime.serve.app import Server

    # fallbacks off by default here: the tests compare the server's tokens with the plain runtime's
    eng = Engine(rt, config or EngineConfig(min_hit_rate=0.0, max_kv_noise=None), stepper=stepper)
    srv = Server(eng, model_name=name, guard=guard)
    if start:
        eng.start()
        assert eng.ready.wait(30)
    uv = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not uv.started:
        assert time.monotonic() - t0 < 30 and th.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        th.join(10)
        eng.close()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0)


def metric_samples(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


PROMPTS = ["Once upon a time", "The cat sat", "A", "She said hello to the", "x y z", "The end", "Tim", "big red"]


def test_completions_match_the_runtime_streaming_and_not(rts):
    rt = rts["demo"]
    ref = rt.generate("Once upon a time", 12, temperature=0.0)
    with live_server(rt) as (_, url):
        c = client(url)
        r = c.completions.create(model="demo", prompt="Once upon a time", max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_ids) and r.usage.completion_tokens == len(ref.ids)
        chunks = list(c.completions.create(model="demo", prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text
        assert [ch.choices[0].finish_reason for ch in chunks][-1] == ref.finish_reason
        assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
        r = c.completions.create(model="demo", prompt=[1, 76, 111], max_tokens=5, temperature=0.8, seed=4,
                                 extra_body={"stop_token_ids": []})
        assert r.choices[0].text == rt.generate([1, 76, 111], 5, temperature=0.8, seed=4, stop_ids=[]).text
        assert [m.id for m in c.models.list().data] == ["demo"]


def test_chat_streaming_with_the_bundle_template(rts):
    rt = rts["chat"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a scratch."}]
    ref = rt.chat(msgs, 12, temperature=0.0)  # the 52-token prompt leaves 12 of the 64 positions
    with live_server(rt, "chat") as (_, url):
        c = client(url)
        r = c.chat.completions.create(model="chat", messages=msgs, max_tokens=12, temperature=0)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
        assert r.choices[0].model_extra["gsm_finish_reason"] == ref.finish_reason  # the engine's own reason
        assert r.choices[0].finish_reason == {"context": "length"}.get(ref.finish_reason, ref.finish_reason)
        assert r.usage.prompt_tokens == len(ref.prompt_ids)
        chunks = list(c.chat.completions.create(model="chat", messages=msgs, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.ids)


def test_concurrent_streaming_clients_equal_sequential(rts):
    rt = rts["demo"]
    refs = [rt.generate(p, 24, temperature=0.0, stop_ids=[]) for p in PROMPTS]
    with live_server(rt) as (srv, url):
        c = client(url)

        def one(p):
            s = c.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0, stream=True,
                                     extra_body={"stop_token_ids": []})
            return "".join(ch.choices[0].text for ch in s)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, PROMPTS))
        assert got == [r.text for r in refs]
        m = metric_samples(url)
    n_out = sum(len(r.ids) for r in refs)
    assert m[("gsm_requests_total", (("finish_reason", "length"),))] == len(PROMPTS)
    assert m[("gsm_generation_tokens_total", ())] == n_out
    assert m[("gsm_prompt_tokens_total", ())] == sum(len(r.prompt_ids) for r in refs)
    assert m[("gsm_time_to_first_token_seconds_count", ())] == len(PROMPTS)
    assert m[("gsm_request_latency_seconds_count", ())] == len(PROMPTS)
    assert m[("gsm_running_sequences", ())] == 0 and m[("gsm_queue_depth", ())] == 0
    # prompts and 24 new tokens stay inside the FP16 window: every row FP16, by hand
    # 4 layers x 2 x 32 x 2 = 512 dense bytes / (66 latent values x 2 + 3 x 16 x 2) = 228 bytes per position
    assert m[("gsm_kv_compression_ratio", ())] == pytest.approx(512 / 228)


def err(r, status=400):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


LONG = "xyz" * 30  # one token per character in the demo vocabulary: 91 tokens > max-seq 64
BAD = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1, "x"]}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": "x", "model": 7}, "model"),
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "max_tokens": 64}, "max_tokens"),  # prompt + 64 > max-seq 64
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ("completions", {"prompt": "x", "response_format": "json"}, "response_format"),
    ("completions", {"prompt": LONG}, "prompt"),
    ("completions", {"prompt": [1, VOCAB]}, "prompt"),
    ("completions", {"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, "messages[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # no chat template
]


def test_bad_input_is_400_with_an_openai_error_and_the_server_lives(rts):
    with live_server(rts["demo"]) as (_, url):
        for path, body, param in BAD:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = httpx.post(f"{url}/v1/{path}", content=data, headers={"Content-Type": "application/json"}, timeout=10)
            e = err(r)
            assert e["param"] == param, (body, e)
            if param == "model" and body.get("model") == "gpt-4":
                assert e["code"] == "model_not_found"
            if body is not None and not isinstance(body, bytes) and body.get("prompt") == LONG:
                assert "more than the bundle's max-seq 64" in e["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        with pytest.raises(openai.BadRequestError):  # what the client library makes of it
            client(url).completions.create(model="demo", prompt="x", max_tokens=0)
        m = metric_samples(url)
        assert m[("gsm_requests_rejected_total", (("reason", "bad_request"),))] == len(BAD) + 1


def test_queue_full_is_429_with_retry_after(rts):
    from runtime.engine import EngineConfig

    rt = rts["demo"]
    with live_server(rt, config=EngineConfig(max_running=1, max_queue=1), stepper=SlowStepper(rt, 0.01)) as (srv, url):
        a = srv.engine.submit([1, 5], 50, stop_ids=[])
        while a.t_first is None:
            time.sleep(0.005)
        b = srv.engine.submit([1, 6], 50, stop_ids=[])  # the queue's one place
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        e = err(r, 429)
        assert e["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        a.cancel(), b.cancel()
        b.wait(10)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200
        assert metric_samples(url)[("gsm_requests_rejected_total", (("reason", "queue_full"),))] == 1


def test_client_disconnect_mid_stream_cancels(rts):
    rt = rts["demo"]
    with live_server(rt, stepper=SlowStepper(rt, 0.02)) as (srv, url):
        with httpx.stream("POST", url + "/v1/completions", timeout=10,
                          json={"prompt": "Once", "max_tokens": 60, "stream": True, "stop_token_ids": []}) as r:
            got = []
            for ln in r.iter_lines():
                if ln.startswith("data:"):
                    got.append(ln)
                if len(got) == 2:
                    break
        t0 = time.monotonic()
        key = ("gsm_requests_total", (("finish_reason", "cancelled"),))
        while metric_samples(url)[key] != 1:
            assert time.monotonic() - t0 < 10, "the request was not cancelled"
            time.sleep(0.05)
        assert srv.engine.running == []
        m = metric_samples(url)
        assert m[("gsm_generation_tokens_total", ())] < 60 and m[("gsm_running_sequences", ())] == 0


def test_health_waits_for_warmup(rts):
    from starlette.testclient import TestClient

    from runtime.engine import Engine
    from runtime.serve.app import Server

    eng = Engine(rts["demo"])
    srv = Server(eng, model_name="demo")
    with TestClient(srv.app) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up" and r.headers["Retry-After"] == "1"
        assert err(tc.post("/v1/completions", json={"prompt": "x"}), 503)["type"] == "server_error"
        eng.start()
        assert eng.ready.wait(30)
        r = tc.get("/health")
        assert r.status_code == 200 and r.json()["warmup_s"] > 0
        assert r.json()["backend"] == "onnxruntime" and r.json()["graph"] == eng.rt.backend.graph  # which network runs
        r = tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    eng.close()


def test_serving_never_imports_torch(bundles):
    code = (
        "import sys\n"
        "from starlette.testclient import TestClient\n"
        "import runtime\n"
        "from runtime.engine import Engine\n"
        "from runtime.serve.app import Server\n"
        f"eng = Engine(runtime.load({str(bundles['demo'])!r}, 'onnxruntime', threads=1)).start()\n"
        "tc = TestClient(Server(eng, model_name='demo').app)\n"
        "assert eng.ready.wait(30)\n"
        "r = tc.post('/v1/completions', json={'prompt': 'x', 'max_tokens': 2})\n"
        "assert r.status_code == 200, r.text\n"
        "eng.close()\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'gsm.golden')\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("args,words", [
    (["/nonexistent/bundle"], "bundle"),
    (["BUNDLE", "--port", "70000"], "--port"),
    (["BUNDLE", "--max-queue", "0"], "--max-queue"),
    (["BUNDLE", "--deadline", "-1"], "--deadline"),
    (["BUNDLE", "--min-hit-rate", "1.5"], "--min-hit-rate"),
    (["BUNDLE", "--hit-rate-every", "-1"], "--hit-rate-every"),
    (["BUNDLE", "--max-kv-noise", "-0.1"], "--max-kv-noise"),
    (["BUNDLE", "--max-kv-noise", "nan"], "--max-kv-noise"),
])
def test_serve_cli_bad_input_is_one_error_line(bundles, args, words):
    args = [str(bundles["demo"]) if a == "BUNDLE" else a for a in args]
    r = run_module("runtime", "serve", *args, cwd=bundles["demo"].parent, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and words in errors[0], r.stderr


def test_serve_fallback_flags():
    import argparse

    from runtime.serve.cli import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["serve", "b"])  # unset: the bundle's run_time thresholds (0.85, 64, auto as built)
    assert (a.min_hit_rate, a.hit_rate_every, getattr(a, "max_kv_noise", "unset")) == (None, None, "unset")
    a = p.parse_args(["serve", "b", "--min-hit-rate", "1", "--hit-rate-every", "0", "--max-kv-noise", "off"])
    assert (a.min_hit_rate, a.hit_rate_every, a.max_kv_noise) == (1.0, 0, None)


def test_tegrastats_figures_in_metrics(rts):
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient
    from test_tegrastats import ORIN_NANO

    from jetson.tegrastats import TegrastatsMonitor
    from runtime.engine import Engine
    from runtime.serve.app import Server

    mon = TegrastatsMonitor()
    srv = Server(Engine(rts["demo"]), model_name="demo", tegrastats=mon)
    with TestClient(srv.app) as tc:
        assert "gsm_gpu_load_ratio" not in tc.get("/metrics").text  # no sample yet: nothing made up
        mon.feed(ORIN_NANO)
        fams = {s.name: s for f in text_string_to_metric_families(tc.get("/metrics").text) for s in f.samples
                if s.name != "gsm_device_power_watts"}
        rails = {s.labels["rail"]: s.value for f in text_string_to_metric_families(tc.get("/metrics").text)
                 for s in f.samples if s.name == "gsm_device_power_watts"}
    assert fams["gsm_device_memory_used_bytes"].value == 3162 * 2**20
    assert fams["gsm_device_memory_total_bytes"].value == 7620 * 2**20
    assert fams["gsm_gpu_load_ratio"].value == pytest.approx(0.01)
    assert rails == {"VDD_IN": 3.913, "VDD_CPU_GPU_CV": 0.598, "VDD_SOC": 1.238}


def test_compression_ratio_fallback_forced_threshold(rts, bundles, tmp_path, caplog):
    """The demo's FP16 rows give 512/228 = 2.25 < 2.5: the default threshold fires; a forced threshold
    of 2.0 does not. The integrity check passes on the real bundle and fails on a changed copy."""
    import logging
    import shutil

    from starlette.testclient import TestClient

    import runtime
    from runtime.engine import Engine
    from runtime.serve.app import Server
    from runtime.serve.fallbacks import FallbackConfig

    def serve_one(rt, cfg):
        eng = Engine(rt).start()
        srv = Server(eng, model_name="demo", fallbacks=cfg)
        assert eng.ready.wait(30)
        with TestClient(srv.app) as tc:
            for _ in range(2):  # the second is inside the check interval: counted once
                assert tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
            if srv.ratio_policy is not None and srv.ratio_policy.checks == 0 and srv.ratio_policy._last is not None:
                assert srv.ratio_policy.check_done.wait(30)
            from prometheus_client.parser import text_string_to_metric_families

            m = {(s.name, tuple(s.labels.items())): s.value
                 for f in text_string_to_metric_families(tc.get("/metrics").text) for s in f.samples}
        eng.close()
        return {("gsm_bundle_integrity_ok", ()) if k[0] == "gsm_bundle_integrity_ok" else k: v for k, v in m.items()}

    caplog.set_level(logging.INFO, logger="runtime.serve.fallbacks")
    m = serve_one(rts["demo"], FallbackConfig(min_compression_ratio=2.0))
    assert m[("gsm_fallbacks_total", (("policy", "compression_ratio"),))] == 0
    assert ("gsm_bundle_integrity_ok", ()) not in m
    m = serve_one(rts["demo"], FallbackConfig())  # the published 2.5
    assert m[("gsm_fallbacks_total", (("policy", "compression_ratio"),))] == 1
    assert m[("gsm_bundle_integrity_ok", ())] == 1
    assert "KV compression ratio 2.25 < 2.50" in caplog.text
    bad = tmp_path / "bad"
    shutil.copytree(bundles["demo"], bad)
    rt = runtime.load(bad, "onnxruntime", threads=1)
    (bad / "plan.json").write_text((bad / "plan.json").read_text() + " ")  # changed after load
    m = serve_one(rt, FallbackConfig())
    assert m[("gsm_bundle_integrity_ok", ())] == 0 and "integrity check FAILED" in caplog.text


def test_sequence_fallbacks_in_metrics(rts):
    """Forced thresholds through the server: hit rate 1.0 (every step probed) and KV noise 0.0 on a
    48-token prompt (its re-tier pass demotes rows): each policy once, counted by kind, and the two
    GSM series carry the values the engine measured (tests/test_fallbacks.py checks the switch itself)."""
    from runtime.engine import EngineConfig, Observer

    rt = rts["demo"]
    assert rt.can_probe
    seen = {}

    class Seen(Observer):
        def on_hit_rate(self, req, hit_rate):
            seen.setdefault("hit_rate", hit_rate)

        def on_kv_noise(self, req, noise):
            seen.setdefault("noise", noise)

    cfg = EngineConfig(min_hit_rate=1.0, hit_rate_every=1, max_kv_noise=0.0)
    with live_server(rt, config=cfg) as (srv, url):
        srv.engine.observers.append(Seen())
        before = metric_samples(url)  # no measurement yet: the two series are absent, not 0
        assert ("gsm_sparse_mask_hit_rate", ()) not in before and ("gsm_shared_kv_noise_level", ()) not in before
        r = httpx.post(url + "/v1/completions", json={"prompt": [1] + list(range(40, 87)), "max_tokens": 6,
                                                      "temperature": 0, "stop_token_ids": []}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        m = metric_samples(url)
    assert m[("gsm_fallbacks_total", (("policy", "hit_rate"),))] == 1
    assert m[("gsm_fallbacks_total", (("policy", "kv_noise"),))] == 1
    assert m[("gsm_sparse_mask_probes_total", ())] == 1  # dense after the first probe: no more
    assert m[("gsm_sparse_mask_hit_rate", ())] == pytest.approx(seen["hit_rate"]) and seen["hit_rate"] < 1
    assert m[("gsm_kv_noise_measurements_total", ())] == 1  # the refreshed cache is never re-encoded
    assert m[("gsm_shared_kv_noise_level", ())] == pytest.approx(seen["noise"]) and seen["noise"] > 0
