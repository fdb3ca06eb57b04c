"""Random, poisoned GsmSparseAttention scenarios shared by the CPU tests, the GPU tests and the benchmark.

A scenario is one attention call over a cache that was filled through the reference
GsmKVCacheUpdate and partly demoted through GsmKVDemote, exactly as an engine would hold it.
Everything attention must not read is poisoned (NaN rows, NaN table rows, NaN padding
activations, slots of uncached positions pointing at a NaN row), so an out-of-bounds read shows
up as NaN in the output. NumPy only: the golden comparison (torch) lives in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gsm_edge_plugins import ref
from gsm_edge_plugins.ref import FP16, INT4, INT8, INT12, Dims, make_slot

# How a position's row reached its tier (the golden simulation needs the path, not only the tier).
PATH_FP16, PATH_INT12, PATH_INT8_FROM_FP16, PATH_INT8_FROM_INT12 = 0, 1, 2, 3
PATH_INT4_FROM_FP16, PATH_INT4_FROM_INT12, PATH_INT4_FROM_INT8, PATH_INT4_FROM_INT12_INT8 = 4, 5, 6, 7
# The tiers each path passes through after FP16, one re-tier point per step.
PATH_TIERS = {PATH_FP16: (), PATH_INT12: (INT12,), PATH_INT8_FROM_FP16: (INT8,), PATH_INT8_FROM_INT12: (INT12, INT8),
              PATH_INT4_FROM_FP16: (INT4,), PATH_INT4_FROM_INT12: (INT12, INT4), PATH_INT4_FROM_INT8: (INT8, INT4),
              PATH_INT4_FROM_INT12_INT8: (INT12, INT8, INT4)}


@dataclass
class Scenario:
    dims: Dims
    window: int
    past: np.ndarray  # [B] int32
    new: np.ndarray  # [B] int32
    ck_raw: np.ndarray  # [B, N_max, r_k] float32 latents as computed (NaN where uncached)
    cv_raw: np.ndarray  # [B, N_max, r_v]
    keys_raw: np.ndarray  # [B, N_max, dI]
    path: np.ndarray  # [B, N_max] PATH_* (-1 where uncached)
    s8: np.ndarray  # [r]
    s12: np.ndarray  # [r]
    comp: np.ndarray  # [r] comp8
    s4: np.ndarray  # [r]
    comp4: np.ndarray  # [r]
    quant: np.ndarray  # [5, r] = s12, s8, comp8, s4, comp4
    pool: np.ndarray  # [B, pool_words] int32
    index_keys: np.ndarray  # [B, N_max, dI] float16
    slots: np.ndarray  # [B, N_max] int32
    q: np.ndarray  # [B, S, nH*D] (NaN on padding rows)
    index_q: np.ndarray  # [B, S, nI*dI]
    index_w: np.ndarray  # [B, S, nI]
    rope_cos: np.ndarray  # [N_max, D] (NaN beyond the longest sequence)
    rope_sin: np.ndarray
    w0: np.ndarray  # owning: k_up [kvD, r_k]; sharing: kv_proj_weight [2kvD, r]
    w1: np.ndarray  # owning: v_up [kvD, r_v]; sharing: kv_proj_bias [2kvD]
    top_k: np.ndarray | None = None  # [B] int32 per-sequence sparse_top_k (None: the node's max_top_k for all)
    cache_rows: np.ndarray | None = None  # [B] int32 rows of pool / index_keys [R, ...] (None: row b, R = B)

    @property
    def S(self) -> int:
        return int(self.q.shape[1])

    @property
    def lengths(self) -> np.ndarray:
        return self.past + self.new

    def call(self, selected: np.ndarray | None = None, **kw) -> ref.AttentionResult:
        """Run the CPU reference on this scenario (with its per-sequence budgets when it has them)."""
        kw.setdefault("sparse_top_k", self.top_k if self.dims.layer_kind == 0 else None)
        kw.setdefault("cache_rows", self.cache_rows)
        return ref.sparse_attention(self.dims, self.q, self.pool, self.slots, self.past, self.new, self.quant,
                                    self.rope_cos, self.rope_sin, self.w0, self.w1, index_q=self.index_q,
                                    index_w=self.index_w, index_keys=self.index_keys, sparse_window=self.window,
                                    selected=selected, **kw)

    def in_rows(self, rows: np.ndarray, total: int, fill_byte: int = 0xFF) -> Scenario:
        """The same call with sequence b's cache in row rows[b] of `total`-row pools and indexer keys (the
        cache_rows input); every other row is poisoned (pool bytes fill_byte, keys NaN), so reading a wrong row
        shows."""
        from dataclasses import replace

        rows = np.asarray(rows, np.int32)
        if rows.shape != (self.pool.shape[0],) or len(set(rows.tolist())) != rows.size:
            raise ValueError(f"rows: one distinct row per sequence, got {rows}")
        pool = ref.empty_pool(self.dims, total, fill_byte)
        keys = np.full((total, *self.index_keys.shape[1:]), *_key_poison(self.index_keys.dtype))
        pool[rows], keys[rows] = self.pool, self.index_keys
        return replace(self, pool=pool, index_keys=keys, cache_rows=rows)

    def all_rows(self) -> np.ndarray:
        """logit_rows [B, S] naming every row of each sequence, a shorter one's last repeated (a verification's)."""
        return np.minimum(np.arange(self.S)[None, :], np.maximum(self.new - 1, 0)[:, None]).astype(np.int32)

    def one_token(self, j: int) -> Scenario:
        """The one-token call of each sequence at its row j of this call (its last row where it has fewer): that row's
        q, index_q and index_w, past_lengths at its position. The cache holds the call's rows already (make_scenario
        writes them), and a query reads nothing after its position, so the step reads what row j reads."""
        from dataclasses import replace

        B = len(self.past)
        r = np.minimum(j, np.maximum(self.new - 1, 0))

        def pick(a: np.ndarray) -> np.ndarray:
            return a[np.arange(B), r][:, None].copy()

        return replace(self, past=(self.past + r).astype(np.int32), new=np.minimum(self.new, 1).astype(np.int32),
                       q=pick(self.q), index_q=pick(self.index_q), index_w=pick(self.index_w))

    def budget(self, b: int) -> int:
        """Selection budget of sequence b: its sparse_top_k, or max_top_k without per-sequence budgets."""
        return self.dims.max_top_k if self.top_k is None else int(self.top_k[b])

    def query_top_k(self, b: int, t: int) -> int:
        """Top-k of sequence b's query at absolute position t: the budget, grown to (t + 1) // sparse_top_k_divisor
        when the node has a divisor, at most max_top_k (spec 4.1, written out here apart from the C++)."""
        k, div = self.budget(b), self.dims.sparse_top_k_divisor
        if div > 0:
            k = max(k, (t + 1) // div)
        return min(max(k, 0), self.dims.max_top_k)


def rope_tables_np(n: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, D] by decisions "RoPE tables" (float64 angles, one rounding to float32)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(n, dtype=np.float64)[:, None] * inv
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _key_poison(dtype: np.dtype) -> tuple[float | int, np.dtype]:
    """Fill value of unwritten indexer keys: NaN FP16 keys; INT8 codes have no NaN, so a large code (0x7F bytes)
    whose scores stand out."""
    return (np.nan, np.float16) if np.dtype(dtype) == np.float16 else (0x7F7F7F7F, np.int32)


def make_scenario(rng: np.random.Generator, *, num_heads: int, num_kv_heads: int, head_dim: int, rank_k: int,
                  rank_v: int, index_heads: int, index_dim: int, sink_tokens: int, top_k: int,
                  max_sparse_window: int, window: int, n_max: int, past: list[int], new: list[int],
                  tier_mix: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0), layer_kind: int = 0,
                  theta: float = 10000.0, poison: bool = True, key_value: float | None = None,
                  seq_top_k: list[int] | None = None, index_key_bits: int = 16,
                  sparse_top_k_divisor: int = 0) -> Scenario:
    """top_k: the node's max_top_k (K_sel); seq_top_k: each sequence's sparse_top_k input (None: the call
    passes none, every sequence selects max_top_k). tier_mix: fractions of the cached positions outside
    the call's new rows that take each path PATH_FP16, PATH_INT12, ... in order (4 to 8 numbers: FP16, INT12,
    INT8 from FP16, INT8 from INT12, then INT4 from FP16, from INT12, from INT8, from INT12 then INT8).
    key_value: every indexer key equal to this constant (all scores tie) instead of random.
    index_key_bits 8: INT8 indexer keys; the keys the update node stores are then 60 x the random ones, not
    integers and ~3.5 % beyond +-127, so the store's rint and clamp are exercised.
    sparse_top_k_divisor: the node's attribute (> 0: each query's top-k grows with its position)."""
    B = len(past)
    past_a, new_a = np.asarray(past, np.int32), np.asarray(new, np.int32)
    n_b = past_a + new_a
    S = int(new_a.max())
    spare = 2
    d = Dims(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rank_k=rank_k, rank_v=rank_v,
             n_max=n_max, rows_fp16=n_max + spare, rows_int12=n_max // 2 + 1, rows_int8=n_max // 2 + 1,
             rows_int4=n_max // 2 + 1, index_heads=index_heads, index_dim=index_dim, sink_tokens=sink_tokens,
             max_top_k=top_k, max_sparse_window=max_sparse_window, layer_kind=layer_kind, index_key_bits=index_key_bits,
             sparse_top_k_divisor=sparse_top_k_divisor)
    r, kvD = d.rank, d.kv_dim
    nan = np.float32(np.nan)

    # raw latents and keys; scales put ~1 % of INT8 values into the clamp
    ck = np.full((B, n_max, rank_k), nan, np.float32)
    cv = np.full((B, n_max, rank_v), nan, np.float32)
    keys = np.full((B, n_max, index_dim), nan, np.float32)
    for b in range(B):
        ck[b, :n_b[b]] = rng.standard_normal((n_b[b], rank_k), dtype=np.float32)
        cv[b, :n_b[b]] = rng.standard_normal((n_b[b], rank_v), dtype=np.float32)
        keys[b, :n_b[b]] = (rng.standard_normal((n_b[b], index_dim), dtype=np.float32) if key_value is None
                            else np.float32(key_value))
    if index_key_bits == 8:
        keys = (keys * np.float32(60)).astype(np.float32)
    s8 = (np.float32(2.5) / 127 * rng.uniform(0.8, 1.2, r)).astype(np.float32)
    s12 = ((s8 * np.float32(127)) / np.float32(2047)).astype(np.float32)  # spec 5 default, float32 order
    comp = (rng.standard_normal(r).astype(np.float32) * s8 * np.float32(0.05)).astype(np.float32)
    # What the INT4 tier draws comes from a generator of its own (spawning leaves rng's stream as it is), so a
    # scenario without INT4 paths holds the numbers it held before the tier existed. s4 is a calibrated-like
    # scale, not the s8 default (~2 % of the values clamp at +-7), and comp4 is non-zero.
    aux = rng.spawn(1)[0]
    s4 = (np.float32(2.2 / 7) * aux.uniform(0.8, 1.2, r)).astype(np.float32)
    comp4 = (aux.standard_normal(r).astype(np.float32) * s4 * np.float32(0.2)).astype(np.float32)
    quant = np.stack([s12, s8, comp, s4, comp4]).astype(np.float32)

    # every cached position gets its own FP16 row first (a random permutation), as the runtime would
    pool = ref.empty_pool(d, B, fill_byte=0xFF if poison else 0)  # 0xFFFF is an FP16 NaN
    index_keys = d.empty_index_keys(B)
    if poison:
        index_keys[:] = _key_poison(index_keys.dtype)[0]
    poison_row = make_slot(FP16, n_max + spare - 1)  # never written: a NaN row
    slots = np.full((B, n_max), poison_row if poison else -1, np.int32)
    for b in range(B):
        rows = rng.permutation(n_max + spare - 1)[:n_b[b]]
        slots[b, :n_b[b]] = [make_slot(FP16, int(g)) for g in rows]
    S_all = int(n_b.max())
    ref.kv_update(d, ck[:, :S_all], cv[:, :S_all], keys[:, :S_all], pool, index_keys, slots, np.zeros(B, np.int32),
                  n_b)

    # demotions, one pass per step of the paths as at successive re-tier points: FP16 -> INT12 / INT8 / INT4, then
    # INT12 -> INT8 / INT4, then INT8 -> INT4
    path = np.full((B, n_max), -1, np.int32)
    free12 = {b: list(rng.permutation(np.arange(d.rows_fp16, d.rows_fp16 + d.rows_int12))) for b in range(B)}
    base8 = d.rows_fp16 + d.rows_int12
    free8 = {b: list(rng.permutation(np.arange(base8, base8 + d.rows_int8))) for b in range(B)}
    base4 = base8 + d.rows_int8
    free4 = {b: list(aux.permutation(np.arange(base4, base4 + d.rows_int4))) for b in range(B)}
    mix = np.asarray(tier_mix, np.float64)
    if not 4 <= mix.size <= len(PATH_TIERS):
        raise ValueError(f"tier_mix: 4 to {len(PATH_TIERS)} fractions, got {list(tier_mix)}")
    passes: list[list[tuple[int, int, int]]] = [[], [], []]
    for b in range(B):
        path[b, :n_b[b]] = PATH_FP16
        old = np.arange(past_a[b])  # the call's new rows stay FP16, as freshly written rows are
        pick = rng.choice(mix.size, size=old.size, p=mix / mix.sum())
        for s, kind in zip(old.tolist(), pick.tolist()):
            src = int(slots[b, s])
            for step, tier in enumerate(PATH_TIERS[kind]):
                g_src = src & 0xFFFFFF
                if tier == INT12:
                    # half of the INT12 rows stay in their FP16 row (a borrowed row), half move
                    g = g_src if rng.random() < 0.5 or not free12[b] else int(free12[b].pop())
                elif tier == INT8 and step == 0:
                    g = int(free8[b].pop()) if free8[b] else g_src
                elif tier == INT8:
                    g = g_src if rng.random() < 0.5 or not free8[b] else int(free8[b].pop())  # in place or moved
                else:
                    # half of the INT4 rows stay in the wider row they held (FP16, INT12 or INT8 region)
                    g = g_src if aux.random() < 0.5 or not free4[b] else int(free4[b].pop())
                dst = make_slot(tier, g)
                passes[step].append((b, src, dst))
                src = dst
            slots[b, s] = src
            path[b, s] = kind
    for entries in passes:
        if entries:
            ref.kv_demote(d, np.asarray(entries, np.int32), pool, quant)

    # activations of the call; padding rows poisoned
    q = rng.standard_normal((B, S, num_heads * head_dim), dtype=np.float32)
    iq = rng.standard_normal((B, S, index_heads * index_dim), dtype=np.float32)
    iw = rng.standard_normal((B, S, index_heads), dtype=np.float32)
    for b in range(B):
        if poison:
            q[b, new_a[b]:] = nan
            iq[b, new_a[b]:] = nan
            iw[b, new_a[b]:] = nan
    cos, sin = rope_tables_np(n_max, head_dim, theta)
    if poison:
        cos[S_all:] = nan
        sin[S_all:] = nan
    scale = np.float32(1.0 / np.sqrt(r))
    if layer_kind == 0:
        w0 = (rng.standard_normal((kvD, rank_k), dtype=np.float32) * scale).astype(np.float32)
        w1 = (rng.standard_normal((kvD, rank_v), dtype=np.float32) * scale).astype(np.float32)
    else:
        w0 = (rng.standard_normal((2 * kvD, r), dtype=np.float32) * scale).astype(np.float32)
        w1 = rng.standard_normal(2 * kvD, dtype=np.float32) * np.float32(0.1)
    seq_k = None if seq_top_k is None else np.asarray(seq_top_k, np.int32)
    return Scenario(d, window, past_a, new_a, ck, cv, keys, path, s8, s12, comp, s4, comp4, quant, pool, index_keys,
                    slots, q, iq, iw, cos, sin, w0, w1, seq_k)


def numpy_selection(scores: np.ndarray, t: int, sinks: int, window: int, top_k: int) -> list[int]:
    """Sel(t) of spec 4.1 in plain Python: every s <= t when t + 1 <= sinks + window + top_k, else the sinks, the
    window and the top_k best other positions (score descending, the lower position first)."""
    if t + 1 <= sinks + window + top_k:
        return list(range(t + 1))
    best = sorted(range(sinks, t - window + 1), key=lambda s: (-float(scores[s]), s))[:top_k]
    return sorted([*range(sinks), *best, *range(t - window + 1, t + 1)])
