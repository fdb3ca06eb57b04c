"""One sequence over a backend: `CachedSequence`, its cache row and tier state, and what its steps measured.

A sequence is made by the step worker (runtime.step_worker; `Runtime.new_sequence()`), holds one row of the
backend's memory plan until it is closed or garbage-collected, and keeps the knobs it was made with
(gsm.bundle_knobs: window and budget sent to the graphs, tier policy) whatever the runtime's change to. The runtime
owns what the graphs do not decide (docs/engine_io.md section 2, "Ownership"): the hotness EMA from `attn_mass`, the
decode step count and the re-tier passes at the end of every prefill call and after every
`quantization_adaptation_rate`-th decode step, applied through the backend's demotion graph.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gsm.bundle_format import BundleConfig
from gsm.bundle_knobs import RunKnobs
from runtime.backend import Backend, CacheRow, Capabilities, StepOutput
from runtime.policy import SequenceState, TierPolicy, retier
from runtime.prefix_cache import Prefix, PrefixCache
from runtime.sampling import RequestError

Scorer = Callable[[int, np.ndarray], None]  # (first position, logits [n, V]) of each prefill chunk


class StepHost(Protocol):
    """What a sequence reads of the step worker that made it (runtime.step_worker.StepWorker), and the batched
    calls its one-sequence steps go through."""

    cfg: BundleConfig
    backend: Backend
    capabilities: Capabilities
    n_max: int
    prefixes: PrefixCache

    def prefill_batch(self, seqs: Sequence[CachedSequence], prompts: Sequence[Sequence[int]],
                      scorers: Sequence[Scorer | None] | None = None,
                      breaks: Sequence[int | None] | None = None) -> np.ndarray: ...

    def decode_batch(self, seqs: Sequence[CachedSequence], tokens: Sequence[int],
                     probe: Sequence[bool] | None = None, *, selections: bool = False) -> np.ndarray: ...

    def verify_batch(self, seqs: Sequence[CachedSequence], chunks: Sequence[Sequence[int]]) -> list[np.ndarray]: ...


class SequenceSource(Protocol):
    """Where drivers get sequences: a `Runtime`, a `StepWorker`, an engine's stepper."""

    def new_sequence(self, knobs: RunKnobs | None = None) -> CachedSequence: ...


@dataclass(frozen=True)
class PendingVerification:
    """What a verify call fed one sequence, until `CachedSequence.keep` says how much of it stays."""

    tokens: list[int]
    mass: np.ndarray  # [n, L]: each token's query's own attention mass


