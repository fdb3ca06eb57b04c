"""Prompt prefixes computed once: a chat prompt's messages before its last one (a system prompt, worked examples, a
conversation's history) are prefilled as calls of their own, and the state they leave is kept, by their tokens, for
the next prompt that starts with them.

The break is a rule of the prompt, not of the cache: a chat request's prefill always ends a call where its last
message starts (`RequestState.prompt_break`), so a prompt gives the same cache, and the same tokens, whether its prefix
was computed for it or found here. What a prefix holds is the sequence's state after those calls and their re-tier
passes: tokens, tiers, hotness (`SequenceState`), and the backend's copy of its cache rows (on the plugins' pools: the
slot table, each layer's rows those positions name and their indexer keys, runtime.plugin_cache.take_prefix).
Sequences with a selection budget of their own, a refreshed FP16-only cache or a scored prompt neither use nor fill
it. The cache is bounded in bytes and evicts the least recently used prefix.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from runtime.backend import PrefixCopy
from runtime.policy import SequenceState

DEFAULT_PREFIX_CACHE_MIB = 32


@dataclass(frozen=True)
class Prefix:
    """A sequence's state after its first `len(tokens)` positions, and the backend's copy of its cache."""

    tokens: tuple[int, ...]
    state: SequenceState
    rows: PrefixCopy  # the backend's take_prefix
    knobs_key: Hashable = None  # what the sequence selected and re-tiered with (RunKnobs.cache_key)

    @property
    def key(self) -> tuple[Hashable, tuple[int, ...]]:
        """Its key in the cache: a prefix is the same only under the same selection and tier policy (a patched
        server's old and new requests never share one; fallback thresholds do not count)."""
        return self.knobs_key, self.tokens

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.state.tier.nbytes + self.state.hotness.nbytes + 8 * len(self.tokens))

    def state_copy(self) -> SequenceState:
        return copy.deepcopy(self.state)


class PrefixCache:
    """Prefixes by their knobs and tokens (Prefix.key), at most `capacity` bytes, least recently used evicted first;
    thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 bytes, got {capacity}")
        self.capacity, self.bytes = capacity, 0
        self.hits = self.misses = 0
        self._items: OrderedDict[tuple[Hashable, tuple[int, ...]], Prefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether a prefix of exactly these tokens is kept (under any knobs), without counting a hit or a miss."""
        t = tuple(int(x) for x in tokens)
        with self._lock:
            return any(k[1] == t for k in self._items)

    def get(self, key: tuple[Hashable, tuple[int, ...]]) -> Prefix | None:
        """The prefix of Prefix.key `key` (knobs, tokens), or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return hit

    def put(self, prefix: Prefix) -> bool:
        """Keep `prefix` (False: larger than the whole cache, not kept)."""
        n = prefix.nbytes
        with self._lock:
            if n > self.capacity:
                return False
            old = self._items.pop(prefix.key, None)
            if old is not None:
                self.bytes -= old.nbytes
            while self._items and self.bytes + n > self.capacity:
                self.bytes -= self._items.popitem(last=False)[1].nbytes
            self._items[prefix.key] = prefix
            self.bytes += n
            return True
