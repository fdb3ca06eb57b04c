"""One engine request's sequence over its whole life: `ScheduledSequence`, what the scheduler, its fallback policies
and the metrics read of it.

It holds the knobs the request was submitted under (gsm.bundle_knobs; the request keeps them whatever a patch
changes later), the cache row while the request runs (a runtime.sequence.CachedSequence, opened at admission with
those knobs, replaced by a KV-noise refresh, closed at the end), and the measurements the fallback policies act on
(docs/serving.md "Fallback policies"): the decode steps, the next probed step, the last hit rate, the dense switch,
the last KV noise, the refreshes and the re-tier passes seen. These outlive the cache row: a refresh keeps them, and
they are still there when the request has ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gsm.bundle_knobs import RunKnobs
from runtime.sequence import CachedSequence, SequenceSource


@dataclass
class ScheduledSequence:
    """A request's sequence as the scheduler sees it (see the module doc)."""

    knobs: RunKnobs  # the engine's when the request was submitted, for its whole life
    cached: CachedSequence | None = None  # its cache row while it runs (None: queued, or ended)
    decode_steps: int = 0  # decode steps of the request, across refreshes (a verification counts those it keeps)
    next_probe: int = 0  # the decode step at or after which the next hit-rate probe runs
    hit_rate: float | None = None  # the last probed sparse mask hit rate
    dense: bool = False  # switched to dense attention by the hit-rate fallback
    kv_noise: float | None = None  # the KV noise of the last re-tier pass that re-encoded rows
    refreshes: int = 0  # caches rebuilt by the KV-noise fallback
    retier_passes_seen: int = 0  # the cache row's re-tier passes when last looked at (new_kv_noise)

    @property
    def running(self) -> CachedSequence:
        """The cache row of a request that runs (a RuntimeError otherwise: a scheduler bug)."""
        if self.cached is None:
            raise RuntimeError("the request holds no sequence: it is not running")
        return self.cached

    @property
    def tiers(self) -> np.ndarray | None:
        """Each cached position's KV tier (gsm.tiers), None while no cache row is held: what the metrics count."""
        return None if self.cached is None else self.cached.state.tier

    def open(self, source: SequenceSource) -> CachedSequence:
        """Take a cache row with the request's knobs (CacheFullError when the plan has none free)."""
        self.cached = source.new_sequence(self.knobs)
        self.retier_passes_seen = self.cached.retier_passes
        return self.cached

    def close(self) -> None:
        """Give the cache row back now, for the next request (nothing to do when none is held)."""
        if self.cached is not None:
            self.cached.close()
        self.cached = None

    def reopen_fp16(self, source: SequenceSource) -> CachedSequence:
        """The KV-noise fallback's fresh cache: the old row given back first (the plan may have no spare one), a new one
        with the request's knobs that never re-tiers (every row stays FP16), dense where the hit-rate fallback switched
        it. The caller prefills it; `refreshed` records it once that worked."""
        self.close()
        seq = self.open(source)
        seq.keep_fp16()
        if self.dense:
            seq.use_dense()
        return seq

    def refreshed(self) -> None:
        """The fresh cache is filled: a refresh done."""
        self.retier_passes_seen = self.running.retier_passes
        self.refreshes += 1

    def count_decode_steps(self, n: int = 1) -> None:
        self.decode_steps += n

    def probe_due(self) -> bool:
        """Decode steps 0, n, 2n, ... are probed (n = hit_rate_every; a verification advances several steps at once,
        so the next probed step is the first at or past the mark); a dense sequence is never probed."""
        return not self.dense and self.decode_steps >= self.next_probe

    def schedule_probe(self) -> None:
        """A probed step is under way: the next one hit_rate_every steps after it."""
        self.next_probe = self.decode_steps + self.knobs.run_time.hit_rate_every

    def take_hit_rate(self) -> float | None:
        """The hit rate the last probed step measured (None: none measured), as the request's."""
        hr = self.running.last_hit_rate
        if hr is None:
            return None
        self.hit_rate = float(hr)
        return self.hit_rate

    def switch_to_dense(self) -> None:
        """The hit-rate fallback: dense attention over the cache from the next step to the end (a refresh too)."""
        self.running.use_dense()
        self.dense = True

    def new_kv_noise(self) -> float | None:
        """The KV noise of the cache row's last re-tier pass if a pass ran since the last look (None: none ran, or it
        re-encoded no row)."""
        seq = self.running
        passes, seen = seq.retier_passes, self.retier_passes_seen
        self.retier_passes_seen = passes
        return seq.last_kv_noise if passes != seen else None
