"""The GSM network as one ONNX graph (docs/engine_io.md section 2), for either variant.

The layer stack (embedding, RMSNorm, projections, SwiGLU, head) is emitted here once; the GSM
operations go through an `ops` object: `PortableOps` (standard ops, ONNX Runtime) or `PluginOps`
(custom nodes for the TensorRT plugins). Both variants therefore share every tensor name outside
the GSM nodes, and the external weight data: the checkpoint tensors are stored in their own layout
(linear layers are `Gemm(transB=1)`) and read lazily, one tensor at a time, the first time a
graph needs them. With weight-only quantisation (NetSpec.quantised, docs/weights.md) the projections
q, o, gate, up, down and the embedding / LM head are read, quantised and stored in both forms
instead (builder/qlinear.py ProjectionStore), and each variant emits its own form: MatMulNBits
(portable) or DequantizeLinear + MatMul (TensorRT); a quantised embedding is looked up over the same
codes (GatherBlockQuantized / Gather of the DequantizeLinear output), so a tied head is stored once.

Fewer, larger operators (ONNX Runtime pays a fixed cost per node, docs/runtime.md "Layer-stack
fusions"): the projections that read the same input and are not quantised are stored once more as one
row-concatenated weight (FUSED, streamed) and run as one Gemm whose output is split: an owning layer's
GSM-side projections (+ q_proj in float32), and gate_proj + up_proj.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from builder.nodes import F16, F32, I32, I64, AttentionCall, cast, linear, rms_norm, rope_tables, silu_mul
from builder.onnx_util import GraphBuilder
from builder.qlinear import (
    MS_DOMAIN,
    ProjectionStore,
    dq_gather_nodes,
    dq_nodes,
    group_indicator,
    nbits_gather_nodes,
    nbits_nodes,
)
from gsm import graph_io as io
from gsm import names
from gsm.checkpoint import CheckpointTensors
from gsm.config import ModelConfig

ROPE_COS, ROPE_SIN = "gsm.rope_cos", "gsm.rope_sin"

# Stored tensors that are row-concatenations of checkpoint projections, `{i}` the layer. Not under
# "gsm.layers." (that prefix is the plugin nodes' calibration tables): both graph variants read these.
FUSED = {
    "in_proj": "fused.layers.{i}.in_proj",  # [k_Vt; v_Vt; idx_k; idx_q; idx_w (; q_proj)] [rows, H]
    "in_scale": "fused.layers.{i}.in_scale",  # [k_S; v_S; ones] over the GSM-side rows of in_proj
    "gate_up": "fused.layers.{i}.gate_up",  # [gate_proj; up_proj] [2I, H]
}
GSM_SIDE = ("k_Vt", "v_Vt", "idx_k", "idx_q", "idx_w")  # in_proj's row blocks, in order
# the tensor names the GSM nodes and the runtime's probes read, one per GSM_SIDE block
GSM_SIDE_OUT = ("L{i}.latent_k_new", "L{i}.latent_v_new", "L{i}.index_key_new", "L{i}.index_q", "L{i}.index_w")


def fused_name(key: str, i: int) -> str:
    return FUSED[key].format(i=i)


def quant_name(l: int) -> str:
    return f"gsm.layers.{l}.quant"


class TensorSource(Protocol):
    """Where checkpoint tensors come from: shapes, and float32 values as flat chunks in C order."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def chunks(self, name: str) -> Iterable[np.ndarray]: ...


