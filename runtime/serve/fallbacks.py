"""The server-side fallback policy: compression ratio < 2.5 (the GSM deployment description's
threshold) -> a warning and a background integrity check of the bundle's hashes
(`gsm_bundle_integrity_ok` 1 / 0), counted in /metrics (`gsm_fallbacks_total{policy="compression_ratio"}`).
A cache that holds less than expected most often means the tier policy is not demoting (contexts shorter
than the FP16 window sit at the FP16 ratio), but a changed bundle file is the failure that must not go
unnoticed on a device that runs for months.

The per-sequence policies (hit rate < 0.85 -> dense attention, KV noise > 0.05 -> cache refreshed at
FP16) act on the scheduler's sequences, so they live in the engine (runtime.engine, EngineConfig); the
server counts them through its metrics observer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from runtime.engine import Engine, EngineRequest, Observer
from runtime.metrics import CacheGeometry, compression_ratio, tier_counts

log = logging.getLogger("runtime.serve.fallbacks")


@dataclass(frozen=True)
class FallbackConfig:
    min_compression_ratio: float = 2.5  # the published threshold; 0 turns the policy off
    min_positions: int = 1  # judge the live caches only when they hold at least this many positions
    check_interval_s: float = 600.0  # at most one warning and integrity check per interval

    def __post_init__(self) -> None:
        if not self.min_compression_ratio >= 0 or self.min_positions < 1 or not self.check_interval_s >= 0:
            raise ValueError(f"FallbackConfig: min_compression_ratio >= 0, min_positions >= 1, check_interval_s >= 0;"
                             f" got {self}")


class CompressionRatioPolicy(Observer):
    """Engine observer: live compression ratio below the threshold -> warning + integrity check."""

    def __init__(self, bundle: Path, geo: CacheGeometry, config: FallbackConfig, count: Callable[[str], None],
                 registry: Any, verify: Callable[[Path], Any] | None = None) -> None:
        from runtime.bundle import verify_bundle

        self.bundle, self.geo, self.config, self.count = bundle, geo, config, count
        self.verify = verify or verify_bundle
        self.integrity = Gauge("gsm_bundle_integrity_ok", "1: every bundle file matches its manifest hash at the "
                               "last check, 0: a mismatch; absent before any check", ["bundle"],
                               registry=registry)
        self._last: float | None = None
        self.checks = 0
        self.check_done = threading.Event()

    def on_step(self, engine: Engine, running: Sequence[EngineRequest]) -> None:
        if self.config.min_compression_ratio <= 0:
            return
        counts = tier_counts([t for r in running if (t := r.sequence.tiers) is not None])
        if counts.sum() < self.config.min_positions:
            return
        ratio = compression_ratio(counts, self.geo)
        if ratio is None or ratio >= self.config.min_compression_ratio:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last < self.config.check_interval_s:
            return
        self._last = now
        self.count("compression_ratio")
        log.warning("KV compression ratio %.2f < %.2f over %d live positions: checking the bundle's hashes",
                    ratio, self.config.min_compression_ratio, int(counts.sum()))
        self.check_done.clear()
        threading.Thread(target=self._check, name="gsm-integrity", daemon=True).start()

    def _check(self) -> None:
        try:
            self.verify(self.bundle)
        except Exception as e:  # BundleError: a changed, missing or unlisted file
            self.integrity.labels(str(self.bundle)).set(0)
            log.error("bundle integrity check FAILED: %s", e)
        else:
            self.integrity.labels(str(self.bundle)).set(1)
            log.info("bundle integrity check passed (%s)", self.bundle)
        self.checks += 1
        self.check_done.set()
