"""The OpenAI-compatible ASGI app (Starlette) over an Engine.

Routes: POST /v1/completions, POST /v1/chat/completions (stream: server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health (503 until warm-up is done), GET /metrics (Prometheus),
GET and PATCH /admin/config (the run-time knobs of new requests, gsm.bundle_knobs; the admin key only),
behind runtime.serve.guard (API keys, body limit). Bad input is a 400 with an OpenAI error body naming the
field; a full queue a 429 with Retry-After; a client that disconnects mid-stream cancels its request (the
engine drops its cache).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gsm.bundle_knobs import KnobError
from runtime.engine import Engine, EngineClosedError, EngineRequest, QueueFullError
from runtime.sampling import RequestError
from runtime.serve import protocol
from runtime.serve.fallbacks import CompressionRatioPolicy, FallbackConfig
from runtime.serve.guard import Guard, GuardConfig
from runtime.serve.metrics import ServeMetrics, TegrastatsCollector, geometry
from runtime.serve.protocol import ApiError, GenerationArgs
from runtime.text import ChatTemplateError
from runtime.verdict import verdict_status

log = logging.getLogger("runtime.serve")

# runtime RequestError fields -> the OpenAI parameter that set them
PARAMS = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids", "messages": "messages"}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """Holds the engine, its metrics and the model name; `app` is the ASGI application."""

    def __init__(self, engine: Engine, *, model_name: str, registry: CollectorRegistry | None = None,
                 tegrastats: Any = None, fallbacks: FallbackConfig | None = None,
                 guard: GuardConfig | None = None, verify: dict[str, Any] | None = None) -> None:
        """verify: the bundle's recorded golden check on the serving backend (runtime.verdict.verdict_status), which
        /health shows (None: read from the bundle's report)."""
        self.engine = engine
        self.verify = verify if verify is not None else verdict_status(engine.rt.bundle, engine.rt.backend.name)
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        geo = geometry(engine.rt.bundle, engine.rt.cfg)
        self.metrics = ServeMetrics(self.registry, geo, engine.rt.n_max)
        self.ratio_policy: CompressionRatioPolicy | None = None
        fallbacks = fallbacks or FallbackConfig()
        if geo is not None and fallbacks.min_compression_ratio > 0:
            self.ratio_policy = CompressionRatioPolicy(engine.rt.bundle, geo, fallbacks,
                                                       lambda p: self.metrics.fallbacks.labels(p).inc(), self.registry)
            engine.observers.append(self.ratio_policy)
        if tegrastats is not None:  # a jetson.tegrastats.TegrastatsMonitor (started by the caller)
            self.registry.register(TegrastatsCollector(tegrastats))
        engine.observers.append(self.metrics)
        self.guard = guard or GuardConfig()
        self.routes = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/admin/config", self.admin_config, methods=["GET", "PATCH"]),
        ], exception_handlers={ApiError: lambda _r, e: error_response(e)})
        self.app = Guard(self.routes, self.guard)  # API key and body limit before any route

    # -- plain endpoints --
    async def health(self, _: Request) -> Response:
        eng = self.engine
        if eng.warmup_error is not None:
            return JSONResponse({"status": "failed", "error": str(eng.warmup_error)}, status_code=503)
        if not eng.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503, headers={"Retry-After": "1"})
        backend, budget = eng.rt.backend, eng.budget
        return JSONResponse({"status": "ok", "warmup_s": eng.warmup_s, "running": len(eng.running),
                             "queue_depth": eng.queue_depth, "backend": backend.name,
                             "graph": backend.capabilities.graph, "max_running": eng.max_running,
                             "kv_rows": budget.rows, "kv_budget_bytes": budget.budget_bytes, "verify": self.verify})

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                          "owned_by": "gsm-edge",
                                                          "max_model_len": self.engine.rt.n_max}]})

    async def metrics_endpoint(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def admin_config(self, request: Request) -> Response:
        """GET: the knobs new requests take; PATCH: a JSON Patch (RFC 6902) of them, all or nothing (400 naming the
        path, nothing changed), answered with the knobs now in force."""
        eng = self.engine
        if request.method == "PATCH":
            try:
                ops = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                return error_response(ApiError(400, f"the request body is not a JSON Patch: {e}"))
            try:
                eng.patch(ops)
            except KnobError as e:
                return error_response(ApiError(400, str(e), param=e.path))
            self.metrics.config_generation.set(eng.config_generation)
        knobs = eng.knobs
        return JSONResponse({"generation": eng.config_generation, "checksum": knobs.checksum,
                             "config": knobs.document()})

    # -- generation --
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            except RecursionError:
                raise ApiError(400, "the request body is JSON nested too deeply") from None
            args = protocol.parse(body, chat=chat, model_names=(self.model_name,))
            req = self._submit(args, chat=chat)
        except ApiError as e:
            if e.status == 400:
                self.metrics.rejected.labels("bad_request").inc()
            return error_response(e)
        rid, created = protocol.new_id(chat), protocol.now()
        if args.stream:
            return StreamingResponse(self._events(req, args, rid, created, chat=chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in req.aiter():
                pass
        finally:
            if not req.done:  # the handler was cancelled (client gone): free the sequence
                req.cancel()
        if req.finish_reason == "error":
            return error_response(ApiError(500, f"generation failed: {req.error}", type="server_error"))
        text, tokens = req.text or "", req.tokens
        if args.echo:  # the prompt's text (and scored tokens) before the answer, as OpenAI echoes
            text = self._prompt_text(args, req) + text
            if tokens is not None:
                tokens = self._echoed_tokens(req) + tokens
        lp = None if tokens is None else protocol.logprobs_body(tokens, self._token_text, chat=chat)
        return JSONResponse(protocol.completion(rid, self.model_name, created, text, req.finish_reason or "",
                                                len(req.prompt_ids), len(req.ids), chat=chat, logprobs=lp))

    def _echo_chunk(self, args: GenerationArgs, req: EngineRequest, rid: str, created: int) -> dict[str, Any]:
        lp = None if req.prompt_tokens is None else protocol.logprobs_body(self._echoed_tokens(req),
                                                                           self._token_text, chat=False)
        return protocol.chunk(rid, self.model_name, created, self._prompt_text(args, req), None, chat=False,
                              logprobs=lp)

    def _prompt_text(self, args: GenerationArgs, req: EngineRequest) -> str:
        if isinstance(args.prompt, str):
            return args.prompt
        codec = self.engine.rt.codec
        return codec.decode(req.prompt_ids) if codec is not None else ""

    def _echoed_tokens(self, req: EngineRequest) -> list[Any]:
        """The prompt's scored tokens with their text (each token's decoded piece; the request's are left as
        they are)."""
        return [dataclasses.replace(t, text=self._token_text(t.id)) for t in req.prompt_tokens or []]

    def _token_text(self, token_id: int) -> str:
        codec = self.engine.rt.codec
        return codec.decode([token_id]) if codec is not None else str(token_id)

    def _submit(self, args: GenerationArgs, *, chat: bool) -> EngineRequest:
        eng = self.engine
        if not eng.ready.is_set():
            raise ApiError(503, "the server is warming up", type="server_error", headers={"Retry-After": "1"})
        max_new = eng.rt.n_max if args.max_tokens is None else args.max_tokens  # the context ends it
        try:  # options' fit_context: an explicit limit that cannot fit is refused, as vLLM does
            if chat:
                if not eng.rt.has_chat_template:
                    raise ApiError(400, "messages: this model has no chat template; use /v1/completions",
                                   param="messages")
                assert args.messages is not None
                return eng.submit_chat(args.messages, max_new, options=args.options())
            assert args.prompt is not None
            return eng.submit(args.prompt, max_new, options=args.options())
        except RequestError as e:
            param = PARAMS.get(e.field, e.field)
            raise ApiError(400, f"{param}: {e.detail}", param=param) from None
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        except QueueFullError as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(math.ceil(e.retry_after_s))}) from None
        except EngineClosedError as e:
            raise ApiError(503, str(e), type="server_error", headers={"Retry-After": "5"}) from None

    async def _events(self, req: EngineRequest, args: GenerationArgs, rid: str, created: int, *,
                      chat: bool) -> AsyncIterator[str]:
        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        sent = 0
        try:
            if chat:
                yield sse(protocol.chunk(rid, self.model_name, created, "", None, chat=True, role=True))
            echo = args.echo  # sent once the prompt has been run (its scores exist from then on)
            async for tok in req.aiter():
                if echo:
                    yield sse(self._echo_chunk(args, req, rid, created))
                    echo = False
                lp = None if tok.logprob is None else protocol.logprobs_body([tok], self._token_text, chat=chat,
                                                                             offset=sent)
                if tok.text or lp is not None:
                    sent += len(tok.text)
                    yield sse(protocol.chunk(rid, self.model_name, created, tok.text, None, chat=chat, logprobs=lp))
            if echo and req.finish_reason != "error":
                yield sse(self._echo_chunk(args, req, rid, created))
            if req.finish_reason == "error":
                yield sse(ApiError(500, f"generation failed: {req.error}", type="server_error").body())
            else:
                rest = (req.text or "")[sent:]  # bytes held back before a stop id
                yield sse(protocol.chunk(rid, self.model_name, created, rest or None if chat else rest,
                                         req.finish_reason, chat=chat))
                if args.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": created, "model": self.model_name, "choices": [],
                               "usage": protocol.usage(len(req.prompt_ids), len(req.ids))})
            yield "data: [DONE]\n\n"
        finally:
            if not req.done:  # client disconnected mid-stream: cancel, the engine frees its sequence
                log.info("request %d: client gone, cancelled", req.id)
                req.cancel()


def create_app(engine: Engine, *, model_name: str, registry: CollectorRegistry | None = None) -> Starlette:
    return Server(engine, model_name=model_name, registry=registry).app
