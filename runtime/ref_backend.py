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

from gsm.bundle_format import FILES, BundleConfig
from runtime.backend import Capabilities, RowPool, StepOutput, check_max_top_k, kv_noise_sums, relative_noise
from runtime.slots import SlotTable


def reference_usable() -> tuple[bool, str]:
    try:
        import onnx.reference  # noqa: F401
        from gsm_edge_plugins import reference_available
    except ImportError as e:
        return False, f"needs onnx and gsm_edge_plugins ({e})"
    if not reference_available():
        return False, "the plugins' CPU reference library is not built (pip install plugins/)"
    return True, ""


def _ops() -> list[type]:
    """OpRun classes for the three GSM node types, executing the C++ reference."""
    from gsm_edge_plugins import ref
    from onnx import helper
    from onnx.reference.op_run import OpRun

    def dims(node: Any) -> tuple[Any, dict[str, Any]]:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        if "top_k" in a:  # the attribute's name before engine_io revision 4
            a.setdefault("max_top_k", a.pop("top_k"))
        names = {f for f in ref.Dims.__dataclass_fields__}
        d = ref.Dims(**{k: int(v) for k, v in a.items() if k in names and not isinstance(v, bytes)},
                     **{k: 0 for k in ("num_heads", "num_kv_heads", "head_dim") if k not in a})
        return d, a

    class GsmKVCacheUpdate(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, ck, cv, key, pool, keys, slots, past, new, **_: Any):  # type: ignore[override]
            d, _a = dims(self.onnx_node)
            pool, keys = pool.copy(), keys.copy()
            ref.kv_update(d, ck.astype(np.float32), cv.astype(np.float32), key.astype(np.float32), pool, keys,
                          slots, past, new)
            return pool, keys

    class GsmSparseAttention(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, *x, **_: Any):  # type: ignore[override]
            d, a = dims(self.onnx_node)
            q, pool, slots, past, new, quant, cos, sin, w0, w1 = x[:10]
            f32 = np.float32
            if int(a["layer_kind"]) == 0:
                # input 14 sparse_top_k [B] since engine_io rev 4; an older node selects max_top_k for all
                r = ref.sparse_attention(d, q.astype(f32), pool, slots, past, new, quant, cos, sin, w0, w1,
                                         index_q=x[10].astype(f32), index_w=x[11].astype(f32), index_keys=x[12],
                                         sparse_window=int(x[13][0]), sparse_top_k=x[14] if len(x) > 14 else None)
                return r.out.astype(q.dtype), r.selected, r.mass
            r = ref.sparse_attention(d, q.astype(f32), pool, slots, past, new, quant, cos, sin, w0, w1,
                                     selected=x[10])
            return (r.out.astype(q.dtype),)

    class GsmKVDemote(OpRun):
        op_domain = "gsm.plugins"

        def _run(self, entries, quant, pool, **_: Any):  # type: ignore[override]
            d, _a = dims(self.onnx_node)
            return (ref.kv_demote(d, entries, pool.copy(), quant),)

    return [GsmKVCacheUpdate, GsmSparseAttention, GsmKVDemote]


