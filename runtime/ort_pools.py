"""The onnxruntime backend's cache on model.cpu.onnx: the plugins' own pools (docs/engine_io.md section 3), the memory
the TensorRT and reference backends hold, written and demoted by the same code.

Per owning layer `kv_pool.{l}` [R, P32] (latent rows in FP16 / INT12 / INT8 / INT4 regions) and `index_keys.{l}`
[R, N_max, w] (FP16 keys, or INT8 codes four to an int32 word); per layer a row cache of reconstructed K rows,
`row_cache.{i}` [R, C_i, kvD] and its tags [R, 3, C_i] (plugins/ortCpu/GsmPoolAttention; C_i a constant of the plan,
not of the context). Rows and slot tables are runtime.plugin_cache's (`PluginRows`): a call's new positions get FP16
rows, a re-tier pass re-encodes rows through the plugins' C++ reference (`GsmKVDemote`), a shadow call (the dense
probe) is undone by restoring the slot tables. The graph's nodes read and write the buffers in place (bound once);
the pools' pages are the OS's zeroed pages until written, so resident memory follows the rows in use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gsm import graph_io as io
from gsm.bundle_format import REBUILD, ROW_CACHE_FREE, ROW_CACHE_TAGS, BundleConfig, BundleError
from runtime.backend import kv_noise_sums, relative_noise
from runtime.host_memory import cache_zeros
from runtime.plugin_cache import CallPlan, PluginCache, PluginRows, demotion_list, pool_dims, read_latents, read_rows

QUANT = "gsm.layers.{l}.quant"  # builder/network.py quant_name: each owning layer's [5, r] table


@dataclass(frozen=True)
class PoolBytes:
    """What the pools hold for one sequence (one row of every buffer)."""

    per_position: int  # latent pools and indexer keys, all owning layers, divided by N_max
    row_cache: int  # the K-row caches of every layer (constant: independent of the context)
    per_sequence: int  # every buffer's row: pools, keys, row caches and their tags


class OrtPools:
    """The buffers of model.cpu.onnx's cache inputs and the host work around each call."""

    def __init__(self, cfg: BundleConfig, inputs: Mapping[str, Sequence[Any]], weights: Mapping[str, np.ndarray],
                 backend: str) -> None:
        self.cfg, self.rows = cfg, PluginRows(cfg, backend)
        R, N = self.rows.rows, cfg.n_max
        self.buffers: dict[str, np.ndarray] = {}
        self.quant: dict[int, np.ndarray] = {}
        int8 = cfg.index_keys.bits == 8
        for l in cfg.owning_layers:
            if io.KV_POOL.at(l) not in inputs:
                raise BundleError(f"model.cpu.onnx has no input kv_pool.{l}: rebuild the bundle with `{REBUILD}`")
        # one block per layer in 4 KiB pages (runtime.host_memory.cache_zeros): a short context touches the start of
        # every layer's pool row (its FP16 region), which 2 MiB pages would make resident whole (docs/decisions.md
        # "One allocation per layer's buffer, no huge pages")
        for l in cfg.owning_layers:
            self.buffers[io.KV_POOL.at(l)] = cache_zeros((R, int(inputs[io.KV_POOL.at(l)][-1])), np.int32)
        for l in cfg.owning_layers:
            self.buffers[io.INDEX_KEYS.at(l)] = cache_zeros((R, N, int(inputs[io.INDEX_KEYS.at(l)][-1])),
                                                           np.int32 if int8 else np.float16)
            q = np.ascontiguousarray(weights[QUANT.format(l=l)], np.float32)
            self.quant[l] = q
        self.row_cache_layers = []
        for i in range(len(inputs)):
            name = io.ROW_CACHE.at(i)
            if name not in inputs:
                break
            _, c, kvd = inputs[name]
            self.buffers[name] = cache_zeros((R, int(c), int(kvd)), np.float32)
            tags = self.buffers[io.ROW_CACHE_TAGS.at(i)] = cache_zeros((R, ROW_CACHE_TAGS, int(c)), np.int32)
            tags[:] = ROW_CACHE_FREE
            self.row_cache_layers.append(i)
        self.dims = {l: pool_dims(cfg, l) for l in cfg.owning_layers}

    def bytes(self) -> PoolBytes:
        R, N = self.rows.rows, self.cfg.n_max
        pools = sum(self.buffers[f"{k}.{l}"].nbytes for l in self.cfg.owning_layers for k in ("kv_pool", "index_keys"))
        rc = sum(self.buffers[io.ROW_CACHE.at(i)].nbytes for i in self.row_cache_layers)
        every = sum(b.nbytes for b in self.buffers.values())
        return PoolBytes(pools // R // N, rc // R, every // R)

    # -- rows ----------------------------------------------------------------------------------------
    def new_cache(self) -> PluginCache:
        return self.rows.new_cache()

    def release(self, cache: PluginCache) -> None:
        self.rows.release(cache)

    def plan(self, caches: Sequence[PluginCache], past: np.ndarray, new: np.ndarray) -> CallPlan:
        """FP16 rows for the call's new positions (rows moved first where the FP16 region is short) and its
        kv_slots [B, N_max]."""
        plan = self.rows.plan_call(caches, past, new)
        if plan.compaction.size:
            self._demote_all(plan.compaction)
        return plan

    def undo(self, caches: Sequence[PluginCache], plan: CallPlan) -> None:
        self.rows.undo(caches, plan)

    def _demote_all(self, entries: np.ndarray) -> None:
        from gsm_edge_plugins import ref

        for l in self.cfg.owning_layers:
            ref.kv_demote(self.dims[l], entries, self.buffers[io.KV_POOL.at(l)], self.quant[l])

    def latents(self, cache: PluginCache, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n positions' dequantised latents of one owning layer (tests, the KV-noise measure)."""
        ck, cv = read_latents(self.cfg, layer, self.buffers[io.KV_POOL.at(layer)][cache.row], cache.slots.entries,
                              self.quant[layer])
        return ck[:n], cv[:n]

    def demote(self, cache: PluginCache, new_tier: np.ndarray) -> float | None:
        """One re-tier pass of one sequence: the slot-table moves, each layer's rows re-encoded; returns the pass's
        relative KV noise over the positions whose tier changed (read back one layer at a time, those positions
        only held at once)."""
        from gsm_edge_plugins import ref

        where = np.nonzero(np.asarray(new_tier) >= 0)[0]
        if where.size == 0:
            return None
        old = cache.slots.entries[where]  # a copy (indexed by an array), taken before the moves
        moves = cache.slots.demote(np.asarray(new_tier))
        if not moves:
            return None
        now = cache.slots.entries[where]
        entries = demotion_list(cache.row, moves)
        sums = []
        for l in self.cfg.owning_layers:
            pool = self.buffers[io.KV_POOL.at(l)]
            before = read_rows(self.cfg, l, pool[cache.row], old, self.quant[l])
            ref.kv_demote(self.dims[l], entries, pool, self.quant[l])
            after = read_rows(self.cfg, l, pool[cache.row], now, self.quant[l])
            sums += [kv_noise_sums(b, a) for b, a in zip(before, after)]
        return relative_noise(sums)
