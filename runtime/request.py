"""One generation request as an iterator: `TokenStream` runs a `RequestState` on its own sequence.

Everything a call changes lives in the request, never on the shared `Runtime`, so requests on several
threads do not see each other's state (the backend's own limits apply: docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from runtime.request_state import Generation, RequestState, Token
from runtime.sampling import SamplingParams

__all__ = ["TokenStream"]


class SequenceSource(Protocol):
    """Where a stream gets its sequence (a `Runtime`); typed here so this module needs nothing of model.py."""

    def new_sequence(self) -> Any: ...


class TokenStream:
    """Iterate for the generated tokens; after exhaustion `ids`, `text` and `finish_reason` hold the
    outcome. Every input was checked when its `state` was made, before any model work."""

    def __init__(self, rt: SequenceSource, state: RequestState) -> None:
        self.state = state
        self._rt = rt
        self._iter: Iterator[Token] | None = None

    # the request's fields, read through (the state is the only copy)
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
        """Text after the prompt so far (all of it once exhausted); None without a tokenizer."""
        return self.state.text

    def __iter__(self) -> Iterator[Token]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def __next__(self) -> Token:
        return next(iter(self))

    def _run(self) -> Iterator[Token]:
        st = self.state
        if not st.start():
            return
        seq = self._rt.new_sequence()
        logits = seq.prefill(st.prompt_ids)
        while True:
            tok = st.accept(logits, seq.length)
            if tok is not None:
                yield tok
            if st.done:
                return
            logits = seq.decode(st.next_token)

    def collect(self) -> Generation:
        """Run to the end; the whole result."""
        for _ in self:
            pass
        return self.state.result()