class RefBackend:
    """Same interface as OrtBackend; a cache is one sequence's engine state (pools, index keys, slot table)."""

    name = "reference"

    def __init__(self, bundle: Path, cfg: BundleConfig) -> None:
        ok, why = reference_usable()
        if not ok:
            raise RuntimeError(f"backend 'reference' unavailable: {why}")
        import onnx
        from onnx.reference import ReferenceEvaluator

        ops = _ops()
        self.model = ReferenceEvaluator(onnx.load(str(bundle / FILES.model_trt)), new_ops=ops)
        self.demote_model = ReferenceEvaluator(onnx.load(str(bundle / FILES.demote_trt)), new_ops=ops)
        self.cfg = cfg
        self.layers = list(cfg.owning_layers)
        self.n_max = cfg.n_max
        self.rows = cfg.pool_rows.by_tier
        proto = onnx.load(str(bundle / FILES.model_trt), load_external_data=False)
        self.shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}
        # revision 4: the owning attention nodes read sparse_top_k, each budget up to their attribute max_top_k;
        # an older graph selects with its build-time attribute top_k only (Runtime refuses other budgets)
        self.per_sequence_top_k = cfg.graph_revision >= 4
        attrs = next(a for a in ({x.name: x.i for x in n.attribute} for n in proto.graph.node
                                 if n.op_type == "GsmSparseAttention") if a["layer_kind"] == 0)
        self.max_top_k = int(attrs["max_top_k" if self.per_sequence_top_k else "top_k"])
        from onnx import numpy_helper

        tables = {i.name: i for i in self.demote_model.proto_.graph.initializer}
        self.quant = {l: numpy_helper.to_array(tables[f"gsm.layers.{l}.quant"]) for l in self.layers}
        # each cache holds its own pools, but no more of them live at once than the plan's max_batch rows
        self.pool = RowPool(cfg.max_batch, self.name)
        row_bytes = sum(4 * self.shapes[f"kv_pool.{l}"][1] + self.n_max * cfg.index_dim * 2 for l in self.layers)
        # forward(commit=False) leaves pools and slot tables as they were: probes possible
        self.capabilities = Capabilities(
            max_resident=cfg.max_batch, max_per_call=cfg.max_batch, positions=self.n_max,
            kv_bytes_per_sequence=row_bytes + 4 * self.n_max, per_sequence_top_k=self.per_sequence_top_k,
            hit_rate_probes=True, kv_noise=True)

    def new_cache(self) -> dict[str, Any]:
        """One sequence: its slot table, its kv_pool.{l} [1, P32] and index_keys.{l} [1, N_max, dI]."""
        cache: dict[str, Any] = {"row": self.pool.take(), "slots": SlotTable(self.n_max, self.rows)}
        for l in self.layers:
            cache[f"kv_pool.{l}"] = np.zeros((1, self.shapes[f"kv_pool.{l}"][1]), np.int32)
            cache[f"index_keys.{l}"] = np.zeros((1, self.n_max, self.cfg.index_dim), np.float16)
        return cache

    def release(self, cache: dict[str, Any]) -> None:
        row = cache.pop("row", None)
        if row is not None:
            self.pool.give(row)

    def close(self) -> None:
        """Nothing outside Python's memory."""

    def forward(self, caches: list[dict[str, Any]], ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                sparse_window: int, top_k: np.ndarray, *, probes: bool = False, commit: bool = True) -> StepOutput:
        """Batch entry b is caches[b]: pools and slot tables are stacked into [B, ...] for the call. With
        commit False (a shadow step) the pools and slot tables are left as they were (a compaction the
        call needed stays done: it moves rows without changing any value). top_k: each sequence's budget,
        at most the nodes' max_top_k (RequestError otherwise, before anything changes)."""
        check_max_top_k(top_k, self.max_top_k, self.name)
        saved = []
        for c, p0, n in zip(caches, past, new):
            slots: SlotTable = c["slots"]
            moves = slots.compaction(int(n))
            if moves:
                self._run_demote(c, moves)
            saved.append((slots.entries.copy(), [list(f) for f in slots.free]))
            slots.allocate(range(int(p0), int(p0) + int(n)))
        feeds = {k: np.concatenate([c[k] for c in caches]) for k in caches[0] if k not in ("slots", "row")}
        feeds.update(input_ids=ids.astype(np.int64), past_lengths=past.astype(np.int32),
                     new_lengths=new.astype(np.int32), sparse_window=np.array([sparse_window], np.int32),
                     kv_slots=np.stack([c["slots"].entries for c in caches]))
        if self.per_sequence_top_k:
            feeds["sparse_top_k"] = np.asarray(top_k, np.int32).reshape(len(caches))
        names = [o.name for o in self.model.proto_.graph.output]
        outs = dict(zip(names, self.model.run(None, feeds)))
        for b, c in enumerate(caches):
            if commit:
                for l in self.layers:
                    c[f"kv_pool.{l}"] = outs[f"kv_pool_out.{l}"][b:b + 1]
                    c[f"index_keys.{l}"] = outs[f"index_keys_out.{l}"][b:b + 1]
            else:
                c["slots"].entries[:], c["slots"].free = saved[b]
        sel = mass = None
        if probes or self.cfg.debug_outputs:
            sel = {l: outs[f"selected.{l}"] for l in self.layers if f"selected.{l}" in outs} or None
        if probes:
            mass = {l: outs[f"attn_mass.{l}"] for l in self.layers}
        return StepOutput(outs["logits"], outs["attn_mass"], sel, mass)

    def demote(self, cache: dict[str, Any], new_tier: np.ndarray) -> float | None:
        """new_tier: int32 by position (-1 = unchanged). Returns the pass's relative KV noise over the
        re-encoded rows (all owning layers, K and V; read back dequantised), None when none changed."""
        where = np.nonzero(np.asarray(new_tier) >= 0)[0]
        before = {l: self.latents(cache, l) for l in self.layers} if where.size else {}
        moves = cache["slots"].demote(np.asarray(new_tier))
        if moves:
            self._run_demote(cache, moves)
        if not where.size:
            return None
        sums = []
        for l in self.layers:
            for old, now in zip(before[l], self.latents(cache, l)):
                sums.append(kv_noise_sums(old[0, where], now[0, where]))
        return relative_noise(sums)

    def _run_demote(self, cache: dict[str, Any], moves: list[tuple[int, int]]) -> None:
        feeds: dict[str, np.ndarray] = {"demote_list": np.array([(0, o, n) for o, n in moves], np.int32)}
        for l in self.layers:
            feeds[f"kv_pool.{l}"] = cache[f"kv_pool.{l}"]
        names = [o.name for o in self.demote_model.proto_.graph.output]
        for name, arr in zip(names, self.demote_model.run(None, feeds)):
            cache[name.replace("_out.", ".")] = arr

    def latents(self, cache: dict[str, Any], layer: int,
                quant: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Dequantised latents of one layer by position [1, N_max, r] (NaN where no row), through the
        reference reader; quant: the layer's [3, r] table (default: the bundle's)."""
        from gsm_edge_plugins import ref

        rk, rv = self.cfg.ranks[layer]
        d = ref.Dims(num_heads=0, num_kv_heads=0, head_dim=0, rank_k=rk, rank_v=rv, n_max=self.n_max,
                     rows_fp16=self.rows[0], rows_int12=self.rows[1], rows_int8=self.rows[2],
                     index_dim=self.cfg.index_dim)
        if quant is None:
            quant = self.quant[layer]
        return ref.read_latents(d, cache[f"kv_pool.{layer}"], cache["slots"].entries[None], quant)
