"""One generation request as an iterator: `TokenStream` runs a `RequestState` on its own sequence.

Everything a call changes lives in the request, never on the shared `Runtime`, so requests on several
threads do not see each other's state (the backend's own limits apply: docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Iterator

from runtime.request_state import Generation, RequestFields, RequestState, Token
from runtime.sequence import CachedSequence, SequenceSource

__all__ = ["TokenStream", "advance"]


def advance(seq: CachedSequence, st: RequestState) -> list[Token]:
    """One call for one request after its first token: a verification of the request's drafts where it has some
    (runtime.speculative), else a one-token step; none when the grammar's forced tokens end the request
    (RequestState.finish_forced). Returns the tokens to emit (stop ids are not)."""
    ended = st.finish_forced(seq.length)
    if st.done:
        return ended
    drafts = st.propose(seq.draft_room)
    if drafts:
        length = seq.length
        toks, used = st.accept_verified(seq.verify([st.next_token, *drafts]), drafts, length)
        seq.keep(used)
        return toks
    tok = st.accept(seq.decode(st.next_token), seq.length)
    return [] if tok is None else [tok]


class TokenStream(RequestFields):
    """Iterate for the generated tokens; after exhaustion `ids`, `text` and `finish_reason` hold the
    outcome. Every input was checked when its `state` was made, before any model work."""

    def __init__(self, source: SequenceSource, state: RequestState) -> None:
        self.state = state
        self._source = source  # where its sequence comes from (a Runtime)
        self._iter: Iterator[Token] | None = None

    def __iter__(self) -> Iterator[Token]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def __next__(self) -> Token:
        return next(iter(self))

    def _run(self) -> Iterator[Token]:
        st = self.state
        if not st.start():
            yield from st.lead_in
            return
        seq = self._source.new_sequence()
        tok = st.accept(seq.prefill(st.prefill_ids, scorer=st.prompt_scorer, break_at=st.prompt_break), seq.length)
        yield from st.lead_in  # with the first sampled token: the time to the first token is the prefill's
        if tok is not None:
            yield tok
        while not st.done:
            yield from advance(seq, st)

    def collect(self) -> Generation:
        """Run to the end; the whole result."""
        for _ in self:
            pass
        return self.state.result()
