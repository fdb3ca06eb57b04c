"""What a backend is to the Runtime and the engine: the step API (`Backend`), the record of what it can do
(`Capabilities`), and the step types every backend shares.

The scheduler reads `Capabilities` instead of probing backends for attributes: how many sequences may be
resident at once (the memory plan's rows: the engine admits by it, a backend never grows past it), how many
one call may carry, and which measurements the backend can make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gsm import graph_io as io
from runtime.sampling import RequestError

BATCH_ROWS = 8  # the call size Capabilities.verify_row_cost_batch is stated for


class CacheFullError(RuntimeError):
    """Every cache row of the memory plan is taken; the message names the limit and the build flag."""


@dataclass(frozen=True)
class Capabilities:
    """What one backend over one bundle can do. Row counts come from the bundle's memory plan (bundle.json
    max_batch, n_max): they are fixed at load and never grow under load."""

    max_resident: int  # sequences with a cache at once: the plan's max_batch rows
    max_per_call: int  # sequences one forward call may carry
    positions: int  # positions per sequence (max_seq, bundle.json n_max)
    kv_bytes_per_sequence: int  # this backend's cache bytes of one row (a sequence at max_seq), all owning layers
    hit_rate_probes: bool  # forward(commit=False) leaves the cache as it was: a dense shadow call is possible
    kv_noise: bool  # demote() measures the KV noise a re-tier pass adds (None from a backend that cannot)
    graph: str | None = None  # which of the bundle's networks runs where there is a choice (onnxruntime: cpu, portable)
    graph_note: str = ""  # why the first choice of network was not taken, if it was not
    # a prefill call's new tokens x the positions each sees, over all its sequences, at most (0: max-input tokens
    # whatever the context): the working memory of a call that scores every position for every query follows it
    call_positions: int = 0
    # new tokens per sequence a call may carry whose logits and per-query attention mass (`rows`, StepOutput
    # query_mass) equal one-token steps' bit for bit: a speculative verification's most (0: none, no speculation)
    verify_rows: int = 0
    # what each verified row beyond the first adds to a call, in one-token steps (the adaptive draft length's price),
    # for a call of one sequence and for a call of BATCH_ROWS or more (a batched step is compute already)
    verify_row_cost: float = 1.0
    verify_row_cost_batch: float = 1.0
    prefix_reuse: bool = False  # take_prefix / put_prefix copy a sequence's first positions (runtime.prefix_cache)
    # the largest selection budget a call takes (the plugin nodes' max_top_k, check_max_top_k); 0: any up to positions
    max_top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("max_resident", "max_per_call", "positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"Capabilities.{name}: expected an integer >= 1, got {getattr(self, name)!r}")

    def row_cost(self, sequences: int) -> float:
        """The cost of a verified row in a call of `sequences` sequences: from verify_row_cost at one to
        verify_row_cost_batch at BATCH_ROWS, linear in 1 - 1/sequences between."""
        f = min(1.0, (1 - 1 / max(1, sequences)) / (1 - 1 / BATCH_ROWS))
        return self.verify_row_cost + f * (self.verify_row_cost_batch - self.verify_row_cost)

    @property
    def kv_budget_bytes(self) -> int:
        """The cache bytes of all resident rows: what this backend holds at most (preallocated or not)."""
        return self.kv_bytes_per_sequence * self.max_resident


class CacheRow(Protocol):
    """A backend's record of one sequence's place in its buffers (onnxruntime's OrtCache, the plugin backends'
    PluginCache): the memory plan's row it holds, until released. Only the backend that made it reads the rest."""

    row: int
    released: bool


class PrefixCopy(Protocol):
    """A backend's copy of a sequence's first positions (`Backend.take_prefix`: PositionRows, PrefixRows)."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class StepOutput:
    logits: np.ndarray  # [B, J, V] float32 (J: the call's logit rows), or [B, S, V] (a bundle built --logits all)
    attn_mass: np.ndarray  # [B, L] float32, L >= every sequence's length after the call (positions 0..L-1)
    selected: dict[int, np.ndarray] | None = None  # owning layer -> [B, S, k] int32 positions, -1 padded
    layer_mass: dict[int, np.ndarray] | None = None  # owning layer -> [B, L] float32: that layer's attn_mass
    query_mass: np.ndarray | None = None  # [B, J, L] float32: the attention mass of each logit row's query alone


class Backend(Protocol):
    """The calls the Runtime makes (onnxruntime, tensorrt, reference). A cache is the backend's own record of
    one sequence; the Runtime hands it back on every call and releases it exactly once."""

    name: str
    capabilities: Capabilities

    def new_cache(self) -> CacheRow:
        """A free row for a new sequence; CacheFullError when all `capabilities.max_resident` are taken."""
        ...

    def release(self, cache: CacheRow) -> None:
        """Give the cache's row back (idempotent)."""
        ...

    def forward(self, caches: list[CacheRow], ids: np.ndarray, past: np.ndarray, new: np.ndarray, sparse_window: int,
                top_k: np.ndarray, *, probes: bool = False, commit: bool = True,
                rows: np.ndarray | None = None) -> StepOutput:
        """One call over ids [B, S]: sequence b adds new[b] tokens at positions past[b].. of caches[b]. rows
        [B, J] (0..S-1): the rows whose logits come back, and their queries' own attention mass where
        `capabilities.verify_rows` > 0; None: each sequence's last new row."""
        ...

    def take_prefix(self, cache: CacheRow, length: int) -> PrefixCopy:
        """A copy of the cache of the sequence's first `length` positions (an object with nbytes)."""
        ...

    def put_prefix(self, cache: CacheRow, prefix: PrefixCopy) -> None:
        """A fresh sequence's cache made a take_prefix copy's."""
        ...

    def truncate(self, cache: CacheRow, length: int) -> None:
        """Forget the positions from `length` on (the drafts a verification rejected): the next call writes them."""
        ...

    def demote(self, cache: CacheRow, new_tier: np.ndarray) -> float | None:
        """Re-encode positions whose new_tier >= 0; the pass's KV noise (None: none measured or none changed)."""
        ...

    def close(self) -> None:
        """Free what the backend holds outside Python's memory (device buffers); a no-op elsewhere."""
        ...


