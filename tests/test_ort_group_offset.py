"""`GsmGroupOffset` (plugins/ortCpu, model.cpu.onnx): a float-zero-point projection's offset term and residual,
y = main + (group sums of x) @ offsets (+ residual), against NumPy in float64 from that definition."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NO_ORT_OPS, ORT_OPS_DOMAIN, ort_op_session
from gsm_edge_plugins import ort_ops_library

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

pytestmark = pytest.mark.skipif(ort_ops_library() is None, reason=NO_ORT_OPS)


def session(block: int | None, residual: bool, threads: int, swiglu: int | None = None,
            offsets: int = TensorProto.FLOAT):
    names = ["x", "main", "offsets"] + (["residual"] if residual else [])
    attrs = ({} if block is None else {"block_size": block}) | ({} if swiglu is None else {"swiglu": swiglu})
    node = helper.make_node("GsmGroupOffset", names, ["y"], domain=ORT_OPS_DOMAIN, **attrs)
    return ort_op_session(node, [helper.make_tensor_value_info(n, offsets if n == "offsets" else TensorProto.FLOAT,
                                                               None) for n in names],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], threads)


def reference(x: np.ndarray, main: np.ndarray, offsets: np.ndarray, block: int,
              residual: np.ndarray | None) -> np.ndarray:
    x64, y = x.astype(np.float64), main.astype(np.float64)
    for g in range(offsets.shape[0]):
        y = y + x64[:, g * block:(g + 1) * block].sum(axis=1, keepdims=True) * offsets[g].astype(np.float64)
    return y if residual is None else y + residual


# (M, K, N, block): a decode row at SmolLM2's gate+up and down shapes; 4-row blocks with a remainder row; a last
# group shorter than the block; column counts that leave a tail after the 16- and 32-column strips; one tile only;
# decode rows wide enough to split into column strips on the pool (SmolLM2's LM head; an odd width whose strips
# end mid-vector)
SHAPES = [(1, 576, 3072, 32), (1, 1536, 576, 32), (9, 100, 37, 32), (4, 64, 16, 16), (37, 96, 600, 32),
          (2, 7, 5, 4), (1, 576, 49152, 32), (2, 576, 30001, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("half", [False, True])
def test_matches_numpy(shape, residual, threads, half) -> None:
    """float32 offsets, or float16 ones (a Q4_1 source's, builder/qlinear.py), widened exactly."""
    M, K, N, block = shape
    rng = np.random.default_rng(M * 7 + K)
    G = -(-K // block)
    x, main = rng.standard_normal((M, K), np.float32), rng.standard_normal((M, N), np.float32)
    offsets = rng.standard_normal((G, N), np.float32).astype(np.float16 if half else np.float32)
    res = rng.standard_normal((M, N), np.float32) if residual else None
    feeds = {"x": x, "main": main, "offsets": offsets, **({"residual": res} if residual else {})}
    y = session(block, residual, threads, offsets=TensorProto.FLOAT16 if half else TensorProto.FLOAT).run(
        None, feeds)[0]
    want = reference(x, main, offsets, block, res)
    assert y.shape == (M, N) and y.dtype == np.float32
    # float32 sums of up to K/block + 2 terms of the rounding of a block's sum: a few ulp of the output scale
    assert np.abs(y - want).max() <= 4e-6 * np.abs(want).max(), np.abs(y - want).max()


@pytest.mark.parametrize("field,shape,message", [
    ("offsets", (3, 8), "offsets [3, 8]: expected main [M, N] with x's M and offsets [2, N]"),
    ("main", (3, 8), "main [3, 8]"),
    ("residual", (2, 7), "input residual has shape [2, 7], expected main's [2, 8]"),
])
def test_bad_shape_names_input(field, shape, message) -> None:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 64), np.float32), "main": rng.standard_normal((2, 8), np.float32),
             "offsets": rng.standard_normal((2, 8), np.float32), "residual": rng.standard_normal((2, 8), np.float32)}
    feeds[field] = rng.standard_normal(shape, np.float32)
    with pytest.raises(Exception, match="GsmGroupOffset") as err:
        session(32, True, 1).run(None, feeds)
    assert message in str(err.value)


def test_block_size_is_required() -> None:
    with pytest.raises(Exception, match="GsmGroupOffset: attribute block_size"):
        session(None, False, 1)


def silu_mul(y: np.ndarray) -> np.ndarray:
    a, b = np.split(y.astype(np.float64), 2, axis=1)
    return a / (1.0 + np.exp(-a)) * b


# SmolLM2's gate+up decode row and prefill block; a width that leaves a tail after the 8-lane strips; one column
SWIGLU_SHAPES = [(1, 576, 3072, 32), (37, 576, 3072, 32), (3, 64, 2 * 13, 16), (2, 32, 2, 32)]


