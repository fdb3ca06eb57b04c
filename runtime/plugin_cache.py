"""The cache of the plugin-graph backends (TensorRT and its CPU reference), host side.

Memory model (docs/engine_io.md section 2): per owning layer one byte pool `kv_pool.{l}` [R, P32] and indexer keys
`index_keys.{l}` [R, N_max, dI], R = the memory plan's max_batch rows, allocated once and updated in place by the
graphs. A sequence owns one row for its life (`cache_rows[b]` tells the graph which) and its slot table; a call
carries any subset of the resident sequences, demotion lists name the row of each entry.

What is shared here, so that CI runs every line the TensorRT backend runs except the TensorRT calls:
the rows, the slot-table work before a call (compaction, new rows), the undo of a shadow call, the
demotion lists, and the KV-noise measure of a re-tier pass from pools read back before and after.

A shadow call (forward with commit False: the dense call of a hit-rate probe) needs no copy of the pools:
it writes only the positions it adds, which lie beyond each sequence's length, into rows of that
sequence's FP16 region that the restored slot table holds free again. Nothing reads a free row or a
position past the length, and the real call that follows writes the same positions again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gsm import graph_io as io
from gsm.bundle_format import ROW_CACHE_FREE, BundleConfig
from gsm.quant_table import full_table
from runtime.backend import RowPool, kv_noise_sums, relative_noise
from runtime.slots import ROW_MASK, SlotTable


@dataclass
class PluginCache:
    """One sequence: its row of the pools and its slot table (what the graph reads as kv_slots[b])."""

    row: int
    slots: SlotTable
    released: bool = False


@dataclass
class CallPlan:
    """What one forward call binds, after the slot-table work it needed."""

    compaction: np.ndarray  # [M, 3] (row, old entry, new entry): run through the demotion graph before the call
    kv_slots: np.ndarray  # [B, N_max] int32
    cache_rows: np.ndarray  # [B] int32
    saved: list[tuple[np.ndarray, list[list[int]]]] = field(default_factory=list)  # tables before the new rows


def demotion_list(row: int, moves: Sequence[tuple[int, int]]) -> np.ndarray:
    """demote_list entries [M, 3] of one sequence (engine_io 4.3: b is the pool row)."""
    return np.array([(row, old, new) for old, new in moves], np.int32).reshape(-1, 3)


class PluginRows:
    """The plan's rows of one plugin-graph backend and the host work around each call."""

    def __init__(self, cfg: BundleConfig, backend: str) -> None:
        self.rows = cfg.max_batch  # R: what the pools are allocated for
        self.n_max, self.tiers = cfg.n_max, cfg.pool_rows.by_tier
        self.pool = RowPool(self.rows, backend)

    def new_cache(self) -> PluginCache:
        return PluginCache(self.pool.take(), SlotTable(self.n_max, self.tiers))

    def release(self, cache: PluginCache) -> None:
        if not cache.released:
            cache.released = True
            self.pool.give(cache.row)

    def plan_call(self, caches: Sequence[PluginCache], past: np.ndarray, new: np.ndarray) -> CallPlan:
        """Rows for each sequence's new positions (moving borrowed rows first where its FP16 region is short:
        those moves must run before the call) and the call's kv_slots / cache_rows."""
        moves, saved = [], []
        for c, p0, n in zip(caches, past, new):
            moves.append(demotion_list(c.row, c.slots.compaction(int(n))))
            saved.append((c.slots.entries.copy(), [list(f) for f in c.slots.free]))
            c.slots.allocate(range(int(p0), int(p0) + int(n)))
        return CallPlan(np.concatenate(moves), np.stack([c.slots.entries for c in caches]),
                        np.array([c.row for c in caches], np.int32), saved)

    @staticmethod
    def undo(caches: Sequence[PluginCache], plan: CallPlan) -> None:
        """After a shadow call: each slot table as before its new rows (a compaction stays done: it moved rows
        without changing a value)."""
        for c, (entries, free) in zip(caches, plan.saved):
            c.slots.entries[:], c.slots.free = entries, free

    def demote(self, cache: PluginCache, new_tier: np.ndarray, run: Callable[[np.ndarray], None],
               latents: Callable[[PluginCache], list[np.ndarray]] | None) -> float | None:
        """One re-tier pass of one sequence: the slot-table moves, run through the demotion graph by `run`
        (demote_list [M, 3]). With `latents` (every owning layer's dequantised K and V latents by position
        of the sequence, read back from the pools) returns the pass's relative KV noise over the positions
        whose tier changed (runtime.backend.relative_noise); None when none changed or nothing was read."""
        where = np.nonzero(np.asarray(new_tier) >= 0)[0]
        before = latents(cache) if where.size and latents is not None else None
        moves = cache.slots.demote(np.asarray(new_tier))
        if moves:
            run(demotion_list(cache.row, moves))
        if before is None:
            return None
        return relative_noise([kv_noise_sums(old[where], now[where]) for old, now in zip(before, latents(cache))])


