"""GSM operations in standard ONNX ops (docs/engine_io.md section 5), for ONNX Runtime anywhere.

Each method emits, inside the scope `L{l}.<GsmNodeName>`, the subgraph that stands for one GSM
plugin node of the TensorRT variant (graph_trt.py). The cache is held as the golden holds it:
dequantised float32 latents and FP16 indexer keys by position, in buffers of `R` rows (one row per
live sequence) that the runtime allocates once and binds in place; `cache_rows[b]` says which row
batch entry `b` uses. The graph never copies a cache buffer: it outputs only the new rows (the
runtime writes them at positions past + j) and reads the cache by `Gather` at flat indices
`row * N_max + position`, so a step costs what it reads, not `N_max`:
- the indexer scores the context columns: cached positions `0..T_c-1` (`T_c` = the batch's largest
  `past_lengths`) and this call's new rows, O(T_c * dI) per query (inherent to the indexer);
- selection (spec 4.1) is one `TopK` of `k = min(max_b(sinks + window + top_k[b]), columns)` over the
  columns, with the sinks and window scored +inf and non-causal columns -inf, then every pick past
  sequence b's own budget `sinks + window + top_k[b]` dropped: in the sparse case that leaves the sinks,
  the window and exactly top_k[b] others (ONNX TopK orders equal values by lower index, the tie rule;
  columns are in position order), in the dense case (t + 1 <= budget) every causal position. The
  budget is the run-time input `sparse_top_k` [B], so `selected` is k wide, not K_sel;
- attention gathers the `K_sel` selected K rows per query from every layer's K-row cache (made
  once, when a row is written or re-encoded, never per step), takes the softmax over them and, in a
  decode step, attends over the V *latents*, up-projecting once per head afterwards (a prefill chunk
  rebuilds V once per distinct row instead): O(K_sel * nH * (kvD + r_v) + nH * r_v * D) per decode
  query, whatever `N_max` or `T_c` (docs/runtime.md "The attention's arithmetic").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import TensorProto

from builder.nodes import F16, F32, I8, I32, I64, AttentionCall, cast, key_codes, positions, valid_rows
from builder.onnx_util import GraphBuilder
from gsm import graph_io as io
from gsm.bundle_format import VERIFY_ROWS
from gsm.config import ModelConfig
from gsm.tiers import INT4, INT8, INT12, QMAX

F64 = TensorProto.DOUBLE  # the V-side weighted latent sum (_attend_v)
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)


class PortableOps:
    """Standard-op GSM subgraphs; tensors by name in GraphBuilder `g`."""

    variant = "portable"
    fused_offsets = False  # CpuOps: a float zero point's offset term as one custom node
    fused_quant = False  # CpuOps: a quantised projection with stored tiles as one custom node
    fused_side = False  # CpuOps: an owning layer's GSM-side scale, split and cache rounding as one custom node
    flat_q = False  # CpuOps: an owning layer's q enters and attn_out leaves the attention as [B*S, q_dim]
    half_up = False  # CpuOps: U_k / U_v as float16 when they lie on the FP16 grid

    def __init__(self, g: GraphBuilder, cfg: ModelConfig, ranks: dict[int, tuple[int, int]], n_max: int, *,
                 int8_keys: bool = False) -> None:
        self.g, self.cfg, self.ranks, self.n_max = g, cfg, ranks, n_max
        self.int8_keys = int8_keys  # the key buffers hold INT8 codes (int8) instead of FP16 keys
        self.key_type = I8 if int8_keys else F16
        self._geo: dict[str, str] = {}
        self._sel: dict[tuple[str, str], dict[str, str]] = {}
        self.logit_rows = ""  # Network.build sets the graph input
        self.query_masses: list[str] = []  # owning layers' attention mass of each logit row's query [B, J, L]

    # -- I/O ---------------------------------------------------------------------------------------
    def declare_cache(self) -> dict[int, dict[str, str]]:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        self.rows = g.input(io.CACHE_ROWS.name, I32, ["B"])
        # the per-sequence selection budget; declared with the cache because the layer stack
        # (network.py) is shared with the plugin variant, which declares it the same way
        g.input(io.SPARSE_TOP_K.name, I32, ["B"])
        state = {}
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            state[l] = {"k": g.input(io.LATENT_K.at(l), F32, ["R", self.n_max, rk]),
                        "v": g.input(io.LATENT_V.at(l), F32, ["R", self.n_max, rv]),
                        "keys": g.input(io.INDEX_KEYS.at(l), self.key_type, ["R", self.n_max, dI])}
        # every layer's K rows (RoPE applied) as the golden reconstructs them from the held
        # latents, cached by position, so that a step gathers K_sel rows instead of rebuilding them
        self.k_rows = {l: g.input(io.K_ROWS.at(l), F32, ["R", self.n_max, self.cfg.kv_dim])
                       for l in range(self.cfg.num_hidden_layers)}
        return state

    def declare_cache_outputs(self) -> None:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            g.output(io.NEW_LATENT_K.at(l), F32, ["B", "S", rk])
            g.output(io.NEW_LATENT_V.at(l), F32, ["B", "S", rv])
            g.output(io.NEW_INDEX_KEYS.at(l), self.key_type, ["B", "S", dI])
        for l in range(self.cfg.num_hidden_layers):
            g.output(io.NEW_K_ROWS.at(l), F32, ["B", "S", self.cfg.kv_dim])
        # per-layer probes: always in the graph, where they are intermediate tensors anyway;
        # the runtime binds them only when asked (hit-rate probe, debug bundles), so a step pays nothing
        for l in self.cfg.owning_layers:
            g.output(io.SELECTED.at(l), *self.selected_type(l))
            g.output(io.LAYER_MASS.at(l), F32, self.mass_shape())

    def selected_type(self, l: int) -> tuple[int, list[Any]]:
        """Element type and shape of `selected.{l}`: positions ascending, padded with -1 (as the plugin); the
        width is the call's k = min(max_b budget_b, columns), at most K_sel at the default budget.
        Its symbolic width is named per distinct selection: layers that select differently have
        different widths, and ONNX Runtime plans buffers as if equal names were equal sizes."""
        ls = self.cfg.gsm.selection_of(l)
        grows = f"_d{ls.sparse_top_k_divisor}" if ls.sparse_top_k_divisor else ""
        return I32, ["B", "S", f"K_w{ls.sparse_window}_k{ls.sparse_top_k}{grows}"]

    def mass_shape(self) -> list[Any]:
        """attn_mass covers positions 0..L-1, L = max(past_lengths) + S (every position of the call)."""
        return ["B", "L"]

    # -- helpers -----------------------------------------------------------------------------------
    def _flat_rows(self, cache: str, width: int) -> str:
        """[R, N_max, w] -> [R * N_max, w] (a Reshape aliases its input: no copy)."""
        return self.g.op("Reshape", [cache, self.g.const([-1, width], np.int64, f"flat{width}")])

    def _call(self, rope: tuple[str, str]) -> dict[str, str]:
        """Per-call geometry every layer shares, emitted once in scope `call` from the graph inputs
        (input shape, past/new lengths, cache rows): positions, validity, gather bases, the context
        columns with their causal mask, the query RoPE factors (`_selection` adds a window's masks). Emitting it once
        instead of per layer removes most of a layer's small operators (ONNX Runtime pays a fixed cost
        per operator, which dominates a decode step of a small model)."""
        if self._geo:
            return self._geo
        g, N = self.g, self.n_max
        c64 = {v: g.const(v, np.int64, f"i{v}") for v in (0, 1)}
        with g.in_scope("call"):
            past, new, rows = io.PAST_LENGTHS.name, io.NEW_LENGTHS.name, io.CACHE_ROWS.name
            shape_bs = g.op("Shape", [io.INPUT_IDS.name])
            s_len = g.op("Shape", [io.INPUT_IDS.name], start=1, end=2)  # [1]
            pos, j = positions(g, past, io.INPUT_IDS.name)  # [B, S]
            valid = valid_rows(g, j, new)
            past3 = g.op("Unsqueeze", [past, g.const([1, 2], np.int64, "ax12")])  # [B, 1, 1]
            base = g.op("Mul", [cast(g, rows, I64), g.const(N, np.int64, "n_max")])  # [B]: row * N_max
            b_idx = g.op("Range", [c64[0], g.op("Squeeze", [g.op("Shape", [io.INPUT_IDS.name], end=1)]), c64[1]])
            geo = {"pos": pos, "past3": past3,
                   "valid3": g.op("Unsqueeze", [cast(g, valid, F32), g.const([2], np.int64, "ax2")]),  # [B, S, 1]
                   "base3": g.op("Unsqueeze", [base, g.const([1, 2], np.int64, "ax12")]),
                   "nb3": g.op("Mul", [g.op("Unsqueeze", [b_idx, g.const([1, 2], np.int64, "ax12")]), s_len]),
                   "s_last": g.op("Sub", [g.op("Squeeze", [s_len]), c64[1]])}
            # keys of the call's new rows in _selected_kv's row numbering: -1 - (b * S + j)
            n_new = g.op("ReduceProd", [shape_bs], keepdims=1)  # [1]: B * S
            geo["n_new"] = n_new
            geo["new_keys"] = g.op("Sub", [g.const(-1, np.int64, "i_minus1"),
                                           g.op("Range", [c64[0], g.op("Squeeze", [n_new]), c64[1]])])
            geo["cos_q"], geo["sin_q"] = rope_at(g, rope, pos, self.cfg.head_dim)  # [B, S, 1, 2, D/2]
            # context columns: cached positions 0..T_c-1 (T_c = largest past), then the S new rows
            tc = g.op("ReduceMax", [cast(g, past, I64)], keepdims=1)  # [1]
            col = g.op("Range", [c64[0], g.op("Squeeze", [tc]), c64[1]])  # [T_c]
            geo["key_idx"] = g.op("Add", [g.op("Unsqueeze", [base, g.const([1], np.int64, "ax1")]), col])  # [B, T_c]
            past2 = g.op("Unsqueeze", [past, g.const([1], np.int64, "ax1")])  # [B, 1]
            old_pos = g.op("Expand", [g.op("Unsqueeze", [cast(g, col, I32), g.const([0], np.int64, "ax0")]),
                                      g.op("Shape", [past2])])  # [B, T_c]
            new_pos = g.op("Add", [past2, cast(g, j, I32)])  # [B, S]
            col_pos = g.op("Concat", [old_pos, new_pos], axis=1)  # [B, C]
            # stale cache columns past a shorter sequence's length are none of its positions
            col_ok = g.op("Concat", [g.op("Less", [old_pos, past2]),
                                     g.op("Expand", [g.const(True, np.bool_, "true"), g.op("Shape", [new_pos])])],
                          axis=1)
            s3 = g.op("Unsqueeze", [col_pos, g.const([1], np.int64, "ax1")])  # [B, 1, C]
            t3 = g.op("Unsqueeze", [pos, g.const([2], np.int64, "ax2")])  # [B, S, 1]
            geo["causal"] = g.op("And", [g.op("Unsqueeze", [col_ok, g.const([1], np.int64, "ax1")]),
                                         g.op("LessOrEqual", [s3, t3])])  # [B, S, C]
            geo.update(s3=s3, t3=t3, n_cols=g.op("Add", [tc, s_len]))  # [1]
            geo["col_pos"] = g.op("Expand", [s3, g.op("Concat", [shape_bs, geo["n_cols"]], axis=0)])  # [B, S, C]
            length = g.op("Add", [tc, s_len])  # attn_mass covers positions 0..max(past) + S - 1
            geo["mass0"] = g.op("ConstantOfShape", [g.op("Concat", [g.op("Shape", [io.INPUT_IDS.name], end=1), length],
                                                         axis=0)], value=_zero_f32())
        self._geo = geo
        return geo

    def _selection(self, rope: tuple[str, str], window: str, top_k: str, divisor: int = 0) -> dict[str, str]:
        """The call's geometry plus what one (window [1], top_k [B], divisor) triple decides, emitted once per
        distinct triple (layers that select alike share it): the sink/window mask, the TopK width and the budget
        mask. divisor > 0: the query at t picks max(top_k[b], (t + 1) // divisor) (a budget growing with the
        context, per query: a prefill chunk's queries differ)."""
        key = (window, top_k, divisor)
        if key in self._sel:
            return self._sel[key]
        geo = dict(self._call(rope))
        g, p = self.g, self.cfg.gsm
        with g.in_scope("call/selection"):
            s3, t3 = geo["s3"], geo["t3"]
            sink = g.op("Less", [s3, g.const(p.sink_tokens, np.int32, "sinks")])
            win = g.op("Greater", [g.op("Add", [s3, window]), t3])  # s > t - window
            geo["fixed"] = g.op("Or", [sink, win])  # [B, S, C]
            # per-sequence budget sinks + window + top_k[b]; one TopK of the batch's largest (capped by the
            # columns: a budget >= the context is dense attention), each sequence then keeps its own
            top = g.op("Unsqueeze", [cast(g, top_k, I64), g.const([1, 2], np.int64, "ax12")])  # [B, 1, 1]
            if divisor:
                grown = g.op("Div", [g.op("Add", [cast(g, t3, I64), g.const(1, np.int64, "i1")]),
                                     g.const(divisor, np.int64, f"top_k_divisor{divisor}")])  # [B, S, 1], floor
                top = g.op("Max", [top, grown])
            budget = g.op("Add", [g.op("Add", [top, cast(g, window, I64)]),
                                  g.const(p.sink_tokens, np.int64, "sinks")])  # [B, 1 or S, 1]
            most = g.op("Reshape", [g.op("ReduceMax", [budget], keepdims=0), g.const([1], np.int64, "shape1")])
            geo["k"] = k = g.op("Min", [most, geo["n_cols"]])  # [1]
            rank = g.op("Range", [g.const(0, np.int64, "i0"), g.op("Squeeze", [k]), g.const(1, np.int64, "i1")])
            geo["in_budget"] = g.op("Less", [rank, budget])  # [B, 1 or S, k]
        self._sel[key] = geo
        return geo

    # -- GsmKVCacheUpdate ----------------------------------------------------------------------------
    def kv_update(self, l: int, cache: dict[str, str], ck: str, cv: str, key: str, past: str,
                  new: str) -> dict[str, str]:
        """The new rows as the cache will hold them: latents rounded to FP16 and back (deployed mode),
        keys as FP16 or INT8 codes. They are graph outputs; the runtime writes them at positions past + j."""
        g = self.g
        with g.in_scope(f"L{l}.GsmKVCacheUpdate"):
            out = dict(cache)
            out["new_k"] = g.op("Cast", [cast(g, ck, F16)], to=F32, outputs=[io.NEW_LATENT_K.at(l)])
            out["new_v"] = g.op("Cast", [cast(g, cv, F16)], to=F32, outputs=[io.NEW_LATENT_V.at(l)])
            out["new_keys"] = (key_codes(g, key, I8, outputs=[io.NEW_INDEX_KEYS.at(l)]) if self.int8_keys
                               else g.op("Cast", [key], to=F16, outputs=[io.NEW_INDEX_KEYS.at(l)]))
        return out

    # -- GsmSparseAttention --------------------------------------------------------------------------
    def attention(self, a: AttentionCall) -> tuple[str, str | None, str | None]:
        """Owning (index_q given): select and attend; sharing (selected given): attend over the source's
        selection with K/V projected from the source's latents. Returns attn_out [B, S, nH*D], the
        selection (int32 [B, S, k] positions, -1 padded, named `selected.{l}`) and this layer's
        attention mass [B, L] (`attn_mass.{l}`, owning layers only)."""
        g, cfg = self.g, self.cfg
        nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        grp = cfg.gqa_group
        l, q, cache, up, owning = a.layer, a.q, a.cache, a.up, a.owning
        geo = (self._selection(a.rope, a.sparse_window, a.top_k, self.cfg.gsm.selection_of(l).sparse_top_k_divisor)
               if owning else self._call(a.rope))
        with g.in_scope(f"L{l}.GsmSparseAttention"):
            selected = self._select(l, geo, a.index_q, a.index_w, cache) if owning else a.selected
            sel_ok = g.op("GreaterOrEqual", [selected, g.const(0, np.int32, "zero_i32")])  # [B, S, K]
            p = g.op("Max", [selected, g.const(0, np.int32, "zero_i32")])  # padding reads position 0, masked
            rk, rv = self.ranks[a.owner]
            # this call's K rows (graph output `new_k_rows.{l}`: the runtime caches them with the latents)
            lat_new = cache["new_k"] if owning else g.op("Concat", [cache["new_k"], cache["new_v"]], axis=-1)
            k_new = self.k_rows_from(lat_new, up, owning, geo["cos_q"], geo["sin_q"], out=io.NEW_K_ROWS.at(l))
            k, lat_v, inv = self._selected_kv(geo, p, cache, rk, rv, k_new, self.k_rows[l], owning)
            # queries: RoPE at pos, then each head widened to all nKV key heads, zero outside its own
            # (head h reads key head h // grp): the logits are then one MatMul per query against the
            # gathered [K, nKV*D] rows, read as they lie (no head-major Transpose of K rows, whose cost
            # grew with the batch); the zeros cost nH*K*(nKV-1)*D multiply-adds
            qh = g.op("Reshape", [q, g.const([0, 0, nH, 2, D // 2], np.int64, "bsh2d")])  # [B, S, nH, 2, D/2]
            qh = g.op("Reshape", [_rope(g, qh, geo["cos_q"], geo["sin_q"]),
                                  g.const([0, 0, nKV, grp, 1, D], np.int64, "bskg1d")])
            if nKV > 1:
                qh = g.op("Mul", [qh, g.const(_head_blocks(nKV), np.float32, f"head_blocks{nKV}")])
            qh = g.op("Reshape", [qh, g.const([0, 0, nH, nKV * D], np.int64, "bshkd")])  # [B, S, nH, nKV*D]
            kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])  # last two axes: fused into the MatMul
            logits = g.op("Div", [g.op("MatMul", [qh, kt]), g.const(math.sqrt(D), np.float32, "sqrt_d")])
            mask = g.op("Unsqueeze", [sel_ok, g.const([2], np.int64, "ax2")])  # [B, S, 1, K]
            probs = g.op("Softmax", [g.op("Where", [mask, logits, g.const(NEG_INF, np.float32, "neg_inf")])],
                         axis=-1)  # [B, S, nH, K]
            out = self._attend_v(l, probs, lat_v, inv, up, owning, rk, rv)  # [B, S, nKV, grp, D]
            out = g.op("Reshape", [out, g.const([0, 0, nH * D], np.int64, "bsq")], outputs=[f"L{l}.attn_out"])
            mass = None
            if owning:
                per_pos = g.op("Mul", [g.op("ReduceSum", [probs, g.const([2], np.int64, "ax2")], keepdims=0),
                                       geo["valid3"]])
                flat = g.const([0, -1], np.int64, "b_flat")
                mass = g.op("ScatterElements", [geo["mass0"], g.op("Reshape", [cast(g, p, I64), flat]),
                                                g.op("Reshape", [per_pos, flat])], axis=1, reduction="add",
                            outputs=[io.LAYER_MASS.at(l)])  # [B, L]
                self.query_masses.append(self._query_mass(l, geo, per_pos, p))
        return out, (selected if owning else None), mass

    def _query_mass(self, l: int, geo: dict[str, str], per_pos: str, picks: str) -> str:
        """The attention mass of each logit row's query alone, [B, J, L]: per_pos [B, S, K] (summed over heads,
        padding rows zero) and the picks' positions [B, S, K] gathered at `logit_rows`, then scattered by position."""
        g = self.g
        rows = g.op("Unsqueeze", [cast(g, self.logit_rows, I64), g.const([2], np.int64, "ax2")])  # [B, J, 1]
        k = g.op("Shape", [per_pos], start=2, end=3)
        idx = g.op("Expand", [rows, g.op("Concat", [g.op("Shape", [self.logit_rows]), k], axis=0)])  # [B, J, K]
        zero = g.op("ConstantOfShape", [g.op("Concat", [g.op("Shape", [self.logit_rows]),
                                                        g.op("Shape", [geo["mass0"]], start=1, end=2)], axis=0)],
                    value=_zero_f32())
        return g.op("ScatterElements", [zero, g.op("GatherElements", [cast(g, picks, I64), idx], axis=1),
                                        g.op("GatherElements", [per_pos, idx], axis=1)], axis=2, reduction="add",
                    outputs=[f"{io.QUERY_MASS.name}.{l}"])

    def _attend_v(self, l: int, probs: str, lat_u: str, inv: str, up: tuple[str, str], owning: bool, rk: int,
                  rv: int) -> str:
        """sum_s p_s V_s [B, S, nKV, grp, D] over the picks (`inv` [B, S, K] into the distinct latent rows lat_u
        [U, w]; sharing: the source's [c_k; c_v]). Two forms, chosen per call by an `If` on S:
        - a decode step or a verification (S <= VERIFY_ROWS), `_attend_latents`: V is never rebuilt; the weights
          attend over the latents and one up-projection per head follows (K_sel * r_v instead of K_sel * r_v * kvD
          per query), each query's sums its own, so a verified token's output is the one-token step's;
        - a longer prefill chunk, `_attend_rebuilt`: V rebuilt once per distinct row, then the golden's own
          order (rebuild, then the weighted sum) in float32: a chunk's queries share their rows, and the
          float64 per-pick sum the latent form needs was most of a prefill chunk's time at a large top-k."""
        g = self.g
        s_len = g.op("Gather", [g.op("Shape", [probs]), g.const(1, np.int64, "i1")], axis=0)
        decode = g.op("LessOrEqual", [s_len, g.const(VERIFY_ROWS, np.int64, "verify_rows")])
        then = g.branch(f"L{l}_attend_latents", lambda: [(self._attend_latents(probs, lat_u, inv, up, owning, rk,
                                                                                rv), F32)])
        other = g.branch(f"L{l}_attend_rebuilt", lambda: [(self._attend_rebuilt(probs, lat_u, inv, up, owning), F32)])
        return g.op("If", [decode], then_branch=then, else_branch=other)

    def _projector_half(self, up: tuple[str, str], half: int) -> tuple[str, str]:
        """The K (half 0) or V (half 1) rows of a sharing layer's kv_projector [2*kvD, rk+rv] and bias [2*kvD]:
        [K; V] = [W_k; W_v] [c_k; c_v] + [b_k; b_v]."""
        g, kvd = self.g, self.cfg.kv_dim
        rows = (g.const([half * kvd], np.int64, f"kvd{half}"), g.const([(half + 1) * kvd], np.int64, f"kvd{half + 1}"),
                g.const([0], np.int64, "ax0"))
        return g.op("Slice", [up[0], *rows]), g.op("Slice", [up[1], *rows])

    def _v_weight(self, up: tuple[str, str], owning: bool) -> tuple[str, str | None]:
        """W_v [kvD, w] and b_v [kvD] (owning: U_v, no bias; sharing: the V half of the kv_projector)."""
        return (up[1], None) if owning else self._projector_half(up, 1)

    def _attend_latents(self, probs: str, lat_u: str, inv: str, up: tuple[str, str], owning: bool, rk: int,
                        rv: int) -> str:
        """sum_s p_s V_s without reconstructing V: V_s = U_v c_s (+ b_v) is linear in the latent row, so
        sum_s p_s V_s = U_v (sum_s p_s c_s) (+ b_v, as sum_s p_s = 1): attend over the latents, then one
        up-projection per query head. Exact up to float reassociation; [B, S, nKV, grp, D].

        The weighted latent sum is accumulated in float64: reassociated against the golden's
        U_v c_s-then-sum, a float32 sum moved a deployed latent across an FP16 rounding boundary in the
        stories260K golden test (logits 1.7e-3 off at one step, tolerance 1.67e-3); in float64 the
        deviation is the golden's own float32 rounding (7e-4, as with reconstructed V). It costs a Cast
        of the probabilities and of the distinct latent rows and a float64 MatMul of nH * K * r per query
        (no K * r * nKV * D)."""
        g, cfg = self.g, self.cfg
        nKV, D, grp = cfg.num_key_value_heads, cfg.head_dim, cfg.gqa_group
        width = rv if owning else rk + rv
        lat = g.op("Gather", [cast(g, lat_u, F64), inv], axis=0)  # [B, S, K, w], float64 per distinct row first
        ctx = cast(g, g.op("MatMul", [cast(g, probs, F64), lat]), F32)  # [B, S, nH, w]
        ctx = g.op("Reshape", [ctx, g.const([0, 0, nKV, grp, width], np.int64, f"bskg{width}")])
        w_v, b_v = self._v_weight(up, owning)
        # [nKV*D, w] -> [nKV, w, D] per key head (constant-folded at load); MatMul broadcasts over B, S, grp
        w3 = g.op("Transpose", [g.op("Reshape", [w_v, g.const([nKV, D, width], np.int64, f"kdw{width}")])],
                  perm=[0, 2, 1])
        out = g.op("MatMul", [ctx, g.op("Unsqueeze", [w3, g.const([0, 1], np.int64, "ax01")])])
        if b_v is not None:
            out = g.op("Add", [out, g.op("Reshape", [b_v, g.const([nKV, 1, D], np.int64, "k1d")])])
        return out

    def _attend_rebuilt(self, probs: str, lat_u: str, inv: str, up: tuple[str, str], owning: bool) -> str:
        """The golden's order: V_u = W_v c_u (+ b_v) per distinct row [U, kvD], gathered per pick, then
        probs [B, S, nH, K] @ V [B, S, K, kvD] in float32 and each head's own key-head block kept (the other
        nKV - 1 blocks are multiplied by 0 and summed away: exact). [B, S, nKV, grp, D]."""
        g, cfg = self.g, self.cfg
        nKV, D, grp = cfg.num_key_value_heads, cfg.head_dim, cfg.gqa_group
        w_v, b_v = self._v_weight(up, owning)
        v_u = g.op("MatMul", [lat_u, g.op("Transpose", [w_v], perm=[1, 0])])  # [U, kvD]
        if b_v is not None:
            v_u = g.op("Add", [v_u, b_v])
        full = g.op("MatMul", [probs, g.op("Gather", [v_u, inv], axis=0)])  # [B, S, nH, kvD]
        full = g.op("Reshape", [full, g.const([0, 0, nKV, grp, nKV, D], np.int64, "bskgkd")])
        if nKV == 1:
            return g.op("Reshape", [full, g.const([0, 0, 1, grp, D], np.int64, "bs1gd")])
        return g.op("ReduceSum", [g.op("Mul", [full, g.const(_head_blocks(nKV), np.float32, f"head_blocks{nKV}")]),
                                  g.const([4], np.int64, "ax4")], keepdims=0)

    def k_rows_from(self, lat: str, up: tuple[str, str], owning: bool, cos: str, sin: str, *, out: str,
                    lead_dims: int = 2) -> str:
        """K rows (spec 4.1/4.2: RoPE after reconstruction) of latent rows `lat` [*lead, r] (sharing: the source's
        [c_k; c_v]) at the positions whose RoPE factors `cos`/`sin` [*lead, 1, 2, D/2] are given: [*lead, kvD],
        named `out`. The main graph makes the call's new rows with it, the demotion graph the re-encoded ones."""
        g, cfg = self.g, self.cfg
        nKV, D = cfg.num_key_value_heads, cfg.head_dim
        if owning:
            k = g.op("MatMul", [lat, g.op("Transpose", [up[0]], perm=[1, 0])])  # c U_k^T
        else:
            w_k, b_k = self._projector_half(up, 0)
            k = g.op("Add", [g.op("MatMul", [lat, g.op("Transpose", [w_k], perm=[1, 0])]), b_k])
        lead = [0] * lead_dims  # Reshape's 0 keeps a leading dimension as it is
        heads = g.const(lead + [nKV, 2, D // 2], np.int64, f"lead{lead_dims}_h2d")
        return g.op("Reshape", [_rope(g, g.op("Reshape", [k, heads]), cos, sin),
                                g.const(lead + [nKV * D], np.int64, f"lead{lead_dims}_kvd")], outputs=[out])

    def _selected_kv(self, geo: dict[str, str], p: str, cache: dict[str, str], rk: int, rv: int, k_new: str,
                     k_rows: str, owning: bool) -> tuple[str, str, str]:
        """K (RoPE applied) [B, S, K, nKV*D] of the selected positions p [B, S, K], row-major as gathered, and the
        latents V is made from as distinct rows [U, rv] (sharing: the source's [c_k; c_v], [U, rk + rv]) with
        each pick's row among them, inv [B, S, K].

        K rows come from the layer's K-row cache (`k_rows.{l}`) and this call's `k_new`
        [B, S, kvD]: nothing is reconstructed per step. Rows are gathered once per *distinct* selected
        row (`Unique` over the batch's picks: a prefill chunk's queries select mostly the same rows),
        then per pick (`_attend_v` for V)."""
        g, cfg = self.g, self.cfg
        kvD = cfg.kv_dim
        is_new = g.op("GreaterOrEqual", [p, geo["past3"]])
        p64 = cast(g, p, I64)
        zero, minus1 = g.const(0, np.int64, "i0"), g.const(-1, np.int64, "i_minus1")
        in_cache = g.op("Add", [geo["base3"], p64])  # row in the cache buffer viewed as [R * N_max, r]
        j = g.op("Clip", [g.op("Sub", [p64, cast(g, geo["past3"], I64)]), zero, geo["s_last"]])
        in_new = g.op("Add", [geo["nb3"], j])  # row in this call's new rows viewed as [B * S, r]
        key = g.op("Where", [is_new, g.op("Sub", [minus1, in_new]), in_cache])  # new row i as key -1 - i
        flat = g.const([-1], np.int64, "flat")
        # the call's B*S new rows are put first (keys -1 .. -B*S, in order), so `Unique` (first-occurrence
        # order) lists them as its first B*S rows whether picked or not: the unique rows are the new rows
        # as they are, then cache rows (keys >= 0), one Gather and one Concat, no per-row Where
        n_new = geo["n_new"]
        uniq, _, inverse, _ = g.op("Unique", [g.op("Concat", [geo["new_keys"], g.op("Reshape", [key, flat])],
                                                   axis=0)], n_out=4, sorted=0)
        big = g.const([np.iinfo(np.int64).max], np.int64, "i64max")
        cache_row = g.op("Slice", [uniq, n_new, big])  # [U - B*S]
        inverse = g.op("Slice", [inverse, n_new, big])  # the picks' rows in the unique list

        def rows(buf: str, new_rows: str, r: int) -> str:  # [U, r]
            from_cache = g.op("Gather", [self._flat_rows(buf, r), cache_row], axis=0)
            new_flat = g.op("Reshape", [new_rows, g.const([-1, r], np.int64, f"flat{r}")])
            return g.op("Concat", [new_flat, from_cache], axis=0)

        k_u = rows(k_rows, k_new, kvD)
        lat_v = rows(cache["v"], cache["new_v"], rv)
        if not owning:
            lat_v = g.op("Concat", [rows(cache["k"], cache["new_k"], rk), lat_v], axis=-1)
        inv = g.op("Reshape", [inverse, g.op("Shape", [p])])  # [B, S, K]
        # row gathers along axis 0: contiguous row copies, the layout the MatMuls read; V per pick in _attend_v
        return g.op("Gather", [k_u, inv], axis=0), lat_v, inv

    def _select(self, l: int, geo: dict[str, str], index_q: str, index_w: str, cache: dict[str, str]) -> str:
        """Sel(t) by spec 4.1 as positions [B, S, k] int32, ascending, padded with -1."""
        g, p = self.g, self.cfg.gsm
        nI, dI = p.indexer_heads, p.indexer_dim
        # keys of the context columns: the sequence's cached positions 0..T_c-1, then the S new keys
        old_keys = g.op("Gather", [self._flat_rows(cache["keys"], dI), geo["key_idx"]], axis=0)  # [B, T_c, dI]
        keys = g.op("Concat", [old_keys, cache["new_keys"]], axis=1)  # [B, C, dI]
        # index scores I(t, s) = sum_j w_j ReLU(q_j . e_s) / sqrt(dI): [B, S, C]
        qi = g.op("Reshape", [index_q, g.const([0, 0, nI, dI], np.int64, "bsid")])  # [B, S, nI, dI]
        kt = g.op("Transpose", [g.op("Unsqueeze", [cast(g, keys, F32), g.const([1], np.int64, "ax1")])],
                  perm=[0, 1, 3, 2])  # [B, 1, dI, C]: last two axes, fused into the MatMul by ONNX Runtime
        dots = g.op("Relu", [g.op("MatMul", [qi, kt])])  # [B, S, nI, C]
        wi = g.op("Unsqueeze", [index_w, g.const([3], np.int64, "ax3")])  # [B, S, nI, 1]
        scores = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [wi, dots]), g.const([2], np.int64, "ax2")], keepdims=0),
                              g.const(math.sqrt(dI), np.float32, "sqrt_di")])  # [B, S, C]
        inf = g.const(POS_INF, np.float32, "pos_inf")
        ninf = g.const(NEG_INF, np.float32, "neg_inf")
        ranked = g.op("Where", [geo["causal"], g.op("Where", [geo["fixed"], inf, scores]), ninf])  # [B, S, C]
        vals, idx = g.op("TopK", [ranked, geo["k"]], n_out=2, axis=-1, largest=1, sorted=1)  # [B, S, k]
        chosen = g.op("And", [g.op("Greater", [vals, ninf]), geo["in_budget"]])  # [B, S, k]
        sel_pos = g.op("GatherElements", [geo["col_pos"], idx], axis=2)  # [B, S, k]
        # ascending positions, unselected last: TopK of -position (exact in float32 below 2^24)
        key = g.op("Where", [chosen, g.op("Neg", [cast(g, sel_pos, F32)]), ninf])
        svals, order = g.op("TopK", [key, geo["k"]], n_out=2, axis=-1, largest=1, sorted=1)
        return g.op("Where", [g.op("Greater", [svals, ninf]), g.op("GatherElements", [sel_pos, order], axis=2),
                              g.const(-1, np.int32, "minus1")], outputs=[io.SELECTED.at(l)])

    # -- GsmKVDemote (demotion graph) ---------------------------------------------------------------
    def demote(self, l: int, lat: str, new_tier: str, quant: str, cols: tuple[int, int], out: str) -> str:
        """new_tier [M] int32 (-1 unchanged, 1 INT12, 2 INT8, 3 INT4) -> re-encoded latent rows [M, r] (the
        runtime gathers the M rows a re-tier pass changes and writes them back: cost follows the changed rows).

        code = clip(round_half_even(x / s)); INT12 value = code * s12, INT8 = (code * s8) + comp8,
        INT4 = (code * s4) + comp4 (two separately rounded float32 ops, decisions "Rounding"); x is the
        held value (FP16, INT12- or INT8-dequantised), as the golden re-quantises.
        """
        g = self.g
        with g.in_scope(f"L{l}.GsmKVDemote"):
            table = g.op("Slice", [quant, g.const([cols[0]], np.int64, "c0"), g.const([cols[1]], np.int64, "c1"),
                                   g.const([1], np.int64, "ax1")])  # [5, r]: s12, s8, comp8, s4, comp4
            s12, s8, comp8, s4, comp4 = g.op("Split", [table, g.const([1] * 5, np.int64, "rows5")], n_out=5,
                                             axis=0)  # [1, r] each

            def code(scale: str, qmax: int) -> str:
                return g.op("Clip", [g.op("Round", [g.op("Div", [lat, scale])]),
                                     g.const(-qmax, np.float32, f"m{qmax}"), g.const(qmax, np.float32, f"p{qmax}")])

            value = {INT12: g.op("Mul", [code(s12, QMAX[INT12]), s12]),
                     INT8: g.op("Add", [g.op("Mul", [code(s8, QMAX[INT8]), s8]), comp8]),
                     INT4: g.op("Add", [g.op("Mul", [code(s4, QMAX[INT4]), s4]), comp4])}
            tier = g.op("Unsqueeze", [new_tier, g.const([1], np.int64, "ax1")])  # [M, 1]
            held = lat
            for t in (INT4, INT8, INT12):  # innermost Where: the held value of an unchanged row
                held = g.op("Where", [g.op("Equal", [tier, g.const(t, np.int32, f"t{t}")]), value[t], held],
                            **({"outputs": [out]} if t == INT12 else {}))
            return held



