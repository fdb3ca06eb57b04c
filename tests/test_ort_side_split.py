"""`GsmSideSplit` (plugins/ortCpu, model.cpu.onnx): an owning layer's GSM-side projection scaled, split and rounded
as the cache holds it, against NumPy from the definition (the portable graph's Mul, Split, FP16 Casts and INT8 key
codes: decisions "INT8 indexer keys"). Every step is one IEEE rounding, so the comparison is exact."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NO_ORT_OPS, ORT_OPS_DOMAIN, ort_op_session
from gsm_edge_plugins import ort_ops_library

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

pytestmark = pytest.mark.skipif(ort_ops_library() is None, reason=NO_ORT_OPS)
OUTS = ["latent_k", "latent_v", "index_key", "index_q", "index_w"]


def session(widths: list[int] | None, key_type: int, threads: int = 1):
    attrs = {} if widths is None else {"widths": widths}
    node = helper.make_node("GsmSideSplit", ["y", "scale", "batch_shape", "keys_like"], OUTS, domain=ORT_OPS_DOMAIN,
                            **attrs)
    ins = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
           helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
           helper.make_tensor_value_info("batch_shape", TensorProto.INT64, None),
           helper.make_tensor_value_info("keys_like", key_type, None)]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in OUTS]
    outs[2] = helper.make_tensor_value_info("index_key", key_type, None)
    return ort_op_session(node, ins, outs, threads)


def reference(y: np.ndarray, scale: np.ndarray, widths: list[int], int8_keys: bool, b: int, s: int) -> list[np.ndarray]:
    v = y * scale  # float32 product: one rounding
    parts = np.split(v, np.cumsum(widths)[:-1], axis=1)
    out = [p.reshape(b, s, -1) for p in parts]
    with np.errstate(invalid="ignore", over="ignore"):  # overflow to infinity is the point of the hard inputs
        out[0] = out[0].astype(np.float16).astype(np.float32)
        out[1] = out[1].astype(np.float16).astype(np.float32)
        out[2] = (np.clip(np.rint(out[2]), -127, 127).astype(np.int8) if int8_keys else out[2].astype(np.float16))
    return out


def inputs(rng: np.random.Generator, m: int, widths: list[int], hard: bool) -> tuple[np.ndarray, np.ndarray]:
    W = sum(widths)
    y = (rng.standard_normal((m, W)) * 40).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, W).astype(np.float32)
    if hard:  # ties of rint (x.5 with scale 1), FP16 rounding ties and overflow, codes past +-127
        scale[:] = 1.0
        k0 = widths[0] + widths[1]
        y[:, k0:k0 + widths[2]] = rng.choice(np.float32([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.5, 300.0,
                                                         -1e6]), (m, widths[2]))
        # halfway between two FP16 neighbours of 1.0 (1 + 2^-11: ties to even 1.0; 1 + 3 * 2^-11: up), and past
        # the largest FP16 (rounds to infinity)
        y[:, :widths[0]] = rng.choice(np.float32([1 + 2 ** -11, 1 + 3 * 2 ** -11, 65520.0, -7e4, 6e-8, 3e-8]),
                                      (m, widths[0]))
    return y, scale


# SmolLM2's decode row (rk 187, rv 192, dI 32, nI 3), a prefill chunk over the pool's threshold, a batch, odd widths
CASES = [(1, 1, [187, 192, 32, 96, 3]), (1, 96, [187, 192, 32, 96, 3]), (3, 5, [7, 9, 4, 8, 2]),
         (2, 1, [1, 1, 1, 1, 1])]


@pytest.mark.parametrize("b,s,widths", CASES)
@pytest.mark.parametrize("int8_keys", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hard", [False, True])
def test_matches_numpy_exactly(b, s, widths, int8_keys, threads, hard) -> None:
    rng = np.random.default_rng(b * 31 + s + sum(widths))
    y, scale = inputs(rng, b * s, widths, hard)
    key_type = TensorProto.INT8 if int8_keys else TensorProto.FLOAT16
    keys_like = np.zeros((4, 6, widths[2]), np.int8 if int8_keys else np.float16)
    got = session(widths, key_type, threads).run(None, {"y": y, "scale": scale, "batch_shape": np.int64([b, s]),
                                                        "keys_like": keys_like})
    want = reference(y, scale, widths, int8_keys, b, s)
    for name, g, w in zip(OUTS, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        # bit for bit (NaN-free inputs; -0 and +0 told apart through the bits)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (name, np.argwhere(g != w)[:4])


@pytest.mark.parametrize("field,value,message", [
    ("y", np.zeros((2, 9), np.float32), "input y has shape [2, 9], expected [M, 10] (the sum of widths)"),
    ("scale", np.ones(9, np.float32), "input scale has shape [9], expected [10]"),
    ("batch_shape", np.int64([3, 1]), "input batch_shape = [3, 1] does not give y's 2 rows (B * S)"),
    ("keys_like", np.zeros((1, 3), np.int8), "input keys_like has shape [1, 3], expected a last axis of 2"),
])
def test_bad_input_names_it(field, value, message) -> None:
    feeds = {"y": np.zeros((2, 10), np.float32), "scale": np.ones(10, np.float32), "batch_shape": np.int64([2, 1]),
             "keys_like": np.zeros((1, 2), np.int8)}
    feeds[field] = value
    with pytest.raises(Exception, match="GsmSideSplit") as err:
        session([3, 3, 2, 1, 1], TensorProto.INT8).run(None, feeds)
    assert message in str(err.value)


def test_key_type_must_be_the_caches() -> None:
    feeds = {"y": np.zeros((1, 10), np.float32), "scale": np.ones(10, np.float32), "batch_shape": np.int64([1, 1]),
             "keys_like": np.zeros((1, 2), np.float32)}
    with pytest.raises(Exception, match="keys_like must be float16 or int8"):
        session([3, 3, 2, 1, 1], TensorProto.FLOAT).run(None, feeds)


@pytest.mark.parametrize("widths,message", [(None, "attribute widths must be 5 int64"),
                                            ([3, 3, 2, 1], "attribute widths must be 5 int64"),
                                            ([3, 0, 2, 1, 1], "every width must be positive")])
def test_bad_widths_are_refused(widths, message) -> None:
    with pytest.raises(Exception, match=message):
        session(widths, TensorProto.INT8)
