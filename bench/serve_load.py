"""Load test of `python -m runtime serve` on loopback: concurrent streaming clients and a soak.

    python bench/serve_load.py BUNDLE [--levels 1,4,8,16] [--requests 32] [--max-tokens 32] [--soak 1000]
    python bench/serve_load.py BUNDLE --levels 0 --soak 0 --burst 8 --burst-prompt 1500 --max-tokens 64

Starts the server itself on 127.0.0.1 (a free port; nothing else is ever contacted), waits for
/health, then for each concurrency level N runs `--requests` streaming completions with N clients
at a time (httpx, SSE) and reports P50/P95 time to first token and request latency and aggregate
generated tokens/s (and its ratio to one client). The soak runs `--soak` requests at `--soak-concurrency`
and reports the server's RSS after warm-up (the first 10 %) and at the end. The burst sends `--burst` requests
of `--burst-prompt` token ids at once (more than the memory plan's rows: the rest must queue) and reports the
server's peak RSS (VmHWM) above its RSS after warm-up beside the plan's KV bytes. `--patch P.json` sends that JSON
Patch to PATCH /admin/config when half of each level's requests are done (a knob change under load: its p99 latency
against a run without it). Everything is bounded:
`--time-limit` seconds in all (the run stops and reports what it has). Exit 0 ok, 2 bad input, 1 a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proc_status import proc_status_mib

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The little dog ran", "She opened the box and", "Tom and Sue went to the park",
           "The sun was hot", "A big red ball", "In the morning the bird", "He said hello to"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: Any, url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "stop_token_ids": []}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            elif ttft is None and ev["choices"] and ev["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
    lat = time.perf_counter() - t0
    return {"ttft": lat if ttft is None else ttft, "latency": lat, "tokens": tokens}


ADMIN_KEY = "serve-load-bench"  # the server's --admin-key when --patch is given


async def run_level(url: str, conc: int, n: int, max_tokens: int, deadline: float,
                    on_done: Any = None, patch: Any = None) -> tuple[list[dict[str, float]], float]:
    import httpx

    results: list[dict[str, float]] = []
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def task(i: int) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    return
                results.append(await one_request(client, url, PROMPTS[i % len(PROMPTS)], max_tokens))
                if on_done is not None:
                    on_done(len(results))
                if patch is not None and len(results) == n // 2:
                    r = await client.patch(url + "/admin/config", json=patch,
                                           headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                    if r.status_code != 200:
                        raise RuntimeError(f"PATCH /admin/config: HTTP {r.status_code}: {r.text[:300]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(n)))
        return results, time.perf_counter() - t0


async def run_burst(url: str, n: int, prompt_len: int, max_tokens: int, vocab: int) -> tuple[list[int], float]:
    """n requests of prompt_len token ids (seeded, past the special ids) at once; their HTTP statuses, wall time."""
    import httpx
    import numpy as np

    rng = np.random.default_rng(0)
    bodies = [{"prompt": [1] + rng.integers(3, vocab, prompt_len - 1).tolist(), "max_tokens": max_tokens,
               "temperature": 0, "stop_token_ids": []} for _ in range(n)]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
        return [r.status_code for r in res], time.perf_counter() - t0


def summary(res: list[dict[str, float]], wall: float) -> dict[str, float]:
    toks = sum(r["tokens"] for r in res)
    return {"requests": len(res), "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in res], 50),
            "ttft_p95_ms": 1e3 * pct([r["ttft"] for r in res], 95),
            "latency_p50_ms": 1e3 * pct([r["latency"] for r in res], 50),
            "latency_p95_ms": 1e3 * pct([r["latency"] for r in res], 95),
            "latency_p99_ms": 1e3 * pct([r["latency"] for r in res], 99),
            "tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall if wall > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--levels", default="1,4,8,16", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=32, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--soak", type=int, default=1000, help="soak requests (0: none)")
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--burst", type=int, default=0, help="requests sent at once for the peak-RSS check (0: none)")
    p.add_argument("--burst-prompt", type=int, default=1024, help="prompt tokens of each burst request")
    p.add_argument("--threads", type=int, default=1, help="server's ONNX Runtime threads")
    p.add_argument("--time-limit", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("--server-args", default="",
                   help="more `runtime serve` flags, e.g. \"--hit-rate-every 0 --max-kv-noise off\" (the fallback "
                        "policies are on at their defaults otherwise)")
    p.add_argument("--patch", type=Path,
                   help="a JSON Patch file sent to PATCH /admin/config halfway through each level")
    args = p.parse_args(argv)
    patch = json.loads(args.patch.read_text()) if args.patch else None
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip() != "0"]  # 0: no levels
    except ValueError:
        print(f"serve_load: error: argument --levels: expected integers such as 1,4,8,16, got {args.levels!r}",
              file=sys.stderr)
        return 2
    if (min(levels, default=1) < 1 or args.burst < 0 or args.burst_prompt < 1 or args.requests < 1
            or args.max_tokens < 1 or args.soak < 0 or args.soak_concurrency < 1):
        print("serve_load: error: --levels, --requests, --max-tokens, --soak-concurrency must be >= 1, --soak >= 0",
              file=sys.stderr)
        return 2
    from gsm.bundle_format import FILES

    if not (args.bundle / FILES.config).is_file():
        print(f"serve_load: error: argument bundle: {args.bundle} is not a bundle (no {FILES.config})", file=sys.stderr)
        return 2
    import httpx
    import psutil

    deadline = time.monotonic() + args.time_limit
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # the server's log: a pipe nobody reads could fill and block it
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(args.bundle), "--host", "127.0.0.1",
                               "--port", str(port), "--threads", str(args.threads), "--max-queue", "256",
                               "--log-level", "warning", "--tegrastats", "off", *shlex.split(args.server_args),
                               *(["--admin-key", ADMIN_KEY] if patch else [])],
                              env=env, stderr=log)
    out: dict[str, Any] = {"bundle": str(args.bundle), "max_tokens": args.max_tokens, "levels": {},
                           "cpus": os.cpu_count(), "server_args": args.server_args}
    try:
        while True:
            if server.poll() is not None:
                log.seek(0)
                print(f"serve_load: error: the server exited: {log.read()[-2000:]}", file=sys.stderr)
                return 1
            try:
                h = httpx.get(url + "/health", timeout=2)
                if h.status_code == 200:
                    break
                if h.json().get("status") == "failed":
                    print(f"serve_load: error: the server's warm-up failed: {h.json().get('error')}", file=sys.stderr)
                    return 1
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("serve_load: error: the server did not become ready in time", file=sys.stderr)
                return 1
            time.sleep(0.2)
        proc = psutil.Process(server.pid)
        if args.burst:
            health = httpx.get(url + "/health", timeout=10).json()
            cfg = json.loads((args.bundle / FILES.config).read_text())
            plan = json.loads((args.bundle / FILES.plan).read_text()) if (args.bundle / FILES.plan).is_file() else {}
            before = proc_status_mib("VmRSS", server.pid)
            codes, wall = asyncio.run(run_burst(url, args.burst, args.burst_prompt, args.max_tokens, cfg["vocab_size"]))
            b = {"requests": args.burst, "prompt_tokens": args.burst_prompt, "answered": codes.count(200),
                 "statuses": sorted(set(codes)), "wall_s": wall, "rss_after_warmup_mb": before,
                 "peak_rss_mb": proc_status_mib("VmHWM", server.pid), "max_batch": cfg["max_batch"],
                 "max_seq": cfg["n_max"], "plan_kv_pool_mb": plan.get("kv_pool_bytes", float("nan")) / 2**20,
                 "plan_cpu_kv_mb": plan.get("cpu_kv_bytes", float("nan")) / 2**20,
                 "backend_kv_budget_mb": health.get("kv_budget_bytes", float("nan")) / 2**20,
                 "max_running": health.get("max_running")}
            b["peak_growth_mb"] = b["peak_rss_mb"] - before
            out["burst"] = b
            print(f"burst: {b['answered']}/{args.burst} answered in {wall:.1f} s; peak RSS {b['peak_rss_mb']:.1f} MB, "
                  f"{b['peak_growth_mb']:+.1f} MB over warm-up; plan KV {b['plan_kv_pool_mb']:.1f} MB on TensorRT, "
                  f"{b['plan_cpu_kv_mb']:.1f} MB on onnxruntime (max_batch {b['max_batch']} x max_seq "
                  f"{b['max_seq']}), this backend's KV budget {b['backend_kv_budget_mb']:.1f} MB", file=sys.stderr)
        for conc in levels:
            res, wall = asyncio.run(run_level(url, conc, args.requests, args.max_tokens, deadline, patch=patch))
            s = summary(res, wall)
            out["levels"][conc] = s
            print(f"clients {conc:>2}: {s['requests']} requests, TTFT p50 {s['ttft_p50_ms']:.1f} ms p95 "
                  f"{s['ttft_p95_ms']:.1f} ms, latency p50 {s['latency_p50_ms']:.1f} ms p95 {s['latency_p95_ms']:.1f} "
                  f"ms p99 {s['latency_p99_ms']:.1f} ms, {s['tokens_per_s']:.1f} tokens/s"
                  + (" (patched halfway)" if patch else ""), file=sys.stderr)
        base = out["levels"].get(1, {}).get("tokens_per_s")
        for s in out["levels"].values():
            s["tokens_per_s_vs_one_client"] = s["tokens_per_s"] / base if base else None
        if args.soak:
            rss: dict[str, float] = {}
            warm = max(1, args.soak // 10)

            def on_done(k: int) -> None:
                if k == warm:
                    rss["after_warmup_mb"] = proc.memory_info().rss / 2**20

            res, wall = asyncio.run(run_level(url, args.soak_concurrency, args.soak, args.max_tokens, deadline,
                                              on_done))
            rss["end_mb"] = proc.memory_info().rss / 2**20
            s = summary(res, wall)
            s.update(rss)
            s["rss_growth_mb"] = rss["end_mb"] - rss.get("after_warmup_mb", rss["end_mb"])
            s["concurrency"] = args.soak_concurrency
            out["soak"] = s
            print(f"soak: {s['requests']} requests at {args.soak_concurrency} clients in {wall:.1f} s, "
                  f"{s['tokens_per_s']:.1f} tokens/s, RSS {rss.get('after_warmup_mb', float('nan')):.1f} MB after "
                  f"warm-up -> {rss['end_mb']:.1f} MB (growth {s['rss_growth_mb']:+.2f} MB)", file=sys.stderr)
        m = httpx.get(url + "/metrics", timeout=10).text
        out["server_requests_by_reason"] = {ln.split('"')[1]: float(ln.split()[-1]) for ln in m.splitlines()
                                            if ln.startswith("gsm_requests_total{")}
        out["timed_out"] = time.monotonic() > deadline
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
