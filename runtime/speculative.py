"""Speculative decoding, host side: drafts from the request's own tokens and the rule that sizes them.

A verification feeds the sequence's next token and k drafted tokens as one call (`Runtime.verify_batch`); row j of
its logits is what a one-token step after token j would return, bit for bit (the graphs' calls of up to
`Capabilities.verify_rows` tokens compute each query as a one-token step does). The request samples row 0 as it
would a decode step's logits; while the sampled token equals the next draft it samples the next row, and the first
disagreeing sample is the correction. For a drafter that proposes one token with certainty (prompt lookup: q is a
point mass on the draft d), that is the speculative-sampling rule exactly: d is kept with probability p(d) =
min(1, p(d) / q(d)), and a rejection's token is p restricted to tokens other than d, renormalised, the rule's
residual max(0, p - q) / Z. It draws from the request's own sampler in the order one-token steps would, so a
seeded sampled request gives the same tokens with drafting on or off, and greedy output is the same by
construction. `accept_draft` states the general rule (a drafter with a distribution of its own); its test checks
the output distribution by chi-square.

A `Drafter` proposes tokens after a request's history: `NgramDrafts` is prompt lookup (vLLM's `ngram`, llama.cpp's
`lookup`): the tokens that followed the latest earlier occurrence of the history's last n tokens, longest n first;
runtime.draft_model's `ModelDrafts` is another bundle's greedy tokens. `DraftLength` is the adaptive rule: from an
estimate of the per-token acceptance, the measured cost of a verification row and the cost of drafting a token it
drafts the length whose expected tokens per unit of cost is best, and nothing when no length beats a one-token step,
so no workload is slower with it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime.sampling import RequestError

SPECULATIVE_MODES = ("auto", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests draft. mode "off": never; "auto": prompt lookup sized by the adaptive rule."""

    mode: str = "auto"
    max_draft: int = 8  # drafted tokens per verification at most (the call carries one more)
    ngram_max: int = 4  # longest history suffix looked up
    ngram_min: int = 2  # shortest (a one-token match proposes too often to pay)
    # the cost of each verified row beyond the first, in one-token steps: the backend's (Capabilities.verify_row_cost,
    # set by Runtime.request); the rule drafts k tokens only where the expected tokens beat 1 + row_cost * k
    row_cost: float = 0.25
    prior_acceptance: float = 0.6  # a request's acceptance estimate before its first verification
    memory: float = 0.7  # weight of the previous estimate at each verification (an exponential average)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {self.mode!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} and ngram_max {self.ngram_max}: need 1 <= min <= max")
        if self.max_draft < 1 or not self.row_cost > 0:
            raise ValueError("max_draft must be >= 1 and row_cost > 0")

    @property
    def on(self) -> bool:
        return self.mode != "off"


def check_speculative(mode: str | None, field_name: str = "speculative") -> str | None:
    if mode is not None and mode not in SPECULATIVE_MODES:
        raise RequestError(field_name, f"must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
    return mode


class Drafter(Protocol):
    """What a request drafts with: told every token the request accepts, asked for tokens to verify next."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, limit: int) -> list[int]: ...

    def close(self) -> None:
        """The request ended: give back what the drafter holds."""
        ...


class NgramDrafts:
    """Prompt lookup over one request's tokens (prompt, then output), indexed as they come: for each n in
    ngram_min..ngram_max the latest end of every n-gram, so a proposal costs O(ngram_max) whatever the length."""

    def __init__(self, prompt: Sequence[int], cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(cfg.ngram_min, cfg.ngram_max + 1)}
        self._prev: dict[int, int | None] = {}  # n -> where the current suffix of n tokens occurred before
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1
            for n, last in self._last.items():
                if end + 1 < n:
                    continue
                key = tuple(self.tokens[end + 1 - n:])
                self._prev[n] = last.get(key)
                last[key] = end

    def close(self) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if limit <= 0:
            return []
        for n in range(self.cfg.ngram_max, self.cfg.ngram_min - 1, -1):
            at = self._prev.get(n)
            if at is not None:
                return self.tokens[at + 1:at + 1 + limit]
        return []


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of k drafts yields when each draft is kept with probability `acceptance` until the
    first rejection: the correction (or bonus) token plus a + a^2 + ... + a^k."""
    a = min(max(acceptance, 0.0), 1.0)
    return 1.0 + sum(a ** i for i in range(1, k + 1))


@dataclass
class DraftLength:
    """The adaptive rule of one request: an exponential average of the fraction of drafted tokens kept, and the
    draft length that maximises expected tokens per cost (1 + (row_cost + draft_cost) * k one-token steps); 0 when
    none beats a one-token step. A request whose drafts stopped paying drafts again after `retry` steps without, with
    the estimate halfway back to the prior (a workload can change within a request)."""

    cfg: SpeculativeConfig
    acceptance: float = field(init=False)
    drafted: int = 0
    accepted: int = 0
    idle: int = 0  # one-token steps since the rule last said 0
    retry: int = 16

    def __post_init__(self) -> None:
        self.acceptance = self.cfg.prior_acceptance

    def length(self, room: int, draft_cost: float = 0.0) -> int:
        """Drafts for the next call, at most `room` (what the call and the sequence can take); draft_cost: what making
        one costs, in one-token steps (0 for prompt lookup; a draft bundle's DraftModel.cost)."""
        best_k, best = 0, 1.0
        for k in range(1, min(self.cfg.max_draft, room) + 1):
            rate = expected_tokens(self.acceptance, k) / (1.0 + (self.cfg.row_cost + draft_cost) * k)
            if rate > best * 1.0001:
                best_k, best = k, rate
        if best_k == 0:
            self.idle += 1
            if self.idle >= self.retry:
                self.idle = 0
                self.acceptance = 0.5 * (self.acceptance + self.cfg.prior_acceptance)
        return best_k

    def record(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens kept `accepted` of them (the first rejection ends the count)."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        # a draft kept with probability a gives, before the first rejection, accepted / (accepted + 1 rejection)
        seen = accepted / drafted if accepted == drafted else accepted / (accepted + 1)
        self.acceptance = self.cfg.memory * self.acceptance + (1 - self.cfg.memory) * seen


def accept_draft(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """The speculative-sampling rule for one drafted token: target distribution p, draft distribution q (both [V],
    summing to 1), `draft` sampled from q. Keeps it with probability min(1, p/q); else returns a token from the
    residual max(0, p - q) renormalised. The output is distributed as p exactly (Leviathan et al. 2023, Chen et al.
    2023). Returns (kept, token)."""
    pd, qd = float(p[draft]), float(q[draft])
    if qd <= 0 or rng.random() < min(1.0, pd / qd):
        return True, int(draft)
    residual = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    total = residual.sum()
    if total <= 0:  # p == q: a rejection has probability 0; guard the rounding
        return True, int(draft)
    return False, int(rng.choice(len(residual), p=residual / total))