class CachedSequence:
    """One sequence's cache row and tier state; use Runtime.new_sequence(). Its row of the backend's buffers is given
    back when the sequence is garbage-collected (or by `close()`).

    Measurements: `sparse_top_k` is this sequence's selection budget (None: the runtime's default; `use_dense()`
    switches it to dense attention); after a probed decode step `last_hit_rate` / `last_hit_rates` hold the mask hit
    rate (docs/runtime.md "Selection budget, probes and KV noise"); after every re-tier pass `last_kv_noise` holds
    the relative error the pass's demotions added (None when it demoted nothing) and `retier_passes` counts the
    passes."""

    def __init__(self, worker: StepHost, knobs: RunKnobs) -> None:
        self.worker = worker
        self.knobs = knobs
        self.policy = tier_policy(worker.cfg, knobs)
        # what the graphs are sent when nobody chose: window 0 and budget -1, "each layer's own" (gsm_config
        # layer_selection; the model's window and top-k in a layer without one)
        self.window_input = knobs.sparse_window or 0
        self._default_budget = -1 if knobs.sparse_top_k is None else knobs.sparse_top_k
        self.cache: CacheRow = worker.backend.new_cache()
        self.state = SequenceState()
        self.last: StepOutput | None = None  # this sequence's part of its last call's output
        self._sparse_top_k: int | None = None
        self.last_hit_rate: float | None = None  # mean over owning layers, from the last probed step
        self.last_hit_rates: dict[int, float] | None = None  # owning layer -> hit rate, same step
        self.last_kv_noise: float | None = None  # from the last re-tier pass (None: it demoted nothing)
        self.retier_passes = 0  # re-tier passes run so far (tells a new last_kv_noise from an old one)
        self._fp16_only = False  # keep_fp16(): no re-tier passes (nothing demoted)
        self.pending: PendingVerification | None = None  # the last verify call's tokens and masses, until keep()
        self._finalizer = weakref.finalize(self, worker.backend.release, self.cache)

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def sparse_top_k(self) -> int | None:
        """Selection budget (spec 4.1 top-k) of this sequence's next calls; None: the runtime's default."""
        return self._sparse_top_k

    @sparse_top_k.setter
    def sparse_top_k(self, k: int | None) -> None:
        self._sparse_top_k = None if k is None else check_sparse_top_k(k, self.worker.n_max)

    @property
    def effective_sparse_top_k(self) -> int:
        if self._sparse_top_k is not None:
            return self._sparse_top_k
        return self.worker.cfg.sparse_top_k if self.knobs.sparse_top_k is None else self.knobs.sparse_top_k

    @property
    def budget_input(self) -> int:
        """The `sparse_top_k` the graphs are sent for this sequence (-1: each layer's own)."""
        return self._default_budget if self._sparse_top_k is None else self._sparse_top_k

    def use_dense(self) -> None:
        """Dense attention over the whole cache from the next call on (the spec's dense case: a budget of
        n_max covers every position), e.g. as a quality fallback; `sparse_top_k = None` goes back to sparse."""
        self._sparse_top_k = self.worker.n_max

    def keep_fp16(self) -> None:
        """No re-tier pass from now on: every row this sequence writes stays FP16 (the KV-noise fallback's
        refreshed cache, docs/serving.md). Rows already demoted stay as they are (demotion only)."""
        self._fp16_only = True

    def close(self) -> None:
        self._finalizer()

    # -- what the step worker's calls do to the sequence ---------------------------------------------------------
    def add_call(self, tokens: Sequence[int], mass: np.ndarray, out: StepOutput) -> None:
        """A forward call added `tokens` at the end: their positions, the hotness EMA from the call's attention mass
        [L], and this sequence's part of the call's output."""
        self.state.add_positions([int(t) for t in tokens])
        self.state.update_hotness(mass, self.policy.hotness_decay)
        self.last = out

    def retier(self) -> None:
        """A re-tier pass (none on a keep_fp16 sequence): the tiers the policy ranks, demoted through the backend;
        `last_kv_noise` is what it added."""
        if self._fp16_only:
            return
        new_tier = retier(self.state, self.policy, self.state.length)
        self.retier_passes += 1
        self.last_kv_noise = None if new_tier is None else self.worker.backend.demote(self.cache, new_tier)

    def count_decode_step(self) -> None:
        """One decode step done; the re-tier pass after every `rate`-th."""
        self.state.decode_steps += 1
        if self.state.decode_steps % self.policy.rate == 0:
            self.retier()

    def record_hit_rates(self, rates: dict[int, float]) -> None:
        """A probed step's mask hit rate per owning layer, and their mean."""
        self.last_hit_rates = rates
        self.last_hit_rate = float(np.mean(list(rates.values())))

    # -- one sequence's steps (the step worker's batched calls with one sequence) --------------------------------
    def prefill(self, ids: Sequence[int], scorer: Scorer | None = None, break_at: int | None = None) -> np.ndarray:
        """Prompt (or more of it), in chunks of at most max-input tokens, each followed by a re-tier
        pass as golden `prefill` does; returns the last position's logits [V]. scorer, break_at: prefill_batch's."""
        return self.worker.prefill_batch([self], [ids], [scorer], [break_at])[0]

    def decode(self, token: int, *, probe: bool = False) -> np.ndarray:
        """One decode step; re-tier after every `rate`-th step. Returns logits [V]."""
        return self.worker.decode_batch([self], [token], probe=[probe])[0]

    def snapshot(self) -> Prefix:
        """This sequence's state and cache so far, copied (runtime.prefix_cache)."""
        return Prefix(tuple(self.state.tokens), copy.deepcopy(self.state),
                      self.worker.backend.take_prefix(self.cache, self.length), self.knobs.cache_key)

    def restore(self, prefix: Prefix) -> None:
        """A fresh sequence made the one `prefix` was taken from."""
        if self.length:
            raise ValueError("restore() needs a fresh sequence")
        self.worker.backend.put_prefix(self.cache, prefix.rows)
        self.state = prefix.state_copy()

    @property
    def reuses_prefixes(self) -> bool:
        """Whether this sequence's prefill may use and fill the runtime's prefix cache: the runtime's selection
        budget, a cache that re-tiers (not a refreshed FP16 one), a backend that copies prefixes."""
        return (self._sparse_top_k is None and not self._fp16_only and self.worker.prefixes.capacity > 0
                and self.worker.capabilities.prefix_reuse)

    @property
    def draft_room(self) -> int:
        """Drafted tokens the next call may verify after the next token: within the backend's verification rows, the
        sequence's max-seq, and the decode steps left before the next re-tier pass (a pass falls between calls, as
        after one-token steps: the tokens after it read the re-encoded rows). 0: verification not possible."""
        cap = self.worker.capabilities.verify_rows
        if cap < 2:
            return 0
        return max(0, min(cap, self.steps_to_retier, self.worker.n_max - self.length) - 1)

    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed the next token and drafts as one call; returns logits [n, V], row j what a one-token step after
        tokens[j] returns. Nothing is kept until `keep`."""
        return self.worker.verify_batch([self], [tokens])[0]

    def keep(self, n: int) -> None:
        """Keep the first n tokens of the last verify call (1..its length), as n one-token steps would have: positions,
        hotness from each token's own attention mass in order, decode steps and the re-tier pass they reach; the cache
        forgets the rest (rows, slots, row-cache entries: written again by the next call)."""
        v = self.pending
        if v is None or not 1 <= n <= len(v.tokens):
            raise ValueError(f"keep({n}): needs 1..{0 if v is None else len(v.tokens)} after a verify call")
        self.pending = None
        self.worker.backend.truncate(self.cache, self.length + n)
        for j in range(n):
            self.state.add_positions([v.tokens[j]])
            self.state.update_hotness(v.mass[j], self.policy.hotness_decay)
            self.count_decode_step()

    def mark(self) -> SequenceMark:
        """Where the sequence is now, to `rewind` to after steps that turn out not to belong to it (a draft model's
        guesses: runtime.draft_model)."""
        if self.pending is not None:
            raise ValueError("mark(): settle the last verification with keep(n) first")
        return SequenceMark(self.length, copy.deepcopy(self.state), self.retier_passes)

    def rewind(self, mark: SequenceMark) -> None:
        """Back to `mark`, as if the steps after it were never made: the state copied then, the cache forgetting every
        later position (backend.truncate). Steps that ran a re-tier pass cannot be undone (it re-encoded earlier rows):
        the caller stops before one (`steps_to_retier`)."""
        if mark.retier_passes != self.retier_passes or mark.length > self.length:
            raise ValueError(f"rewind to position {mark.length}: a re-tier pass ran since, or the sequence is shorter")
        self.pending = None
        self.worker.backend.truncate(self.cache, mark.length)
        self.state = copy.deepcopy(mark.state)

    @property
    def steps_to_retier(self) -> int:
        """Decode steps until the one that ends with a re-tier pass (1: the next step runs it)."""
        return self.policy.rate - self.state.decode_steps % self.policy.rate


@dataclass(frozen=True)
class SequenceMark:
    """A sequence's length and host state at one point (CachedSequence.mark)."""

    length: int
    state: SequenceState
    retier_passes: int


