"""GSM operations in standard ONNX ops (docs/engine_io.md section 5, revision 2), for ONNX Runtime anywhere.

Each method emits, inside the scope `L{l}.<GsmNodeName>`, the subgraph that stands for one GSM
plugin node of the TensorRT variant (graph_trt.py). The cache is held as the golden holds it:
dequantised float32 latents and FP16 indexer keys by position, in buffers of `R` rows (one row per
live sequence) that the runtime allocates once and binds in place; `cache_rows[b]` says which row
batch entry `b` uses. The graph never copies a cache buffer: it outputs only the new rows (the
runtime writes them at positions past + j) and reads the cache by `Gather` at flat indices
`row * N_max + position`, so a step costs what it reads, not `N_max`:
- the indexer scores the context columns: cached positions `0..T_c-1` (`T_c` = the batch's largest
  `past_lengths`) and this call's new rows, O(T_c * dI) per query (inherent to the indexer);
- selection (spec 4.1) is one `TopK` of `k = sinks + window + top_k` over the columns, with the
  sinks and window scored +inf and non-causal columns -inf: in the sparse case it returns the sinks,
  the window and exactly the top-k others (ONNX TopK orders equal values by lower index, the tie rule;
  columns are in position order), in the dense case (t + 1 <= k) every causal position;
- attention gathers the `K_sel` selected latent rows per query, reconstructs K/V for them only, and
  takes the softmax over them: O(K_sel * (r * kvD + nH * D)) per query, whatever `N_max` or `T_c`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from builder.nodes import F16, F32, I32, I64, apply_rope, cast, linear, positions, valid_rows
from builder.onnx_util import GraphBuilder
from gsm.config import ModelConfig

NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)


class PortableOps:
    """Standard-op GSM subgraphs; tensors by name in GraphBuilder `g`."""

    variant = "portable"

    def __init__(self, g: GraphBuilder, cfg: ModelConfig, ranks: dict[int, tuple[int, int]], n_max: int) -> None:
        self.g, self.cfg, self.ranks, self.n_max = g, cfg, ranks, n_max
        p = cfg.gsm
        self.k_sel = p.sink_tokens + p.max_sparse_window + p.sparse_top_k

    # -- I/O ---------------------------------------------------------------------------------------
    def declare_cache(self) -> dict[int, dict[str, str]]:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        self.rows = g.input("cache_rows", I32, ["B"])
        state = {}
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            state[l] = {"k": g.input(f"latent_k.{l}", F32, ["R", self.n_max, rk]),
                        "v": g.input(f"latent_v.{l}", F32, ["R", self.n_max, rv]),
                        "keys": g.input(f"index_keys.{l}", F16, ["R", self.n_max, dI])}
        return state

    def declare_cache_outputs(self) -> None:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            g.output(f"new_latent_k.{l}", F32, ["B", "S", rk])
            g.output(f"new_latent_v.{l}", F32, ["B", "S", rv])
            g.output(f"new_index_keys.{l}", F16, ["B", "S", dI])

    def selected_type(self) -> tuple[int, list[Any]]:
        """Element type and shape of `L{l}.selected`: positions ascending, padded with -1 (as the plugin)."""
        return I32, ["B", "S", self.k_sel]

    def mass_shape(self) -> list[Any]:
        """attn_mass covers positions 0..L-1, L = max(past_lengths) + S (every position of the call)."""
        return ["B", "L"]

    # -- helpers -----------------------------------------------------------------------------------
    def _flat_rows(self, cache: str, width: int) -> str:
        """[R, N_max, w] -> [R * N_max, w] (a Reshape aliases its input: no copy)."""
        return self.g.op("Reshape", [cache, self.g.const([-1, width], np.int64, f"flat{width}")])

    def _cache_base(self) -> str:
        """cache_rows[b] * N_max as int64 [B]."""
        g = self.g
        return g.op("Mul", [cast(g, self.rows, I64), g.const(self.n_max, np.int64, "n_max")])

    # -- GsmKVCacheUpdate ----------------------------------------------------------------------------
    def kv_update(self, l: int, cache: dict[str, str], ck: str, cv: str, key: str, past: str,
                  new: str) -> dict[str, str]:
        """The new rows as the cache will hold them: latents rounded to FP16 and back (deployed mode),
        keys as FP16. They are graph outputs; the runtime writes them at positions past + j."""
        g = self.g
        with g.in_scope(f"L{l}.GsmKVCacheUpdate"):
            out = dict(cache)
            out["new_k"] = cast(g, cast(g, ck, F16), F32)
            out["new_v"] = cast(g, cast(g, cv, F16), F32)
            out["new_keys"] = cast(g, key, F16)
            for kind, name in (("new_k", f"new_latent_k.{l}"), ("new_v", f"new_latent_v.{l}"),
                               ("new_keys", f"new_index_keys.{l}")):
                out[kind] = g.op("Identity", [out[kind]], outputs=[name])
        return out

    # -- GsmSparseAttention --------------------------------------------------------------------------
    def attention(self, l: int, q: str, cache: dict[str, str], past: str, new: str, *, rope: tuple[str, str],
                  up: tuple[str, str], index_q: str | None = None, index_w: str | None = None,
                  sparse_window: str | None = None, selected: str | None = None, source: int | None = None,
                  quant: str | None = None) -> tuple[str, str | None, str | None]:
        """Owning (index_q given): select and attend; sharing (selected given): attend over the source's
        selection with K/V projected from the source's latents. Returns attn_out [B, S, nH*D], the
        selection (int32 [B, S, K_sel] positions, -1 padded, named `L{l}.selected`) and this layer's
        attention mass [B, L] (owning layers only)."""
        g, cfg = self.g, self.cfg
        nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        grp = cfg.gqa_group
        owning = selected is None
        with g.in_scope(f"L{l}.GsmSparseAttention"):
            pos, j = positions(g, past, q)  # [B, S]
            valid = valid_rows(g, j, new)  # [B, S]
            if owning:
                selected = self._select(l, pos, past, index_q, index_w, cache, sparse_window)
            sel_ok = g.op("GreaterOrEqual", [selected, g.const(0, np.int32, "zero_i32")])  # [B, S, K]
            p = g.op("Max", [selected, g.const(0, np.int32, "zero_i32")])  # padding reads position 0, masked
            rk, rv = self.ranks[l if owning else source]
            lat_k = self._gather_rows(cache["k"], cache["new_k"], p, past, rk)  # [B, S, K, rk]
            lat_v = self._gather_rows(cache["v"], cache["new_v"], p, past, rv)
            if owning:
                k_pre = self._up(lat_k, up[0], None, rk, nKV * D)
                v = self._up(lat_v, up[1], None, rv, nKV * D)
            else:
                kv = self._up(g.op("Concat", [lat_k, lat_v], axis=-1), up[0], up[1], rk + rv, 2 * nKV * D)
                k_pre, v = g.op("Split", [kv, g.const([nKV * D, nKV * D], np.int64, "kv_split")], n_out=2, axis=-1)
            cos, sin = rope
            kvshape = g.const([0, 0, 0, nKV, D], np.int64, "bskhd")
            k = g.op("Reshape", [k_pre, kvshape])  # [B, S, K, nKV, D]
            cos_k = g.op("Unsqueeze", [g.op("Gather", [cos, p], axis=0), g.const([3], np.int64, "ax3")])  # [B,S,K,1,D]
            sin_k = g.op("Unsqueeze", [g.op("Gather", [sin, p], axis=0), g.const([3], np.int64, "ax3")])
            k = g.op("Transpose", [apply_rope(g, k, cos_k, sin_k, D)], perm=[0, 1, 3, 4, 2])  # [B, S, nKV, D, K]
            v = g.op("Transpose", [g.op("Reshape", [v, kvshape])], perm=[0, 1, 3, 2, 4])  # [B, S, nKV, K, D]
            # queries: RoPE at pos; head h reads key head h // grp
            qh = g.op("Reshape", [q, g.const([0, 0, nH, D], np.int64, "bshd")])  # [B, S, nH, D]
            cos_q = g.op("Unsqueeze", [g.op("Gather", [cos, pos], axis=0), g.const([2], np.int64, "ax2")])  # [B,S,1,D]
            sin_q = g.op("Unsqueeze", [g.op("Gather", [sin, pos], axis=0), g.const([2], np.int64, "ax2")])
            qh = g.op("Reshape", [apply_rope(g, qh, cos_q, sin_q, D), g.const([0, 0, nKV, grp, D], np.int64, "bskgd")])
            # [B, S, nKV, grp, K]
            logits = g.op("Div", [g.op("MatMul", [qh, k]), g.const(math.sqrt(D), np.float32, "sqrt_d")])
            mask = g.op("Unsqueeze", [sel_ok, g.const([2, 3], np.int64, "ax23")])  # [B, S, 1, 1, K]
            probs = g.op("Softmax", [g.op("Where", [mask, logits, g.const(NEG_INF, np.float32, "neg_inf")])],
                         axis=-1)
            out = g.op("Reshape", [g.op("MatMul", [probs, v]), g.const([0, 0, nH * D], np.int64, "bsq")],
                       outputs=[f"L{l}.attn_out"])  # [B, S, nKV, grp, D] -> [B, S, nH*D]
            mass = None
            if owning:
                w = g.op("Unsqueeze", [cast(g, valid, F32), g.const([2], np.int64, "ax2")])  # [B, S, 1]
                per_pos = g.op("Mul", [g.op("ReduceSum", [probs, g.const([2, 3], np.int64, "ax23")], keepdims=0), w])
                mass = self._scatter_mass(l, per_pos, p, past, pos)
        return out, (selected if owning else None), mass

    def _gather_rows(self, cache: str, new_rows: str, p: str, past: str, r: int) -> str:
        """Latent rows of positions p [B, S, K]: from the cache row of the sequence for p < past, from
        this call's new rows [B, S, r] otherwise. Two Gathers of B*S*K rows and a Where."""
        g = self.g
        past_b = g.op("Unsqueeze", [past, g.const([1, 2], np.int64, "ax12")])  # [B, 1, 1]
        is_new = g.op("GreaterOrEqual", [p, past_b])
        base = g.op("Unsqueeze", [self._cache_base(), g.const([1, 2], np.int64, "ax12")])  # [B, 1, 1]
        from_cache = g.op("Gather", [self._flat_rows(cache, r), g.op("Add", [base, cast(g, p, I64)])], axis=0)
        shape = g.op("Shape", [new_rows])  # [B, S, r]
        s_len = g.op("Slice", [shape, g.const([1], np.int64, "one1"), g.const([2], np.int64, "two1")])  # [1]
        b_len = g.op("Slice", [shape, g.const([0], np.int64, "zero1"), g.const([1], np.int64, "one1")])
        b_idx = g.op("Range", [g.const(0, np.int64, "zero"), g.op("Squeeze", [b_len]), g.const(1, np.int64, "one")])
        nb = g.op("Mul", [g.op("Unsqueeze", [b_idx, g.const([1, 2], np.int64, "ax12")]), s_len])  # [B, 1, 1]: b * S
        j = g.op("Clip", [cast(g, g.op("Sub", [p, past_b]), I64), g.const(0, np.int64, "zero"),
                          g.op("Sub", [g.op("Squeeze", [s_len]), g.const(1, np.int64, "one")])])
        flat_new = g.op("Reshape", [new_rows, g.const([-1, r], np.int64, f"flat{r}")])
        from_new = g.op("Gather", [flat_new, g.op("Add", [nb, j])], axis=0)  # [B, S, K, r]
        return g.op("Where", [g.op("Unsqueeze", [is_new, g.const([3], np.int64, "ax3")]), from_new, from_cache])

    def _scatter_mass(self, l: int, per_pos: str, p: str, past: str, pos: str) -> str:
        """Probability per selected entry [B, S, K] summed into positions: [B, L], L = max(past) + S."""
        g = self.g
        length = g.op("Add", [g.op("ReduceMax", [cast(g, past, I64)], keepdims=1),
                              g.op("Slice", [g.op("Shape", [pos]), g.const([1], np.int64, "one1"),
                                             g.const([2], np.int64, "two1")])])  # [1]
        shape = g.op("Concat", [g.op("Slice", [g.op("Shape", [pos]), g.const([0], np.int64, "zero1"),
                                               g.const([1], np.int64, "one1")]), length], axis=0)
        zeros = g.op("ConstantOfShape", [shape], value=_zero_f32())
        flat = g.const([0, -1], np.int64, "b_flat")
        idx, val = g.op("Reshape", [cast(g, p, I64), flat]), g.op("Reshape", [per_pos, flat])
        return g.op("ScatterElements", [zeros, idx, val], axis=1, reduction="add", outputs=[f"L{l}.attn_mass"])

    def _up(self, lat: str, weight: str, bias: str | None, r: int, n_out: int) -> str:
        """Gathered latents [B, S, K, r] -> [B, S, K, n_out] = lat @ W^T (+ b)."""
        g = self.g
        flat = g.op("Reshape", [lat, g.const([-1, r], np.int64, f"flat{r}")])
        y = linear(g, flat, weight, bias)  # [B*S*K, n_out]
        shape = g.op("Concat", [g.op("Shape", [lat], end=3), g.const([n_out], np.int64, f"w{n_out}")], axis=0)
        return g.op("Reshape", [y, shape])

    def _select(self, l: int, pos: str, past: str, index_q: str, index_w: str, cache: dict[str, str],
                window: str) -> str:
        """Sel(t) by spec 4.1 as positions [B, S, K_sel] int32, ascending, padded with -1."""
        g, p = self.g, self.cfg.gsm
        nI, dI = p.indexer_heads, p.indexer_dim
        # context columns: cached positions 0..T_c-1 of the sequence's row, then this call's S new keys
        tc = g.op("ReduceMax", [cast(g, past, I64)], keepdims=1)  # [1]
        col = g.op("Range", [g.const(0, np.int64, "zero"), g.op("Squeeze", [tc]), g.const(1, np.int64, "one")])
        base = g.op("Unsqueeze", [self._cache_base(), g.const([1], np.int64, "ax1")])  # [B, 1]
        old_keys = g.op("Gather", [self._flat_rows(cache["keys"], dI), g.op("Add", [base, col])], axis=0)  # [B,Tc,dI]
        keys = g.op("Concat", [old_keys, cache["new_keys"]], axis=1)  # [B, C, dI], C = T_c + S
        # index scores I(t, s) = sum_j w_j ReLU(q_j . e_s) / sqrt(dI): [B, S, C]
        qi = g.op("Reshape", [index_q, g.const([0, 0, nI, dI], np.int64, "bsid")])  # [B, S, nI, dI]
        kt = g.op("Unsqueeze", [g.op("Transpose", [cast(g, keys, F32)], perm=[0, 2, 1]),
                                g.const([1], np.int64, "ax1")])  # [B, 1, dI, C]
        dots = g.op("Relu", [g.op("MatMul", [qi, kt])])  # [B, S, nI, C]
        wi = g.op("Unsqueeze", [index_w, g.const([3], np.int64, "ax3")])  # [B, S, nI, 1]
        scores = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [wi, dots]), g.const([2], np.int64, "ax2")], keepdims=0),
                              g.const(math.sqrt(dI), np.float32, "sqrt_di")])  # [B, S, C]
        # the position of each column, and whether it holds one of the sequence's positions
        s_len = g.op("Slice", [g.op("Shape", [pos]), g.const([1], np.int64, "one1"), g.const([2], np.int64, "two1")])
        new_col = cast(g, g.op("Range", [g.const(0, np.int64, "zero"), g.op("Squeeze", [s_len]),
                                         g.const(1, np.int64, "one")]), I32)  # [S]
        past_b = g.op("Unsqueeze", [past, g.const([1], np.int64, "ax1")])  # [B, 1]
        old_pos = g.op("Expand", [g.op("Unsqueeze", [cast(g, col, I32), g.const([0], np.int64, "ax0")]),
                                  g.op("Shape", [past_b])])  # [B, T_c] (Expand broadcasts [1, T_c] with [B, 1])
        new_pos = g.op("Add", [past_b, new_col])  # [B, S]
        col_pos = g.op("Concat", [old_pos, new_pos], axis=1)  # [B, C]
        # stale cache columns past a shorter sequence's length are none of its positions
        col_ok = g.op("Concat", [g.op("Less", [old_pos, past_b]),
                                 g.op("Expand", [g.const(True, np.bool_, "true"), g.op("Shape", [new_pos])])], axis=1)
        s = g.op("Unsqueeze", [col_pos, g.const([1], np.int64, "ax1")])  # [B, 1, C]
        t = g.op("Unsqueeze", [pos, g.const([2], np.int64, "ax2")])  # [B, S, 1]
        causal = g.op("And", [g.op("Unsqueeze", [col_ok, g.const([1], np.int64, "ax1")]), g.op("LessOrEqual", [s, t])])
        sink = g.op("Less", [s, g.const(p.sink_tokens, np.int32, "sinks")])
        win = g.op("Greater", [g.op("Add", [s, window]), t])  # s > t - window
        fixed = g.op("Or", [sink, win])
        inf = g.const(POS_INF, np.float32, "pos_inf")
        ninf = g.const(NEG_INF, np.float32, "neg_inf")
        ranked = g.op("Where", [causal, g.op("Where", [fixed, inf, scores]), ninf])  # [B, S, C]
        budget = g.op("Add", [cast(g, window, I64), g.const([p.sink_tokens + p.sparse_top_k], np.int64, "sinks_topk")])
        n_cols = g.op("Shape", [ranked], start=2, end=3)
        k = g.op("Min", [budget, n_cols])  # [1]
        vals, idx = g.op("TopK", [ranked, k], n_out=2, axis=-1, largest=1, sorted=1)  # [B, S, k]
        chosen = g.op("Greater", [vals, ninf])
        sel_pos = g.op("GatherElements", [g.op("Expand", [s, g.op("Shape", [ranked])]), idx], axis=2)  # [B, S, k]
        # ascending positions, unselected last: TopK of -position (exact in float32 below 2^24)
        key = g.op("Where", [chosen, g.op("Neg", [cast(g, sel_pos, F32)]), ninf])
        svals, order = g.op("TopK", [key, k], n_out=2, axis=-1, largest=1, sorted=1)
        ordered = g.op("Where", [g.op("Greater", [svals, ninf]), g.op("GatherElements", [sel_pos, order], axis=2),
                                 g.const(-1, np.int32, "minus1")])
        pad = g.op("Concat", [g.const([0, 0, 0, 0, 0], np.int64, "pad0"),
                              g.op("Sub", [g.const([self.k_sel], np.int64, "k_sel"), k])], axis=0)
        return g.op("Pad", [ordered, pad, g.const(-1, np.int32, "minus1")], mode="constant",
                    outputs=[f"L{l}.selected"])

    # -- GsmKVDemote (demotion graph) ---------------------------------------------------------------
    def demote(self, l: int, lat: str, new_tier: str, quant: str, cols: tuple[int, int], out: str) -> str:
        """new_tier [M] int32 (-1 unchanged, 1 INT12, 2 INT8) -> re-encoded latent rows [M, r] (the runtime
        gathers the M rows a re-tier pass changes and writes them back: cost follows the changed rows).

        code = clip(round_half_even(x / s)); INT12 value = code * s12, INT8 = (code * s8) + comp
        (two separately rounded float32 ops, decisions "Rounding"); x is the held value (FP16 or
        INT12-dequantised), as the golden re-quantises.
        """
        g = self.g
        with g.in_scope(f"L{l}.GsmKVDemote"):
            table = g.op("Slice", [quant, g.const([cols[0]], np.int64, "c0"), g.const([cols[1]], np.int64, "c1"),
                                   g.const([1], np.int64, "ax1")])  # [3, r]: s12, s8, comp8
            s12, s8, comp = g.op("Split", [table, g.const([1, 1, 1], np.int64, "rows3")], n_out=3, axis=0)  # [1, r]

            def code(scale: str, qmax: int) -> str:
                return g.op("Clip", [g.op("Round", [g.op("Div", [lat, scale])]),
                                     g.const(-qmax, np.float32, f"m{qmax}"), g.const(qmax, np.float32, f"p{qmax}")])

            v12 = g.op("Mul", [code(s12, 2047), s12])
            v8 = g.op("Add", [g.op("Mul", [code(s8, 127), s8]), comp])
            tier = g.op("Unsqueeze", [new_tier, g.const([1], np.int64, "ax1")])  # [M, 1]
            is12 = g.op("Equal", [tier, g.const(1, np.int32, "t12")])
            is8 = g.op("Equal", [tier, g.const(2, np.int32, "t8")])
            return g.op("Where", [is12, v12, g.op("Where", [is8, v8, lat])], outputs=[out])



def _zero_f32() -> Any:
    import onnx

    return onnx.numpy_helper.from_array(np.zeros(1, np.float32))
