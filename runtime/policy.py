"""Tier maintenance of spec 5 on the host, in numpy: hotness EMA, re-tier ranking, demotion-only.

The numerics are those of gsm/golden/cache.py (decisions "Hotness", "Re-tier pass"), operation
for operation, so a runtime fed the golden's attention mass takes the golden's tier decisions:
- hotness, once per forward call: h <- float32(decay) * h + float32(1 - decay) * m, new positions
  start at 0 before the update;
- ranking: eligible = positions >= sink_tokens, outside the last fp16_window, token not in
  hot_token_ids; stable sort by hotness descending (ties: lower position); counts per tier by
  gsm.tiers.tier_counts (FP16, INT12, INT8, then INT4 when a fourth fraction is non-zero); new tier =
  max(old, ranked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gsm.tiers import FP16, INT4, INT8, INT12, tier_counts

UNCHANGED = -1


@dataclass(frozen=True)
class TierPolicy:
    sink_tokens: int
    fp16_window: int
    tier_fractions: tuple[float, ...]  # 3 (v1) or 4 (with INT4)
    hotness_decay: float
    rate: int  # quantization_adaptation_rate
    hot_token_ids: frozenset[int] = frozenset()


@dataclass
class SequenceState:
    """Host state of one sequence: tokens, per-position tier and hotness, decode step count."""

    tokens: list[int] = field(default_factory=list)
    tier: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    hotness: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    decode_steps: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def add_positions(self, ids: list[int]) -> None:
        self.tokens.extend(int(t) for t in ids)
        self.tier = np.concatenate([self.tier, np.full(len(ids), FP16, np.int8)])
        self.hotness = np.concatenate([self.hotness, np.zeros(len(ids), np.float32)])

    def update_hotness(self, mass: np.ndarray, decay: float) -> None:
        """mass [n]: attention received in this call (summed over heads, owning layers, queries)."""
        m = np.asarray(mass, np.float32)[: self.length]
        self.hotness = np.float32(decay) * self.hotness + np.float32(1.0 - decay) * m


def ranked_tiers(state: SequenceState, p: TierPolicy) -> np.ndarray:
    """Tier of each position by hotness rank alone (before demotion-only)."""
    n = state.length
    target = np.full(n, FP16, np.int8)
    eligible = np.array([s for s in range(p.sink_tokens, max(p.sink_tokens, n - p.fp16_window))
                         if state.tokens[s] not in p.hot_token_ids], dtype=np.int64)
    if eligible.size == 0:
        return target
    order = np.argsort(-state.hotness[eligible], kind="stable")  # descending, ties keep lower s first
    n16, n12, n8, _ = tier_counts(p.tier_fractions, eligible.size)
    ranked = eligible[order]
    target[ranked[n16:n16 + n12]] = INT12
    target[ranked[n16 + n12:n16 + n12 + n8]] = INT8
    target[ranked[n16 + n12 + n8:]] = INT4
    return target


def retier(state: SequenceState, p: TierPolicy, n_max: int) -> np.ndarray | None:
    """Apply a re-tier pass to `state.tier`; returns new_tier [n_max] int32 (-1 = unchanged) for the
    demotion graph, or None when no row changes."""
    new = np.maximum(state.tier, ranked_tiers(state, p))
    changed = np.nonzero(new != state.tier)[0]
    state.tier = new
    if changed.size == 0:
        return None
    out = np.full(n_max, UNCHANGED, np.int32)
    out[changed] = new[changed]
    return out
