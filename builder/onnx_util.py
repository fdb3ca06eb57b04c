"""Small ONNX writing helpers: a graph builder with named scopes, and a streaming external-data store.

Why our own: `onnx.save(..., save_as_external_data=True)` needs every tensor in memory inside the
ModelProto first (TensorRT-Edge-LLM's exporter peaks at 3-4x the parameter bytes that way). Here the
graph only ever holds *references* (`external_data` location/offset/length) and `WeightStore` writes
each tensor's bytes to the data file as soon as it is produced, so the caller can drop it at once.
Both graph variants of a bundle reference the same data file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17  # docs/engine_io.md: standard ops at opset 17
OPSET_INT4 = 21  # a TensorRT graph with INT4 weights: DequantizeLinear's INT4 type and block_size
# opset 18 moved `axes` of these reductions from an attribute to an input
_AXES_TO_INPUT = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                  "ReduceLogSumExp", "ReduceSumSquare"}
ALIGN = 4096  # external data offsets aligned to a page, so runtimes can mmap each tensor

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.uint8): TensorProto.UINT8,
               np.dtype(np.int8): TensorProto.INT8}


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple[int, ...]
    data_type: int  # onnx.TensorProto enum
    offset: int
    length: int


class WeightStore:
    """Append-only external data file; `put(name, array)` writes now and remembers where."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = path.name  # ONNX external_data location, relative to the model file
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.tensors: dict[str, StoredTensor] = {}
        self.peak_tensor_bytes = 0  # largest array held at once (a chunk, for streamed tensors)

    def put(self, name: str, array: np.ndarray) -> str:
        a = np.ascontiguousarray(array)
        return self.put_raw(name, _NP_TO_ONNX[a.dtype], tuple(a.shape),
                            a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())

    def put_raw(self, name: str, data_type: int, dims: tuple[int, ...], raw: bytes) -> str:
        """Store raw little-endian bytes of an ONNX tensor (types numpy lacks, e.g. INT4 packed two per byte)."""
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} stored twice")
        pos = self._f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
        offset = pos + pad
        self._f.write(raw)
        self.tensors[name] = StoredTensor(tuple(dims), data_type, offset, len(raw))
        self.note_held(len(raw))
        return name

    def note_held(self, nbytes: int) -> None:
        """Record an array the build held while producing stored data (the reported streaming bound)."""
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, nbytes)

    def put_chunks(self, name: str, shape: tuple[int, ...], chunks: Iterable[np.ndarray]) -> str:
        """Store a float32 tensor from flat chunks, so not even one whole tensor sits in memory."""
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} stored twice")
        pos = self._f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
        offset, n, biggest = pos + pad, 0, 0
        for c in chunks:
            c32 = np.ascontiguousarray(c, dtype="<f4")
            self._f.write(c32.tobytes())
            n += c32.size
            biggest = max(biggest, c32.nbytes)
        if n != math.prod(shape):
            raise ValueError(f"tensor {name!r}: {n} elements streamed, shape {list(shape)} needs {math.prod(shape)}")
        self.tensors[name] = StoredTensor(tuple(shape), TensorProto.FLOAT, offset, n * 4)
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, biggest)
        return name

    def get_or_put(self, name: str, produce: Callable[[], np.ndarray]) -> str:
        """Store `produce()` under name unless already stored (both graph variants share data)."""
        if name not in self.tensors:
            self.put(name, produce())
        return name

    def initializer(self, name: str) -> TensorProto:
        """A TensorProto that points at the stored bytes (no data in the proto)."""
        s = self.tensors[name]
        t = TensorProto()
        t.name = name
        t.data_type = s.data_type
        t.dims.extend(s.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", str(s.offset)), ("length", str(s.length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers; node names carry the current scope.

    Scopes name subgraphs (`L3.GsmSparseAttention`), which the structural test uses to match each
    GSM plugin node of the TensorRT variant with the standard-op subgraph of the portable one.
    """

    def __init__(self, store: WeightStore, opset: int = OPSET) -> None:
        self.store = store
        self.opset = opset
        self.domains: dict[str, int] = {}  # non-standard domains of added nodes -> opset version
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.consts: list[TensorProto] = []  # small inline constants
        self.external: list[str] = []  # stored tensors this graph uses
        self.scope = ""
        self._n = 0
        self._cache: dict[Any, str] = {}

    # -- naming ---------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{self.scope + '/' if self.scope else ''}{hint}_{self._n}"

    def in_scope(self, scope: str) -> _Scope:
        return _Scope(self, scope)

    # -- graph parts ----------------------------------------------------------------------------
    def input(self, name: str, elem: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def output(self, name: str, elem: int, shape: Sequence[int | str]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def weight(self, name: str, produce: Callable[[], np.ndarray] | None = None) -> str:
        """A stored (external) tensor as an initializer of this graph."""
        if produce is not None:
            self.store.get_or_put(name, produce)
        elif name not in self.store.tensors:
            raise KeyError(f"weight {name!r} not stored")
        if name not in self.external:
            self.external.append(name)
        return name

    def const(self, value: Any, dtype: Any = np.int64, hint: str = "const") -> str:
        """A small inline constant, deduplicated by value."""
        a = np.asarray(value, dtype=dtype)
        key = ("const", a.dtype.str, a.shape, a.tobytes())
        if key not in self._cache:
            name = f"const_{len(self._cache)}_{hint}"
            self.consts.append(onnx.numpy_helper.from_array(a, name))
            self._cache[key] = name
        return self._cache[key]

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, *, name: str | None = None,
           outputs: Sequence[str] | None = None, domain: str = "", **attrs: Any) -> Any:
        """Add a node; returns its output name (or a list when n_out > 1)."""
        outs = list(outputs) if outputs is not None else [self.fresh(op_type.lower()) for _ in range(n_out)]
        if self.opset >= 18 and op_type in _AXES_TO_INPUT and "axes" in attrs:
            inputs = [*inputs, self.const(attrs.pop("axes"), np.int64, "axes")]
        node_name = name or (f"{self.scope}/{op_type}_{self._n}" if self.scope else f"{op_type}_{self._n}")
        self._n += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain or None,
                                           **attrs))
        return outs[0] if len(outs) == 1 else outs

    def branch(self, name: str, build: Callable[[], Sequence[tuple[str, int]]]) -> onnx.GraphProto:
        """A subgraph (an `If` branch): the nodes `build()` adds, with the (name, element type) pairs it returns
        as outputs. Branch nodes read the enclosing graph's tensors by name (outer scope); constants stay in
        the main graph's initializers."""
        saved, self.nodes = self.nodes, []
        try:
            outs = build()
        finally:
            sub, self.nodes = self.nodes, saved
        return helper.make_graph(sub, name, [], [helper.make_tensor_value_info(n, t, None) for n, t in outs])

    def add_nodes(self, nodes: Sequence[onnx.NodeProto], domains: dict[str, int] | None = None) -> None:
        """Nodes made elsewhere (builder/qlinear.py), with the domains (and least opsets) they need."""
        self.nodes.extend(nodes)
        for d, v in (domains or {}).items():
            if d:
                self.domains[d] = max(v, self.domains.get(d, 0))
            elif v > self.opset:
                raise ValueError(f"nodes need opset {v}, this graph is opset {self.opset}")

    def model(self, graph_name: str, *, extra_opsets: dict[str, int] | None = None,
              doc: str = "") -> onnx.ModelProto:
        inits = [self.store.initializer(n) for n in self.external] + self.consts
        g = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, initializer=inits, doc_string=doc)
        extra = {**self.domains, **(extra_opsets or {})}
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, v) for d, v in extra.items()]
        m = helper.make_model(g, opset_imports=opsets, producer_name="gsm-edge builder")
        # opset 17 needs IR >= 8 (kept: older runtimes, TensorRT 10.3's parser); INT4 tensors need IR 10
        m.ir_version = 8 if self.opset < 21 else 10
        return m


class _Scope:
    def __init__(self, g: GraphBuilder, scope: str) -> None:
        self.g, self.scope, self.prev = g, scope, g.scope

    def __enter__(self) -> GraphBuilder:
        self.g.scope = self.scope
        return self.g

    def __exit__(self, *exc: object) -> None:
        self.g.scope = self.prev


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write the graph proto only (its initializers already point at the external data file)."""
    path.write_bytes(model.SerializeToString())