class FusedSource:
    """A TensorSource that also serves row-concatenations of its tensors under their FUSED names (a quantised fused
    projection is quantised from it: groups run along K within each row, so quantising the concatenation is
    quantising each part)."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.parts: dict[str, list[str]] = {}

    def define(self, name: str, parts: list[str]) -> None:
        self.parts[name] = list(parts)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.parts:
            return self.source.shape(name)
        shapes = [tuple(self.source.shape(p)) for p in self.parts[name]]
        if len({sh[1:] for sh in shapes}) != 1:
            raise ValueError(f"{name}: parts {self.parts[name]} differ in shape past the rows: {shapes}")
        return (sum(sh[0] for sh in shapes), *shapes[0][1:])

    def chunks(self, name: str) -> Iterable[np.ndarray]:
        if name not in self.parts:
            return self.source.chunks(name)
        return (c for p in self.parts[name] for c in self.source.chunks(p))


HALF_SUFFIX = ".float16"  # a float16 copy of a stored float32 tensor whose values all lie on the FP16 grid


def on_half_grid(chunks: Iterable[np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """The tensor as float16 when that is exact for every value (NaN and overflow are not), else None."""
    u = np.concatenate([np.asarray(c, np.float32).ravel() for c in chunks])
    with np.errstate(over="ignore"):
        h = u.astype(np.float16)
    return h.reshape(shape) if np.array_equal(h.astype(np.float32), u) else None


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
    # owning layer -> [dI] float32 scale of its INT8 indexer keys (None: FP16 keys; decisions "INT8 indexer keys")
    key_scales: dict[int, np.ndarray] | None = None

    @property
    def int8_keys(self) -> bool:
        return self.key_scales is not None


class Network:
    def __init__(self, g: GraphBuilder, ops: Any, spec: NetSpec, source: TensorSource,
                 quant_tables: dict[int, np.ndarray], act: int, *, projections: ProjectionStore | None = None,
                 form: str = "portable") -> None:
        self.g, self.ops, self.spec, self.act = g, ops, spec, act
        self.source = FusedSource(source)
        self._fused: set[str] = set()  # FUSED tensors emitted as one quantised projection
        self.cfg = spec.cfg
        self.quant_tables = quant_tables
        self._cast: dict[str, str] = {}
        if spec.quantised and projections is None:
            raise ValueError("quantised projections need a ProjectionStore")
        if form not in ProjectionStore.FORMS:
            raise ValueError(f"form must be one of {ProjectionStore.FORMS}, got {form!r}")
        self.projections, self.form = projections, form
        self._dq_done: set[str] = set()  # TensorRT form: weights whose DequantizeLinear is in the graph
        self._group_sums: dict[tuple[str, int, int], str] = {}  # (input, K, block) -> its group sums
        self._flat_q: set[int] = set()  # owning layers whose attention takes q and gives attn_out as [B*S, q_dim]
        self._selections: dict[tuple[int, int], tuple[str, str]] = {}  # (window, top_k) -> graph tensors

    def layer_selection(self, i: int) -> tuple[str, str]:
        """Owning layer i's window [1] and budgets [B] for its attention node: the run-time
        inputs where they are set, the layer's own (gsm_config layer_selection) where they hold the "model's"
        values, `sparse_window` 0 and `sparse_top_k[b]` -1. One pair of Where per distinct selection."""
        ls = self.cfg.gsm.selection_of(i)
        key = (ls.sparse_window, ls.sparse_top_k)
        if key not in self._selections:
            g = self.g
            with g.in_scope(f"call/selection_w{key[0]}_k{key[1]}"):
                w = g.op("Where", [g.op("Less", [io.SPARSE_WINDOW.name, g.const([1], np.int32, "one_i32")]),
                                   g.const([ls.sparse_window], np.int32, "layer_window"), io.SPARSE_WINDOW.name])
                k = g.op("Where", [g.op("Less", [io.SPARSE_TOP_K.name, g.const(0, np.int32, "zero_i32")]),
                                   g.const(ls.sparse_top_k, np.int32, "layer_top_k"), io.SPARSE_TOP_K.name])
            self._selections[key] = (w, k)
        return self._selections[key]

    def proj(self, x2d: str, name: str, residual: str | None = None, *, swiglu: bool = False,
             norm: tuple[str, float, str] | None = None) -> str:
        """x [M, in] @ W^T (+ residual [M, out]) for checkpoint weight `name` (activation type): Gemm on the
        stored tensor, the residual as its C input (one node, not Gemm + Add), or the quantised form of
        this variant (+ an Add). swiglu (W = [gate; up], quantised): silu(x gate^T) * (x up^T) instead, inside the
        projection's or offset node where the ops fold one (CpuOps), else as Split + silu_mul. norm (weight, epsilon,
        output name): that node also writes the result's RMSNorm (only where folds_norm(name); see proj_norm)."""
        if swiglu and not self._folds(self._quantised(name)[0]):
            return self.swiglu(self.proj(x2d, name))
        if name not in self.spec.quantised and name not in self._fused:
            return linear(self.g, x2d, self.w(name), residual)
        lay, prefix = self._quantised(name)
        fold = self._folds(lay)
        if residual is not None and not fold:
            return self.g.op("Add", [residual, self.proj(x2d, name)])
        out = self.g.fresh("qlinear")
        inv = self.projections.input_scale_name(name, self.form)
        if inv is not None:  # AWQ: the stored weight is W diag(s), so the input is x / s
            x2d = self.g.op("Mul", [x2d, inv])
        if self._tiled(lay):  # the whole projection, and what follows it, as one node (CpuOps.quant_matmul)
            return self.ops.quant_matmul(x2d, prefix, lay, out, residual, swiglu, norm)
        if fold:  # the offset term, and the residual, as one node of the ops (CpuOps.group_offset)
            main = self.g.fresh("qlinear_main")
            self.g.add_nodes(nbits_nodes(x2d, main, prefix, replace(lay, offsets=False),
                                         accuracy_level=self.spec.nbits_accuracy), {MS_DOMAIN: 1})
            return self.ops.group_offset(x2d, main, prefix + ".offsets", lay.block, out, residual, swiglu, norm)
        sums = self.group_sums(x2d, lay.k, lay.block) if lay.offsets else None
        if self.form == "portable":
            self.g.add_nodes(nbits_nodes(x2d, out, prefix, lay, accuracy_level=self.spec.nbits_accuracy,
                                         group_sums=sums), {MS_DOMAIN: 1})
        else:
            self.g.add_nodes(dq_nodes(x2d, out, prefix, lay, with_dq=self._first_dq(name), group_sums=sums),
                             {"": lay.dq_opset})
        return out

    def proj_norm(self, x2d: str, name: str, residual: str, norm_weight: str) -> tuple[str, str]:
        """h = x @ W^T + residual and rms_norm(h, norm_weight) in the activation type: one node with two outputs where
        the ops fold the offset term (CpuOps: the RMSNorm as the node's epilogue, one ONNX Runtime node fewer a
        norm), else proj then rms_norm."""
        if self.folds_norm(name):
            normed = self.g.fresh("rms_norm")
            return self.proj(x2d, name, residual, norm=(norm_weight, self.cfg.rms_norm_eps, normed)), normed
        h = self.proj(x2d, name, residual=residual)
        return h, rms_norm(self.g, h, norm_weight, self.cfg.rms_norm_eps, self.act)

    def folds_norm(self, name: str) -> bool:
        """Whether proj_norm of `name` is one node (a quantised projection the CPU ops fold, float32: _folds)."""
        return name in self.spec.quantised and self.act == F32 and self._folds(self._quantised(name)[0])

    def _folds(self, lay) -> bool:
        """Whether a quantised projection's residual, SwiGLU and next norm fold into one node of this variant's ops:
        its offset term's (GsmGroupOffset) or the whole projection's (GsmQuantMatMul)."""
        return self._tiled(lay) or (self.form == "portable" and lay.offsets and self.ops.fused_offsets)

    def _tiled(self, lay) -> bool:
        """Whether a quantised projection is one GsmQuantMatMul node (its tiles stored: a fast build's CPU graph)."""
        return self.form == "portable" and lay.tiles and self.ops.fused_quant

    def swiglu(self, gate_up: str) -> str:
        """silu(gate) * up of a [M, 2 * intermediate] gate+up projection: Split and silu_mul."""
        inter = self.cfg.intermediate_size
        a, b = self.g.op("Split", [gate_up, self.g.const([inter, inter], np.int64, "gate_up_split")], n_out=2, axis=-1)
        return silu_mul(self.g, a, b)

    def fused_proj(self, x2d: str, key: str, i: int, parts: list[str], *, swiglu: bool = False) -> str | None:
        """x @ W^T over the FUSED tensor `key` of layer i (checkpoint tensors `parts` by rows) as one quantised
        projection, when every part is quantised alike (and none has AWQ scales); None otherwise. One node
        instead of one per part (ONNX Runtime pays a fixed cost per node). The GSM side (in_proj) keeps float32
        activations in the TensorRT form too, as its float version does."""
        if self.projections is None or any(p not in self.spec.quantised for p in parts):
            return None
        cfgs = {self.projections.configs[p] for p in parts}
        if len(cfgs) != 1 or any(p in self.projections.input_scales for p in parts):
            return None
        name = fused_name(key, i)
        if name not in self._fused:
            self.projections.register(name, cfgs.pop(), trt_act_dtype="float32" if key == "in_proj" else None)
            self.source.define(name, parts)
            self._fused.add(name)
        return self.proj(x2d, name, swiglu=swiglu)

    def group_sums(self, x2d: str, k: int, block: int) -> str:
        """x [M, K] @ group_indicator: the sums a float-zero-point weight's offset term multiplies, made once
        per input (gate and up share theirs)."""
        key = (x2d, k, block)
        if key not in self._group_sums:
            dt = np.float32 if self.act == F32 else np.float16
            self._group_sums[key] = self.g.op("MatMul", [x2d, self.g.const(group_indicator(k, block, dt), dt,
                                                                            f"groups_{k}_{block}")])
        return self._group_sums[key]

    def _quantised(self, name: str):
        """(layout, initializer prefix) of quantised tensor `name` in this variant, stored on first use."""
        assert self.projections is not None
        lay = self.projections.ensure(name, self.source, self.form)
        for n in self.projections.init_names[(name, self.form)]:
            self.g.weight(n)
        return lay, ProjectionStore.prefix(name, self.form)

    def _first_dq(self, name: str) -> bool:
        first = name not in self._dq_done
        self._dq_done.add(name)
        return first

    def embed(self, ids: str) -> str:
        """[B*S, H] rows of the embedding in the activation type: a Gather on the stored float32 tensor, or,
        quantised, the dequantising gather of this variant over the very codes the tied LM head reads (symmetric
        or float-zero-point codes: the latter's per-group offsets are gathered from the head's own initializer
        and added to the rows, qlinear.nbits_gather_nodes / dq_gather_nodes)."""
        if names.EMBED not in self.spec.quantised:
            h = self.g.op("Gather", [self.w(names.EMBED, keep_f32=True), ids], axis=0)  # [B, S, H] f32
            return self.g.op("Reshape", [h if self.act == F32 else cast(self.g, h, self.act),
                                         self.g.const([-1, self.cfg.hidden_size], np.int64, "flat_h")])
        lay, prefix = self._quantised(names.EMBED)
        out = self.g.fresh("embed")
        if self._tiled(lay) and self.cfg.tie_word_embeddings:  # the head's tiles, the one copy the CPU graph reads
            return self.ops.tile_gather(ids, prefix, lay, out)
        if self.form == "portable":  # float32 rows
            self.g.add_nodes(nbits_gather_nodes(ids, out, prefix, lay), {MS_DOMAIN: 1})
            return out if self.act == F32 else cast(self.g, out, self.act)
        # rows in the DequantizeLinear's (the scales') dtype: the activation type
        self.g.add_nodes(dq_gather_nodes(ids, out, prefix, lay, with_dq=self._first_dq(names.EMBED)),
                         {"": lay.dq_opset})
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

    def up_weights(self, i: int) -> tuple[str, str]:
        """Owning layer i's U_k and U_v: the stored float32 tensors, or, for ops that read them so (`half_up`),
        float16 copies when every value of both lies on the FP16 grid (the converter rounds U there): the same
        numbers in half the bytes a decode step reads (the graph then holds no float32 U). Each is small ([kvD, r])
        and read whole to check."""
        ups = (names.layer_name("k_U", i), names.layer_name("v_U", i))
        if self.ops.half_up:
            half = [on_half_grid(self.source.chunks(n), self.source.shape(n)) for n in ups]
            if all(h is not None for h in half):
                return tuple(self.g.weight(n + HALF_SUFFIX, lambda h=h: h) for n, h in zip(ups, half))  # type: ignore
        return tuple(self.w(n, keep_f32=True) for n in ups)  # type: ignore

    def rows(self, key: str, i: int, parts: list[str]) -> str:
        """Stored FUSED tensor `key` of layer i: checkpoint tensors `parts` ([rows, in] each, row-major)
        concatenated along rows. Streamed: such a concatenation is the parts' bytes one after another."""
        name = fused_name(key, i)
        if name not in self.g.store.tensors:
            self.source.define(name, parts)
            self.g.store.put_chunks(name, self.source.shape(name), self.source.chunks(name))
        return self.g.weight(name)

    def in_scale(self, i: int) -> str:
        """The column scale after owning layer i's in_proj Gemm (stored once, streamed): [k_S; v_S] over the
        latents, then over the indexer's key, query and weight columns ones, or with INT8 keys float32(1 / s)
        over the key (its codes are rint of that product) and s tiled over the query heads (the score reads
        codes against the query scaled by s; gsm.golden.quant "INT8 indexer keys")."""
        name = fused_name("in_scale", i)
        if name not in self.g.store.tensors:
            nI, dI = self.cfg.gsm.indexer_heads, self.cfg.gsm.indexer_dim
            k_s, v_s = names.layer_name("k_S", i), names.layer_name("v_S", i)
            if self.spec.key_scales is None:
                index = np.ones(dI + nI * dI + nI, np.float32)
            else:
                s = np.asarray(self.spec.key_scales[i], np.float32)
                index = np.concatenate([np.float32(1.0) / s, np.tile(s, nI), np.ones(nI, np.float32)])
            n = self.source.shape(k_s)[0] + self.source.shape(v_s)[0] + index.size
            chunks = (*self.source.chunks(k_s), *self.source.chunks(v_s), index)
            self.g.store.put_chunks(name, (n,), chunks)
        return self.g.weight(name)

    def act_w(self, weight: str) -> str:
        """A float32 stored tensor (or a node output over one) in the activation type."""
        return weight if self.act == F32 else cast(self.g, weight, self.act)

    def gsm_inputs(self, i: int, x32: str, x: str, bs: Any, shape_bs: str) -> tuple[str, list[str]]:
        """q [B, S, q_dim] float32 and the GSM-side tensors (GSM_SIDE_OUT, [B, S, width] float32) of owning
        layer i: one Gemm over in_proj (or one quantised projection, --gsm-weights int8), the latent scales applied
        after it as before ((x Vt^T) * S, not S folded into Vt: the latents are rounded to FP16 next and the golden
        tolerance is tight).

        q_proj is a block of in_proj unless quantised; in a float32 graph its rows ride the same Gemm, in a
        lower-precision one they are split off the stored weight (a constant, folded by the engine builder)
        and run in the activation type as before, so both variants read one stored tensor."""
        g, cfg, spec = self.g, self.cfg, self.spec
        rk, rv = spec.ranks[i]
        nI, dI = cfg.gsm.indexer_heads, cfg.gsm.indexer_dim
        widths = [rk, rv, dI, nI * dI, nI]
        outs = [o.format(i=i) for o in GSM_SIDE_OUT]
        q_name = names.layer_name("q_proj", i)
        side = [names.layer_name(k, i) for k in GSM_SIDE]
        scale = self.in_scale(i)
        # --gsm-weights int8: one quantised node, q on its own (a fast build's ONNX Runtime graphs: group 32 with
        # INT8 activations, builder.plan GSM_SIDE_FAST_CONFIG; the TensorRT graph: per channel, float activations)
        fused = self.fused_proj(x32, "in_proj", i, side)
        with_q = fused is None and q_name not in spec.quantised
        w = self.rows("in_proj", i, side + ([q_name] if with_q else [])) if fused is None else None
        if with_q and self.act == F32:
            # the ones over q's rows are a constant Concat, folded at session creation
            scale = g.op("Concat", [scale, g.const(np.ones(cfg.q_dim, np.float32), np.float32, "ones_q")], axis=0)
            y = bs(g.op("Mul", [linear(g, x32, w), scale]), sum(widths) + cfg.q_dim)
            *gsm, q = g.op("Split", [y, g.const([*widths, cfg.q_dim], np.int64, "in_split")], n_out=len(widths) + 1,
                           axis=-1, outputs=[*outs, f"L{i}.q"])
            return q, gsm
        if with_q:
            w, wq = g.op("Split", [w, g.const([sum(widths), cfg.q_dim], np.int64, "in_q_split")], n_out=2, axis=0)
            q = linear(g, x, self.act_w(wq))
        else:
            q = self.proj(x, q_name)
        q = q if self.act == F32 else cast(g, q, F32)
        if self.ops.flat_q:  # the CPU op takes q [B*S, q_dim] as the projection leaves it, and returns attn so
            self._flat_q.add(i)
        else:
            q = bs(q, cfg.q_dim, f"L{i}.q")
        side = fused if fused is not None else linear(g, x32, w)
        if self.ops.fused_side:  # scale, split and cache rounding as one node of the ops (CpuOps.side_split)
            return q, self.ops.side_split(i, side, scale, widths, shape_bs)
        y = bs(g.op("Mul", [side, scale]), sum(widths))
        gsm = g.op("Split", [y, g.const(widths, np.int64, "gsm_split")], n_out=len(widths), axis=-1, outputs=outs)
        return q, gsm

    def mlp(self, i: int, y: str) -> str:
        """silu(y gate^T) * (y up^T): one Gemm over gate_up and a Split unless either is quantised."""
        gate, up = names.layer_name("gate_proj", i), names.layer_name("up_proj", i)
        if gate in self.spec.quantised or up in self.spec.quantised:
            # one quantised node when both are alike, and the product inside its offset node where there is one
            gu = self.fused_proj(y, "gate_up", i, [gate, up], swiglu=True)
            return silu_mul(self.g, self.proj(y, gate), self.proj(y, up)) if gu is None else gu
        return self.swiglu(linear(self.g, y, self.act_w(self.rows("gate_up", i, [gate, up]))))

    def build(self) -> None:
        g, cfg, spec, ops = self.g, self.cfg, self.spec, self.ops
        qd = cfg.q_dim
        ids = g.input(io.INPUT_IDS.name, I64, ["B", "S"])
        past = g.input(io.PAST_LENGTHS.name, I32, ["B"])
        new = g.input(io.NEW_LENGTHS.name, I32, ["B"])
        g.input(io.SPARSE_WINDOW.name, I32, [1])
        # the rows of each sequence whose logits come back (and, where the attention nodes measure it, whose
        # attention mass comes back per query): a one-token step's row 0, a prefill's last, a verification's all
        ops.logit_rows = self.logit_rows = g.input(io.LOGIT_ROWS.name, I32, ["B", "J"])
        cache = ops.declare_cache()
        tables = rope_tables(spec.n_max, cfg.head_dim, cfg.rope_theta)
        rope = (g.weight(ROPE_COS, lambda: tables[0]), g.weight(ROPE_SIN, lambda: tables[1]))
        # calibration tables are stored now; a variant adds them to its graph only where a node reads them
        quant = {l: g.store.get_or_put(quant_name(l), lambda l=l: self.quant_tables[l]) for l in cfg.owning_layers}
        shape_bs = g.op("Shape", [ids])

        shapes: dict[int, str] = {}

        def bs(x2d: str, width: int, name: str | None = None) -> str:
            """[B*S, width] -> [B, S, width] (each width's shape tensor made once, not per layer)"""
            if width not in shapes:
                shapes[width] = g.op("Concat", [shape_bs, g.const([width], np.int64, f"w{width}")], axis=0)
            return g.op("Reshape", [x2d, shapes[width]], outputs=[name] if name else None)

        h = self.embed(ids)
        selected: dict[int, str] = {}
        masses: list[str] = []
        normed = None  # layer i's input norm, made with the previous layer's down projection where the ops fold it
        for i in range(cfg.num_hidden_layers):
            with g.in_scope(f"L{i}"):
                x32 = normed if normed is not None else rms_norm(g, h, self.lw("input_norm", i, keep_f32=True),
                                                                 cfg.rms_norm_eps, self.act, F32)
                x = x32 if self.act == F32 else cast(g, x32, self.act)
                if cfg.is_owning(i):
                    # the GSM-side projections (latents, indexer) run in float32 in both variants: they
                    # are small (r and nI*dI rows), and float32 index scores keep the top-k selection
                    # of an FP16 engine equal to the golden's except at true near-ties
                    q, (ck, cv, key, iq, iw) = self.gsm_inputs(i, x32, x, bs, shape_bs)
                else:
                    q = self.proj(x, names.layer_name("q_proj", i))
                    q = bs(q if self.act == F32 else cast(g, q, F32), qd, f"L{i}.q")  # [B, S, nH*D] f32
            if cfg.is_owning(i):
                cache[i] = ops.kv_update(i, cache[i], ck, cv, key, past, new)
                up = self.up_weights(i)
                window, top_k = self.layer_selection(i)
                attn, selected[i], mass = ops.attention(AttentionCall(
                    i, q, cache[i], past, new, rope, up, quant[i], index_q=iq, index_w=iw, sparse_window=window,
                    top_k=top_k))
                masses.append(mass)
            else:
                src = cfg.gsm.kv_sharing[i]
                up = (self.lw("proj_w", i, keep_f32=True), self.lw("proj_b", i, keep_f32=True))
                attn, _, _ = ops.attention(AttentionCall(i, q, cache[src], past, new, rope, up, quant[src],
                                                         selected=selected[src], source=src))
            with g.in_scope(f"L{i}"):
                # f32 from the GSM node: [B, S, q_dim], or [B*S, q_dim] already where the ops take q flat
                a2 = attn if i in self._flat_q else g.op("Reshape", [attn, g.const([-1, qd], np.int64, "flat_q")])
                a2 = a2 if self.act == F32 else cast(g, a2, self.act)
                h, y = self.proj_norm(a2, names.layer_name("o_proj", i), h, self.lw("post_norm", i, keep_f32=True))
                down = names.layer_name("down_proj", i)
                if i + 1 < cfg.num_hidden_layers and self.folds_norm(down):
                    h, normed = self.proj_norm(self.mlp(i, y), down, h, self.lw("input_norm", i + 1, keep_f32=True))
                else:
                    h, normed = self.proj(self.mlp(i, y), down, residual=h), None
        self._head(h, shape_bs, new)
        # one variadic Sum (in order, as a chain of Adds would add them) instead of a node per owning layer
        g.op("Sum" if len(masses) > 1 else "Identity", masses, outputs=[io.ATTN_MASS.name])
        g.output(io.ATTN_MASS.name, F32, ops.mass_shape())
        if ops.query_masses:  # the variants whose attention measures each logit row's query
            g.op("Sum" if len(ops.query_masses) > 1 else "Identity", ops.query_masses, outputs=[io.QUERY_MASS.name])
            g.output(io.QUERY_MASS.name, F32, ["B", "J", ops.mass_shape()[-1]])
        ops.declare_cache_outputs()
        if spec.debug:
            for l in cfg.owning_layers:
                g.op("Identity", [selected[l]], outputs=[io.SELECTED.at(l)])
                g.output(io.SELECTED.at(l), *ops.selected_type(l))

    def _head(self, h: str, shape_bs: str, new: str) -> None:
        """Final norm and LM head, on the rows `logit_rows` of each sequence (`last`) or every row (`all`)."""
        g, cfg = self.g, self.cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        head = names.EMBED if cfg.tie_word_embeddings else names.LM_HEAD
        if self.spec.logits == "last":
            h3 = g.op("Reshape", [h, g.op("Concat", [shape_bs, g.const([H], np.int64, "w_h")], axis=0)])
            rows = cast(g, self.logit_rows, I64)  # [B, J]
            idx = g.op("Expand", [g.op("Unsqueeze", [rows, g.const([2], np.int64, "ax2")]),
                                  g.op("Concat", [g.op("Shape", [rows]), g.const([H], np.int64, "w_h1")], axis=0)])
            h = g.op("Reshape", [g.op("GatherElements", [h3, idx], axis=1), g.const([-1, H], np.int64, "flat_h")])
        x = rms_norm(g, h, self.w(names.FINAL_NORM, keep_f32=True), cfg.rms_norm_eps, self.act)
        logits = self.proj(x, head)  # [B or B*S, V]
        if self.act != F32:
            logits = cast(g, logits, F32)
        if self.spec.logits == "last":
            g.op("Reshape", [logits, g.op("Concat", [g.op("Shape", [self.logit_rows]), g.const([V], np.int64, "w_v")],
                                          axis=0)], outputs=[io.LOGITS.name])
            g.output(io.LOGITS.name, F32, ["B", "J", V])
        else:
            g.op("Reshape", [logits, g.op("Concat", [shape_bs, g.const([V], np.int64, "w_v")], axis=0)],
                 outputs=[io.LOGITS.name])
            g.output(io.LOGITS.name, F32, ["B", "S", V])


__all__ = ["F16", "FUSED", "GSM_SIDE", "CheckpointSource", "NetSpec", "Network", "ROPE_COS", "ROPE_SIN", "TensorSource",
           "fused_name", "quant_name"]
