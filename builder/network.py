"""The GSM network as one ONNX graph (docs/engine_io.md section 2), for either variant.

The layer stack (embedding, RMSNorm, projections, SwiGLU, head) is emitted here once; the GSM
operations go through an `ops` object: `PortableOps` (standard ops, ONNX Runtime) or `PluginOps`
(custom nodes for the TensorRT plugins). Both variants therefore share every tensor name outside
the GSM nodes, and the external weight data: the checkpoint tensors are stored in their own layout
(linear layers are `Gemm(transB=1)`) and read lazily, one tensor at a time, the first time a
graph needs them. With weight-only quantisation (NetSpec.weights, docs/weights.md) the projections
q, o, gate, up, down (and optionally the LM head) are read, quantised and stored in both forms
instead (builder/qlinear.py ProjectionStore), and each variant emits its own form: MatMulNBits
(portable) or DequantizeLinear + MatMul (TensorRT).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from builder.nodes import F16, F32, I32, I64, cast, linear, rms_norm, rope_tables, silu_mul
from builder.onnx_util import GraphBuilder
from builder.qlinear import MS_DOMAIN, ProjectionStore, dq_nodes, nbits_nodes
from gsm import names
from gsm.checkpoint import CheckpointTensors
from gsm.config import ModelConfig

ROPE_COS, ROPE_SIN = "gsm.rope_cos", "gsm.rope_sin"


def quant_name(l: int) -> str:
    return f"gsm.layers.{l}.quant"


class TensorSource(Protocol):
    """Where checkpoint tensors come from: shapes, and float32 values as flat chunks in C order."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def chunks(self, name: str) -> Iterable[np.ndarray]: ...


class CheckpointSource:
    """TensorSource over a checkpoint: 16 MiB chunks, so a build never holds a whole tensor."""

    def __init__(self, tensors: CheckpointTensors, chunk_bytes: int = 16 << 20) -> None:
        self.tensors, self.chunk_bytes = tensors, chunk_bytes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(name)

    def chunks(self, name: str) -> Iterable[np.ndarray]:
        return self.tensors.reader(name).iter_chunks(name, self.chunk_bytes)


@dataclass(frozen=True)
class NetSpec:
    """What fixes the graph's static shapes and options."""

    cfg: ModelConfig
    ranks: dict[int, tuple[int, int]]
    n_max: int
    logits: str = "last"  # "last" ([B, 1, V]) or "all" ([B, S, V])
    debug: bool = False  # portable only: also output each owning layer's selected positions
    quantised: frozenset[str] = frozenset()  # checkpoint tensors emitted as quantised projections
    nbits_accuracy: int = 0  # MatMulNBits accuracy_level of the portable graph (0 exact, 4 INT8 activations)