def rope_at(g: GraphBuilder, rope: tuple[str, str], pos: str, head_dim: int) -> tuple[str, str]:
    """RoPE factors at positions `pos` [...] from the tables (cos, sin) [N, D]: [..., 1, 2, D/2] halves that
    broadcast over heads, sin signed [-sin | +sin] (the table reshapes and the sign fold at load), so that
    rotate_half is one Slice (_rope)."""
    halves = g.const([-1, 1, 2, head_dim // 2], np.int64, "n1_2_half")
    sign = np.concatenate([-np.ones(head_dim // 2), np.ones(head_dim // 2)]).astype(np.float32)
    cos = g.op("Reshape", [rope[0], halves])
    sin = g.op("Reshape", [g.op("Mul", [rope[1], g.const(sign, np.float32, "rope_sign")]), halves])
    return g.op("Gather", [cos, pos], axis=0), g.op("Gather", [sin, pos], axis=0)


def _rope(g: GraphBuilder, x: str, cos: str, sin_signed: str) -> str:
    """RoPE of x [..., 2, D/2] (halves on axis -2): x * cos + rotate_half(x) * sin, with rotate_half(x) * sin =
    [x2, x1] * [-sin, +sin]: the halves swapped by one reversing Slice (bitwise the same as Split/Neg/Concat)."""
    swapped = g.op("Slice", [x, g.const([-1], np.int64, "i_minus1_1"), g.const([np.iinfo(np.int64).min], np.int64,
                                                                             "i64min"),
                             g.const([-2], np.int64, "ax_minus2"), g.const([-1], np.int64, "step_minus1")])
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [swapped, sin_signed])])


def _head_blocks(n_kv: int) -> np.ndarray:
    """[nKV, 1, nKV, 1]: 1 where the query's key head (axis 0) is the block (axis 2), else 0."""
    return np.eye(n_kv, dtype=np.float32).reshape(n_kv, 1, n_kv, 1)


def _zero_f32() -> Any:
    import onnx

    return onnx.numpy_helper.from_array(np.zeros(1, np.float32))
