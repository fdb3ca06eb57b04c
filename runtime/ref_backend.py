"""CPU reference of the TensorRT path: model.onnx (GSM plugin nodes, FP16 activations) run by ONNX's
reference evaluator, each GSM node executed by the plugins' C++ CPU reference (gsm_edge_plugins.ref).

Why: the engine path (plugin-node graph, int32 byte pools, slot tables, demotion lists) can then be
checked on any machine, against the portable bundle and the golden model, before a Jetson or a GPU
is at hand. It is slow (NumPy op by op) and meant for tests and debugging: `backend="reference"`.
Needs the `onnx` package and the built plugin reference library; never torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gsm import graph_io as io
from gsm.bundle_format import FILES, VERIFY_ROWS, BundleConfig
from gsm.quant_table import full_table
from runtime.backend import Capabilities, StepOutput, check_max_top_k, step_feeds
from runtime.host_memory import cache_zeros
from runtime.plugin_cache import (
    PluginCache,
    PluginRows,
    PrefixRows,
    put_prefix,
    quant_tables,
    read_latents,
    take_prefix,
)
from runtime.ref_standard_ops import ProductRows, standard_ops

# What a verified row adds to a call, in one-token steps. Measured roughly (min of 11 calls, commit=False, on this
# 2-core machine while other work ran on it) on the synthetic tiny and small bundles, 256 and 1,024 positions: a call
# of n = 2 / 4 / 8 tokens added 0.03-0.34 of a step per row at batch 1 (the evaluator's per-operator cost is most of a
# step) and 0.12-0.26 of a batched step at batch 8. Each verified row's products are one more gemv each
# (runtime/ref_standard_ops.py), so on a model whose products dominate a step a row costs more; 0.35 is above every
# measurement, so drafting still pays where drafts are mostly kept and stops where they are not.
VERIFY_ROW_COST = VERIFY_ROW_COST_BATCH = 0.35


def reference_usable() -> tuple[bool, str]:
    try:
        import onnx.reference  # noqa: F401
        from gsm_edge_plugins import reference_available
    except ImportError as e:
        return False, f"needs onnx and gsm_edge_plugins ({e})"
    if not reference_available():
        return False, "the plugins' CPU reference library is not built (pip install plugins/)"
    return True, ""


def _ops(rows: ProductRows) -> list[type]:
    """OpRun classes for the three GSM node types, executing the C++ reference, and the standard operators this
    backend evaluates its own way (runtime.ref_standard_ops; their products as `rows` says)."""
    from gsm_edge_plugins import ref
    from onnx import helper
    from onnx.reference.op_run import OpRun

    def dims(node: Any) -> tuple[Any, dict[str, Any]]:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        names = {f for f in ref.Dims.__dataclass_fields__}
        d = ref.Dims(**{k: int(v) for k, v in a.items() if k in names and not isinstance(v, bytes)},
                     **{k: 0 for k in ("num_heads", "num_kv_heads", "head_dim") if k not in a})
        return d, a

    class GsmKVCacheUpdate(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, *x, **_: Any):  # type: ignore[override]
            # in place, as the TensorRT plugin writes its aliased pools: the evaluator hands over the backend's
            # own buffers (a call writes only its sequences' new rows)
            ck, cv, key, pool, keys, slots, past, new = x[:8]
            rows = x[8] if len(x) > 8 else None  # input 8 cache_rows, optional
            d, _a = dims(self.onnx_node)
            ref.kv_update(d, ck.astype(np.float32), cv.astype(np.float32), key.astype(np.float32), pool, keys,
                          slots, past, new, cache_rows=rows)
            return pool, keys

    class GsmSparseAttention(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, *x, **_: Any):  # type: ignore[override]
            d, a = dims(self.onnx_node)
            q, pool, slots, past, new, quant, cos, sin, w0, w1 = x[:10]
            quant = full_table(quant)
            f32 = np.float32
            if int(a["layer_kind"]) == 0:
                # input 14 sparse_top_k [B], input 15 cache_rows [B], input 16 logit_rows [B, J]
                r = ref.sparse_attention(d, q.astype(f32), pool, slots, past, new, quant, cos, sin, w0, w1,
                                         index_q=x[10].astype(f32), index_w=x[11].astype(f32), index_keys=x[12],
                                         sparse_window=int(x[13][0]), sparse_top_k=x[14],
                                         cache_rows=x[15], logit_rows=x[16])
                return r.out.astype(q.dtype), r.selected, r.mass, r.query_mass
            r = ref.sparse_attention(d, q.astype(f32), pool, slots, past, new, quant, cos, sin, w0, w1,
                                     selected=x[10], cache_rows=x[11])
            return (r.out.astype(q.dtype),)

    class GsmKVDemote(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, entries, quant, pool, **_: Any):  # type: ignore[override]
            d, _a = dims(self.onnx_node)
            return (ref.kv_demote(d, entries, pool, full_table(quant)),)  # in place, entries name their pool rows

    return [GsmKVCacheUpdate, GsmSparseAttention, GsmKVDemote, *standard_ops(rows)]


class RefBackend:
    """runtime.backend.Backend over the plugin graph, with the TensorRT backend's memory model
    (runtime.plugin_cache): pools of the plan's rows allocated once, updated in place by the graphs."""

    name = "reference"

    def __init__(self, bundle: Path, cfg: BundleConfig) -> None:
        ok, why = reference_usable()
        if not ok:
            raise RuntimeError(f"backend 'reference' unavailable: {why}")
        import onnx
        from onnx.reference import ReferenceEvaluator

        self.products = ProductRows()
        ops = _ops(self.products)
        self.model = ReferenceEvaluator(onnx.load(str(bundle / FILES.model_trt)), new_ops=ops)
        self.demote_model = ReferenceEvaluator(onnx.load(str(bundle / FILES.demote_trt)), new_ops=ops)
        self.cfg = cfg
        self.layers = list(cfg.owning_layers)
        self.n_max = cfg.n_max
        proto = self.model.proto_
        widths = {v.name: v.type.tensor_type.shape.dim[1].dim_value for v in proto.graph.input
                  if v.name.startswith(io.KV_POOL.prefix)}
        # the owning attention nodes read sparse_top_k, each budget up to their attribute max_top_k
        attrs = next(a for a in ({x.name: x.i for x in n.attribute} for n in proto.graph.node
                                 if n.op_type == "GsmSparseAttention") if a["layer_kind"] == 0)
        self.max_top_k = int(attrs["max_top_k"])
        self.quant = quant_tables(self.demote_model.proto_)
        self.plugin_rows = PluginRows(cfg, self.name)
        R = self.plugin_rows.rows
        self.buffers: dict[str, np.ndarray] = {}
        for l in self.layers:
            self.buffers[io.KV_POOL.at(l)] = cache_zeros((R, widths[io.KV_POOL.at(l)]), np.int32)
            keys = cfg.index_keys  # FP16, or INT8 codes four to an int32 word
            self.buffers[io.INDEX_KEYS.at(l)] = cache_zeros((R, self.n_max, keys.plugin_width),
                                                           np.float16 if keys.bits == 16 else np.int32)
        row_bytes = sum(b[0].nbytes for b in self.buffers.values()) + 4 * self.n_max  # + the slot table
        self.out_names = [o.name for o in proto.graph.output]
        # a shadow call (forward commit=False) writes only beyond each sequence's length: probes possible;
        # demote() reads the re-encoded latents back for the KV noise; each query of a call is computed alone
        # (GsmSparseAttention's reference, runtime.ref_standard_ops' products) and the graph returns each logit
        # row's query_mass, so a call verifies drafts
        self.capabilities = Capabilities(
            max_resident=R, max_per_call=R, positions=self.n_max, kv_bytes_per_sequence=row_bytes,
            hit_rate_probes=True, kv_noise=True, prefix_reuse=True, max_top_k=self.max_top_k,
            verify_rows=min(VERIFY_ROWS, cfg.max_input),
            verify_row_cost=VERIFY_ROW_COST, verify_row_cost_batch=VERIFY_ROW_COST_BATCH)

    def new_cache(self) -> PluginCache:
        return self.plugin_rows.new_cache()

    def release(self, cache: PluginCache) -> None:
        self.plugin_rows.release(cache)

    def close(self) -> None:
        """Nothing outside Python's memory."""

    def forward(self, caches: list[PluginCache], ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                sparse_window: int, top_k: np.ndarray, *, probes: bool = False, commit: bool = True,
                rows: np.ndarray | None = None) -> StepOutput:
        """One call of the plugin graph over the call's sequences, each in its own row of the pools (updated in
        place). commit False (a shadow step): the slot tables are put back afterwards, so the rows the call
        wrote are free again (runtime.plugin_cache). top_k: each sequence's budget, at most the nodes'
        max_top_k (RequestError otherwise, before anything changes)."""
        check_max_top_k(top_k, self.max_top_k, self.name)
        plan = self.plugin_rows.plan_call(caches, past, new)
        if plan.compaction.size:
            self._run_demote(plan.compaction)
        feeds = {**self.buffers, **step_feeds(ids, past, new, sparse_window, top_k, plan.cache_rows, rows,
                                              plan.kv_slots)}
        self.products.exact = ids.shape[1] <= VERIFY_ROWS  # a decode step or a verification: rows computed alike
        outs = dict(zip(self.out_names, self.model.run(None, feeds)))
        if not commit:
            self.plugin_rows.undo(caches, plan)
        sel = mass = None
        if probes or self.cfg.debug_outputs:
            sel = {l: outs[io.SELECTED.at(l)] for l in self.layers if io.SELECTED.at(l) in outs} or None
        if probes:
            mass = {l: outs[io.LAYER_MASS.at(l)] for l in self.layers}
        query_mass = outs.get(io.QUERY_MASS.name) if rows is not None else None
        return StepOutput(outs[io.LOGITS.name], outs[io.ATTN_MASS.name], sel, mass, query_mass)

    def take_prefix(self, cache: PluginCache, length: int) -> PrefixRows:
        return take_prefix(self.cfg, self.buffers, cache, length)

    def put_prefix(self, cache: PluginCache, prefix: PrefixRows) -> None:
        put_prefix(self.buffers, cache, prefix)

    def truncate(self, cache: PluginCache, length: int) -> None:
        cache.slots.truncate(length)

    def demote(self, cache: PluginCache, new_tier: np.ndarray) -> float | None:
        """new_tier: int32 by position (-1 = unchanged). Returns the pass's relative KV noise over the
        re-encoded rows (all owning layers, K and V; read back dequantised), None when none changed."""
        return self.plugin_rows.demote(cache, new_tier, self._run_demote, self._all_latents)

    def _run_demote(self, demote_list: np.ndarray) -> None:
        self.demote_model.run(None, {io.DEMOTE_LIST.name: demote_list, **{k: v for k, v in self.buffers.items()
                                                                    if k.startswith(io.KV_POOL.prefix)}})

    def _all_latents(self, cache: PluginCache) -> list[np.ndarray]:
        return [a for l in self.layers for a in self.latents(cache, l)]

    def latents(self, cache: PluginCache, layer: int,
                quant: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Dequantised latents of one layer by position [N_max, r] (NaN where no row), through the reference
        reader; quant: the layer's [5, r] table (default: the bundle's)."""
        return read_latents(self.cfg, layer, self.buffers[io.KV_POOL.at(layer)][cache.row], cache.slots.entries,
                            self.quant[layer] if quant is None else quant)
