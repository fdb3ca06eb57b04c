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
ALIGN = 4096  # external data offsets aligned to a page, so runtimes can mmap each tensor

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.uint8): TensorProto.UINT8}


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple[int, ...]
    dtype: np.dtype
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
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} stored twice")
        a = np.ascontiguousarray(array)
        pos = self._f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
        offset = pos + pad
        self._f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        self.tensors[name] = StoredTensor(tuple(a.shape), a.dtype, offset, a.nbytes)
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, a.nbytes)
        return name

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
        self.tensors[name] = StoredTensor(tuple(shape), np.dtype(np.float32), offset, n * 4)
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
        t.data_type = _NP_TO_ONNX[s.dtype]
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

    def __init__(self, store: WeightStore) -> None:
        self.store = store
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
        node_name = name or (f"{self.scope}/{op_type}_{self._n}" if self.scope else f"{op_type}_{self._n}")
        self._n += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain or None,
                                           **attrs))
        return outs[0] if len(outs) == 1 else outs

    def model(self, graph_name: str, *, extra_opsets: dict[str, int] | None = None,
              doc: str = "") -> onnx.ModelProto:
        inits = [self.store.initializer(n) for n in self.external] + self.consts
        g = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, initializer=inits, doc_string=doc)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
        m = helper.make_model(g, opset_imports=opsets, producer_name="gsm-edge builder")
        m.ir_version = 8  # opset 17 needs IR >= 8; keeps older runtimes (TensorRT 10.3's parser) happy
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