def pool_dims(cfg: BundleConfig, layer: int) -> Any:
    """The plugins' reference Dims of owning layer `layer`'s pool (ranks, regions, keys; no heads: the pool's
    reader and the demotion read nothing else)."""
    from gsm_edge_plugins import ref

    rk, rv = cfg.ranks[layer]
    t = cfg.pool_rows.by_tier
    return ref.Dims(num_heads=0, num_kv_heads=0, head_dim=0, rank_k=rk, rank_v=rv, n_max=cfg.n_max, rows_fp16=t[0],
                    rows_int12=t[1], rows_int8=t[2], rows_int4=t[3], index_dim=cfg.index_dim,
                    index_key_bits=cfg.index_keys.bits)


def read_latents(cfg: BundleConfig, layer: int, pool_row: np.ndarray, entries: np.ndarray,
                 quant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised latents of one layer's pool row [P32] by position ([N_max, r_k], [N_max, r_v]; NaN where a
    position has no row), through the plugins' CPU reference reader (the layout exists once, in C++)."""
    return read_rows(cfg, layer, pool_row, entries, quant)  # entries by position: the rows of every position


def read_rows(cfg: BundleConfig, layer: int, pool_row: np.ndarray, entries: np.ndarray,
              quant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised latents of the slot entries `entries` [m] of one layer's pool row ([m, r_k], [m, r_v]): what
    read_latents returns at those entries' positions, in memory that follows m rather than N_max (a re-tier pass
    moves a few hundred rows of a context of thousands)."""
    from gsm_edge_plugins import ref

    entries = np.asarray(entries, np.int32).reshape(1, -1)
    d = dataclasses.replace(pool_dims(cfg, layer), n_max=entries.shape[1])  # the pool's size does not depend on it
    ck, cv = ref.read_latents(d, np.asarray(pool_row).reshape(1, -1), entries, quant)
    return ck[0], cv[0]


def quant_tables(demote_graph: Any) -> dict[int, np.ndarray]:
    """owning layer -> its [5, r] quantisation table (s12, s8, comp8, s4, comp4), from the demotion graph's
    initializers `gsm.layers.{l}.quant` (an onnx ModelProto with its external data loaded), as gsm.quant_table's
    full_table makes them."""
    from onnx import numpy_helper

    out = {}
    for t in demote_graph.graph.initializer:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[:2] == ["gsm", "layers"] and parts[3] == "quant":
            out[int(parts[2])] = full_table(numpy_helper.to_array(t))
    return out



@dataclass(frozen=True)
class PrefixRows:
    """What one sequence's first `length` positions hold of the pools (the plugins' layout): its slot table, each
    layer's rows those positions name (their bytes, where they lie in the sequence's pool) and its indexer keys.
    Put back into another sequence's row, that sequence holds the same cache: the same rows at the same places."""

    length: int
    entries: np.ndarray  # slot entries of positions 0..length-1
    free: tuple[tuple[int, ...], ...]  # the slot table's free rows per region
    rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]  # owning layer -> (byte runs' starts, sizes, bytes)
    keys: dict[int, np.ndarray]  # owning layer -> index_keys of positions 0..length-1

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes + sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in self.rows.values()) + sum(
            k.nbytes for k in self.keys.values())


