"""What one request asks beyond its prompt and max_new_tokens, as one value: `RequestOptions`.

`Runtime.request` / `generate` / `stream` / `chat*` and `Engine.submit*` take these as keywords (`temperature=0.8`,
`stop=["\\n"]`, ...) or as one `options=RequestOptions(...)` with keywords over it; `RequestState` reads them. The
sampling and penalty values are checked when the options are made (`SamplingParams`), the rest by `RequestState`:
each bad one is a RequestError naming its field, before any model work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling import SamplingParams


@dataclass(frozen=True)
class RequestOptions:
    """A request's sampling, penalties, stops, log-probabilities, structured output and drafting.

    top_k is sampling's top-k (0: off), not the selection budget (`CachedSequence.sparse_top_k`). stop_ids: the ids
    that end the output, not emitted (None: EOS; a chat request: EOS and the template's end of turn). stop: up to 4
    strings that end the output (not included). logprobs: None, or how many alternatives each Token carries (0: the
    chosen token's log-probability only). response_format: structured output (runtime.constrained). fit_context:
    refuse a prompt + max_new_tokens beyond max-seq (the server, for an explicit max_tokens) instead of ending at the
    context ("context"). prompt_logprobs: score the prompt's tokens too (`RequestState.prompt_tokens`; echo with
    logprobs, a bundle built with --logits all). speculative: "auto" | "off" for this request (None: the runtime's,
    `load(speculative=...)`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_ids: Sequence[int] | None = None
    stop: str | Sequence[str] | None = None
    logprobs: int | None = None
    response_format: Mapping[str, Any] | None = None
    fit_context: bool = False
    prompt_logprobs: bool = False
    speculative: str | None = None

    # the sampling and penalty fields above, checked: made on construction, so a bad one is the first error a request
    # raises (a RequestError naming it)
    sampling: SamplingParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling", SamplingParams(
            self.temperature, self.top_k, self.top_p, self.seed, self.presence_penalty, self.frequency_penalty,
            self.repetition_penalty))

    @classmethod
    def of(cls, options: RequestOptions | None = None, **keywords: Any) -> RequestOptions:
        """`options` (None: the defaults) with the keywords given in place of its fields; an unknown keyword is a
        TypeError naming it, as a function's would be."""
        base = cls() if options is None else options
        unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls) if f.init})
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (a request takes the fields of "
                            "runtime.RequestOptions)")
        return dataclasses.replace(base, **keywords) if keywords else base
