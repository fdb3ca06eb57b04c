"""The Grafana dashboard over both servers' Prometheus series, generated from one table of panels.

    python -m runtime.serve.dashboard > dashboards/gsm-edge.json

Generated, not hand-kept: the panel table below is also what tests/test_dashboard.py reads to check that
every series a panel queries exists on a running server's /metrics (`runtime serve`, and Triton's for the
GSM series and its own), and that the committed JSON is this module's output; a renamed metric then fails a
test instead of leaving an empty panel. One dashboard serves a fleet: every query keeps the `instance` label
Prometheus adds per scraped server, and a `job` variable picks the servers.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    source: str = "serve"  # serve: runtime serve's /metrics; triton: Triton's; both; jetson: tegrastats (Orin)


def q(expr: str) -> str:
    return expr.replace("RATE", RATE)


PANELS = (
    Panel("Generated tokens / s", ((q("sum by (instance) (rate(gsm_generation_tokens_total{job=~\"$job\"}RATE))"),
                                    "{{instance}}"),), "short", "both"),
    Panel("Requests / s by finish reason", ((q("sum by (finish_reason) (rate(gsm_requests_total{job=~\"$job\"}RATE))"),
                                             "{{finish_reason}}"),), "reqps", "both"),
    Panel("Time to first token", tuple((q(f"histogram_quantile({p}, sum by (le) (rate("
                                         f"gsm_time_to_first_token_seconds_bucket{{job=~\"$job\"}}RATE)))"), f"p{n}")
                                       for p, n in ((0.5, 50), (0.95, 95), (0.99, 99))), "s"),
    Panel("Request latency", tuple((q(f"histogram_quantile({p}, sum by (le) (rate("
                                     f"gsm_request_latency_seconds_bucket{{job=~\"$job\"}}RATE)))"), f"p{n}")
                                   for p, n in ((0.5, 50), (0.95, 95), (0.99, 99))), "s"),
    Panel("Queue depth and running sequences",
          (("sum by (instance) (gsm_queue_depth{job=~\"$job\"})", "queue {{instance}}"),
           ("sum by (instance) (gsm_running_sequences{job=~\"$job\"})", "running {{instance}}")), "short", "both"),
    Panel("Sparse mask hit rate (sampled)", (("min by (instance) (gsm_sparse_mask_hit_rate{job=~\"$job\"})",
                                              "{{instance}}"),), "percentunit", "both"),
    Panel("KV compression ratio (live caches)", (("min by (instance) (gsm_kv_compression_ratio{job=~\"$job\"})",
                                                  "{{instance}}"),), "short"),
    Panel("KV noise of the last re-tier pass", (("max by (instance) (gsm_shared_kv_noise_level{job=~\"$job\"})",
                                                 "{{instance}}"),), "percentunit", "both"),
    Panel("Fallbacks / s", ((q("sum by (policy) (rate(gsm_fallbacks_total{job=~\"$job\"}RATE))"), "{{policy}}"),),
          "short", "both"),
    Panel("Triton: inference success / failure / s",
          ((q("sum by (model) (rate(nv_inference_request_success{job=~\"$job\"}RATE))"), "ok {{model}}"),
           (q("sum by (model) (rate(nv_inference_request_failure{job=~\"$job\"}RATE))"), "failed {{model}}")),
          "reqps", "triton"),
    Panel("Triton: queue time per request",
          ((q("sum by (model) (rate(nv_inference_queue_duration_us{job=~\"$job\"}RATE)) / "
              "clamp_min(sum by (model) (rate(nv_inference_request_success{job=~\"$job\"}RATE)), 1e-9) / 1e6"),
            "{{model}}"),), "s", "triton"),
    Panel("Jetson memory", (("gsm_device_memory_used_bytes{job=~\"$job\"}", "used {{instance}}"),
                            ("gsm_device_memory_total_bytes{job=~\"$job\"}", "total {{instance}}")), "bytes", "jetson"),
    Panel("Jetson GPU load", (("gsm_gpu_load_ratio{job=~\"$job\"}", "{{instance}}"),), "percentunit", "jetson"),
    Panel("Jetson power", (("sum by (instance, rail) (gsm_device_power_watts{job=~\"$job\"})",
                            "{{rail}} {{instance}}"),), "watt", "jetson"),
)

_METRIC = re.compile(r"\b((?:gsm|nv)_[a-z0-9_]+)\b")


def series(panel: Panel) -> set[str]:
    """The metric names a panel's queries read."""
    return {m for e, _ in panel.exprs for m in _METRIC.findall(e)}


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "datasource": {"type": "prometheus", "uid": "${ds}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": e, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${ds}"}}
                        for j, (e, legend) in enumerate(p.exprs)],
        })
    return {
        "title": "gsm-edge fleet", "uid": "gsm-edge-fleet", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["gsm-edge", "triton", "jetson"],
        "templating": {"list": [
            {"name": "ds", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "job", "type": "query", "label": "job", "datasource": {"type": "prometheus", "uid": "${ds}"},
             "query": "label_values(up, job)", "includeAll": True, "multi": True, "current": {"text": "All",
                                                                                           "value": "$__all"}},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
