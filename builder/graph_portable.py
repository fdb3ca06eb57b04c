"""GSM operations in standard ONNX ops (docs/engine_io.md section 5), for ONNX Runtime anywhere.

Each method emits, inside the scope `L{l}.<GsmNodeName>`, the subgraph that stands for one GSM
plugin node of the TensorRT variant (graph_trt.py). The cache is held as the golden holds it:
dequantised float32 latents by position, FP16 indexer keys by position; the portable demotion
graph rewrites latents in place of the plugin's row re-encoding.

Selection follows spec 4.1 exactly: sinks + run-time window + top-k of index scores over the other
causal positions (ONNX TopK orders equal values by lower index: the tie rule), dense when
t + 1 <= sinks + window + top_k. Attention is a dense masked softmax over all N_max positions;
unselected positions get exp(-inf) = 0, so it equals the golden's softmax over Sel(t).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx

from builder.nodes import BOOL, F16, F32, I64, apply_rope, cast, linear, positions, valid_rows
from builder.onnx_util import GraphBuilder
from gsm.config import ModelConfig

NEG_INF = np.float32(-np.inf)


class PortableOps:
    """Standard-op GSM subgraphs; tensors by name in GraphBuilder `g`."""

    variant = "portable"

    def __init__(self, g: GraphBuilder, cfg: ModelConfig, ranks: dict[int, tuple[int, int]], n_max: int) -> None:
        self.g, self.cfg, self.ranks, self.n_max = g, cfg, ranks, n_max

    # -- I/O ---------------------------------------------------------------------------------------
    def declare_cache(self) -> dict[int, dict[str, str]]:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        state = {}
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            state[l] = {"k": g.input(f"latent_k.{l}", F32, ["B", self.n_max, rk]),
                        "v": g.input(f"latent_v.{l}", F32, ["B", self.n_max, rv]),
                        "keys": g.input(f"index_keys.{l}", F16, ["B", self.n_max, dI])}
        return state

    def declare_cache_outputs(self) -> None:
        g, dI = self.g, self.cfg.gsm.indexer_dim
        for l in self.cfg.owning_layers:
            rk, rv = self.ranks[l]
            g.output(f"latent_k_out.{l}", F32, ["B", self.n_max, rk])
            g.output(f"latent_v_out.{l}", F32, ["B", self.n_max, rv])
            g.output(f"index_keys_out.{l}", F16, ["B", self.n_max, dI])

    def selected_type(self) -> tuple[int, list[Any]]:
        """Element type and shape of `L{l}.selected` in this variant (a bool mask by position)."""
        return BOOL, ["B", "S", self.n_max]

    # -- GsmKVCacheUpdate ----------------------------------------------------------------------------
    def kv_update(self, l: int, cache: dict[str, str], ck: str, cv: str, key: str, past: str,
                  new: str) -> dict[str, str]:
        """Round new rows to FP16 (deployed mode) and scatter them at positions past + j."""
        g = self.g
        with g.in_scope(f"L{l}.GsmKVCacheUpdate"):
            pos, _ = positions(g, past, ck)  # [B, S]
            shape_bs = g.op("Shape", [pos])
            b = g.op("Range", [g.const(0, np.int64, "zero"), g.op("Gather", [shape_bs, g.const(0, np.int64, "zero")],
                                                                    axis=0), g.const(1, np.int64, "one")])
            b_bs = g.op("Expand", [g.op("Unsqueeze", [b, g.const([1], np.int64, "ax1")]), shape_bs])  # [B, S]
            idx = g.op("Concat", [g.op("Unsqueeze", [b_bs, g.const([2], np.int64, "ax2")]),
                                  g.op("Unsqueeze", [cast(g, pos, I64), g.const([2], np.int64, "ax2")])],
                       axis=2)  # [B, S, 2]
            out = {}
            for kind, x, name in (("k", ck, f"latent_k_out.{l}"), ("v", cv, f"latent_v_out.{l}")):
                rounded = cast(g, cast(g, x, F16), F32)
                out[kind] = g.op("ScatterND", [cache[kind], idx, rounded], outputs=[name])
            out["keys"] = g.op("ScatterND", [cache["keys"], idx, cast(g, key, F16)], outputs=[f"index_keys_out.{l}"])
        return out

    # -- GsmSparseAttention --------------------------------------------------------------------------
    def attention(self, l: int, q: str, cache: dict[str, str], past: str, new: str, *, rope: tuple[str, str],
                  up: tuple[str, str], index_q: str | None = None, index_w: str | None = None,
                  sparse_window: str | None = None, selected: str | None = None, source: int | None = None,
                  quant: str | None = None) -> tuple[str, str | None, str | None]:
        """Owning (index_q given): select and attend; sharing (selected given): attend over the source's
        selection with K/V projected from the source's latents. Returns attn_out [B, S, nH*D], the
        selection (bool mask [B, S, N_max], named `L{l}.selected`) and this layer's attention mass
        [B, N_max] (owning layers only)."""
        g, cfg = self.g, self.cfg
        nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        owning = selected is None
        with g.in_scope(f"L{l}.GsmSparseAttention"):
            pos, j = positions(g, past, q)  # [B, S]
            valid = valid_rows(g, j, new)  # [B, S]
            if owning:
                selected = self._select(l, pos, index_q, index_w, cache["keys"], sparse_window)
            # K/V from the latents of all N_max positions: [B, N, r] -> [B, N, kvD]
            if owning:
                k_pre = self._up(cache["k"], up[0], None, self.ranks[l][0], nKV * D)
                v = self._up(cache["v"], up[1], None, self.ranks[l][1], nKV * D)
            else:
                rk, rv = self.ranks[source]
                kv = self._up(g.op("Concat", [cache["k"], cache["v"]], axis=-1), up[0], up[1], rk + rv, 2 * nKV * D)
                k_pre, v = g.op("Split", [kv, g.const([nKV * D, nKV * D], np.int64, "kv_split")], n_out=2, axis=-1)
            cos, sin = rope
            k = g.op("Reshape", [k_pre, g.const([0, 0, nKV, D], np.int64, "bnhd")])  # [B, N, nKV, D]
            cos_n = g.op("Unsqueeze", [cos, g.const([1], np.int64, "ax1")])  # [N, 1, D]
            sin_n = g.op("Unsqueeze", [sin, g.const([1], np.int64, "ax1")])
            k = g.op("Transpose", [apply_rope(g, k, cos_n, sin_n, D)], perm=[0, 2, 1, 3])  # [B, nKV, N, D]
            v = g.op("Transpose", [g.op("Reshape", [v, g.const([0, 0, nKV, D], np.int64, "bnhd")])],
                     perm=[0, 2, 1, 3])  # [B, nKV, N, D]
            k, v = self._gqa(k), self._gqa(v)  # [B, nH, N, D]: query head h reads key head h // group
            # queries: RoPE at pos
            qh = g.op("Reshape", [q, g.const([0, 0, nH, D], np.int64, "bshd")])  # [B, S, nH, D]
            cos_q = g.op("Unsqueeze", [g.op("Gather", [cos, pos], axis=0), g.const([2], np.int64, "ax2")])  # [B,S,1,D]
            sin_q = g.op("Unsqueeze", [g.op("Gather", [sin, pos], axis=0), g.const([2], np.int64, "ax2")])
            qh = g.op("Transpose", [apply_rope(g, qh, cos_q, sin_q, D)], perm=[0, 2, 1, 3])  # [B, nH, S, D]
            logits = g.op("Div", [g.op("MatMul", [qh, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                                  g.const(math.sqrt(D), np.float32, "sqrt_d")])  # [B, nH, S, N]
            mask = g.op("Unsqueeze", [selected, g.const([1], np.int64, "ax1")])  # [B, 1, S, N]
            probs = g.op("Softmax", [g.op("Where", [mask, logits, g.const(NEG_INF, np.float32, "neg_inf")])],
                         axis=-1)
            out = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]),
                                   g.const([0, 0, nH * D], np.int64, "bsq")], outputs=[f"L{l}.attn_out"])
            mass = None
            if owning:
                w = g.op("Unsqueeze", [cast(g, valid, F32), g.const([1, 3], np.int64, "ax13")])  # [B, 1, S, 1]
                mass = g.op("ReduceSum", [g.op("Mul", [probs, w]), g.const([1, 2], np.int64, "ax12")], keepdims=0,
                            outputs=[f"L{l}.attn_mass"])
        return out, (selected if owning else None), mass

    def _up(self, lat: str, weight: str, bias: str | None, r: int, n_out: int) -> str:
        """Latents [B, N, r] -> [B, N, n_out] = lat @ W^T (+ b)."""
        g = self.g
        flat = g.op("Reshape", [lat, g.const([-1, r], np.int64, f"flat{r}")])
        y = linear(g, flat, weight, bias)  # [B*N, n_out]
        return g.op("Reshape", [y, g.const([-1, self.n_max, n_out], np.int64, f"bn{n_out}")])

    def _gqa(self, x: str) -> str:
        """[B, nKV, N, D] -> [B, nH, N, D], each key head repeated `group` times in place."""
        g, cfg = self.g, self.cfg
        grp = cfg.gqa_group
        if grp == 1:
            return x
        e = g.op("Expand", [g.op("Unsqueeze", [x, g.const([2], np.int64, "ax2")]),
                            g.const([1, 1, grp, 1, 1], np.int64, "gqa")])  # [B, nKV, grp, N, D]
        return g.op("Reshape", [e, g.const([0, cfg.num_attention_heads, self.n_max, cfg.head_dim], np.int64, "bhnd")])

    def _select(self, l: int, pos: str, index_q: str, index_w: str, keys: str, window: str) -> str:
        """Sel [B, S, N_max] bool by spec 4.1."""
        g, p = self.g, self.cfg.gsm
        nI, dI, N = p.indexer_heads, p.indexer_dim, self.n_max
        # index scores I(t, s) = sum_j w_j ReLU(q_j . e_s) / sqrt(dI): [B, S, N]
        qi = g.op("Reshape", [index_q, g.const([0, 0, nI, dI], np.int64, "bsid")])  # [B, S, nI, dI]
        kt = g.op("Unsqueeze", [g.op("Transpose", [cast(g, keys, F32)], perm=[0, 2, 1]),
                                g.const([1], np.int64, "ax1")])  # [B, 1, dI, N]
        dots = g.op("Relu", [g.op("MatMul", [qi, kt])])  # [B, S, nI, N]
        wi = g.op("Unsqueeze", [index_w, g.const([3], np.int64, "ax3")])  # [B, S, nI, 1]
        scores = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [wi, dots]), g.const([2], np.int64, "ax2")], keepdims=0),
                              g.const(math.sqrt(dI), np.float32, "sqrt_di")])  # [B, S, N]
        s = g.const(np.arange(N, dtype=np.int32), np.int32, "positions")  # [N]
        t = g.op("Unsqueeze", [pos, g.const([2], np.int64, "ax2")])  # [B, S, 1]
        causal = g.op("LessOrEqual", [s, t])  # [B, S, N]
        sink = g.op("Less", [s, g.const(p.sink_tokens, np.int32, "sinks")])  # [N]
        win = g.op("Greater", [g.op("Add", [s, window]), t])  # s > t - window
        fixed = g.op("And", [causal, g.op("Or", [sink, win])])
        budget = g.op("Add", [window, g.const(p.sink_tokens + p.sparse_top_k, np.int32, "sinks_topk")])
        dense = g.op("LessOrEqual", [g.op("Add", [t, g.const(1, np.int32, "one_i32")]), budget])  # [B, S, 1]
        sparse = fixed
        k = min(p.sparse_top_k, N)
        if k > 0:
            cand = g.op("And", [causal, g.op("Not", [fixed])])
            masked = g.op("Where", [cand, scores, g.const(NEG_INF, np.float32, "neg_inf")])
            _, top = g.op("TopK", [masked, g.const([k], np.int64, "topk")], n_out=2, axis=-1, largest=1, sorted=1)
            zeros = g.op("ConstantOfShape", [g.op("Shape", [masked])],
                         value=onnx.numpy_helper.from_array(np.zeros(1, np.float32)))
            hit = g.op("ScatterElements", [zeros, top, g.op("Expand", [g.const(1.0, np.float32, "one_f"),
                                                                       g.op("Shape", [top])])],
                       axis=-1)  # [B, S, N]: 1 at the top-k positions
            chosen = g.op("And", [cand, g.op("Greater", [hit, g.const(0.5, np.float32, "half")])])
            sparse = g.op("Or", [fixed, chosen])
        # sparse is a subset of causal, so Where(dense, causal, sparse) = causal & (dense | sparse)
        return g.op("And", [causal, g.op("Or", [dense, sparse])], outputs=[f"L{l}.selected"])

    # -- GsmKVDemote (demotion graph) ---------------------------------------------------------------
    def demote(self, l: int, lat: str, new_tier: str, quant: str, cols: tuple[int, int], out: str) -> str:
        """new_tier [B, N] int32 (-1 unchanged, 1 INT12, 2 INT8) -> re-encoded latents [B, N, r].

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
            tier = g.op("Unsqueeze", [new_tier, g.const([2], np.int64, "ax2")])  # [B, N, 1]
            is12 = g.op("Equal", [tier, g.const(1, np.int32, "t12")])
            is8 = g.op("Equal", [tier, g.const(2, np.int32, "t8")])
            return g.op("Where", [is12, v12, g.op("Where", [is8, v8, lat])], outputs=[out])