def check_sparse_top_k(k: int, n_max: int) -> int:
    """A selection budget 0..n_max (n_max or anything >= the context: dense attention)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= n_max:
        raise RequestError("sparse_top_k", f"must be an integer in 0..{n_max} (the bundle's max-seq; a value >= "
                                           f"the context is dense attention), got {k!r}")
    return int(k)


def check_sparse_window(w: int | None, cfg: BundleConfig) -> int:
    """The run-time window: the model's by default, else 1..max_sparse_window of the bundle."""
    if w is None:
        return cfg.sparse_window
    hi = cfg.max_sparse_window
    if isinstance(w, bool) or int(w) != w or not 1 <= w <= hi:
        raise RequestError("sparse_window", f"must be an integer in 1..{hi} (the bundle's max_sparse_window), got {w}")
    return int(w)


def tier_policy(cfg: BundleConfig, knobs: RunKnobs) -> TierPolicy:
    """The tier policy (runtime.policy) of a sequence with these knobs."""
    return TierPolicy(sink_tokens=cfg.sink_tokens, fp16_window=knobs.fp16_window, tier_fractions=knobs.tier_fractions,
                      hotness_decay=knobs.hotness_decay, rate=knobs.quantization_adaptation_rate,
                      hot_token_ids=frozenset(knobs.hot_token_ids))
