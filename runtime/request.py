"""One generation request: its checked inputs, its sequence, sampler and detokeniser, its outcome.

Everything a call changes lives here, never on the shared `Runtime`, so requests on several threads
do not see each other's state (the backend's own limits apply: docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.sampling import RequestError, Sampler, SamplingParams
from runtime.text import Detokenizer

if TYPE_CHECKING:
    from runtime.model import Runtime


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


class TokenStream:
    """Iterate for the generated tokens; after exhaustion `ids`, `text` and `finish_reason` hold the
    outcome. Every input is checked on construction, before any model work."""

    def __init__(self, rt: Runtime, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: Sequence[int] | None) -> None:
        self.prompt_ids = check_ids(prompt_ids, rt.vocab_size, "prompt")
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty: need at least one token")
        if len(self.prompt_ids) > rt.n_max:
            raise RequestError("prompt", f"the prompt is {len(self.prompt_ids)} tokens, more than the bundle's max-seq "
                                         f"{rt.n_max} (shorten it or rebuild with a larger --max-seq)")
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop_ids = frozenset([rt.eos_token_id] if stop_ids is None
                                  else check_ids(list(stop_ids), rt.vocab_size, "stop_ids"))
        self.params = params
        self.ids: list[int] = []
        self.finish_reason: str | None = None  # set when the stream ends
        self._rt = rt
        self._detok = None if rt.codec is None else Detokenizer(rt.codec.decode, self.prompt_ids)
        self._iter: Iterator[Token] | None = None
        self._sampler: Sampler | None = None

    @property
    def text(self) -> str | None:
        """Text after the prompt so far (all of it once exhausted); None without a tokenizer."""
        return None if self._detok is None else self._detok.text

    def __iter__(self) -> Iterator[Token]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def __next__(self) -> Token:
        return next(iter(self))

    def _run(self) -> Iterator[Token]:
        if self.max_new_tokens:
            seq = self._rt.new_sequence()
            logits = seq.prefill(self.prompt_ids)
            while True:
                tok = self.accept(logits, seq.length)
                if tok is not None:
                    yield tok
                if self.finish_reason is not None:
                    return
                logits = seq.decode(self.ids[-1])
        self._finish("length")

    # -- the step-driven core (Runtime.generate_batch drives several streams with it) ---------------
    def accept(self, logits: np.ndarray, length: int) -> Token | None:
        """Sample from the logits after `length` positions; returns the token to emit (None for a stop
        id). When the stream ends here `finish_reason` is set; otherwise the caller decodes `ids[-1]`."""
        if self._sampler is None:
            self._sampler = Sampler.from_params(self.params)
        detok = self._detok
        tok = self._sampler(logits)
        if tok in self.stop_ids:
            self._finish("stop")
            return None
        self.ids.append(tok)
        last = len(self.ids) == self.max_new_tokens
        full = length >= self._rt.n_max
        text = "" if detok is None else detok.add(tok)
        if (last or full) and detok is not None:
            text += detok.flush()
        if last or full:
            self._finish("length" if last else "context")
        return Token(tok, text)

    def _finish(self, reason: str) -> None:
        if self._detok is not None:
            self._detok.flush()  # bytes held back before a stop id: no token left to carry them, .text has them
        self.finish_reason = reason

    def collect(self) -> Generation:
        """Run to the end; the whole result."""
        for _ in self:
            pass
        assert self.finish_reason is not None
        return Generation(self.prompt_ids, list(self.ids), self.text, self.finish_reason)
