"""Cache size figures of live sequences (numpy only): bytes held by tier and the compression ratio
against a dense FP16 KV cache, as spec 6 counts them.

Per position, an owning layer holds its latent row (r_k + r_v values at the row's tier: FP16 2 bytes,
INT12 1.5, INT8 1, INT4 0.5 per value) and its indexer key (index_dim FP16 values, never re-tiered). The dense
baseline is what the original model's cache would hold: num_hidden_layers * 2 (K, V) * kv_dim * 2 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gsm.bundle_format import BundleConfig
from gsm.tiers import BYTES as TIER_BYTES
from gsm.tiers import NAMES as TIER_NAMES


@dataclass(frozen=True)
class CacheGeometry:
    """What one cached position costs, from bundle.json and config.json."""

    latent_values: int  # sum over owning layers of r_k + r_v
    index_bytes: int  # sum over owning layers of one position's indexer key (index_dim * 2 FP16, index_dim INT8)
    dense_fp16_bytes: int  # the uncompressed model's K/V bytes per position

    @classmethod
    def from_bundle(cls, bundle_cfg: BundleConfig, model_cfg: Mapping[str, Any]) -> CacheGeometry:
        """bundle_cfg: the bundle's bundle.json; model_cfg: its config.json as parsed JSON."""
        ranks = list(bundle_cfg.ranks.values())
        heads = int(model_cfg["num_attention_heads"])
        head_dim = int(model_cfg.get("head_dim") or int(model_cfg["hidden_size"]) // heads)
        kv_dim = int(model_cfg.get("num_key_value_heads") or heads) * head_dim
        return cls(latent_values=sum(rk + rv for rk, rv in ranks),
                   index_bytes=len(ranks) * bundle_cfg.index_keys.bytes,
                   dense_fp16_bytes=int(model_cfg["num_hidden_layers"]) * 2 * kv_dim * 2)


def tier_counts(tiers: Sequence[np.ndarray]) -> np.ndarray:
    """Positions per tier [4] over several sequences' tier arrays (0 FP16, 1 INT12, 2 INT8, 3 INT4)."""
    n = len(TIER_NAMES)
    total = np.zeros(n, np.int64)
    for t in tiers:
        total += np.bincount(np.asarray(t, np.int64), minlength=n)[:n]
    return total


def cache_bytes(counts: Sequence[int], geo: CacheGeometry) -> dict[str, float]:
    """Bytes the live cache holds: latent rows by tier, plus the indexer keys ("index")."""
    out = {name: float(n) * geo.latent_values * b for name, n, b in zip(TIER_NAMES, counts, TIER_BYTES)}
    out["index"] = float(sum(counts)) * geo.index_bytes
    return out


def compression_ratio(counts: Sequence[int], geo: CacheGeometry) -> float | None:
    """Dense FP16 bytes over the bytes actually held; None while the cache is empty."""
    held = sum(cache_bytes(counts, geo).values())
    return None if held == 0 else float(sum(counts)) * geo.dense_fp16_bytes / held