class RowPool:
    """The plan's rows of a backend, handed out lowest first (live sequences stay packed) and never more."""

    def __init__(self, rows: int, backend: str) -> None:
        self.rows, self.backend = rows, backend
        self.free = list(range(rows - 1, -1, -1))

    @property
    def in_use(self) -> int:
        return self.rows - len(self.free)

    def take(self) -> int:
        if not self.free:
            raise CacheFullError(f"backend {self.backend}: all {self.rows} cache rows of the bundle's memory plan "
                                 f"are in use (max_batch {self.rows}); release a sequence first, or rebuild with a "
                                 "larger --max-batch")
        return self.free.pop()

    def give(self, row: int) -> None:
        if row in self.free or not 0 <= row < self.rows:
            raise ValueError(f"backend {self.backend}: row {row} is not in use")
        self.free.append(row)
        self.free.sort(reverse=True)


def kv_noise_sums(old: np.ndarray, new: np.ndarray) -> tuple[float, float]:
    """(sum of squared changes, sum of squared old values) in float64 over re-encoded rows: the runtime's KV
    noise of a demotion pass is sqrt(first / second) over all its rows, layers, K and V."""
    o, n = np.asarray(old, np.float64), np.asarray(new, np.float64)
    return float(np.sum((n - o) ** 2)), float(np.sum(o ** 2))


def relative_noise(sums: list[tuple[float, float]]) -> float | None:
    """||x_new - x_old||_F / ||x_old||_F from kv_noise_sums parts; None when nothing was re-encoded."""
    if not sums:
        return None
    num, den = sum(a for a, _ in sums), sum(b for _, b in sums)
    return float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else float("inf"))


def check_max_top_k(top_k: np.ndarray, max_top_k: int, backend: str) -> None:
    """The plugin nodes select at most max_top_k per sequence (K_sel); the CUDA kernel
    would clamp a larger budget silently, so the plugin backends refuse it (a builder choice)."""
    worst = int(np.max(top_k)) if np.size(top_k) else 0
    if worst > max_top_k:
        raise RequestError("sparse_top_k", f"{worst} is above the bundle's max_top_k {max_top_k} on backend "
                                           f"{backend} (the plugin graph's selection width: rebuild with "
                                           f"`builder build --max-top-k {worst}` or more, or use the onnxruntime "
                                           "backend)")


def logit_rows(new: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """The `logit_rows` input [B, J] int32 of a call: `rows`, or each sequence's last new row."""
    if rows is None:
        return (np.asarray(new, np.int32) - 1).reshape(-1, 1)
    return np.ascontiguousarray(rows, np.int32)


def step_feeds(ids: np.ndarray, past: np.ndarray, new: np.ndarray, sparse_window: int, top_k: np.ndarray,
               cache_rows: np.ndarray, rows: np.ndarray | None, kv_slots: np.ndarray | None = None
               ) -> dict[str, np.ndarray]:
    """The small inputs of one step call (gsm.graph_io's per-call inputs), by name, in the dtypes the graphs declare;
    kv_slots only for the networks over the plugins' pools."""
    B = len(past)
    feeds = {io.INPUT_IDS.name: np.ascontiguousarray(ids, np.int64),
             io.PAST_LENGTHS.name: np.ascontiguousarray(past, np.int32),
             io.NEW_LENGTHS.name: np.ascontiguousarray(new, np.int32),
             io.SPARSE_WINDOW.name: np.array([sparse_window], np.int32),
             io.SPARSE_TOP_K.name: np.ascontiguousarray(top_k, np.int32).reshape(B),
             io.CACHE_ROWS.name: np.ascontiguousarray(cache_rows, np.int32),
             io.LOGIT_ROWS.name: logit_rows(new, rows)}
    if kv_slots is not None:
        feeds[io.KV_SLOTS.name] = kv_slots
    return feeds


@dataclass(frozen=True)
class PositionRows:
    """The first positions of a sequence in cache buffers laid out by position (the portable graph's): each
    buffer's rows, by name."""

    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())
