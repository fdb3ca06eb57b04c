"""Our own safetensors reader and streaming writer.

Why not just `safetensors.safe_open`: the checker must say *what* is wrong with a hostile or
truncated file (the official library answers with one generic error, or maps a gigabyte before
failing), and the converter/synthesiser must write multi-gigabyte checkpoints one tensor at a time
(`safetensors.numpy.save_file` wants every tensor in memory at once). The format is simple:

    [u64 little-endian N][N bytes of JSON header][data region]

where the header maps tensor names to {dtype, shape, data_offsets: [begin, end]} relative to the
data region, plus an optional `__metadata__` str -> str map. The reader trusts nothing: every
rule below is checked before a byte of tensor data is read, and violations raise
`SafetensorsFormatError` carrying a stable `code` the checker reports.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MAX_HEADER_BYTES = 100 << 20  # no honest header is this big; refuse before allocating it
_ALIGN = 8  # the official writer pads the header so the data region starts 8-byte aligned

# safetensors dtype -> (numpy dtype of the stored bytes, itemsize)
_STORAGE: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: keep the raw bits, widen on read
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
DTYPES = frozenset(_STORAGE)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
WRITABLE_DTYPES = DTYPES


class SafetensorsFormatError(ValueError):
    """A safetensors file breaks the format; `code` is a stable name of the broken rule."""

    def __init__(self, path: str | os.PathLike[str], tensor: str | None, message: str,
                 *, code: str = "SAFETENSORS_ENTRY") -> None:
        where = f"{path}" + (f" tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.tensor = tensor
        self.message = message
        self.code = code


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; `begin`/`end` are absolute file offsets (header already accounted for)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class TensorSpec:
    """What the streaming writer will write: name, shape and safetensors dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _STORAGE[self.dtype].itemsize


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate the header of `path` against the file size; return entries and metadata."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise SafetensorsFormatError(path, None, f"file is {size} bytes, shorter than the 8-byte "
                                     "header length", code="SAFETENSORS_TRUNCATED")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise SafetensorsFormatError(path, None, f"header length {n} exceeds the "
                                         f"{MAX_HEADER_BYTES}-byte limit",
                                         code="SAFETENSORS_HEADER_SIZE")
        if n > size - 8:
            raise SafetensorsFormatError(path, None, f"header length {n} exceeds the {size - 8} "
                                         "bytes after the length field", code="SAFETENSORS_TRUNCATED")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsFormatError(path, None, f"header is not valid UTF-8 JSON ({e})",
                                     code="SAFETENSORS_HEADER_JSON") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(path, None, f"header is a JSON {type(header).__name__}, "
                                     "expected an object", code="SAFETENSORS_HEADER_JSON")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise SafetensorsFormatError(path, "__metadata__", "must map strings to strings",
                                     code="SAFETENSORS_HEADER_JSON")
    data_start = 8 + n
    entries = {name: _parse_entry(path, name, e, data_start) for name, e in header.items()}
    _check_layout(path, entries, data_start, size)
    return entries, metadata


