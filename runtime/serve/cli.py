"""`python -m runtime serve BUNDLE [--host 127.0.0.1] [--port 8000]`: the argument parser and the command.

Exit codes (gsm.cli_support.run_main): 0 ok, 2 bad usage or bad bundle (one `error:` line), 1 a failure while
working (a backend that cannot start, the serve extra not installed, the port taken), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gsm.bundle_knobs import RunTime
from gsm.cli_support import CommandFailed, float_in, int_at_least
from runtime.cli_args import add_backend_arguments, backend_label, load_runtime, one_line
from runtime.engine import FROM_BUNDLE, KV_NOISE_AUTO, KV_NOISE_FLOOR, KV_NOISE_MARGIN
from runtime.serve.guard import ADMIN_KEY_ENV, API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, GuardConfig
from runtime.verdict import ALLOW_FAILED_VERIFY, PASS, refuse_failed

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over a bundle (needs the serve extra)")
    s.add_argument("bundle", type=Path)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int_at_least(0, 65535), default=8000)
    s.add_argument("--model-name", help="the model id clients send (default: the bundle directory's name)")
    add_backend_arguments(s)
    s.add_argument("--max-running", type=int_at_least(0), default=0,
                   help="sequences in the running batch (0: the bundle's max_batch, or --interleave at batch 1); "
                        "at most the cache rows of the bundle's memory plan (the startup log says when clamped)")
    s.add_argument("--interleave", type=int_at_least(1), default=8,
                   help="sequences whose steps are interleaved on a bundle built for batch 1, clamped to the rows "
                        "the backend holds (every backend now holds the plan's max_batch: 1 there)")
    s.add_argument("--max-queue", type=int_at_least(1), default=64, help="waiting requests before 429")
    s.add_argument("--deadline", type=float_in(0, math.inf, lo_open=True),
                   help="seconds a request may take from submission (default: none)")
    s.add_argument("--tegrastats", choices=["auto", "on", "off"], default="auto",
                   help="device memory / GPU load / power in /metrics from tegrastats (auto: when it is installed)")
    s.add_argument("--min-compression-ratio", type=float_in(0, math.inf), default=2.5,
                   help="live KV compression ratio below which a warning and a bundle hash check run (0: off)")
    s.add_argument("--min-hit-rate", type=float_in(0, 1),
                   help="sparse mask hit rate below which a sequence switches to dense attention (0: off; default: "
                        f"the bundle's run_time.min_hit_rate, {RunTime.min_hit_rate} as built)")
    s.add_argument("--hit-rate-every", type=int_at_least(0),
                   help="measure the hit rate on one decode step in this many per sequence (0: never; default: the "
                        f"bundle's run_time.hit_rate_every, {RunTime.hit_rate_every} as built)")
    s.add_argument("--max-kv-noise", type=auto_or(off_or(float_in(0, math.inf))), default=argparse.SUPPRESS,
                   help="KV noise of a re-tier pass above which the sequence's cache is refreshed at FP16 (off: never; "
                        f"auto: {KV_NOISE_FLOOR}, or {KV_NOISE_MARGIN:g}x the error the bundle's calibration measured "
                        "for its narrowest tier when that is larger; default: the bundle's run_time.max_kv_noise, "
                        f"{RunTime.max_kv_noise} as built)")
    s.add_argument("--admin-key",
                   help="the key PATCH /admin/config requires ('Authorization: Bearer KEY', even on loopback), which "
                        "changes the run-time knobs of new requests (docs/serving.md \"Changing knobs\"); default: "
                        f"${ADMIN_KEY_ENV} if set, else the API key; with neither the endpoint answers 403")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                                      f"(default: ${API_KEY_ENV} if set, else no authentication)")
    s.add_argument("--auth-metrics", action="store_true", help="require the API key on /metrics too")
    s.add_argument("--max-body-bytes", type=int_at_least(1), default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; a larger one is a 413, never read whole")
    s.add_argument("--drain-timeout", type=float_in(0, math.inf), default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM / Ctrl-C before they are cut")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    s.add_argument(ALLOW_FAILED_VERIFY, action="store_true",
                   help="serve a bundle whose recorded golden check (report.json, `builder engine`) failed on this "
                        "backend; /health still says so")


def draining_server(config: Any) -> Any:
    """A uvicorn.Server over `config` that drains on SIGTERM and then exits normally (below)."""
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's graceful shutdown on SIGTERM / SIGINT (stop accepting, let in-flight requests finish for
        timeout_graceful_shutdown seconds), then a normal exit: uvicorn itself re-raises the signal once it has
        shut down, so the process would end *by* SIGTERM (exit -15) rather than with status 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and not self.should_exit:
                logging.getLogger("runtime.serve").info("SIGTERM: draining in-flight requests, then exiting")
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    return Draining(config)


def auto_or(parse: Callable[[str], float | None]) -> Callable[[str], float | str | None]:
    """argparse type: "auto" (KV_NOISE_AUTO) or what `parse` accepts."""
    def auto(text: str) -> float | str | None:
        return KV_NOISE_AUTO if text.strip().lower() == KV_NOISE_AUTO else parse(text)

    auto.__name__ = f"'{KV_NOISE_AUTO}' or {parse.__name__}"
    return auto


def off_or(parse: Callable[[str], float]) -> Callable[[str], float | None]:
    """argparse type: "off" (None) or what `parse` accepts."""
    def off(text: str) -> float | None:
        return None if text.strip().lower() == "off" else parse(text)

    off.__name__ = f"'off' or {parse.__name__}"
    return off


def serve(args: argparse.Namespace) -> int:
    """The command body under gsm.cli_support.run_main(extra="serve"): a starlette, uvicorn or prometheus_client
    that is not installed is one line naming the extra, wherever it is first imported."""
    import uvicorn

    from runtime.engine import Engine, EngineConfig
    from runtime.serve.app import Server

    rt = load_runtime(args)
    verdict = refuse_failed(rt.bundle, rt.backend.name, flag=ALLOW_FAILED_VERIFY, allow=args.allow_failed_verify)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(rt, EngineConfig(max_running=args.max_running, interleave=args.interleave,
                                      max_queue=args.max_queue, default_deadline_s=args.deadline,
                                      min_hit_rate=args.min_hit_rate, hit_rate_every=args.hit_rate_every,
                                      max_kv_noise=getattr(args, "max_kv_noise", FROM_BUNDLE)))
    name = args.model_name or Path(args.bundle).resolve().name
    monitor = None
    if args.tegrastats != "off":
        from jetson.tegrastats import TegrastatsMonitor

        if TegrastatsMonitor.available():
            monitor = TegrastatsMonitor().start()
        elif args.tegrastats == "on":
            raise ValueError("argument --tegrastats: on, but no tegrastats program on PATH (not a Jetson?)")
    from runtime.serve.fallbacks import FallbackConfig

    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    guard = GuardConfig(api_key=key, open_paths=("/health",) if args.auth_metrics else ("/health", "/metrics"),
                        max_body_bytes=args.max_body_bytes,
                        admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or key)
    if key is None and args.host not in LOOPBACK:
        logging.getLogger("runtime.serve").warning(
            "listening on %s without an API key: anyone who can reach this address can use the model (set "
            "--api-key or $%s)", args.host, API_KEY_ENV)
    server = Server(engine, model_name=name, tegrastats=monitor,
                    fallbacks=FallbackConfig(min_compression_ratio=args.min_compression_ratio), guard=guard,
                    verify=verdict)
    if verdict["status"] != PASS:
        logging.getLogger("runtime.serve").warning("golden check on backend %s: %s", rt.backend.name,
                                                   verdict["status"])
    engine.start()  # warm-up on the scheduler thread; /health says 503 until it is done
    logging.getLogger("runtime.serve").info("backend %s", backend_label(rt.backend))
    if (rt.manifest.get("checkpoint") or {}).get("demo"):
        logging.getLogger("runtime.serve").warning("this is the DEMO bundle: a seeded random model, its text is "
                                                   "random words")
    uv = draining_server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level=args.log_level,
                                        timeout_graceful_shutdown=args.drain_timeout))

    def stop_if_warmup_fails() -> None:  # /health says "failed" meanwhile; a server that cannot serve exits
        engine.ready.wait()
        if engine.warmup_error is not None:
            uv.should_exit = True

    threading.Thread(target=stop_if_warmup_fails, daemon=True).start()
    try:
        uv.run()
        if engine.warmup_error is not None:
            raise CommandFailed(one_line(f"warm-up failed, the bundle cannot run on this backend: "
                                         f"{engine.warmup_error}"))
    finally:
        engine.close()
        if monitor is not None:
            monitor.stop()
    return 0
