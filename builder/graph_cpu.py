"""The portable network with each owning layer's attention as one ONNX Runtime CPU custom op
(`model.cpu.onnx`; docs/engine_io.md 5.1, the op in plugins/ortCpu).

The portable graph spells a GSM attention in ~90 standard operators per owning layer (graph_portable.py);
ONNX Runtime pays a fixed dispatch cost per operator, which on a small model is most of a decode step
and does not shrink with a second thread. `GsmCachedAttention` computes the same thing (selection
identical, values to float32 rounding) in one node over the same cache buffers, so the graph keeps the
portable graph's inputs and outputs and the runtime binds either the same way.
Sharing layers keep the standard-op subgraph (the op covers owning layers only).

A float-zero-point projection (builder/qlinear.py: MatMulNBits on the symmetric part + a per-group offset term)
gets its offset term as one `GsmGroupOffset` node instead of the portable graph's group-sum MatMul, offset Gemm
and residual Add: three small operators per projection (120 of each on SmolLM2), none of which used a second
thread at a decode step's single row.

An owning layer's GSM-side projection (in_proj: latents and indexer) is scaled, split and rounded as the cache
holds it by one `GsmSideSplit` node instead of the portable graph's Mul, Reshape, Split, FP16 Casts and INT8 key
codes (ten nodes per layer; the values are the same bits). The gate+up projection's `GsmGroupOffset` also takes
the SwiGLU product (silu(gate) * up), in place of the Split, Sigmoid and two Mul after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from builder.graph_portable import PortableOps
from builder.nodes import F16, F32, I32, AttentionCall
from builder.plan import ROW_CACHE_TOP_K_FACTOR, PoolRows, pool_words, row_cache_capacity
from gsm import graph_io as io
from gsm.bundle_format import ROW_CACHE_TAGS, CpuWeightTable, IndexKeyLayout, WeightSpan

CPU_DOMAIN = "ai.gsm_edge.cpu"
CPU_OP = "GsmPoolAttention"
SHARED_OP = "GsmPoolSharedAttention"
OFFSET_OP = "GsmGroupOffset"
QUANT_OP = "GsmQuantMatMul"
SIDE_OP = "GsmSideSplit"
GATHER_OP = "GsmTileGather"
CPU_OP_VERSION = 1
# what model.cpu.onnx may use of the domain
CPU_OPS = {op: CPU_OP_VERSION for op in (CPU_OP, SHARED_OP, OFFSET_OP, QUANT_OP, SIDE_OP, GATHER_OP)}


class CpuOps(PortableOps):
    """PortableOps with each layer's attention as one node over the plugins' pools: `GsmPoolAttention` (owning),
    `GsmPoolSharedAttention` (sharing). The cache is the TensorRT graph's (engine_io section 3: `kv_pool.{l}`,
    `index_keys.{l}`, the slot table `kv_slots`), read and written in place by the nodes, plus a bounded row cache of
    reconstructed K rows per layer (`row_cache.{i}` [R, C_i, kvD], `row_cache_tags.{i}` [R, 3, C_i];
    builder/plan.py row_cache_capacity)."""

    variant = "cpu"
    fused_offsets = True  # Network.proj emits a float zero point's offset term through group_offset
    fused_quant = True  # Network.proj emits a projection whose tiles are stored (fast matmuls) through quant_matmul
    fused_side = True  # Network.gsm_inputs emits the GSM-side tail through side_split
    flat_q = True  # GsmPoolAttention takes q [B*S, q_dim] and returns attn_out so: no Reshape either side
    half_up = True  # GsmPoolAttention reads U_k / U_v as float16 when every value lies on the FP16 grid

    def __init__(self, g: Any, cfg: Any, ranks: dict[int, tuple[int, int]], n_max: int, rows: PoolRows, *,
                 int8_keys: bool = False, row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR) -> None:
        super().__init__(g, cfg, ranks, n_max, int8_keys=int8_keys)
        self.pool_rows = rows
        self.row_cache_factor = row_cache_factor
        self.keys = IndexKeyLayout(cfg.gsm.indexer_dim, 8 if int8_keys else 16)
        self.pool_key_type = F16 if self.keys.bits == 16 else I32
        self._side: set[int] = set()  # owning layers whose new rows side_split made in the cache's form

    def _pool_attrs(self) -> dict[str, int]:
        r = self.pool_rows
        return {"rows_fp16": r.fp16, "rows_int12": r.int12, "rows_int8": r.int8, "rows_int4": r.int4}

    def declare_cache(self) -> dict[int, dict[str, str]]:
        g, cfg = self.g, self.cfg
        self.slots = g.input(io.KV_SLOTS.name, I32, ["B", self.n_max])
        g.input(io.SPARSE_TOP_K.name, I32, ["B"])  # the per-sequence budget: the layer stack reads it by name
        self.rows = g.input(io.CACHE_ROWS.name, I32, ["B"])
        self.selections = g.input(io.SELECTIONS.name, I32, [1])
        # a sharing layer reads its source's selection: that node makes it whatever the call asks
        self._sources = set(cfg.gsm.kv_sharing.values())
        self._keep_selection = g.const(np.ones(1, np.int32), np.int32, "selections_kept") if self._sources else None
        state = {}
        for l in cfg.owning_layers:
            state[l] = {"pool": g.input(io.KV_POOL.at(l), I32, ["R", pool_words(*self.ranks[l], self.pool_rows)]),
                        "keys": g.input(io.INDEX_KEYS.at(l), self.pool_key_type,
                                        ["R", self.n_max, self.keys.plugin_width])}
        self.row_cache = {}
        for i in range(cfg.num_hidden_layers):
            c = row_cache_capacity(cfg, i, self.n_max, self.row_cache_factor)
            self.row_cache[i] = (g.input(io.ROW_CACHE.at(i), F32, ["R", c, cfg.kv_dim]),
                                 g.input(io.ROW_CACHE_TAGS.at(i), I32, ["R", ROW_CACHE_TAGS, c]))
        # GsmSideSplit makes the call's key in the type the op takes (FP16, or INT8 codes): it reads only that
        dt = np.int8 if self.keys.bits == 8 else np.float16
        self._keys_like = g.const(np.zeros((1, 1, cfg.gsm.indexer_dim), dt), dt, "keys_like")
        return state

    def declare_cache_outputs(self) -> None:
        for l in self.cfg.owning_layers:  # per-layer probes; the runtime binds them when asked
            self.g.output(io.SELECTED.at(l), *self.selected_type(l))
            self.g.output(io.LAYER_MASS.at(l), F32, self.mass_shape())

    def side_split(self, l: int, y: str, scale: str, widths: list[int], batch_shape: str) -> list[str]:
        """Owning layer l's in_proj output y [B*S, sum(widths)] as [B, S, w] blocks (batch_shape: [B, S] int64):
        the latents and the key as kv_update would make them (named as its outputs), the indexer's query and
        weights scaled."""
        g = self.g
        self._side.add(l)
        outs = [io.NEW_LATENT_K.at(l), io.NEW_LATENT_V.at(l), io.NEW_INDEX_KEYS.at(l), f"L{l}.index_q", f"L{l}.index_w"]
        with g.in_scope(f"L{l}.GsmKVCacheUpdate"):
            return g.op(SIDE_OP, [y, scale, batch_shape, self._keys_like], n_out=len(outs), outputs=outs,
                        domain=CPU_DOMAIN, widths=[int(w) for w in widths])

    def kv_update(self, l: int, cache: dict[str, str], ck: str, cv: str, key: str, past: str,
                  new: str) -> dict[str, str]:
        # GsmPoolAttention writes the call's rows into the pool, in the cache's form: side_split's, or the standard
        # ops' (a float GSM side)
        if l not in self._side:
            return {**cache, **{k: v for k, v in super().kv_update(l, cache, ck, cv, key, past, new).items()
                                if k.startswith("new_")}}
        return {**cache, "new_k": ck, "new_v": cv, "new_keys": key}

    def group_offset(self, x: str, main: str, offsets: str, block: int, out: str, residual: str | None,
                     swiglu: bool = False, norm: tuple[str, float, str] | None = None) -> str:
        """out = main + group sums of x [M, K] (`block` inputs each) @ offsets [ceil(K / block), N] (+ residual);
        with swiglu, silu(first half) * second half of that sum ([M, N / 2]: gate and up as one projection). norm
        (weight, epsilon, output name): also that output's RMSNorm, out / sqrt(mean(out^2) + eps) * weight, as the
        node's second output (the norm node that would read `out` next, folded in)."""
        return self._epilogue_node(OFFSET_OP, [x, main, offsets], out, residual, swiglu, norm, block_size=block)

    def quant_matmul(self, x: str, prefix: str, lay, out: str, residual: str | None, swiglu: bool = False,
                     norm: tuple[str, float, str] | None = None) -> str:
        """out = x [M, K] @ W^T over the tiles `<prefix>.qt.*` (qlinear.quant_tiles; lay: the QLayout), a float zero
        point's offset term included, INT8 activations as MatMulNBits accuracy_level 4 (+ residual); swiglu and norm
        as group_offset's."""
        ins = [x, f"{prefix}.qt.codes", f"{prefix}.qt.scales", f"{prefix}.qt.offsets" if lay.offsets else ""]
        return self._epilogue_node(QUANT_OP, ins, out, residual, swiglu, norm, K=lay.k, N=lay.n, bits=lay.bits,
                                   block_size=lay.block)

    def tile_gather(self, ids: str, prefix: str, lay, out: str) -> str:
        """Rows `ids` of the weight stored as the tiles `<prefix>.qt.*` (an embedding tied to the LM head), [M, K]
        float32, dequantised as the portable graph's GatherBlockQuantized (+ offsets) gives them: the process holds
        the head's tiles only, not also the codes' plain copy (SmolLM2 at 8K: 13 MiB of weights.bin pages)."""
        ins = [ids, f"{prefix}.qt.codes", f"{prefix}.qt.scales", f"{prefix}.qt.offsets" if lay.offsets else ""]
        return self.g.op(GATHER_OP, ins if lay.offsets else ins[:3], outputs=[out], domain=CPU_DOMAIN, K=lay.k,
                         N=lay.n, bits=lay.bits, block_size=lay.block)

    def _epilogue_node(self, op: str, ins: list[str], out: str, residual: str | None, swiglu: bool,
                       norm: tuple[str, float, str] | None, **attrs: Any) -> str:
        """One `op` node over `ins` followed by the epilogue inputs both ops take (residual, then norm_weight; absent
        ones left out or empty): output `out`, and with norm (weight, epsilon, output name) its RMSNorm as a second
        output."""
        attrs |= {"swiglu": 1} if swiglu else {}  # absent: the plain sum, as graphs before it
        ins = ins + ([residual] if residual else [])
        if norm is None:
            return self.g.op(op, ins, outputs=[out], domain=CPU_DOMAIN, **attrs)
        weight, eps, normed = norm
        ins = ins + ([] if residual else [""]) + [weight]
        self.g.op(op, ins, n_out=2, outputs=[out, normed], domain=CPU_DOMAIN, norm_epsilon=float(eps), **attrs)
        return out

    def attention(self, a: AttentionCall) -> tuple[str, str | None, str | None]:
        g, cfg, p = self.g, self.cfg, self.cfg.gsm
        l, cache, up, rope = a.layer, a.cache, a.up, a.rope
        heads = {"num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
                 "head_dim": cfg.head_dim}
        row_cache, tags = self.row_cache[l]
        if not a.owning:  # sharing: the source's selection over the source's pool, as the source left it
            ins = [a.q, cache["pool"], self.slots, g.weight(a.quant), row_cache, tags, up[0], up[1], rope[0], rope[1],
                   a.selected, self.rows, a.past, a.new]
            with g.in_scope(f"L{l}.GsmSparseAttention"):
                out = g.op(SHARED_OP, ins, outputs=[f"L{l}.attn_out"], domain=CPU_DOMAIN, **heads,
                           rank_k=self.ranks[a.owner][0], **self._pool_attrs())
            return out, None, None
        assert a.index_q is not None and a.index_w is not None and a.sparse_window is not None and a.top_k is not None
        ins = [a.q, a.index_q, a.index_w, cache["new_k"], cache["new_v"], cache["new_keys"], cache["pool"],
               cache["keys"], self.slots, g.weight(a.quant), row_cache, tags, up[0], up[1], rope[0], rope[1], self.rows,
               a.past, a.new, a.sparse_window, a.top_k, self.logit_rows,
               self._keep_selection if l in self._sources else self.selections]
        # output 3 (row_cache_misses, tests) left out; 4: the attention mass of each logit row's query
        outs = [f"L{l}.attn_out", io.SELECTED.at(l), io.LAYER_MASS.at(l), "", f"{io.QUERY_MASS.name}.{l}"]
        d = p.selection_of(l).sparse_top_k_divisor
        grows = {"sparse_top_k_divisor": d} if d else {}
        with g.in_scope(f"L{l}.GsmSparseAttention"):
            out, sel, mass, _, qmass = g.op(CPU_OP, ins, n_out=len(outs), outputs=outs, domain=CPU_DOMAIN, **heads,
                                            index_heads=p.indexer_heads, index_dim=p.indexer_dim,
                                            sink_tokens=p.sink_tokens, **grows, **self._pool_attrs())
        self.query_masses.append(qmass)
        return out, sel, mass


def cpu_weight_table(model: onnx.ModelProto) -> CpuWeightTable:
    """The weights.bin spans of the main graph's initializers that nodes of our domain read (any graph level), in
    file order (bundle_format.CpuWeightTable)."""
    read: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.domain == CPU_DOMAIN:
                read.update(node.input)
            for a in node.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    walk(sub)

    walk(model.graph)
    spans = []
    for t in model.graph.initializer:
        if t.name in read and t.data_location == onnx.TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
            spans.append(WeightSpan(t.name, int(ext.get("offset", 0)), int(ext["length"]), dtype.name, tuple(t.dims)))
    return CpuWeightTable(tuple(sorted(spans, key=lambda w: w.offset)))
