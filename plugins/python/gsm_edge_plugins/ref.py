"""NumPy bindings of the C++ CPU reference of the GSM plugins (docs/engine_io.md).

Numpy in, numpy out, no torch. Buffers the nodes update in place (the latent pool, the indexer
keys) are modified in place *and* returned, as the engine's aliased outputs are. Shapes and the
meaning of every argument are those of docs/engine_io.md section 4.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from gsm_edge_plugins._lib import REF_LIB, load

ABI_VERSION = 7  # gsm_ref_abi_version() of plugins/common/gsmRefCapi.cpp this file is written for
FP16, INT12, INT8, INT4 = 0, 1, 2, 3  # tier codes (gsm/tiers.py)
QUANT_ROWS = 5  # quant table [5, r]: s12, s8, comp8, s4, comp4
SLOT_EMPTY = -1
_c = ctypes


class GsmDims(_c.Structure):
    """Mirror of gsm::GsmDims (plugins/common/gsm_layout.h), field for field."""

    _fields_ = [(n, _c.c_int32) for n in (
        "layerKind", "numHeads", "numKvHeads", "headDim", "rankK", "rankV", "indexHeads", "indexDim",
        "sinkTokens", "maxTopK", "maxSparseWindow", "nMax", "rowsFP16", "rowsINT12", "rowsINT8", "rowsINT4",
        "indexKeyBits", "sparseTopKDivisor")]


@dataclass(frozen=True)
class Dims:
    """Node attributes (docs/engine_io.md 4.1-4.3), Python names."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rank_k: int
    rank_v: int
    n_max: int
    rows_fp16: int
    rows_int12: int
    rows_int8: int
    rows_int4: int = 0
    index_heads: int = 1
    index_dim: int = 8
    sink_tokens: int = 1
    max_top_k: int = 64  # the largest per-sequence sparse_top_k
    max_sparse_window: int = 8
    layer_kind: int = 0
    index_key_bits: int = 16  # 8: INT8 indexer-key codes, four to an int32 word
    sparse_top_k_divisor: int = 0  # > 0: a query's top-k grows to max(sparse_top_k[b], (t + 1) // this)

    def __post_init__(self) -> None:
        for f in fields(self):
            if int(getattr(self, f.name)) < 0:
                raise ValueError(f"Dims.{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.index_key_bits not in (8, 16):
            raise ValueError(f"Dims.index_key_bits must be 8 or 16, got {self.index_key_bits}")
        if self.rows_fp16 + self.rows_int12 + self.rows_int8 + self.rows_int4 < self.n_max:
            raise ValueError("rows_fp16 + rows_int12 + rows_int8 + rows_int4 must be >= n_max (one row per position)")

    @property
    def rank(self) -> int:
        return self.rank_k + self.rank_v

    @property
    def k_sel(self) -> int:
        """K_sel = sink_tokens + max_sparse_window + max_top_k."""
        return self.sink_tokens + self.max_sparse_window + self.max_top_k

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def index_keys_type(self) -> tuple[type, int]:
        """dtype and last-axis width of `index_keys` [R, N_max, width]: float16 [dI], or int32 words holding the
        INT8 codes [ceil(dI / 4)] (gsm.bundle_format.IndexKeyLayout)."""
        return (np.float16, self.index_dim) if self.index_key_bits == 16 else (np.int32, -(-self.index_dim // 4))

    def empty_index_keys(self, rows: int) -> np.ndarray:
        dtype, width = self.index_keys_type
        return np.zeros((rows, self.n_max, width), dtype)

    def c(self) -> GsmDims:
        return GsmDims(self.layer_kind, self.num_heads, self.num_kv_heads, self.head_dim, self.rank_k, self.rank_v,
                       self.index_heads, self.index_dim, self.sink_tokens, self.max_top_k, self.max_sparse_window,
                       self.n_max, self.rows_fp16, self.rows_int12, self.rows_int8, self.rows_int4, self.index_key_bits,
                       self.sparse_top_k_divisor)


def make_slot(tier: int, row: int) -> int:
    """kv_slots encoding: (tier << 24) | global row."""
    return (int(tier) << 24) | int(row)


def key_codes_of(d: Dims, index_keys: np.ndarray) -> np.ndarray:
    """The INT8 codes [..., dI] an int32-word `index_keys` array holds (little-endian bytes, code c at byte c)."""
    words = np.ascontiguousarray(index_keys, dtype=np.int32)
    return words.view(np.int8).reshape(*words.shape[:-1], -1)[..., :d.index_dim]


def slot_tier(entry: np.ndarray | int) -> np.ndarray | int:
    return np.asarray(entry) >> 24


def slot_row(entry: np.ndarray | int) -> np.ndarray | int:
    return np.asarray(entry) & 0xFFFFFF


class PluginContractError(RuntimeError):
    """A contract violation reported by the C++ reference (message names the node and the value)."""


class _Ref:
    def __init__(self) -> None:
        lib = load(REF_LIB)
        if lib is None:
            raise ImportError(f"{REF_LIB} was not built/installed: run `pip install -e .` (plugins/CMakeLists.txt)")
        self.lib = lib
        p, i32, i64, f64 = _c.c_void_p, _c.c_int32, _c.c_int64, _c.c_double
        dp = _c.POINTER(GsmDims)
        sig = {
            "gsm_ref_last_error": (_c.c_char_p, []),
            "gsm_ref_abi_version": (i32, []),
            "gsm_ref_pool_words": (i64, [dp]),
            "gsm_ref_row_offset": (i64, [dp, i32]),
            "gsm_ref_kv_update": (i32, [dp, i32, i32, p, p, p, p, p, p, p, p, p, i32]),
            "gsm_ref_kv_demote": (i32, [dp, i32, i32, p, p, p]),
            "gsm_ref_read_latents": (i32, [dp, i32, p, p, p, p, p]),
            # dims, B, S, 13 inputs, window, selected, top-k, cache_rows + R, logit_rows + J, 5 outputs, threads
            "gsm_ref_sparse_attention": (i32, [dp, i32, i32] + [p] * 13 + [i32, p, p] + [p, i32] * 2 + [p] * 5 + [i32]),
            "gsm_ref_hotness_update": (None, [i32, p, p, f64]),
            "gsm_ref_ranked_tiers": (None, [i32, p, p, i32, p, i32, i32, f64, f64, f64, f64, p]),
            "gsm_ref_f32_to_f16": (None, [p, p, i64]),
            "gsm_ref_f16_to_f32": (None, [p, p, i64]),
            "gsm_ref_quantize": (None, [p, p, i64, i32, i32, p]),
            "gsm_ref_dequantize": (i32, [p, p, p, i64, i32, i32, p]),
            "gsm_ref_default_scale": (i32, [p, i64, i32, p]),
            "gsm_ref_pack_int12": (None, [p, i64, p]),
            "gsm_ref_unpack_int12": (None, [p, i64, p]),
            "gsm_ref_pack_int4": (None, [p, i64, p]),
            "gsm_ref_unpack_int4": (None, [p, i64, p]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        found = lib.gsm_ref_abi_version()
        if found != ABI_VERSION:  # a library built from other sources would take other arguments
            raise ImportError(f"{REF_LIB} has ABI {found}, these bindings need {ABI_VERSION}: rebuild it "
                              "(`pip install -e .`, or GSM_EDGE_PLUGINS_DIR=<a fresh CMake build>)")

    def check(self, rc: int) -> None:
        if rc != 0:
            raise PluginContractError(self.lib.gsm_ref_last_error().decode())


_REF: _Ref | None = None


def lib() -> _Ref:
    """The loaded reference library (ImportError when it was not built)."""
    global _REF
    if _REF is None:
        _REF = _Ref()
    return _REF


def _arr(a: np.ndarray | None, dtype: type, shape: tuple[int, ...] | None = None, name: str = "") -> np.ndarray | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a, dtype=dtype)
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
    return a


def _quant(quant: np.ndarray, d: Dims) -> np.ndarray:
    """A layer's quant table as the library reads it: float32 [5, r] (rows s12, s8, comp8, s4, comp4)."""
    q = np.ascontiguousarray(quant, dtype=np.float32)
    if q.shape != (QUANT_ROWS, d.rank):
        raise ValueError(f"quant: expected shape ({QUANT_ROWS}, {d.rank}) (rows s12, s8, comp8, s4, comp4), got "
                         f"{q.shape}")
    return q


def _p(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _inplace(a: np.ndarray, dtype: type, shape: tuple[int, ...], name: str) -> np.ndarray:
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"{name}: updated in place, so it must be a writable C-contiguous {np.dtype(dtype)} "
                         f"array of shape {shape}; got {a.dtype} {a.shape}")
    return a


# ---- layout ------------------------------------------------------------------------------------
def pool_words(d: Dims) -> int:
    """int32 words of one sequence's latent pool (docs/engine_io.md section 3)."""
    return int(lib().lib.gsm_ref_pool_words(_c.byref(d.c())))


def row_offset(d: Dims, g: int) -> int:
    """Byte offset of global row g in a sequence's latent pool (docs/engine_io.md section 3)."""
    return int(lib().lib.gsm_ref_row_offset(_c.byref(d.c()), int(g)))


def empty_pool(d: Dims, batch: int, fill_byte: int = 0) -> np.ndarray:
    """A [B, pool_words] int32 pool with every byte set to fill_byte (tests poison with 0xFF...)."""
    return np.full((batch, pool_words(d) * 4), fill_byte, np.uint8).view(np.int32)


# ---- GsmKVCacheUpdate / GsmKVDemote --------------------------------------------------------------
def kv_update(d: Dims, ck: np.ndarray, cv: np.ndarray, key: np.ndarray, pool: np.ndarray, index_keys: np.ndarray,
              slots: np.ndarray, past_lengths: np.ndarray, new_lengths: np.ndarray,
              cache_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Write new rows (FP16) and indexer keys; pool and index_keys are updated in place and returned.
    cache_rows: int [B], sequence b's row of pool [R, P32] / index_keys [R, N_max, dI] (None: row b, R = B)."""
    B, S = ck.shape[:2]
    ck = _arr(ck, np.float32, (B, S, d.rank_k), "ck")
    cv = _arr(cv, np.float32, (B, S, d.rank_v), "cv")
    key = _arr(key, np.float32, (B, S, d.index_dim), "key")
    R = B if cache_rows is None else pool.shape[0]
    rows = None if cache_rows is None else _arr(np.reshape(cache_rows, -1), np.int32, (B,), "cache_rows")
    _inplace(pool, np.int32, (R, pool_words(d)), "pool")
    kdt, kw = d.index_keys_type
    _inplace(index_keys, kdt, (R, d.n_max, kw), "index_keys")
    slots = _arr(slots, np.int32, (B, d.n_max), "slots")
    past = _arr(past_lengths, np.int32, (B,), "past_lengths")
    new = _arr(new_lengths, np.int32, (B,), "new_lengths")
    L = lib()
    L.check(L.lib.gsm_ref_kv_update(_c.byref(d.c()), B, S, _p(ck), _p(cv), _p(key), _p(pool), _p(index_keys),
                                    _p(slots), _p(past), _p(new), _p(rows), R))
    return pool, index_keys


def kv_demote(d: Dims, entries: np.ndarray, pool: np.ndarray, quant: np.ndarray) -> np.ndarray:
    """entries [M,3] = (b, old slot entry, new slot entry); pool updated in place and returned."""
    entries = _arr(entries, np.int32).reshape(-1, 3)
    B = pool.shape[0]
    _inplace(pool, np.int32, (B, pool_words(d)), "pool")
    quant = _quant(quant, d)
    L = lib()
    L.check(L.lib.gsm_ref_kv_demote(_c.byref(d.c()), B, entries.shape[0], _p(entries), _p(pool), _p(quant)))
    return pool


def read_latents(d: Dims, pool: np.ndarray, slots: np.ndarray, quant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised latents by position: ck [B, N_max, r_k], cv [B, N_max, r_v] (NaN where no row)."""
    B = pool.shape[0]
    pool = _arr(pool, np.int32, (B, pool_words(d)), "pool")
    slots = _arr(slots, np.int32, (B, d.n_max), "slots")
    quant = _quant(quant, d)
    ck = np.empty((B, d.n_max, d.rank_k), np.float32)
    cv = np.empty((B, d.n_max, d.rank_v), np.float32)
    L = lib()
    L.check(L.lib.gsm_ref_read_latents(_c.byref(d.c()), B, _p(pool), _p(slots), _p(quant), _p(ck), _p(cv)))
    return ck, cv


# ---- GsmSparseAttention --------------------------------------------------------------------------
@dataclass
class AttentionResult:
    out: np.ndarray  # [B, S, nH*D]
    selected: np.ndarray | None  # owning: [B, S, K_sel] ascending, -1 padded
    mass: np.ndarray | None  # owning: [B, N_max]
    scores: np.ndarray | None  # when asked: [B, S, N_max] index scores, NaN where not computed
    query_mass: np.ndarray | None = None  # owning, with logit_rows [B, J]: [B, J, N_max] each logit row's own mass


def sparse_attention(d: Dims, q: np.ndarray, pool: np.ndarray, slots: np.ndarray, past_lengths: np.ndarray,
                     new_lengths: np.ndarray, quant: np.ndarray, rope_cos: np.ndarray, rope_sin: np.ndarray,
                     w0: np.ndarray, w1: np.ndarray, *, index_q: np.ndarray | None = None,
                     index_w: np.ndarray | None = None, index_keys: np.ndarray | None = None,
                     sparse_window: int | None = None, sparse_top_k: np.ndarray | None = None,
                     selected: np.ndarray | None = None, cache_rows: np.ndarray | None = None,
                     logit_rows: np.ndarray | None = None, return_scores: bool = False,
                     threads: int = 0) -> AttentionResult:
    """One GsmSparseAttention call. Owning (d.layer_kind 0): w0 = k_svd_U [kvD, r_k], w1 = v_svd_U [kvD, r_v],
    index_q/index_w/index_keys/sparse_window required; sparse_top_k: int [B], each sequence's budget in
    0..d.max_top_k (None: d.max_top_k for all, a node without that input). Sharing (1): w0 = kv_projector
    weight [2kvD, r], w1 = its bias [2kvD], selected = the source layer's selection [B, S, K_sel].
    cache_rows: int [B], sequence b's row of pool [R, P32] and index_keys [R, N_max, dI] (None: row b, R = B).
    logit_rows: int [B, J] (owning): rows 0..S-1 whose queries' own attention mass comes back as `query_mass`
    [B, J, N_max] (what a one-token step at that row returns as `mass`; 0 for a padding row)."""
    B, S = q.shape[:2]
    nq = d.num_heads * d.head_dim
    owning = d.layer_kind == 0
    q = _arr(q, np.float32, (B, S, nq), "q")
    R = B if cache_rows is None else pool.shape[0]
    rows = None if cache_rows is None else _arr(np.reshape(cache_rows, -1), np.int32, (B,), "cache_rows")
    pool = _arr(pool, np.int32, (R, pool_words(d)), "pool")
    slots = _arr(slots, np.int32, (B, d.n_max), "slots")
    past = _arr(past_lengths, np.int32, (B,), "past_lengths")
    new = _arr(new_lengths, np.int32, (B,), "new_lengths")
    quant = _quant(quant, d)
    rope_cos = _arr(rope_cos, np.float32, (d.n_max, d.head_dim), "rope_cos")
    rope_sin = _arr(rope_sin, np.float32, (d.n_max, d.head_dim), "rope_sin")
    if owning:
        w0 = _arr(w0, np.float32, (d.kv_dim, d.rank_k), "k_up")
        w1 = _arr(w1, np.float32, (d.kv_dim, d.rank_v), "v_up")
        if index_q is None or index_w is None or index_keys is None or sparse_window is None:
            raise ValueError("an owning layer needs index_q, index_w, index_keys and sparse_window")
        index_q = _arr(index_q, np.float32, (B, S, d.index_heads * d.index_dim), "index_q")
        index_w = _arr(index_w, np.float32, (B, S, d.index_heads), "index_w")
        kdt, kw = d.index_keys_type
        index_keys = _arr(index_keys, kdt, (R, d.n_max, kw), "index_keys")
        sel_out: np.ndarray | None = np.empty((B, S, d.k_sel), np.int32)
        mass: np.ndarray | None = np.empty((B, d.n_max), np.float32)
        sel_in = None
        if logit_rows is not None:
            logit_rows = _arr(logit_rows, np.int32, (B, np.shape(logit_rows)[-1]), "logit_rows")
        top_k = None if sparse_top_k is None else _arr(np.reshape(sparse_top_k, -1), np.int32, (B,), "sparse_top_k")
    else:
        w0 = _arr(w0, np.float32, (2 * d.kv_dim, d.rank), "kv_proj_weight")
        w1 = _arr(w1, np.float32, (2 * d.kv_dim,), "kv_proj_bias")
        if selected is None:
            raise ValueError("a sharing layer needs the source layer's `selected`")
        sel_in = _arr(selected, np.int32, (B, S, d.k_sel), "selected")
        sel_out = mass = top_k = None
        if logit_rows is not None:
            raise ValueError("logit_rows: a sharing layer measures no mass")
    J = 0 if logit_rows is None else logit_rows.shape[1]
    query_mass = None if logit_rows is None else np.empty((B, J, d.n_max), np.float32)
    out = np.empty((B, S, nq), np.float32)
    scores = np.empty((B, S, d.n_max), np.float32) if return_scores and owning else None
    L = lib()
    rc = L.lib.gsm_ref_sparse_attention(
        _c.byref(d.c()), B, S, _p(q), _p(pool), _p(slots), _p(past), _p(new), _p(quant), _p(rope_cos),
        _p(rope_sin), _p(w0), _p(w1), _p(index_q), _p(index_w), _p(index_keys),
        int(sparse_window or 0), _p(sel_in), _p(top_k), _p(rows), R, _p(logit_rows), J, _p(out), _p(sel_out),
        _p(mass), _p(scores), _p(query_mass), int(threads))
    L.check(rc)
    return AttentionResult(out, sel_out, mass, scores, query_mass)


# ---- tier policy helpers the runtime calls ---------------------------------------------------------
def hotness_update(hotness: np.ndarray, mass: np.ndarray, decay: float) -> np.ndarray:
    """h <- float32(decay)*h + float32(1-decay)*m (decisions "Hotness"); returns a new array."""
    h = np.array(hotness, dtype=np.float32, copy=True)
    m = _arr(mass, np.float32, h.shape, "mass")
    lib().lib.gsm_ref_hotness_update(h.size, _p(h), _p(m), float(decay))
    return h


def ranked_tiers(hotness: np.ndarray, tokens: np.ndarray, *, hot_token_ids: tuple[int, ...] = (),
                 sink_tokens: int, fp16_window: int, tier_fractions: Sequence[float]) -> np.ndarray:
    """Tier of each position by hotness rank alone (decisions "Re-tier pass"); apply max(old, ranked).
    tier_fractions: (f16, f12, f8) or (f16, f12, f8, f4); three mean f4 = 0, which never ranks a row INT4."""
    fr = tuple(float(f) for f in tier_fractions)
    if len(fr) == 3:
        fr = (*fr, 0.0)
    if len(fr) != 4:
        raise ValueError(f"tier_fractions: 3 or 4 numbers, got {list(tier_fractions)}")
    h = _arr(hotness, np.float32)
    tok = _arr(tokens, np.int32, h.shape, "tokens")
    hot = np.asarray(hot_token_ids, dtype=np.int32).reshape(-1)
    out = np.empty(h.shape, np.int32)
    lib().lib.gsm_ref_ranked_tiers(h.size, _p(h), _p(tok), hot.size, _p(hot) if hot.size else None, sink_tokens,
                                   fp16_window, *fr, _p(out))
    return out


# ---- probes of plugins/common/gsm_math.h -------------------------------------------------------------
def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    x = _arr(x, np.float32)
    out = np.empty(x.shape, np.uint16)
    lib().lib.gsm_ref_f32_to_f16(_p(x), _p(out), x.size)
    return out


def f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    h = _arr(h, np.uint16)
    out = np.empty(h.shape, np.float32)
    lib().lib.gsm_ref_f16_to_f32(_p(h), _p(out), h.size)
    return out


def quantize(x: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    """x [n, r], scale [r] -> int32 codes clamp(rint_half_even(x / s), -qmax, qmax); qmax 2047, 127 or 7."""
    x = _arr(x, np.float32)
    r = x.shape[-1]
    s = _arr(scale, np.float32, (r,), "scale")
    out = np.empty(x.shape, np.int32)
    lib().lib.gsm_ref_quantize(_p(x), _p(s), x.size // max(r, 1), r, int(qmax), _p(out))
    return out


def dequantize(q: np.ndarray, scale: np.ndarray, comp: np.ndarray | None = None, tier: int | None = None
               ) -> np.ndarray:
    """codes [n, r] -> float32: q*s (INT12) or (q*s)+comp (INT8, INT4), no FMA. tier: INT12, INT8 or INT4
    (None: INT12 without comp, INT8 with it)."""
    q = _arr(q, np.int32)
    r = q.shape[-1]
    s = _arr(scale, np.float32, (r,), "scale")
    c = _arr(comp, np.float32, (r,), "comp")
    t = (INT12 if comp is None else INT8) if tier is None else int(tier)
    out = np.empty(q.shape, np.float32)
    L = lib()
    L.check(L.lib.gsm_ref_dequantize(_p(q), _p(s), _p(c), q.size // max(r, 1), r, t, _p(out)))
    return out


def default_scale(s8: np.ndarray, tier: int) -> np.ndarray:
    """Data-free INT12 or INT4 scale from s8 (gsm_math.h defaultScaleINT12 / defaultScaleINT4)."""
    s = _arr(s8, np.float32)
    out = np.empty(s.shape, np.float32)
    L = lib()
    L.check(L.lib.gsm_ref_default_scale(_p(s), s.size, int(tier), _p(out)))
    return out


def pack_int12(q: np.ndarray) -> np.ndarray:
    q = _arr(q, np.int32).ravel()
    out = np.empty(3 * ((q.size + 1) // 2), np.uint8)
    lib().lib.gsm_ref_pack_int12(_p(q), q.size, _p(out))
    return out


def unpack_int12(packed: np.ndarray, count: int) -> np.ndarray:
    p = _arr(packed, np.uint8).ravel()
    if p.size < 3 * ((count + 1) // 2):
        raise ValueError(f"{count} INT12 codes need {3 * ((count + 1) // 2)} bytes, got {p.size}")
    out = np.empty(count, np.int32)
    lib().lib.gsm_ref_unpack_int12(_p(p), count, _p(out))
    return out


def pack_int4(q: np.ndarray) -> np.ndarray:
    q = _arr(q, np.int32).ravel()
    out = np.empty((q.size + 1) // 2, np.uint8)
    lib().lib.gsm_ref_pack_int4(_p(q), q.size, _p(out))
    return out


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    p = _arr(packed, np.uint8).ravel()
    if p.size < (count + 1) // 2:
        raise ValueError(f"{count} INT4 codes need {(count + 1) // 2} bytes, got {p.size}")
    out = np.empty(count, np.int32)
    lib().lib.gsm_ref_unpack_int4(_p(p), count, _p(out))
    return out
