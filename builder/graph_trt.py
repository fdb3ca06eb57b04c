"""GSM operations as custom-domain nodes for the TensorRT plugins (docs/engine_io.md sections 2-4).

The TensorRT ONNX parser turns a node it has no importer for into a plugin layer, looking the
creator up by `op_type`, the `plugin_version` and `plugin_namespace` attributes; every other
attribute becomes a plugin field. Each node here is emitted in the scope `L{l}.<op_type>` so the
structural test can pair it with the portable subgraph of the same scope.
"""

from __future__ import annotations

from typing import Any

from builder.nodes import F16, F32, I32, AttentionCall, key_codes
from builder.onnx_util import GraphBuilder
from builder.plan import PoolRows, pool_words
from gsm import graph_io as io
from gsm.bundle_format import IndexKeyLayout
from gsm.config import ModelConfig

DOMAIN = "gsm.plugins"
PLUGIN_VERSION = "3"
PLUGIN_NAMESPACE = "gsm"
PLUGINS = ("GsmKVCacheUpdate", "GsmSparseAttention", "GsmKVDemote")


class PluginOps:
    """GSM nodes for TensorRT; the cache is the engine_io byte pools (int32 words) + slot table.

    The pools and indexer keys hold every cache row of the memory plan ([R, ...], R = max_batch, bound whole
    and updated in place); `cache_rows` [B] names the row of each sequence in the call, so
    a call carries any subset of the resident sequences.

    max_top_k: the largest per-sequence budget (`sparse_top_k` input) the attention nodes honour; it
    fixes K_sel = sinks + max_sparse_window + max_top_k (the `selected` width, the CUDA workspace).
    Default N_max: every run-time budget 0..max-seq works, the dense fallback included
    (docs/engine_io.md section 4.2, "max_top_k" for the memory it costs)."""

    variant = "trt"
    fused_offsets = False  # CpuOps: a float zero point's offset term as one custom node
    fused_quant = False  # CpuOps: a quantised projection with stored tiles as one custom node
    fused_side = False  # CpuOps: an owning layer's GSM-side scale, split and cache rounding as one custom node
    flat_q = False  # CpuOps: an owning layer's q enters and attn_out leaves the attention as [B*S, q_dim]
    half_up = False  # CpuOps: U_k / U_v as float16 when they lie on the FP16 grid

    def __init__(self, g: GraphBuilder, cfg: ModelConfig, ranks: dict[int, tuple[int, int]], n_max: int,
                 rows: PoolRows, max_top_k: int | None = None, *, int8_keys: bool = False) -> None:
        self.g, self.cfg, self.ranks, self.n_max, self.rows = g, cfg, ranks, n_max, rows
        # INT8 keys: codes four to an int32 word (`index_key_bits` 8 on the update and owning attention nodes)
        self.keys = IndexKeyLayout(cfg.gsm.indexer_dim, 8 if int8_keys else 16)
        self.key_type = F16 if self.keys.bits == 16 else I32
        self.max_top_k = n_max if max_top_k is None else max_top_k
        self.logit_rows = ""  # Network.build sets the graph input
        self.query_masses: list[str] = []  # each owning GsmSparseAttention's mass of each logit row's query
        low = cfg.gsm.max_top_k_to(n_max)
        if not low <= self.max_top_k <= n_max:  # every layer's default budget must fit, at its last position too
            raise ValueError(f"max_top_k must be in [the layers' largest top-k within max-seq {low}, "
                             f"max-seq {n_max}], got {self.max_top_k}")

    def _attrs(self, **kw: Any) -> dict[str, Any]:
        return {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE, "n_max": self.n_max,
                "rows_fp16": self.rows.fp16, "rows_int12": self.rows.int12, "rows_int8": self.rows.int8,
                "rows_int4": self.rows.int4, **kw}

    def _key_attrs(self) -> dict[str, Any]:
        """`index_key_bits` only when 8: a node without it means FP16 keys."""
        return {} if self.keys.bits == 16 else {"index_key_bits": 8}

    def selected_type(self, l: int) -> tuple[int, list[Any]]:
        return I32, ["B", "S", self.cfg.gsm.k_sel(l, self.max_top_k)]

    def mass_shape(self) -> list[Any]:
        return ["B", self.n_max]

    # -- I/O ---------------------------------------------------------------------------------------
    def declare_cache(self) -> dict[int, dict[str, str]]:
        g = self.g
        self.slots = g.input(io.KV_SLOTS.name, I32, ["B", self.n_max])
        self.top_k = g.input(io.SPARSE_TOP_K.name, I32, ["B"])  # per-sequence selection budget
        self.cache_rows = g.input(io.CACHE_ROWS.name, I32, ["B"])  # each sequence's row of the pools
        state = {}
        for l in self.cfg.owning_layers:
            state[l] = {"pool": g.input(io.KV_POOL.at(l), I32, ["R", pool_words(*self.ranks[l], self.rows)]),
                        "keys": g.input(io.INDEX_KEYS.at(l), self.key_type, ["R", self.n_max, self.keys.plugin_width])}
        return state

    def declare_cache_outputs(self) -> None:
        g = self.g
        for l in self.cfg.owning_layers:
            g.output(io.KV_POOL_OUT.at(l), I32, ["R", pool_words(*self.ranks[l], self.rows)])
            g.output(io.INDEX_KEYS_OUT.at(l), self.key_type, ["R", self.n_max, self.keys.plugin_width])
        for l in self.cfg.owning_layers:  # per-layer probes; the runtime binds them when asked
            g.output(io.SELECTED.at(l), *self.selected_type(l))
            g.output(io.LAYER_MASS.at(l), F32, self.mass_shape())

    # -- nodes -------------------------------------------------------------------------------------
    def kv_update(self, l: int, cache: dict[str, str], ck: str, cv: str, key: str, past: str,
                  new: str) -> dict[str, str]:
        g = self.g
        rk, rv = self.ranks[l]
        with g.in_scope(f"L{l}.GsmKVCacheUpdate"):
            if self.keys.bits == 8:  # the node stores the codes the standard ops make (integers in float32)
                key = key_codes(g, key)
            pool, keys = g.op("GsmKVCacheUpdate", [ck, cv, key, cache["pool"], cache["keys"], self.slots, past, new,
                                                   self.cache_rows],
                              outputs=[io.KV_POOL_OUT.at(l), io.INDEX_KEYS_OUT.at(l)], domain=DOMAIN,
                              **self._attrs(rank_k=rk, rank_v=rv, index_dim=self.cfg.gsm.indexer_dim),
                              **self._key_attrs())
        return {"pool": pool, "keys": keys}

    def attention(self, a: AttentionCall) -> tuple[str, str | None, str | None]:
        g, cfg, p = self.g, self.cfg, self.cfg.gsm
        l, owning = a.layer, a.owning
        rk, rv = self.ranks[a.owner]
        g.weight(a.quant)
        attrs = self._attrs(layer_kind=0 if owning else 1, num_heads=cfg.num_attention_heads,
                            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rank_k=rk, rank_v=rv,
                            sink_tokens=p.sink_tokens, max_top_k=self.max_top_k,
                            max_sparse_window=p.layer_max_window(a.owner))
        ins = [a.q, a.cache["pool"], self.slots, a.past, a.new, a.quant, a.rope[0], a.rope[1], a.up[0], a.up[1]]
        if owning:
            attrs.update(index_heads=p.indexer_heads, index_dim=p.indexer_dim, **self._key_attrs())
            divisor = p.selection_of(l).sparse_top_k_divisor
            if divisor:  # absent: a fixed top-k, as graphs before it
                attrs["sparse_top_k_divisor"] = divisor
            # logit_rows: the rows whose queries' own mass (output 3) a verification keeps, one hotness update each
            ins += [a.index_q, a.index_w, a.cache["keys"], a.sparse_window, a.top_k, self.cache_rows, self.logit_rows]
            outs = [f"L{l}.attn_out", io.SELECTED.at(l), io.LAYER_MASS.at(l), f"{io.QUERY_MASS.name}.{l}"]
        else:
            ins += [a.selected, self.cache_rows]
            outs = [f"L{l}.attn_out"]
        with g.in_scope(f"L{l}.GsmSparseAttention"):
            res = g.op("GsmSparseAttention", ins, outputs=outs, domain=DOMAIN, **attrs)
        if not owning:
            return res, None, None
        self.query_masses.append(res[3])
        return res[0], res[1], res[2]

    def demote(self, l: int, pool: str, demote_list: str, quant: str, out: str) -> str:
        g = self.g
        rk, rv = self.ranks[l]
        with g.in_scope(f"L{l}.GsmKVDemote"):
            return g.op("GsmKVDemote", [demote_list, g.weight(quant), pool], outputs=[out], domain=DOMAIN,
                        **self._attrs(rank_k=rk, rank_v=rv, index_dim=self.cfg.gsm.indexer_dim))
