"""The server's request options and its guard, over HTTP with the `openai` client unchanged: stop strings,
logprobs, penalties and response_format equal the runtime's own answer; the API key (401 without or with a
wrong one, OpenAI's error body), the body limit (413 without reading past it), nested JSON (400), a client gone
mid-body (one log line), max_tokens that cannot fit (400 naming both numbers), SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_serve import MAX_INPUT, MAX_SEQ, err, live_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=30, max_retries=0)


def test_stop_logprobs_penalties_equal_the_runtime(rts):
    rt = rts["demo"]
    full = rt.generate("Once upon a time", 30, stop_ids=[]).text
    stop = full[10:13]
    want = rt.generate("Once upon a time", 30, stop=[stop], logprobs=2, presence_penalty=0.5)
    with live_server(rt) as (_, url):
        r = client(url).completions.create(model="demo", prompt="Once upon a time", max_tokens=30, temperature=0,
                                           stop=[stop], logprobs=2, presence_penalty=0.5)
        ch = r.choices[0]
        assert ch.text == want.text == full[:full.find(stop)] and ch.finish_reason == "stop"
        assert ch.logprobs.token_logprobs == pytest.approx([t.logprob for t in want.tokens])
        assert [len(d) for d in ch.logprobs.top_logprobs] == [2] * len(want.tokens)
        # streamed: the same text, no piece of it past the stop string
        parts = [c.choices[0].text for c in client(url).completions.create(
            model="demo", prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop, stream=True,
            presence_penalty=0.5)]
        assert "".join(parts) == want.text


def test_chat_logprobs_and_json_schema(rts):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    rt = rts["chat"]
    # short: the demo vocabulary is one token per character and the chat prompt takes 35 of the 64 positions
    schema = {"type": "object", "properties": {"sev": {"enum": ["low", "high"]}, "n": {"type": "integer",
                                                                                     "maximum": 9}},
              "required": ["sev"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Report the defect."}]
    with live_server(rt, "chat") as (_, url):
        for temp, seed in ((0, None), (0.9, 1), (1.2, 2)):
            r = client(url).chat.completions.create(model="chat", messages=msgs, max_tokens=28, temperature=temp,
                                                    seed=seed, response_format=fmt, logprobs=True, top_logprobs=3)
            ch = r.choices[0]
            jsonschema.validate(json.loads(ch.message.content), schema)
            assert ch.finish_reason == "stop" and len(ch.logprobs.content) == r.usage.completion_tokens
            assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in ch.logprobs.content)
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "response_format": {
            "type": "regex", "regex": "(("}}, timeout=10)
        assert err(bad)["param"] == "response_format" and "does not compile" in bad.json()["error"]["message"]


def test_max_tokens_that_cannot_fit_is_400_naming_both(rts):
    with live_server(rts["demo"]) as (_, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "abcd", "max_tokens": MAX_SEQ}, timeout=10)
        e = err(r)
        assert e["param"] == "max_tokens" and f"+ {MAX_SEQ} new tokens" in e["message"] and "max-seq 64" in e["message"]


def test_api_key(rts):
    from runtime.serve.guard import GuardConfig

    with live_server(rts["demo"], guard=GuardConfig(api_key="s3cret")) as (_, url):
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(model="demo", prompt="x", max_tokens=2)
        assert client(url, "s3cret").completions.create(model="demo", prompt="x", max_tokens=2,
                                                    temperature=0).choices[0].text  # greedy: the same answer every run
    with live_server(rts["demo"], guard=GuardConfig(api_key="k", open_paths=("/health",))) as (_, url):
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401


def test_body_limit_nested_json_and_a_client_gone_mid_body(rts, caplog):
    from runtime.serve.guard import GuardConfig

    with live_server(rts["demo"], guard=GuardConfig(max_body_bytes=10_000)) as (srv, url):
        r = httpx.post(url + "/v1/completions", content=b"x" * 20_000, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: refused once the bytes read pass the limit
            for _ in range(1000):
                yield b"y" * 1000

        r = httpx.post(url + "/v1/completions", content=chunks(), timeout=10)
        assert r.status_code == 413
        deep = b"[" * 5000 + b"]" * 5000
        r = httpx.post(url + "/v1/completions", content=deep, timeout=10)
        assert err(r)["message"] == "the request body is JSON nested too deeply"
        caplog.set_level(logging.INFO, logger="runtime.serve")
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):  # clients that announce a body and leave after half of it
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.05)
        time.sleep(0.5)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    gone = [r for r in caplog.records if "client disconnected while sending the request body" in r.getMessage()]
    assert len(gone) == 5 and not any(r.exc_info for r in caplog.records)


def test_sigterm_drains_the_stream_and_exits_0(bundles, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bundles["demo"]), "--port", str(port),
                             "--threads", "1", "--drain-timeout", "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Once", "max_tokens": 40, "stream": True,
                                                                  "stop_token_ids": []}, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM: draining" in proc.stdout.read()


def test_echo_scores_the_prompt(rts, tmp_path_factory):
    """echo with logprobs (how evaluation harnesses score a continuation): on a bundle built with --logits all,
    each prompt token's logprob = log_softmax of the logits at the position before it, as one forward call over
    the prompt gives them (numpy, by hand); the first token has none; max_tokens 0 scores only. On a bundle that
    returns only the last position's logits: a 400 naming echo and the build flag. Echo without logprobs
    prepends the prompt's text."""
    import numpy as np
    from runtime_bundles import build_demo

    import runtime

    allb = build_demo(tmp_path_factory.mktemp("echo") / "all", max_seq=MAX_SEQ, max_input=MAX_INPUT, max_batch=2,
                      extra=("--logits", "all"))
    rt = runtime.load(allb, "onnxruntime", threads=1)
    prompt = "The cat sat on"
    ids = rt.encode(prompt)
    seq = rt.new_sequence()
    logits = rt.forward_batch([seq], [ids]).logits[0]
    seq.close()
    z = logits.astype(np.float64)
    lp = z - z.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    want = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    with live_server(rt) as (_, url):
        r = client(url).completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        ch = r.choices[0]
        assert ch.text == prompt and ch.logprobs.token_logprobs[0] is None
        assert ch.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-6)
        assert len(ch.logprobs.tokens) == len(ids) and r.usage.completion_tokens == 0
        r = client(url).completions.create(model="demo", prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                           temperature=0, stop=None)
        n = len(ids)
        assert r.choices[0].text.startswith(prompt) and len(r.choices[0].logprobs.token_logprobs) == n + 3
        assert r.choices[0].logprobs.token_logprobs[1:n] == pytest.approx(want[1:], abs=1e-6)
        streamed = "".join(c.choices[0].text for c in client(url).completions.create(
            model="demo", prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True))
        assert streamed == r.choices[0].text
    with live_server(rts["demo"]) as (_, url):  # logits of the last position only
        e = err(httpx.post(url + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1}, timeout=10))
        assert e["param"] == "echo" and "--logits all" in e["message"]
        r = client(url).completions.create(model="demo", prompt="The", max_tokens=2, echo=True, temperature=0)
        assert r.choices[0].text.startswith("The")