def _parse_entry(path: Path, name: str, e: Any, data_start: int) -> TensorInfo:
    if not isinstance(e, dict):
        raise SafetensorsFormatError(path, name, "entry must be an object with dtype, shape and "
                                     "data_offsets")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsFormatError(path, name, f"dtype {dtype!r} is not one of {sorted(DTYPES)}",
                                     code="SAFETENSORS_DTYPE")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise SafetensorsFormatError(path, name, f"shape {shape!r} must be a list of "
                                     "non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise SafetensorsFormatError(path, name, f"data_offsets {offsets!r} must be [begin, end] "
                                     "with 0 <= begin <= end", code="SAFETENSORS_OFFSETS")
    want = math.prod(shape) * _STORAGE[dtype].itemsize
    if offsets[1] - offsets[0] != want:
        raise SafetensorsFormatError(path, name, f"data_offsets {offsets} span "
                                     f"{offsets[1] - offsets[0]} bytes, {dtype}{shape} needs {want}",
                                     code="SAFETENSORS_OFFSETS")
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_layout(path: Path, entries: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """Tensors must tile the data region exactly: sorted, no gap, no overlap, nothing after."""
    pos = data_start
    for t in sorted(entries.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise SafetensorsFormatError(path, t.name, f"data starts at byte {t.begin - data_start} "
                                         f"of the data region, expected {pos - data_start} ({what})",
                                         code="SAFETENSORS_OFFSETS")
        pos = t.end
    if pos > size:
        raise SafetensorsFormatError(path, None, f"header describes {pos - data_start} data bytes, "
                                     f"file holds {size - data_start}: truncated",
                                     code="SAFETENSORS_TRUNCATED")
    if pos < size:
        raise SafetensorsFormatError(path, None, f"{size - pos} bytes after the last tensor are "
                                     "not covered by the header", code="SAFETENSORS_OFFSETS")


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 -> float32 (exact: bf16 is the top half of an f32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as uint16, round to nearest even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    # NaN: rounding could carry into the exponent and give Inf; keep the sign, force quiet NaN.
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x0040, rounded).astype(np.uint16)


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_bits_to_f32(raw)
    return raw.astype(np.float32, copy=False)


class LazySafetensors:
    """Validated header of one file; tensors are read one at a time, only when asked."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries, self.metadata = parse_header(self.path)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def info(self, name: str) -> TensorInfo:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        return self.info(name).dtype

    def _read(self, f: BinaryIO, t: TensorInfo, offset: int, count: int) -> np.ndarray:
        st = _STORAGE[t.dtype]
        f.seek(t.begin + offset * st.itemsize)
        buf = f.read(count * st.itemsize)
        if len(buf) != count * st.itemsize:
            raise SafetensorsFormatError(self.path, t.name, "file ended inside the tensor data "
                                         "(changed since its header was read?)",
                                         code="SAFETENSORS_TRUNCATED")
        return np.frombuffer(buf, dtype=st)

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (BF16 as uint16 bits), shaped, writable."""
        t = self.info(name)
        with open(self.path, "rb") as f:
            return self._read(f, t, 0, t.numel).reshape(t.shape).copy()

    def array(self, name: str) -> np.ndarray:
        """The tensor; float dtypes widened/narrowed to float32, others in their own dtype."""
        t = self.info(name)
        raw = self.raw(name)
        return _to_float32(raw, t.dtype) if t.dtype in FLOAT_DTYPES else raw

    def iter_raw_chunks(self, name: str, max_bytes: int = 16 << 20) -> Iterator[np.ndarray]:
        """Flat chunks of the stored elements, each at most max_bytes (at least one element)."""
        t = self.info(name)
        per = max(1, max_bytes // _STORAGE[t.dtype].itemsize)
        with open(self.path, "rb") as f:
            for start in range(0, t.numel, per):
                yield self._read(f, t, start, min(per, t.numel - start))

    def iter_chunks(self, name: str, max_bytes: int = 16 << 20) -> Iterator[np.ndarray]:
        """Flat chunks as float32 (float dtypes) for scans that must not load a whole tensor."""
        dtype = self.dtype(name)
        for raw in self.iter_raw_chunks(name, max_bytes):
            yield _to_float32(raw, dtype) if dtype in FLOAT_DTYPES else raw

    def count_nonfinite(self, name: str, max_bytes: int = 16 << 20) -> int:
        """NaN/Inf elements of a float tensor, scanned chunk by chunk on the stored bits."""
        dtype = self.dtype(name)
        if dtype not in FLOAT_DTYPES:
            return 0
        n = 0
        for raw in self.iter_raw_chunks(name, max_bytes):
            if dtype == "BF16":  # exponent all ones <=> Inf or NaN
                n += int(np.count_nonzero((raw & 0x7F80) == 0x7F80))
            else:
                n += raw.size - int(np.count_nonzero(np.isfinite(raw)))
        return n


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor: header first (offsets follow from the specs).

    Peak memory is one tensor (plus one cast chunk), whatever the file size. Tensors must be
    written in spec order; `close()` fails if any is missing. Use as a context manager: on an
    exception the file is closed without the completeness check (the caller's atomic directory
    throws it away).
    """

    _CAST_CHUNK = 8 << 20  # elements cast per step, bounding the extra copy

    def __init__(self, path: str | os.PathLike[str], specs: list[TensorSpec],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = list(specs)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        pos = 0
        for s in self.specs:
            if s.dtype not in WRITABLE_DTYPES:
                raise ValueError(f"{self.path}: tensor {s.name!r}: dtype {s.dtype!r} is not one of "
                                 f"{sorted(WRITABLE_DTYPES)}")
            if s.name in header or s.name == "__metadata__":
                raise ValueError(f"{self.path}: tensor {s.name!r} listed twice")
            if not all(_is_uint(d) for d in s.shape):
                raise ValueError(f"{self.path}: tensor {s.name!r}: bad shape {s.shape}")
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape),
                              "data_offsets": [pos, pos + s.nbytes]}
            pos += s.nbytes
        self.data_bytes = pos
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % _ALIGN)
        self._f: BinaryIO | None = open(self.path, "wb")
        self._f.write(len(blob).to_bytes(8, "little") + blob)
        self._total = 8 + len(blob) + self.data_bytes
        self._next = 0

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._f is not None:
            self._f.close()
            self._f = None

    def write(self, name: str, array: np.ndarray) -> None:
        """Cast `array` to the spec's dtype and append it; must be the next spec in order."""
        if self._f is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: tensor {name!r} written, but all "
                             f"{len(self.specs)} specs are already written")
        spec = self.specs[self._next]
        if name != spec.name:
            raise ValueError(f"{self.path}: expected tensor {spec.name!r} next (spec order), "
                             f"got {name!r}")
        a = np.asarray(array)
        if tuple(a.shape) != spec.shape:
            raise ValueError(f"{self.path}: tensor {name!r} has shape {tuple(a.shape)}, "
                             f"spec says {spec.shape}")
        flat = a.reshape(-1)
        for i in range(0, flat.size, self._CAST_CHUNK):
            self._f.write(_cast(flat[i:i + self._CAST_CHUNK], spec.dtype).tobytes())
        self._next += 1

    def close(self) -> None:
        """Finish the file; raises if some spec was never written."""
        if self._f is None:
            return
        missing = [s.name for s in self.specs[self._next:]]
        written = self._f.tell()
        self._f.close()
        self._f = None
        if missing:
            raise ValueError(f"{self.path}: closed with {len(missing)} tensor(s) unwritten, first "
                             f"{missing[0]!r}")
        if written != self._total:
            raise OSError(f"{self.path}: wrote {written} bytes, expected {self._total}")


def _cast(chunk: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16_bits(chunk.astype(np.float32, copy=False))
    return chunk.astype(_STORAGE[dtype], copy=False)