class Network:
    def __init__(self, g: GraphBuilder, ops: Any, spec: NetSpec, source: TensorSource,
                 quant_tables: dict[int, np.ndarray], act: int, *, projections: ProjectionStore | None = None,
                 form: str = "portable") -> None:
        self.g, self.ops, self.spec, self.source, self.act = g, ops, spec, source, act
        self.cfg = spec.cfg
        self.quant_tables = quant_tables
        self._cast: dict[str, str] = {}
        if spec.quantised and projections is None:
            raise ValueError("quantised projections need a ProjectionStore")
        if form not in ProjectionStore.FORMS:
            raise ValueError(f"form must be one of {ProjectionStore.FORMS}, got {form!r}")
        self.projections, self.form = projections, form

    def proj(self, x2d: str, name: str) -> str:
        """x [M, in] @ W^T for checkpoint weight `name` (activation type): Gemm on the stored tensor, or
        the quantised form of this variant."""
        if name not in self.spec.quantised:
            return linear(self.g, x2d, self.w(name))
        assert self.projections is not None
        lay = self.projections.ensure(name, self.source, self.form)
        for n in self.projections.init_names[(name, self.form)]:
            self.g.weight(n)
        prefix, out = ProjectionStore.prefix(name, self.form), self.g.fresh("qlinear")
        inv = self.projections.input_scale_name(name, self.form)
        if inv is not None:  # AWQ: the stored weight is W diag(s), so the input is x / s
            x2d = self.g.op("Mul", [x2d, inv])
        if self.form == "portable":
            self.g.add_nodes(nbits_nodes(x2d, out, prefix, lay, accuracy_level=self.spec.nbits_accuracy),
                             {MS_DOMAIN: 1})
        else:
            self.g.add_nodes(dq_nodes(x2d, out, prefix, lay), {"": lay.dq_opset})
        return out

    def w(self, name: str, *, keep_f32: bool = False) -> str:
        """Checkpoint tensor `name` (streamed into the weight file on first use), cast to the activation
        type unless keep_f32."""
        if name not in self.g.store.tensors:
            self.g.store.put_chunks(name, self.source.shape(name), self.source.chunks(name))
        self.g.weight(name)
        if keep_f32 or self.act == F32:
            return name
        if name not in self._cast:
            self._cast[name] = self.g.op("Cast", [name], to=self.act, outputs=[name + ".f16"])
        return self._cast[name]

    def lw(self, key: str, i: int, **kw: Any) -> str:
        return self.w(names.layer_name(key, i), **kw)

    def build(self) -> None:
        g, cfg, spec, ops = self.g, self.cfg, self.spec, self.ops
        H, qd = cfg.hidden_size, cfg.q_dim
        ids = g.input("input_ids", I64, ["B", "S"])
        past = g.input("past_lengths", I32, ["B"])
        new = g.input("new_lengths", I32, ["B"])
        window = g.input("sparse_window", I32, [1])
        cache = ops.declare_cache()
        tables = rope_tables(spec.n_max, cfg.head_dim, cfg.rope_theta)
        rope = (g.weight(ROPE_COS, lambda: tables[0]), g.weight(ROPE_SIN, lambda: tables[1]))
        # calibration tables are stored now; a variant adds them to its graph only where a node reads them
        quant = {l: g.store.get_or_put(quant_name(l), lambda l=l: self.quant_tables[l]) for l in cfg.owning_layers}
        shape_bs = g.op("Shape", [ids])

        def bs(x2d: str, width: int, name: str | None = None) -> str:
            """[B*S, width] -> [B, S, width]"""
            return g.op("Reshape", [x2d, g.op("Concat", [shape_bs, g.const([width], np.int64, f"w{width}")], axis=0)],
                        outputs=[name] if name else None)

        h = g.op("Gather", [self.w(names.EMBED, keep_f32=True), ids], axis=0)  # [B, S, H] f32
        h = g.op("Reshape", [h if self.act == F32 else cast(g, h, self.act), g.const([-1, H], np.int64, "flat_h")])
        selected: dict[int, str] = {}
        masses: list[str] = []
        for i in range(cfg.num_hidden_layers):
            with g.in_scope(f"L{i}"):
                x32 = rms_norm(g, h, self.lw("input_norm", i, keep_f32=True), cfg.rms_norm_eps, self.act, F32)
                x = x32 if self.act == F32 else cast(g, x32, self.act)
                q = self.proj(x, names.layer_name("q_proj", i))
                q = bs(q if self.act == F32 else cast(g, q, F32), qd, f"L{i}.q")  # [B, S, nH*D] f32
                if cfg.is_owning(i):
                    # the GSM-side projections (latents, indexer) run in float32 in both variants: they
                    # are small (r and nI*dI rows), and float32 index scores keep the top-k selection
                    # of an FP16 engine equal to the golden's except at true near-ties
                    rk, rv = spec.ranks[i]
                    f32w = {"keep_f32": True}
                    ck = bs(g.op("Mul", [linear(g, x32, self.lw("k_Vt", i, **f32w)), self.lw("k_S", i, **f32w)]), rk,
                            f"L{i}.latent_k_new")
                    cv = bs(g.op("Mul", [linear(g, x32, self.lw("v_Vt", i, **f32w)), self.lw("v_S", i, **f32w)]), rv,
                            f"L{i}.latent_v_new")
                    key = bs(linear(g, x32, self.lw("idx_k", i, **f32w)), cfg.gsm.indexer_dim, f"L{i}.index_key_new")
                    iq = bs(linear(g, x32, self.lw("idx_q", i, **f32w)), cfg.gsm.indexer_heads * cfg.gsm.indexer_dim,
                            f"L{i}.index_q")
                    iw = bs(linear(g, x32, self.lw("idx_w", i, **f32w)), cfg.gsm.indexer_heads, f"L{i}.index_w")
            if cfg.is_owning(i):
                cache[i] = ops.kv_update(i, cache[i], ck, cv, key, past, new)
                up = (self.lw("k_U", i, keep_f32=True), self.lw("v_U", i, keep_f32=True))
                attn, selected[i], mass = ops.attention(i, q, cache[i], past, new, rope=rope, up=up, index_q=iq,
                                                        index_w=iw, sparse_window=window, quant=quant[i])
                masses.append(mass)
            else:
                src = cfg.gsm.kv_sharing[i]
                up = (self.lw("proj_w", i, keep_f32=True), self.lw("proj_b", i, keep_f32=True))
                attn, _, _ = ops.attention(i, q, cache[src], past, new, rope=rope, up=up, selected=selected[src],
                                           source=src, quant=quant[src])
            with g.in_scope(f"L{i}"):
                a2 = g.op("Reshape", [attn, g.const([-1, qd], np.int64, "flat_q")])  # f32 from the GSM node
                a2 = a2 if self.act == F32 else cast(g, a2, self.act)
                h = g.op("Add", [h, self.proj(a2, names.layer_name("o_proj", i))])
                y = rms_norm(g, h, self.lw("post_norm", i, keep_f32=True), cfg.rms_norm_eps, self.act)
                mlp = silu_mul(g, self.proj(y, names.layer_name("gate_proj", i)),
                               self.proj(y, names.layer_name("up_proj", i)))
                h = g.op("Add", [h, self.proj(mlp, names.layer_name("down_proj", i))])
        self._head(h, shape_bs, new)
        total = masses[0]
        for m in masses[1:]:
            total = g.op("Add", [total, m])
        g.op("Identity", [total], outputs=["attn_mass"])
        g.output("attn_mass", F32, ops.mass_shape())
        ops.declare_cache_outputs()
        if spec.debug:
            for l in cfg.owning_layers:
                g.op("Identity", [selected[l]], outputs=[f"selected.{l}"])
                g.output(f"selected.{l}", *ops.selected_type())

    def _head(self, h: str, shape_bs: str, new: str) -> None:
        """Final norm and LM head, on the last valid row of each sequence (`last`) or every row (`all`)."""
        g, cfg = self.g, self.cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        head = names.EMBED if cfg.tie_word_embeddings else names.LM_HEAD
        if self.spec.logits == "last":
            h3 = g.op("Reshape", [h, g.op("Concat", [shape_bs, g.const([H], np.int64, "w_h")], axis=0)])
            last = g.op("Sub", [cast(g, new, I64), g.const(1, np.int64, "one")])  # [B]
            idx = g.op("Expand", [g.op("Unsqueeze", [last, g.const([1, 2], np.int64, "ax12")]),
                                  g.op("Concat", [g.op("Slice", [shape_bs, g.const([0], np.int64, "zero1"),
                                                                 g.const([1], np.int64, "one1")]),
                                                  g.const([1, H], np.int64, "one_h")], axis=0)])  # [B, 1, H]
            h = g.op("Reshape", [g.op("GatherElements", [h3, idx], axis=1), g.const([-1, H], np.int64, "flat_h")])
        x = rms_norm(g, h, self.w(names.FINAL_NORM, keep_f32=True), cfg.rms_norm_eps, self.act)
        logits = self.proj(x, head)  # [B or B*S, V]
        if self.act != F32:
            logits = cast(g, logits, F32)
        if self.spec.logits == "last":
            g.op("Unsqueeze", [logits, g.const([1], np.int64, "ax1")], outputs=["logits"])
            g.output("logits", F32, ["B", 1, V])
        else:
            g.op("Reshape", [logits, g.op("Concat", [shape_bs, g.const([V], np.int64, "w_v")], axis=0)],
                 outputs=["logits"])
            g.output("logits", F32, ["B", "S", V])


__all__ = ["F16", "CheckpointSource", "NetSpec", "Network", "ROPE_COS", "ROPE_SIN", "TensorSource", "quant_name"]