def row_spans(cfg: BundleConfig, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte start and size of each global row of `rows` in one sequence's pool of owning layer `layer`: each region's
    rows equally wide and back to back, where the plugins' layout (gsm_layout.h rowOffset) places them."""
    from gsm_edge_plugins import ref

    d = pool_dims(cfg, layer)
    counts = cfg.pool_rows.by_tier
    firsts = np.cumsum((0, *counts[:-1]))
    bases = np.array([ref.row_offset(d, int(f)) for f in firsts], np.int64)
    widths = np.array([ref.row_offset(d, int(f) + 1) - ref.row_offset(d, int(f)) if c else 0
                       for f, c in zip(firsts, counts)], np.int64)
    region = np.searchsorted(firsts, rows, side="right") - 1  # the last region starting at or before each row
    return bases[region] + (rows - firsts[region]) * widths[region], widths[region]


def byte_runs(starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte spans (in order) merged where one ends where the next starts: a prefix's rows lie mostly back to back in
    their regions, so a few slice copies move them (an index of every byte made restoring the inspection app's
    215-position prefix on SmolLM2 take 4.0 ms rather than 0.36)."""
    if starts.size == 0:
        return starts, sizes
    ends = starts + sizes
    first = np.flatnonzero(np.concatenate(([True], starts[1:] != ends[:-1])))
    last = np.concatenate((first[1:] - 1, [starts.size - 1]))
    return starts[first], ends[last] - starts[first]


def take_prefix(cfg: BundleConfig, buffers: dict[str, np.ndarray], cache: PluginCache, length: int) -> PrefixRows:
    """A copy of the first `length` positions of a sequence's cache (runtime.prefix_cache)."""
    entries = cache.slots.entries[:length].copy()
    rows = np.unique(entries & ROW_MASK).astype(np.int64)
    kept, keys = {}, {}
    for l in cfg.owning_layers:
        starts, sizes = byte_runs(*row_spans(cfg, l, rows))
        pool = buffers[io.KV_POOL.at(l)][cache.row].view(np.uint8)
        data = np.concatenate([pool[a:a + n] for a, n in zip(starts.tolist(), sizes.tolist())] or [pool[:0]])
        kept[l] = (starts, sizes, data)
        keys[l] = buffers[io.INDEX_KEYS.at(l)][cache.row, :length].copy()
    return PrefixRows(length, entries, tuple(tuple(f) for f in cache.slots.free), kept, keys)


def put_prefix(buffers: dict[str, np.ndarray], cache: PluginCache, prefix: PrefixRows) -> None:
    """A fresh sequence's cache made the prefix's: slot table, rows, keys; its row of any row cache emptied (a slot of
    the row's last sequence could name a position and entry the prefix reuses)."""
    if np.any(cache.slots.entries >= 0):
        raise ValueError("a prefix goes into a fresh sequence only")
    cache.slots.entries[:prefix.length] = prefix.entries
    cache.slots.free = [list(f) for f in prefix.free]
    for l, (starts, sizes, data) in prefix.rows.items():
        pool, at = buffers[io.KV_POOL.at(l)][cache.row].view(np.uint8), 0
        for a, n in zip(starts.tolist(), sizes.tolist()):
            pool[a:a + n] = data[at:at + n]
            at += n
        buffers[io.INDEX_KEYS.at(l)][cache.row, :prefix.length] = prefix.keys[l]
    for name, tags in buffers.items():
        if name.startswith(io.ROW_CACHE_TAGS.prefix):
            tags[cache.row] = ROW_CACHE_FREE
