"""Prometheus metrics of a serving engine (prometheus_client, one registry per server).

Names follow the GSM deployment description where it names them (`gsm_kv_compression_ratio`,
`gsm_sparse_mask_hit_rate`, `gsm_shared_kv_noise_level`). The hit rate is measured on sampled decode
steps (EngineConfig.hit_rate_every) and the KV noise on re-tier passes that re-encode rows; both series
stay absent until a first measurement (docs/serving.md, "Metrics").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from gsm.bundle_format import BundleConfig
from runtime.engine import FINISH_REASONS, Engine, EngineRequest, Observer
from runtime.metrics import CacheGeometry, cache_bytes, compression_ratio, tier_counts

# Buckets for an edge model: from a millisecond (tiny models on a GPU) to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
# gsm_fallbacks_total{policy}: the engine's two per-sequence policies and the server's integrity check
FALLBACK_POLICIES = ("hit_rate", "kv_noise", "compression_ratio")


def geometry(bundle: Path, cfg: BundleConfig) -> CacheGeometry | None:
    """The cache figures of a bundle: its bundle.json as loaded (`cfg`) and its config.json."""
    try:
        return CacheGeometry.from_bundle(cfg, json.loads((bundle / "config.json").read_text(encoding="utf-8")))
    except (OSError, KeyError, TypeError, ValueError):  # an older bundle: no cache figures, the rest works
        return None


class ServeMetrics(Observer):
    """Engine observer that keeps the Prometheus series up to date."""

    def __init__(self, registry: CollectorRegistry, geo: CacheGeometry | None, n_max: int) -> None:
        self.registry, self.geo, self.n_max = registry, geo, n_max
        r = registry
        self.requests = Counter("gsm_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.rejected = Counter("gsm_requests_rejected", "Requests refused before queueing", ["reason"], registry=r)
        self.prompt_tokens = Counter("gsm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("gsm_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("gsm_time_to_first_token_seconds", "Submission to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("gsm_time_per_output_token_seconds", "Mean time per token after the first",
                              registry=r, buckets=TOKEN_BUCKETS)
        self.latency = Histogram("gsm_request_latency_seconds", "Submission to the end of the request",
                                 registry=r, buckets=LATENCY_BUCKETS)
        self.queue_depth = Gauge("gsm_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("gsm_running_sequences", "Sequences in the running batch", registry=r)
        self.occupancy = Gauge("gsm_kv_cache_occupancy", "Cached positions over running sequences x max-seq",
                               registry=r)
        self.cache_bytes = Gauge("gsm_kv_cache_bytes", "Bytes the live caches hold, by tier", ["tier"], registry=r)
        self.ratio = Gauge("gsm_kv_compression_ratio", "Dense FP16 KV bytes over the bytes the live caches hold",
                           registry=r)
        self.fallbacks = Counter("gsm_fallbacks", "Fallback policies taken", ["policy"], registry=r)
        for policy in FALLBACK_POLICIES:
            self.fallbacks.labels(policy)
        # The two GSM measurements are registered at their first value: a 0 before any measurement would
        # read as "no hit" / "no noise".
        self.hit_rate: Gauge | None = None
        self.kv_noise: Gauge | None = None
        self.hit_rate_probes = Counter("gsm_sparse_mask_probes", "Decode steps whose hit rate was measured",
                                       registry=r)
        self.kv_noise_passes = Counter("gsm_kv_noise_measurements", "Re-tier passes that re-encoded rows",
                                       registry=r)
        self.steps = Counter("gsm_scheduler_steps", "Scheduler iterations", registry=r)
        self.drafted = Counter("gsm_spec_draft_tokens", "Drafted tokens verified (speculative decoding)", registry=r)
        self.accepted = Counter("gsm_spec_accepted_tokens", "Drafted tokens the model's own tokens matched and kept",
                                registry=r)
        self.config_generation = Gauge("gsm_config_generation", "Run-time knob patches applied since the server "
                                       "started (PATCH /admin/config)", registry=r)
        self.last_ratio: float | None = None

    def on_reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def on_submit(self, req: EngineRequest) -> None:
        self.queue_depth.inc()

    def on_finish(self, req: EngineRequest) -> None:
        assert req.finish_reason is not None and req.t_end is not None
        self.requests.labels(req.finish_reason).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.generation_tokens.inc(len(req.ids))
        self.latency.observe(req.t_end - req.t_submit)
        if req.t_first is not None and len(req.ids) > 1:
            self.tpot.observe((req.t_end - req.t_first) / (len(req.ids) - 1))

    def on_hit_rate(self, req: EngineRequest, hit_rate: float) -> None:
        if self.hit_rate is None:
            self.hit_rate = Gauge("gsm_sparse_mask_hit_rate", "Sparse mask hit rate of the last probed decode step "
                                  "(mean over owning layers; sampled steps only)", registry=self.registry)
        self.hit_rate.set(hit_rate)
        self.hit_rate_probes.inc()

    def on_kv_noise(self, req: EngineRequest, noise: float) -> None:
        if self.kv_noise is None:
            self.kv_noise = Gauge("gsm_shared_kv_noise_level", "Relative error the last re-tier pass added to the "
                                  "latent rows it re-encoded, ||x_new - x_old||_F / ||x_old||_F",
                                  registry=self.registry)
        self.kv_noise.set(noise)
        self.kv_noise_passes.inc()

    def on_fallback(self, req: EngineRequest, policy: str, value: float) -> None:
        self.fallbacks.labels(policy).inc()

    def on_drafts(self, req: EngineRequest, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def on_first_token(self, req: EngineRequest) -> None:
        assert req.t_first is not None
        self.ttft.observe(req.t_first - req.t_submit)

    def on_step(self, engine: Engine, running: Sequence[EngineRequest]) -> None:
        self.steps.inc()
        self.queue_depth.set(engine.queue_depth)
        self.running.set(len(running))
        counts = tier_counts([t for r in running if (t := r.sequence.tiers) is not None])
        self.occupancy.set(float(counts.sum()) / (engine.max_running * self.n_max))
        if self.geo is None:
            return
        for name, b in cache_bytes(counts, self.geo).items():
            self.cache_bytes.labels(name).set(b)
        ratio = compression_ratio(counts, self.geo)
        if ratio is not None:  # keep the last live figure while idle
            self.ratio.set(ratio)
            self.last_ratio = ratio



class TegrastatsCollector:
    """Device memory, GPU load and power rails from the newest tegrastats sample, read at scrape time."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def collect(self) -> Any:
        s = self.monitor.latest
        if s is None:
            return
        mib = 1024 * 1024
        if s.ram_used_mb is not None:
            yield GaugeMetricFamily("gsm_device_memory_used_bytes", "Device RAM in use (tegrastats)",
                                    value=s.ram_used_mb * mib)
            yield GaugeMetricFamily("gsm_device_memory_total_bytes", "Device RAM (tegrastats)",
                                    value=s.ram_total_mb * mib)
        if s.gpu_load is not None:
            yield GaugeMetricFamily("gsm_gpu_load_ratio", "GPU load 0..1, mean over GPCs (tegrastats GR3D_FREQ)",
                                    value=s.gpu_load)
        rails = GaugeMetricFamily("gsm_device_power_watts", "Power rail, current reading (tegrastats)",
                                  labels=["rail"])
        for name, (cur, _avg) in s.power_mw.items():
            rails.add_metric([name], cur / 1000)
        yield rails
