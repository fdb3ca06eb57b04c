"""What stands in front of the routes: the API key and the request-body limit, as plain ASGI middleware.

- `Authorization: Bearer KEY` on every route but the open ones (`/health`; `/metrics` unless asked), compared
  in constant time (hmac.compare_digest); a missing or wrong key is a 401 with OpenAI's error body.
- The admin routes (`/admin/...`) take the admin key only, wherever the client is (loopback too); a server started
  without one answers them 403.
- A body over `max_body_bytes` is a 413: refused from its Content-Length before reading, or as soon as the
  bytes read pass the limit (never buffered past it).
- A client that goes away while still sending its body is one info line, not a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("runtime.serve")

API_KEY_ENV = "GSM_API_KEY"
ADMIN_KEY_ENV = "GSM_ADMIN_KEY"
ADMIN_PREFIX = "/admin/"
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a max-seq prompt of JSON-escaped text with room to spare

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None  # None: no authentication (the server warns when it listens beyond loopback)
    open_paths: tuple[str, ...] = ("/health", "/metrics")  # reachable without the key
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_key: str | None = None  # what /admin/... routes require; None: they answer 403

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("the admin key is empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def _error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app, self.config = app, config
        self._key = None if config.api_key is None else config.api_key.encode()
        self._admin = None if config.admin_key is None else config.admin_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if str(scope.get("path", "")).startswith(ADMIN_PREFIX):
            if self._admin is None:
                await _error(send, 403, f"the admin routes are off: start the server with --admin-key (or "
                                        f"${ADMIN_KEY_ENV}, or an --api-key)", "permission_error", "admin_disabled")
                return
            if not self._authorised(scope, self._admin):
                await _error(send, 401, "the admin key is required: send the header 'Authorization: Bearer KEY'",
                             "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        elif self._key is not None and scope.get("path") not in self.config.open_paths and \
                not self._authorised(scope, self._key):
            await _error(send, 401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                         "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        limit = self.config.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _error(send, 413, f"the request body is {int(length)} bytes, more than this server's limit of "
                                    f"{limit}", "invalid_request_error", "request_too_large")
            return
        try:
            body = await self._read(receive, limit)
        except ClientGone:
            log.info("%s %s: client disconnected while sending the request body", scope.get("method"),
                     scope.get("path"))
            return
        if body is None:
            await _error(send, 413, f"the request body is more than this server's limit of {limit} bytes",
                         "invalid_request_error", "request_too_large")
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: what the server says next (a disconnect)

        await self.app(scope, replay, send)

    @staticmethod
    def _authorised(scope: Scope, expected: bytes) -> bool:
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, key = got.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), expected)

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes | None:
        """The whole body, None once it passes `limit` (the rest is not read); ClientGone on a disconnect."""
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)
