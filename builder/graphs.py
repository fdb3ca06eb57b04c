"""Write the five graphs of a bundle over one streamed weight file.

- `model.portable.onnx`: the network in standard ops (fp32), ONNX Runtime runs it anywhere;
- `model.cpu.onnx`: the same network with each owning layer's attention as one ONNX Runtime CPU custom op
  (`GsmCachedAttention`, plugins/ortCpu; same inputs and outputs), the runtime's choice where the op's
  library is built;
- `model.onnx`: the same network with GSM plugin nodes and FP16 activations, for TensorRT;
- `gsm_demote.portable.onnx` / `gsm_demote.onnx`: the demotion graphs (engine_io 4.3 / section 5).
All five reference `weights.bin`; each checkpoint tensor is read, written and dropped once (a
quantised projection is written in both graphs' forms at its first read, builder/qlinear.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from builder.bundle import write_json
from builder.graph_cpu import CPU_DOMAIN, CPU_OP_VERSION, CpuOps, cpu_weight_table
from builder.graph_portable import PortableOps, rope_at
from builder.graph_trt import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, PLUGINS, PluginOps
from builder.network import ROPE_COS, ROPE_SIN, NetSpec, Network, TensorSource, quant_name
from builder.nodes import F16, F32, I32
from builder.onnx_util import OPSET, OPSET_INT4, GraphBuilder, WeightStore, save_model
from builder.plan import ROW_CACHE_TOP_K_FACTOR, PoolRows
from builder.qlinear import BundleWeights, ProjectionStore
from gsm import graph_io as io
from gsm import names
from gsm.bundle_format import FILES


@dataclass(frozen=True)
class GraphsInfo:
    opset: int  # of model.onnx (the TensorRT graph): 21 with quantised weights, else 17
    plugins: dict[str, str]  # op_type -> plugin_version
    plugin_namespace: str
    plugin_domain: str
    files: list[str]
    largest_tensor_bytes: int  # largest array the build held at once (a chunk of a streamed tensor, or a
    # quantised projection's uint8 codes)
    weight_file_bytes: int
    portable_opset: int = OPSET


def write_graphs(out: Path, spec: NetSpec, source: TensorSource, quant: dict[int, np.ndarray],
                 rows: PoolRows, *, trt_precision: str = "fp16", weights: BundleWeights | None = None,
                 max_top_k: int | None = None, row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR,
                 progress: Callable[[str], None] = lambda s: None) -> GraphsInfo:
    """trt_precision: activation type of model.onnx; "fp16" for engines, "fp32" to compare the plugin
    path with the portable graph to float32 rounding (runtime backend "reference").
    weights: the quantisation of each tensor in spec.quantised, by name (None or no configs: none quantised), the
    AWQ scales of some of them and GPTQ in round-to-nearest's place for some of them (builder/qlinear.py
    ProjectionStore)."""
    if trt_precision not in ("fp16", "fp32"):
        raise ValueError(f"trt_precision must be fp16 or fp32, got {trt_precision!r}")
    weights = weights if weights is not None else BundleWeights()
    if set(spec.quantised) != set(weights.configs):
        raise ValueError("spec.quantised must name the tensors `weights` quantises")
    store = WeightStore(out / FILES.weights)
    cfg, ranks, n_max = spec.cfg, spec.ranks, spec.n_max
    projections = None if not weights.configs else ProjectionStore(
        store, weights.configs, trt_act_dtype="float16" if trt_precision == "fp16" else "float32",
        input_scales=dict(weights.input_scales), row_quantizers=weights.row_quantizers,
        tiles=spec.nbits_accuracy == 4)
    # any quantised TensorRT form at opset 21: blocked DQ needs it, and per-channel INT8 there too because
    # onnx's reference evaluator (our TensorRT-less check of model.onnx) implements DequantizeLinear from 19 on
    trt_opset = OPSET_INT4 if weights.configs else OPSET
    try:
        progress("portable graph + weights")
        g = GraphBuilder(store)
        # the portable graph always outputs selected.{l} / attn_mass.{l}: no debug copies
        Network(g, PortableOps(g, cfg, ranks, n_max, int8_keys=spec.int8_keys), replace(spec, debug=False), source,
                quant, F32,
                projections=projections).build()
        save_model(g.model("gsm_portable", doc="GSM network, standard ONNX ops, fp32 (docs/engine_io.md 5)"),
                   out / FILES.model_portable)
        progress("ONNX Runtime CPU graph")
        g = GraphBuilder(store)
        Network(g, CpuOps(g, cfg, ranks, n_max, rows, int8_keys=spec.int8_keys, row_cache_factor=row_cache_factor),
                replace(spec, debug=False), source,
                quant, F32,
                projections=projections).build()
        cpu_model = g.model("gsm_cpu", extra_opsets={CPU_DOMAIN: CPU_OP_VERSION},
                            doc="GSM network, standard ONNX ops + GsmPoolAttention over the plugins' pools (ONNX "
                                "Runtime CPU custom ops), fp32 (docs/engine_io.md 5.1)")
        save_model(cpu_model, out / FILES.model_cpu)
        write_json(out / FILES.cpu_weights, cpu_weight_table(cpu_model).to_json())
        progress("TensorRT graph")
        g = GraphBuilder(store, opset=trt_opset)
        trt_spec = replace(spec, debug=False)
        Network(g, PluginOps(g, cfg, ranks, n_max, rows, max_top_k=max_top_k, int8_keys=spec.int8_keys), trt_spec,
                source, quant,
                F16 if trt_precision == "fp16" else F32, projections=projections, form="tensorrt").build()
        doc = f"GSM network with GSM plugin nodes, {trt_precision} activations (docs/engine_io.md 2-4)"
        save_model(g.model("gsm_trt", extra_opsets={DOMAIN: 1}, doc=doc), out / FILES.model_trt)
        progress("demotion graphs")
        _demote_portable(GraphBuilder(store), spec, out / FILES.demote_portable)
        _demote_trt(GraphBuilder(store), spec, rows, out / FILES.demote_trt)
    finally:
        store.close()
    return GraphsInfo(opset=trt_opset, plugins=dict.fromkeys(PLUGINS, PLUGIN_VERSION),
                      plugin_namespace=PLUGIN_NAMESPACE, plugin_domain=DOMAIN,
                      files=[FILES.weights, FILES.model_trt, FILES.model_portable, FILES.model_cpu, FILES.cpu_weights,
                             FILES.demote_trt, FILES.demote_portable],
                      largest_tensor_bytes=store.peak_tensor_bytes,
                      weight_file_bytes=(out / FILES.weights).stat().st_size)


def _demote_portable(g: GraphBuilder, spec: NetSpec, path: Path) -> None:
    """Over the M rows a re-tier pass changes (gathered by the runtime), not the whole cache: the re-encoded
    latents, and the K rows of every layer that reads them, made from the re-encoded latents at
    the rows' `positions` [M] as the golden reconstructs them."""
    cfg, ranks, n = spec.cfg, spec.ranks, spec.n_max
    ops = PortableOps(g, cfg, ranks, n)
    tier = g.input(io.NEW_TIER.name, I32, ["M"])
    pos = g.input(io.POSITIONS.name, I32, ["M"])
    cos, sin = rope_at(g, (g.weight(ROPE_COS), g.weight(ROPE_SIN)), pos, cfg.head_dim)  # [M, 1, 2, D/2]
    out: dict[int, dict[str, str]] = {}
    for l in cfg.owning_layers:
        rk, rv = ranks[l]
        for kind, r, c0 in (("k", rk, 0), ("v", rv, rk)):
            lat = g.input(f"latent_{kind}.{l}", F32, ["M", r])
            out.setdefault(l, {})[kind] = ops.demote(l, lat, tier, g.weight(quant_name(l)), (c0, c0 + r),
                                                     f"latent_{kind}_out.{l}")
            g.output(f"latent_{kind}_out.{l}", F32, ["M", r])
    for i in range(cfg.num_hidden_layers):
        if cfg.is_owning(i):
            lat, up, owning = out[i]["k"], (g.weight(names.layer_name("k_U", i)), ""), True
        else:
            src = out[cfg.gsm.kv_sharing[i]]
            lat = g.op("Concat", [src["k"], src["v"]], axis=-1)
            up, owning = (g.weight(names.layer_name("proj_w", i)), g.weight(names.layer_name("proj_b", i))), False
        with g.in_scope(f"L{i}.GsmKVDemote"):
            ops.k_rows_from(lat, up, owning, cos, sin, out=io.K_ROWS_OUT.at(i), lead_dims=1)
        g.output(io.K_ROWS_OUT.at(i), F32, ["M", cfg.kv_dim])
    save_model(g.model("gsm_demote_portable", doc="re-encode changed latent rows to their new tier, and their K "
                                                  "rows (docs/engine_io.md 5)"), path)


def _demote_trt(g: GraphBuilder, spec: NetSpec, rows: PoolRows, path: Path) -> None:
    from builder.plan import pool_words

    cfg, ranks, n = spec.cfg, spec.ranks, spec.n_max
    ops = PluginOps(g, cfg, ranks, n, rows)
    lst = g.input(io.DEMOTE_LIST.name, I32, ["M", 3])
    for l in cfg.owning_layers:
        p = pool_words(*ranks[l], rows)
        pool = g.input(io.KV_POOL.at(l), I32, ["R", p])  # every cache row; a list entry names its row
        ops.demote(l, pool, lst, quant_name(l), io.KV_POOL_OUT.at(l))
        g.output(io.KV_POOL_OUT.at(l), I32, ["R", p])
    save_model(g.model("gsm_demote", extra_opsets={DOMAIN: 1}, doc="GsmKVDemote per owning layer (engine_io 4.3)"),
               path)
