"""llama.cpp's `llama-server` as a bench anchor (built by scripts/llama_server.sh): started on a free port with the
given flags, waited for, asked over HTTP, its peak RSS read from /proc, stopped.

    with LlamaServer(binary(d), gguf, threads=2, ctx=4096, parallel=8) as s:
        s.post("/completion", {...})
        s.peak_rss_mib()
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from proc_status import proc_status_mib

DEFAULT_DIR = Path.home() / ".cache" / "gsm-edge" / "llama-server"


def binary(d: Path) -> Path | None:
    """d/bin/llama-server where it is built, else None."""
    server = d / "bin" / "llama-server"
    return server if server.is_file() else None


class LlamaServer:
    """One llama-server process: `ctx` positions shared by `parallel` slots (llama.cpp's -c / -np), `extra` flags."""

    def __init__(self, server: Path, gguf: Path, *, threads: int, ctx: int, parallel: int = 1,
                 extra: tuple[str, ...] = ()) -> None:
        self.cmd = [str(server), "-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-np", str(parallel), *extra]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> LlamaServer:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self.proc = subprocess.Popen([*self.cmd, "--port", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"llama-server did not start: {' '.join(self.cmd)}")

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())

    def peak_rss_mib(self) -> float:
        assert self.proc is not None
        return proc_status_mib("VmHWM", self.proc.pid)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
