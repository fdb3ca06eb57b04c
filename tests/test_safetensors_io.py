"""Our safetensors reader/writer against the official library, and every header rule.

Tolerances: F32 round trips are exact; F16 is compared with numpy's own cast (exact); BF16 with
torch's round-to-nearest-even cast (exact bits, except NaN payloads).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_file_torch

from gsm.safetensors_io import (
    MAX_HEADER_BYTES,
    LazySafetensors,
    SafetensorsFormatError,
    StreamingSafetensorsWriter,
    TensorSpec,
    f32_to_bf16_bits,
)

RNG = np.random.default_rng(1234)


def _write(path: Path, arrays: dict[str, np.ndarray], dtype: str = "F32",
           metadata: dict[str, str] | None = None) -> None:
    specs = [TensorSpec(n, a.shape, dtype) for n, a in arrays.items()]
    with StreamingSafetensorsWriter(path, specs, metadata) as w:
        for n, a in arrays.items():
            w.write(n, a)


def _arrays() -> dict[str, np.ndarray]:
    return {"w": RNG.standard_normal((7, 5)).astype(np.float32),
            "b": RNG.standard_normal(3).astype(np.float32),
            "empty": np.zeros((0, 4), np.float32),
            "scalar": np.array(2.5, np.float32)}


@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_writer_output_loads_with_official_numpy(tmp_path: Path, dtype: str) -> None:
    a = _arrays()
    _write(tmp_path / "x.safetensors", a, dtype, {"format": "pt"})
    got = load_file(tmp_path / "x.safetensors")
    want_dtype = np.float32 if dtype == "F32" else np.float16
    assert set(got) == set(a)
    for n, v in a.items():
        assert got[n].dtype == want_dtype and got[n].shape == v.shape
        np.testing.assert_array_equal(got[n], v.astype(want_dtype))
    with safe_open(tmp_path / "x.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_bf16_matches_torch_rounding(tmp_path: Path) -> None:
    x = np.concatenate([RNG.standard_normal(1000).astype(np.float32) * 10.0 ** RNG.integers(-30, 30, 1000),
                        np.array([0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.4e38, np.inf, -np.inf,
                                  1e-40, -1e-42], np.float32)]).astype(np.float32)
    _write(tmp_path / "x.safetensors", {"x": x}, "BF16")
    got = load_file_torch(tmp_path / "x.safetensors")["x"]
    assert got.dtype == torch.bfloat16
    want = torch.from_numpy(x).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    back = LazySafetensors(tmp_path / "x.safetensors").array("x")
    np.testing.assert_array_equal(back, want.float().numpy())


def test_bf16_nan_stays_nan() -> None:
    x = np.array([np.nan, -np.nan, np.float32(np.uint32(0x7F800001).view(np.float32))], np.float32)
    bits = f32_to_bf16_bits(x)
    assert np.all((bits & 0x7F80) == 0x7F80) and np.all(bits & 0x007F)


def test_reader_reads_official_files_of_every_dtype(tmp_path: Path) -> None:
    a = {"f64": RNG.standard_normal((2, 3)), "f32": RNG.standard_normal(4).astype(np.float32),
         "f16": RNG.standard_normal(5).astype(np.float16), "i8": np.arange(-3, 3, dtype=np.int8),
         "u8": np.arange(6, dtype=np.uint8), "i32": np.arange(4, dtype=np.int32),
         "i64": np.arange(3, dtype=np.int64), "bool": np.array([True, False])}
    save_file(a, str(tmp_path / "o.safetensors"), metadata={"k": "v"})
    f = LazySafetensors(tmp_path / "o.safetensors")
    assert set(f.names) == set(a) and f.metadata == {"k": "v"}
    for n, v in a.items():
        got = f.array(n)
        if v.dtype.kind == "f":  # float dtypes come back as float32
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, v.astype(np.float32))
        else:
            assert got.dtype == v.dtype
            np.testing.assert_array_equal(got, v)
    assert f.shape("f64") == (2, 3) and f.dtype("i8") == "I8"


def test_chunks_and_nonfinite_scan(tmp_path: Path) -> None:
    x = RNG.standard_normal((100, 37)).astype(np.float32)
    x[5, 3], x[99, 36], x[50, 0] = np.nan, np.inf, -np.inf
    for dtype in ("F32", "F16", "BF16"):
        p = tmp_path / f"{dtype}.safetensors"
        _write(p, {"x": x}, dtype)
        f = LazySafetensors(p)
        chunks = list(f.iter_chunks("x", max_bytes=1000))
        assert len(chunks) > 1 and all(c.nbytes <= 2000 for c in chunks)  # float32 of <=1000 raw bytes
        np.testing.assert_array_equal(np.concatenate(chunks).reshape(x.shape), f.array("x"))
        assert f.count_nonfinite("x", max_bytes=1000) == 3


def test_writer_enforces_order_shape_and_completeness(tmp_path: Path) -> None:
    specs = [TensorSpec("a", (2,), "F32"), TensorSpec("b", (3,), "F16")]
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match="expected tensor 'a' next"):
        w.write("b", np.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(3,\), spec says \(2,\)"):
        w.write("a", np.zeros(3))
    w.write("a", np.zeros(2))
    with pytest.raises(ValueError, match="1 tensor\\(s\\) unwritten, first 'b'"):
        w.close()
    with pytest.raises(ValueError, match="listed twice"):
        StreamingSafetensorsWriter(tmp_path / "y.safetensors", specs + specs[:1])
    with pytest.raises(ValueError, match="dtype 'Q4'"):
        StreamingSafetensorsWriter(tmp_path / "z.safetensors", [TensorSpec("q", (1,), "Q4")])


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=5),
       dtype=st.sampled_from(["F32", "F16", "BF16"]))
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory, shapes: list[list[int]],
                             dtype: str) -> None:
    p = tmp_path_factory.mktemp("rt") / "x.safetensors"
    a = {f"t{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    _write(p, a, dtype)
    official = load_file_torch(p)
    f = LazySafetensors(p)
    for n, v in a.items():
        np.testing.assert_array_equal(f.array(n), official[n].float().numpy())
        assert f.shape(n) == v.shape


# ---- header rules: each hostile file raises SafetensorsFormatError with a stable code --------

def _raw(header: object, data: bytes = b"", n: int | None = None) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(hb) if n is None else n).to_bytes(8, "little") + hb + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]}}


def _entry(**kw: object) -> dict:
    return {**GOOD, "b": {**GOOD["b"], **kw}}


BAD: dict[str, tuple[bytes, str]] = {
    "tiny file": (b"\x01\x02", "SAFETENSORS_TRUNCATED"),
    "absurd length": (_raw(GOOD, bytes(16), n=MAX_HEADER_BYTES + 1), "SAFETENSORS_HEADER_SIZE"),
    "length past end": (_raw(GOOD, bytes(16), n=10_000), "SAFETENSORS_TRUNCATED"),
    "not json": (_raw(b"{nope", bytes(16)), "SAFETENSORS_HEADER_JSON"),
    "not utf8": (_raw(b"\xff\xfe", bytes(16)), "SAFETENSORS_HEADER_JSON"),
    "json list": (_raw([1, 2]), "SAFETENSORS_HEADER_JSON"),
    "duplicate key": (_raw(b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, '
                           b'"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'),
                      "SAFETENSORS_HEADER_JSON"),
    "metadata not str": (_raw({"__metadata__": {"k": 1}, **GOOD}, bytes(16)), "SAFETENSORS_HEADER_JSON"),
    "entry not object": (_raw({**GOOD, "b": 7}, bytes(16)), "SAFETENSORS_ENTRY"),
    "unknown dtype": (_raw(_entry(dtype="F12"), bytes(16)), "SAFETENSORS_DTYPE"),
    "dtype not str": (_raw(_entry(dtype={"x": 1}), bytes(16)), "SAFETENSORS_DTYPE"),
    "negative dim": (_raw(_entry(shape=[-2, -2]), bytes(16)), "SAFETENSORS_ENTRY"),
    "bool dim": (_raw(_entry(shape=[True, 4]), bytes(16)), "SAFETENSORS_ENTRY"),
    "shape not list": (_raw(_entry(shape=4), bytes(16)), "SAFETENSORS_ENTRY"),
    "offsets reversed": (_raw(_entry(data_offsets=[16, 8]), bytes(16)), "SAFETENSORS_OFFSETS"),
    "offsets wrong size": (_raw(_entry(data_offsets=[8, 15]), bytes(16)), "SAFETENSORS_OFFSETS"),
    "overlap": (_raw({**GOOD, "c": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                     bytes(24)), "SAFETENSORS_OFFSETS"),
    "gap": (_raw(_entry(data_offsets=[12, 20]), bytes(20)), "SAFETENSORS_OFFSETS"),
    "trailing bytes": (_raw(GOOD, bytes(20)), "SAFETENSORS_OFFSETS"),
    "truncated data": (_raw(GOOD, bytes(12)), "SAFETENSORS_TRUNCATED"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_hostile_header_rejected(tmp_path: Path, case: str) -> None:
    raw, code = BAD[case]
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    with pytest.raises(SafetensorsFormatError) as ei:
        LazySafetensors(p)
    assert ei.value.code == code
    assert str(p) in str(ei.value)


def test_good_handmade_header_accepted(tmp_path: Path) -> None:
    p = tmp_path / "ok.safetensors"
    p.write_bytes(_raw({"__metadata__": {"k": "v"}, **GOOD}, np.arange(2, dtype="<f4").tobytes()
                       + np.ones(4, "<f2").tobytes()))
    f = LazySafetensors(p)
    np.testing.assert_array_equal(f.array("b"), np.ones((2, 2), np.float32))
    assert f.metadata == {"k": "v"}
    np.testing.assert_array_equal(load_file(p)["a"], f.array("a"))