@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_swiglu_matches_numpy(shape, threads) -> None:
    """swiglu = 1: silu(gate) * up of the offset-corrected projection [gate; up], against float64 NumPy; the
    inputs span the exponent's clamp (|a| up to ~100) and the sigmoid's flat ends."""
    M, K, N, block = shape
    rng = np.random.default_rng(M + N)
    G = -(-K // block)
    x, main = rng.standard_normal((M, K), np.float32), (rng.standard_normal((M, N)) * 8).astype(np.float32)
    main[0, : min(4, N // 2)] = np.float32([-100.0, 100.0, 90.0, -95.0])[: min(4, N // 2)]
    offsets = (rng.standard_normal((G, N)) * 0.01).astype(np.float32)
    feeds = {"x": x, "main": main, "offsets": offsets}
    y = session(block, False, threads, swiglu=1).run(None, feeds)[0]
    assert y.shape == (M, N // 2) and y.dtype == np.float32
    # the projection itself is test_matches_numpy's; the epilogue against float64 over the op's own sum
    plain = session(block, False, threads).run(None, feeds)[0]
    want = silu_mul(plain)
    # expv within 2 ulp of exp, then one division and one product: a few ulp of each value (and for a -> -inf,
    # where the exponent's clamp keeps exp finite, a value below 1e-35 where the true one is smaller still)
    assert np.all(np.abs(y - want) <= 1e-6 * np.abs(want) + 1e-35), np.max(np.abs(y - want) / (np.abs(want) + 1e-35))
    assert np.abs(silu_mul(reference(x, main, offsets, block, None)) - y).max() <= 1e-5 * np.abs(want).max()


def test_swiglu_refuses_a_residual_an_odd_width_and_other_values() -> None:
    feeds = {"x": np.ones((1, 64), np.float32), "main": np.ones((1, 8), np.float32),
             "offsets": np.ones((2, 8), np.float32), "residual": np.ones((1, 8), np.float32)}
    with pytest.raises(Exception, match="with swiglu = 1 main must have an even width .* no residual"):
        session(32, True, 1, swiglu=1).run(None, feeds)
    odd = {**{k: v for k, v in feeds.items() if k != "residual"}, "main": np.ones((1, 7), np.float32),
           "offsets": np.ones((2, 7), np.float32)}
    with pytest.raises(Exception, match="even width"):
        session(32, False, 1, swiglu=1).run(None, odd)
    with pytest.raises(Exception, match="GsmGroupOffset: attribute swiglu = 2 must be 0 or 1"):
        session(32, False, 1, swiglu=2)


def test_offsets_of_another_type_are_refused() -> None:
    feeds = {"x": np.ones((1, 64), np.float32), "main": np.ones((1, 8), np.float32),
             "offsets": np.ones((2, 8), np.float64)}
    with pytest.raises(Exception, match="input offsets must be float32 or float16"):
        session(32, False, 1, offsets=TensorProto.DOUBLE).run(None, feeds)


def norm_session(block: int, residual: bool, threads: int, eps: float | None = 1e-5, outputs: int = 2):
    """A node with the RMSNorm epilogue: inputs x, main, offsets (float16), residual (empty name when absent),
    norm_weight; outputs y and normed."""
    names = ["x", "main", "offsets", "residual" if residual else "", "norm_weight"]
    attrs = {"block_size": block} | ({} if eps is None else {"norm_epsilon": eps})
    node = helper.make_node("GsmGroupOffset", names, ["y", "normed"][:outputs], domain=ORT_OPS_DOMAIN, **attrs)
    types = {n: TensorProto.FLOAT16 if n == "offsets" else TensorProto.FLOAT for n in names if n}
    return ort_op_session(node, [helper.make_tensor_value_info(n, t, None) for n, t in types.items()],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                           for n in ["y", "normed"][:outputs]], threads)


@pytest.mark.parametrize("shape", [(1, 576, 576, 32), (1, 1536, 576, 32), (37, 96, 600, 32), (2, 7, 5, 4)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_norm_epilogue_matches_numpy(shape, residual, threads) -> None:
    """norm_weight: the second output is y's RMSNorm, y / sqrt(mean(y^2) + eps) * w per row (float64 NumPy over
    the op's own y, and over the float64 reference), y itself as without it."""
    M, K, N, block = shape
    rng = np.random.default_rng(M * 3 + N)
    G = -(-K // block)
    x, main = rng.standard_normal((M, K), np.float32), (rng.standard_normal((M, N)) * 3).astype(np.float32)
    offsets = rng.standard_normal((G, N), np.float32).astype(np.float16)
    res = rng.standard_normal((M, N), np.float32) if residual else None
    w = rng.uniform(0.5, 2.0, N).astype(np.float32)
    feeds = {"x": x, "main": main, "offsets": offsets, "norm_weight": w, **({"residual": res} if residual else {})}
    y, normed = norm_session(block, residual, threads, eps=1e-5).run(None, feeds)
    plain = session(block, residual, threads, offsets=TensorProto.FLOAT16).run(
        None, {k: v for k, v in feeds.items() if k != "norm_weight"})[0]
    np.testing.assert_array_equal(y, plain)

    def rms_norm(a: np.ndarray) -> np.ndarray:
        a = a.astype(np.float64)
        return a / np.sqrt((a * a).mean(axis=1, keepdims=True) + 1e-5) * w

    assert normed.shape == (M, N) and normed.dtype == np.float32
    assert np.abs(normed - rms_norm(y)).max() <= 2e-6 * np.abs(rms_norm(y)).max()
    want = rms_norm(reference(x, main, offsets, block, res))
    assert np.abs(normed - want).max() <= 1e-5 * np.abs(want).max()


def test_norm_epilogue_refusals() -> None:
    feeds = {"x": np.ones((1, 64), np.float32), "main": np.ones((1, 8), np.float32),
             "offsets": np.ones((2, 8), np.float16), "norm_weight": np.ones(8, np.float32)}
    with pytest.raises(Exception, match="norm_weight .* needs shape \\[N\\] = \\[8\\], attribute norm_epsilon"):
        norm_session(32, False, 1, eps=None).run(None, feeds)
    with pytest.raises(Exception, match="norm_weight \\[7\\] needs shape \\[N\\] = \\[8\\]"):
        norm_session(32, False, 1).run(None, {**feeds, "norm_weight": np.ones(7, np.float32)})
    with pytest.raises(Exception, match="attribute norm_epsilon = -1.* must be >= 0"):
        norm_session(32, False, 1, eps=-1.0)
