"""Bundles in the real Triton Inference Server (the `tritonserver` of nvidia-pytriton), loopback only, with
`tritonclient` and Triton's own generate endpoints as the clients: the repository `runtime triton` writes
loads and reports ready; generate and generate_stream answer what the runtime answers; 8 concurrent greedy
requests equal the runtime's own, token for token; a malformed request gets Triton's error and the server
lives; GSM metrics are on Triton's /metrics; unloading frees the model's processes and reloading serves again;
two instances of one model serve at once; the knobs of the config parameter gsm_config_patch, at load and through a
reload with a config override. Skips, saying why, where tritonserver cannot start."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from runtime_bundles import build_demo, run_module

httpx = pytest.importorskip("httpx")
from runtime.triton.launch import client_path, model_env  # noqa: E402

client_path()  # tritonclient from scripts/install_triton.sh's directory


def repo_args():
    """--python-env: the models' environment scripts/install_triton.sh made (Triton 2.51's stub needs numpy 1)."""
    env = model_env()
    if env is None:
        pytest.skip("no models' environment: run scripts/install_triton.sh")
    return ["--python-env", str(env)]
MAX_SEQ, MAX_INPUT = 64, 16
PROMPTS = ["Once upon a time", "The cat sat", "A", "She said hello to the", "x y z", "The end", "Tim", "big red"]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Triton:
    def __init__(self, repo, work, *, explicit=False):
        from runtime.triton import launch

        try:
            launch.TritonDist.find()
        except launch.TritonUnavailable as e:
            pytest.skip(str(e))
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.log = work / "tritonserver.log"
        self.proc = launch.start(repo, work, http_port=self.http_port, grpc_port=self.grpc_port,
                                 metrics_port=self.metrics_port, explicit=explicit, log=self.log)
        self.url = f"http://127.0.0.1:{self.http_port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"tritonserver could not start here: {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise AssertionError(f"tritonserver not ready in 180 s: {self.log.read_text()[-3000:]}")

    def generate(self, model, prompt, **kw):
        r = httpx.post(f"{self.url}/v2/models/{model}/generate", json={"text_input": prompt, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo(tmp_path_factory.mktemp("tri") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT, max_batch=4)


@pytest.fixture(scope="module")
def rt(demo):
    import runtime

    return runtime.load(demo, "onnxruntime", threads=1)


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    work = tmp_path_factory.mktemp("triton")
    # the bundle its own draft bundle: each instance opens both (runtime.draft_model), and answers as the runtime does
    r = run_module("runtime", "triton", str(demo), "--out", str(work / "repo"), "--model-name", "demo",
                   "--instances", "2", "--draft-bundle", str(demo), *repo_args(), cwd=work)
    assert r.returncode == 0, r.stderr
    t = Triton(work / "repo", work)
    yield t
    t.close()


def test_repository_is_atomic_and_names_the_bundle(demo, tmp_path):
    from gsm.atomic import verify_manifest

    r = run_module("runtime", "triton", str(demo), "--out", str(tmp_path / "repo"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    repo = tmp_path / "repo"
    assert verify_manifest(repo) == []
    cfg = (repo / "demo" / "config.pbtxt").read_text()
    assert 'backend: "python"' in cfg and "decoupled: true" in cfg and str(demo.resolve()) in cfg
    assert 'name: "text_input"' in cfg and 'name: "text_output"' in cfg and "KIND_CPU" in cfg
    assert "draft_bundle" not in cfg
    drafted = run_module("runtime", "triton", str(demo), "--out", str(tmp_path / "r3"), "--draft-bundle", str(demo),
                         cwd=tmp_path)
    assert drafted.returncode == 0, drafted.stderr
    assert f'key: "draft_bundle"\n  value: {{ string_value: "{demo.resolve()}" }}' in (
        tmp_path / "r3" / "demo" / "config.pbtxt").read_text()
    again = run_module("runtime", "triton", str(demo), "--out", str(repo), cwd=tmp_path)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # never over an existing one
    bad = run_module("runtime", "triton", str(tmp_path), "--out", str(tmp_path / "r2"), cwd=tmp_path)
    assert bad.returncode == 2 and not (tmp_path / "r2").exists()


def test_generate_and_stream_equal_the_runtime(server, rt):
    want = rt.generate("Once upon a time", 12, temperature=0.0)
    got = server.generate("demo", "Once upon a time", max_tokens=12, temperature=0.0)
    assert got["text_output"] == want.text and got["finish_reason"] == want.finish_reason
    r = httpx.post(f"{server.url}/v2/models/demo/generate_stream",
                   json={"text_input": "Once upon a time", "max_tokens": 12, "stream": True}, timeout=120)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == want.text
    assert events[-1]["finish_reason"] == want.finish_reason


def test_eight_concurrent_greedy_equal_the_runtime(server, rt):
    """Through tritonclient's gRPC streaming API (decoupled), 8 requests at once over the model's two
    instances: each equals the runtime alone."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    want = [rt.generate(p, 10, temperature=0.0).text for p in PROMPTS]

    def ask(prompt):
        out, done = [], []
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

        def callback(result, error):
            if error is not None:
                done.append(error)
                return
            out.append(result.as_numpy("text_output")[0].decode())

        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32"),
                  grpcclient.InferInput("stream", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([10], np.int32))
        inputs[2].set_data_from_numpy(np.array([True]))
        c.start_stream(callback=callback)
        c.async_stream_infer("demo", inputs, enable_empty_final_response=False)
        c.stop_stream()  # waits for the responses of the requests sent
        c.close()
        assert not done, done
        return "".join(out)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert got == want
    # both instances took requests (each labels its own series)
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    per_instance = {}
    for line in text.splitlines():
        if line.startswith("gsm_generation_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            per_instance[labels.split('instance="')[1].split('"')[0]] = float(value)
    assert len(per_instance) == 2 and all(v > 0 for v in per_instance.values()), per_instance


def test_malformed_request_is_a_triton_error_and_the_server_lives(server):
    r = httpx.post(f"{server.url}/v2/models/demo/generate", json={"text_input": "x", "max_tokens": -3}, timeout=30)
    assert r.status_code >= 400 and "max_tokens" in r.json()["error"]
    r = httpx.post(f"{server.url}/v2/models/demo/generate", json={"max_tokens": 3}, timeout=30)
    assert r.status_code >= 400
    r = httpx.post(f"{server.url}/v2/models/demo/generate", json={"text_input": "x", "temperature": -1}, timeout=30)
    assert r.status_code >= 400 and "temperature" in r.json()["error"]
    assert server.generate("demo", "still", max_tokens=2)["text_output"] is not None


def test_gsm_metrics_on_tritons_metrics(server):
    server.generate("demo", "count me", max_tokens=3)
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert "gsm_generation_tokens_total{" in text and 'model="demo"' in text and "nv_inference_request_success" in text
    assert "gsm_running_sequences" in text and 'finish_reason="length"' in text


def test_unload_frees_and_reload_serves(demo, tmp_path):
    """Explicit model control: load, serve, unload (the model's stub processes end), load again and serve."""
    import psutil
    import tritonclient.http as httpclient

    r = run_module("runtime", "triton", str(demo), "--out", str(tmp_path / "repo"), *repo_args(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    t = Triton(tmp_path / "repo", tmp_path, explicit=True)
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{t.http_port}")

        def stubs():
            return [p for p in psutil.Process(t.proc.pid).children(recursive=True)
                    if "triton_python_backend_stub" in " ".join(p.cmdline())]

        for _ in range(2):
            c.load_model("demo")
            assert c.is_model_ready("demo") and len(stubs()) == 1
            assert t.generate("demo", "hello", max_tokens=3)["finish_reason"] == "length"
            c.unload_model("demo")
            deadline = time.monotonic() + 60
            while stubs() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not stubs() and not c.is_model_ready("demo")
    finally:
        t.close()


def test_dashboard_series_exist_on_tritons_metrics(server):
    """Every series of the dashboard's Triton panels and of the panels both servers feed, after a request
    whose decode step is probed and whose re-tier pass re-encodes rows (48 tokens: the FP16 window is 32)."""
    from runtime.serve import dashboard as dash

    server.generate("demo", "".join(chr(97 + i % 26) for i in range(47)), max_tokens=3)
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for p in dash.PANELS:
        if p.source in ("triton", "both"):
            assert dash.series(p) <= names, (p.title, dash.series(p) - names)


# window 2, no indexer pick; the fallbacks off, so the engine's greedy text is the plain runtime's at that window
# (at window 2 the hit rate is low and the dense fallback would take the sequence over)
WINDOW_PATCH = [{"op": "replace", "path": "/run_time/sparse_window", "value": 2},
                {"op": "replace", "path": "/run_time/sparse_top_k", "value": 0},
                {"op": "replace", "path": "/run_time/min_hit_rate", "value": 0},
                {"op": "replace", "path": "/run_time/max_kv_noise", "value": None}]


def test_config_patch_at_load_and_through_a_reload_with_a_config_override(demo, tmp_path):
    """gsm_config_patch: `--config-patch` writes it (a patch past the bundle's limits is one error line naming the
    path, and no repository); the model applies it when it loads; Triton's repository API changes it (load with a
    config override: a reload), after which requests select with the new knobs (greedy text equal to the runtime's at
    that window, which differs from the model's own); the knobs' checksum and generation are in Triton's log and
    /metrics; a bad override fails the reload naming the path, and the model loaded before serves on."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    import runtime
    from gsm.bundle_knobs import patch_knobs

    prompt, n = "Once upon a time there", 30
    base = runtime.load(demo, "onnxruntime", threads=1)
    windowed = runtime.load(demo, "onnxruntime", threads=1, sparse_window=2, sparse_top_k=0)
    want_base, want_new = (r.generate(prompt, n, temperature=0.0).text for r in (base, windowed))
    assert want_base != want_new  # the window is observable from outside on this prompt
    sums = {"base": base.knobs.checksum, "new": patch_knobs(base.knobs, WINDOW_PATCH, base.cfg.knob_limits).checksum}

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"op": "replace", "path": "/run_time/sparse_window", "value": 9}]))
    r = run_module("runtime", "triton", str(demo), "--out", str(tmp_path / "repo"), "--config-patch", str(bad),
                   *repo_args(), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--config-patch" in r.stderr and "/run_time/sparse_window: 9 is above" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]  # nothing written
    good = tmp_path / "good.json"
    good.write_text(json.dumps(WINDOW_PATCH))
    r = run_module("runtime", "triton", str(demo), "--out", str(tmp_path / "repo"), "--model-name", "demo",
                   "--config-patch", str(good), *repo_args(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'key: "gsm_config_patch"' in (tmp_path / "repo" / "demo" / "config.pbtxt").read_text()

    t = Triton(tmp_path / "repo", tmp_path, explicit=True)
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{t.http_port}")

        def serves(text, checksum, generation):
            assert t.generate("demo", prompt, max_tokens=n, temperature=0.0)["text_output"] == text
            metrics = httpx.get(f"http://127.0.0.1:{t.metrics_port}/metrics", timeout=10).text
            assert 'gsm_config_generation{instance="demo_0_0",model="demo"} ' + str(generation) in metrics
            deadline = time.monotonic() + 10
            while f"knobs {checksum}, config generation {generation}" not in t.log.read_text():
                assert time.monotonic() < deadline, t.log.read_text()[-2000:]
                time.sleep(0.2)

        def reload(patch):
            cfg = c.get_model_config("demo")  # the whole config: an override replaces config.pbtxt, not merges
            cfg["parameters"].pop("gsm_config_patch", None)
            if patch is not None:
                cfg["parameters"]["gsm_config_patch"] = {"string_value": json.dumps(patch)}
            c.load_model("demo", config=json.dumps(cfg))

        c.load_model("demo")  # config.pbtxt's patch
        serves(want_new, sums["new"], 1)
        reload(None)  # no patch: the bundle's knobs
        serves(want_base, sums["base"], 0)
        reload(WINDOW_PATCH)
        serves(want_new, sums["new"], 1)
        with pytest.raises(InferenceServerException, match="gsm_config_patch: /run_time/sparse_window: 9 is above"):
            reload([{"op": "replace", "path": "/run_time/sparse_window", "value": 9}])
        assert c.is_model_ready("demo")
        serves(want_new, sums["new"], 1)
    finally:
        t.close()
