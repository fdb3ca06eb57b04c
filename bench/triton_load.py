"""Throughput through Triton Inference Server against `runtime serve`, same bundle, same run.

    python bench/triton_load.py BUNDLE --clients 1,4,8 --requests 16 --max-tokens 32 --out bench-triton.json

For each round and each server (one at a time, so they never share the cores): start it on loopback (Triton
from a repository `python -m runtime triton` writes, with nvidia-pytriton's tritonserver), wait until ready,
then for each client count send `--requests` greedy completions of `--max-tokens` (prompts of the eval text),
that many at a time, and report generated tokens / s (the servers' own token counts) and the median
request latency. Non-streaming on both: Triton's /v2/models/NAME/generate, our /v1/completions. The
difference is what Triton's Python backend and its HTTP front end cost around the same engine.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready in {timeout} s: {url}")


def prompts(n: int) -> list[str]:
    text = (DATA / "tinystories_eval.txt").read_text(encoding="utf-8").split("\n\n")
    stories = [t.strip() for t in text if len(t.strip()) > 200]
    return [" ".join(s.split()[:40]) for s in stories[:n]]


def measure(send, ps: list[str], clients: int) -> dict:
    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        res = list(pool.map(send, ps))
    wall = time.monotonic() - t0
    toks = sum(n for n, _, _ in res)
    return {"clients": clients, "requests": len(ps), "tokens": toks, "wall_s": round(wall, 2),
            "tokens_per_s": round(toks / wall, 2), "latency_p50_s": round(statistics.median(t for _, t, _ in res), 3),
            "texts": [x for _, _, x in res]}


def run_serve(bundle: Path, args: argparse.Namespace, ps: list[str]) -> list[dict]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc)

        def send(p: str) -> tuple[int, float]:
            t = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": args.max_tokens, "temperature": 0},
                           timeout=600)
            r.raise_for_status()
            body = r.json()
            return body["usage"]["completion_tokens"], time.monotonic() - t, body["choices"][0]["text"]

        return [measure(send, ps, c) for c in args.clients]
    finally:
        proc.terminate()
        proc.wait(60)


def run_triton(bundle: Path, args: argparse.Namespace, ps: list[str]) -> list[dict]:
    import httpx

    from runtime.triton import launch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = launch.model_env()
        r = subprocess.run([sys.executable, "-m", "runtime", "triton", str(bundle), "--out", str(work / "repo"),
                            "--model-name", "m", *(["--python-env", str(env)] if env else [])], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr)
        ports = [free_port() for _ in range(3)]
        proc = launch.start(work / "repo", work, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                            log=work / "triton.log")
        url = f"http://127.0.0.1:{ports[0]}"
        try:
            wait_ready(url + "/v2/health/ready", proc)

            def send(p: str) -> tuple[int, float]:
                t = time.monotonic()
                r = httpx.post(url + "/v2/models/m/generate", json={"text_input": p, "max_tokens": args.max_tokens,
                                                                     "temperature": 0.0}, timeout=600)
                r.raise_for_status()
                body = r.json()
                return int(body["completion_tokens"]), time.monotonic() - t, body["text_output"]

            return [measure(send, ps, c) for c in args.clients]
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ps = prompts(args.requests)
    out: dict = {"bundle": str(args.bundle), "max_tokens": args.max_tokens, "rounds": []}
    for rnd in range(args.rounds):
        row = {"runtime serve": run_serve(args.bundle, args, ps), "triton": run_triton(args.bundle, args, ps)}
        out["rounds"].append(row)
        for server, res in row.items():
            for m in res:
                print(f"round {rnd + 1} {server:>13} clients {m['clients']}: {m['tokens_per_s']:7.2f} tok/s, "
                      f"latency p50 {m['latency_p50_s']:.2f} s ({m['tokens']} tokens, {m['wall_s']} s)",
                      file=sys.stderr)
        same = [a["texts"] == b["texts"] for a, b in zip(row["runtime serve"], row["triton"])]
        print(f"round {rnd + 1}: greedy texts equal between the servers at every client count: {all(same)} "
              f"({same})", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
