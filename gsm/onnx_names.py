"""The input names of an ONNX graph file, read without the `onnx` package.

Why: the runtime installs without `onnx` (numpy, onnxruntime, tokenizers), and an ONNX Runtime session
would load the weights only to list the inputs. A bundle's graphs keep their weights in weights.bin, so
the file is small and a few protobuf fields are all there is to walk: ModelProto.graph (7) ->
GraphProto.input (11) -> ValueInfoProto.name (1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

_MODEL_GRAPH, _GRAPH_INPUT, _VALUE_INFO_NAME = 7, 11, 1
_LEN = 2  # protobuf wire type of bytes, strings and sub-messages


class OnnxFormatError(ValueError):
    """The file is not a protobuf message of the shape an ONNX model has."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise OnnxFormatError("truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, end of the value) for each field of the message buf[start:end]."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, j = _varint(buf, i)
        elif wire == 1:
            j = i + 8
        elif wire == _LEN:
            n, i = _varint(buf, i)
            j = i + n
        elif wire == 5:
            j = i + 4
        else:  # 3/4: groups, which ONNX never uses
            raise OnnxFormatError(f"wire type {wire} at byte {i}")
        if j > end:
            raise OnnxFormatError(f"field {number} runs past its message")
        yield number, wire, i, j
        i = j


def _sub(buf: bytes, start: int, end: int, number: int) -> Iterator[tuple[int, int]]:
    for n, wire, i, j in _fields(buf, start, end):
        if n == number and wire == _LEN:
            yield i, j


def onnx_input_names(path: Path) -> list[str]:
    """The graph's declared inputs in order (initializers are not inputs in the graphs the builder writes)."""
    buf = Path(path).read_bytes()
    try:
        return [buf[a:b].decode("utf-8")
                for g0, g1 in _sub(buf, 0, len(buf), _MODEL_GRAPH)
                for v0, v1 in _sub(buf, g0, g1, _GRAPH_INPUT)
                for a, b in _sub(buf, v0, v1, _VALUE_INFO_NAME)]
    except UnicodeDecodeError as e:
        raise OnnxFormatError(f"an input name is not UTF-8 ({e})") from None
