"""One request's state: its checked inputs, sampler, detokeniser, ids and finish logic.

Every driver (`TokenStream`, `Runtime.generate_batch`, `Engine`) runs the model and hands the logits here;
this object alone decides the next token and when the request ends, so the three cannot disagree. It
knows nothing of sequences or backends: the driver passes the sequence's length with the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.sampling import RequestError, Sampler, SamplingParams
from runtime.text import Detokenizer, TextCodec

# Ends after which bytes the detokeniser holds back are dropped, not flushed into `text`: the request was
# abandoned (cancelled) or broke (error). Every other end (stop, length, context, deadline) keeps them.
ABANDONED_ENDS = ("cancelled", "error")


@dataclass
class Token:
    id: int
    text: str  # the text this token adds after the prompt (may be "" inside a UTF-8 sequence)


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]
    text: str | None  # what follows the prompt's text (leading space kept); None without a tokenizer
    finish_reason: str  # "stop" (a stop id) | "length" (max_new_tokens) | "context" (max-seq reached)


class ModelLimits(Protocol):
    """What a request is checked against (a `Runtime` has these)."""

    vocab_size: int
    n_max: int
    eos_token_id: int
    codec: TextCodec | None


def check_ids(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    """Token ids as ints inside the vocabulary; a RequestError naming the first bad one."""
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or int(t) != t:
            raise RequestError(field, f"id {t!r} (position {i}) is not an integer")
        if not 0 <= t < vocab_size:
            raise RequestError(field, f"id {int(t)} (position {i}) is outside the vocabulary 0..{vocab_size - 1}")
        out.append(int(t))
    return out


def check_max_new_tokens(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise RequestError("max_new_tokens", f"must be an integer >= 0, got {n!r}")
    return int(n)


class RequestState:
    """Checked on construction, before any model work (a RequestError names the parameter). A driver
    calls `start()`; if True it prefills `prompt_ids`, then alternates `accept(logits, length)` and a
    decode step of `next_token` until `finish_reason` is set."""

    def __init__(self, model: ModelLimits, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: Sequence[int] | None) -> None:
        self.prompt_ids = check_ids(prompt_ids, model.vocab_size, "prompt")
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty: need at least one token")
        if len(self.prompt_ids) > model.n_max:
            raise RequestError("prompt", f"the prompt is {len(self.prompt_ids)} tokens, more than the bundle's max-seq "
                                         f"{model.n_max} (shorten it or rebuild with a larger --max-seq)")
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop_ids = frozenset([model.eos_token_id] if stop_ids is None
                                  else check_ids(list(stop_ids), model.vocab_size, "stop_ids"))
        self.params = params
        self.n_max = model.n_max
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.detok = None if model.codec is None else Detokenizer(model.codec.decode, self.prompt_ids)
        self.sampler = Sampler.from_params(params)

    @property
    def text(self) -> str | None:
        """Text after the prompt so far (all of it once finished); None without a tokenizer."""
        return None if self.detok is None else self.detok.text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_token(self) -> int:
        """The token the next decode step feeds (the last one accepted)."""
        return self.ids[-1]

    def start(self) -> bool:
        """Whether the model has anything to do; with max_new_tokens 0 the request ends here ("length")."""
        if self.max_new_tokens == 0:
            self.finish("length")
        return not self.done

    def accept(self, logits: np.ndarray, length: int) -> Token | None:
        """Sample from the logits after `length` positions; returns the token to emit (None for a stop id).
        Checks in this order: stop id (not emitted), then emit, then max_new_tokens, then the context end."""
        tok = self.sampler(logits)
        if tok in self.stop_ids:
            self.finish("stop")
            return None
        self.ids.append(tok)
        last = len(self.ids) == self.max_new_tokens
        full = length >= self.n_max
        text = "" if self.detok is None else self.detok.add(tok)
        if last or full:
            if self.detok is not None:
                text += self.detok.flush()
            self.finish("length" if last else "context")
        return Token(tok, text)

    def finish(self, reason: str) -> None:
        """End the request: stop | length | context here; a driver adds cancelled | deadline | error."""
        if self.detok is not None and reason not in ABANDONED_ENDS:
            self.detok.flush()  # bytes held back before a stop id: no token left to carry them, .text has them
        self.finish_reason = reason

    def result(self) -> Generation:
        assert self.finish_reason is not None, "the request has not finished"
        return Generation(self.prompt_ids, list(self.ids), self.text, self.finish_reason)


class RequestFields:
    """A driver's read-through view of its request (`self.state`): the state holds the only copy."""

    state: RequestState

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids

    @property
    def max_new_tokens(self) -> int:
        return self.state.max_new_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.state.stop_ids

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def ids(self) -> list[int]:
        return self.state.ids

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def text(self) -> str | None:
        """Text after the prompt so far (all of it once the request ended); None without a tokenizer."""
        return self.state.text
