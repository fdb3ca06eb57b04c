"""OpenAI request bodies -> checked engine arguments, and the response / chunk / error bodies.

Fields we know are type-checked (a wrong type is a 400 naming the field); fields we do not know are
ignored, as clients send extras (`user`, `stream_options`, ...). Parameters we cannot honour with a
value that changes the result (n > 1, suffix, logit_bias, tools, echo on chat) are refused rather than
silently dropped.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.request_options import RequestOptions
from runtime.speculative import SPECULATIVE_MODES

# engine finish reason -> the OpenAI value (the engine's own goes in `gsm_finish_reason`)
OPENAI_FINISH = {"stop": "stop", "length": "length", "context": "length", "deadline": "length",
                 "cancelled": "stop", "error": "stop"}
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class GenerationArgs:
    """A checked completion or chat request."""

    prompt: str | list[int] | None  # completions
    messages: list[dict[str, Any]] | None  # chat
    max_tokens: int | None  # None (chat without a limit): up to the bundle's max-seq
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_ids: list[int] | None  # None: the engine's default (EOS; chat: EOS and end of turn)
    stream: bool
    include_usage: bool
    stop: list[str] | str | None = None  # stop strings (checked by the runtime: up to 4, not empty)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # completions: `logprobs` N; chat: `top_logprobs` N when `logprobs` is true
    response_format: dict[str, Any] | None = None
    echo: bool = False  # completions: the prompt before the answer (its tokens scored, with logprobs)
    speculative: str | None = None  # an extension: "auto" | "off" for this request (None: the server's --speculative)

    def options(self) -> RequestOptions:
        """What this request asks beyond the prompt and max_tokens, as Runtime.request takes it (stop_ids None: the
        engine's default, EOS and for chat the end of turn). Sampling fields out of range: a RequestError."""
        return RequestOptions(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, stop_ids=self.stop_ids, stop=self.stop,
                              logprobs=self.logprobs, response_format=self.response_format,
                              prompt_logprobs=self.echo and self.logprobs is not None, speculative=self.speculative,
                              fit_context=self.max_tokens is not None)


def _number(body: Mapping[str, Any], key: str, default: float, *, lo: float | None = None,
            lo_open: bool = False, hi: float | None = None) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(key, f"expected a finite number, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(key, f"must be <= {hi}, got {v}")
    return float(v)


def _integer(body: Mapping[str, Any], key: str, default: int | None, *, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"expected an integer, got {v!r}")
    if v < lo:
        raise bad(key, f"must be an integer >= {lo}, got {v}")
    return v


def _id_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise bad(key, f"expected a list of integer token ids, got {v!r}")
    return list(v)


def _unsupported(body: Mapping[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise bad("n", f"only n = 1 is supported, got {body['n']!r}")
    for key in ("suffix", "logit_bias", "tools", "functions"):
        if body.get(key) not in (None, False, {}, []):
            raise bad(key, "is not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "is not supported by this server")


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """OpenAI's two shapes: completions `logprobs: N` (0..5 there; up to 20 here); chat `logprobs: true` with
    `top_logprobs: N` (0..20)."""
    if not chat:
        return _integer(body, "logprobs", None, lo=0)
    on = body.get("logprobs")
    if on not in (None, True, False):
        raise bad("logprobs", f"expected true or false, got {on!r}")
    top = _integer(body, "top_logprobs", None, lo=0)
    if top is not None and not on:
        raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if on else None


def parse(body: Any, *, chat: bool, model_names: tuple[str, ...]) -> GenerationArgs:
    """A request body (already JSON-decoded) -> GenerationArgs, or an ApiError (400)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"expected a string, got {model!r}")
    if model not in (None, *model_names):
        raise ApiError(400, f"model: the model {model!r} does not exist; this server has {list(model_names)}",
                       param="model", code="model_not_found")
    _unsupported(body)
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", f"expected a non-empty list of messages, got {messages!r}")
        messages = [_message(m, i) for i, m in enumerate(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            prompt = _id_list(prompt, "prompt")
        elif not isinstance(prompt, str):
            raise bad("prompt", f"expected a string or a list of token ids, got {prompt!r}")
    echo = body.get("echo", False)
    if echo not in (True, False, None):
        raise bad("echo", f"expected true or false, got {echo!r}")
    if echo and chat:
        raise bad("echo", "is a completions parameter (chat has no prompt text to echo)")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_key, None, lo=0 if echo else 1)  # echo + 0: score the prompt only
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"expected true or false, got {stream!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options", f"expected an object, got {opts!r}")
    stop_ids = body.get("stop_token_ids")
    stop = body.get("stop")
    if stop in ("", []):
        stop = None
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad("response_format", f"expected an object with a 'type', got {fmt!r}")
    speculative = body.get("speculative")
    if speculative is not None and speculative not in SPECULATIVE_MODES:
        raise bad("speculative", f"expected one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
    return GenerationArgs(
        prompt=prompt, messages=messages,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None and not chat else max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, lo_open=True, hi=1.0),
        top_k=int(_integer(body, "top_k", 0, lo=0) or 0),  # an extension, as vLLM has it
        seed=_integer(body, "seed", None, lo=0),
        stop_ids=None if stop_ids is None else _id_list(stop_ids, "stop_token_ids"),
        stream=stream, include_usage=bool(opts.get("include_usage", False)), stop=stop,
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True, hi=100.0),
        logprobs=_logprobs(body, chat), response_format=fmt, echo=bool(echo), speculative=speculative)


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"messages[{i}]", f"expected an object with a string 'role', got {m!r}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"messages[{i}].content", f"only text parts are supported, got {p!r}")
            parts.append(p["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", f"expected a string, got {content!r}")
    return {"role": m["role"], "content": content}


# -- responses --------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_body(tokens: list[Any], token_text: Any, *, chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for runtime Tokens (with logprob set). Chat: {"content": [{"token", "logprob",
    "bytes", "top_logprobs": [...]}]}; completions: {"tokens", "token_logprobs", "top_logprobs" (a
    {token: logprob} per position), "text_offset"}. token_text(id) -> the token's text."""
    if chat:
        def entry(i: int, lp: float) -> dict[str, Any]:
            t = token_text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]}
                            for t in tokens]}
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.text)
    return {"tokens": [token_text(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{token_text(i): lp for i, lp in t.top_logprobs or []} for t in tokens],
            "text_offset": offsets}


def completion(rid: str, model: str, created: int, text: str, reason: str, n_prompt: int, n_out: int, *,
               chat: bool, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": OPENAI_FINISH[reason], "gsm_finish_reason": reason,
                              "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(n_prompt, n_out)}


def chunk(rid: str, model: str, created: int, text: str | None, reason: str | None, *, chat: bool,
          role: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": None if reason is None else OPENAI_FINISH[reason],
                              "logprobs": logprobs}
    if reason is not None:
        choice["gsm_finish_reason"] = reason
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def now() -> int:
    return int(time.time())
