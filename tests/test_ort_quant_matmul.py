"""`GsmQuantMatMul` (plugins/ortCpu, model.cpu.onnx of a `fast` build): a quantised projection (symmetric 4-/8-bit,
or 4-bit on the float-zero-point grid with its offset term) over the tiles `builder.qlinear.quant_tiles` packs, against
NumPy from the op's definition (plugins/ortCpu/GsmQuantMatMul/gsmQuantMatMul.h): INT8 activations per group,
w = scale * (u - 2^(bits-1)) [+ offset]."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import NO_ORT_OPS, ORT_OPS_DOMAIN, ort_op_session
from gsm_edge_plugins import ort_ops_library

from builder.qlinear import quant_tiles
from builder.wquant import WeightQuantConfig, WeightQuantError, quantize

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

needs_ops = pytest.mark.skipif(ort_ops_library() is None, reason=NO_ORT_OPS)
ASYM_F = WeightQuantConfig(4, 32, symmetric=False, float_zero_point=True)
CONFIGS = {"int4 asym-f g32": ASYM_F, "int4 sym g32": WeightQuantConfig(4, 32),
           "int4 sym g128": WeightQuantConfig(4, 128), "int8 g32": WeightQuantConfig(8, 32),
           "int8 g64": WeightQuantConfig(8, 64)}
FLOAT_TYPES = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}


def weight(n: int, k: int, seed: int, cfg: WeightQuantConfig = ASYM_F):
    return quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), cfg)


def test_tiles_by_hand() -> None:
    """Every byte, scale and offset (min + 8 scale) at the place the op's header gives it, by explicit loops; padding
    rows are zero."""
    q = weight(20, 70, 0)  # 2 tiles (12 padding rows), 3 blocks (26 padding inputs)
    codes, scales, offsets = quant_tiles(q)
    assert codes.shape == (2, 3, 256) and scales.shape == offsets.shape == (2, 3, 16)
    want_offsets = q.mins.astype(np.float64) + 8 * q.scales.astype(np.float64)
    u = np.zeros((32, 96), np.int64)
    u[:20] = q.codes
    for t in range(2):
        for b in range(3):
            for p in range(4):
                for r in range(16):
                    for j in range(4):
                        k = 32 * b + 8 * p + j
                        assert codes[t, b, 64 * p + 4 * r + j] == u[16 * t + r, k] | u[16 * t + r, k + 4] << 4
                for r in range(16):
                    n = 16 * t + r
                    assert scales[t, b, r] == (q.scales[n, b] if n < 20 else 0)
                    assert offsets[t, b, r] == (np.float32(want_offsets[n, b]) if n < 20 else 0)
    assert scales.dtype == np.float16  # the scales are float16 values (WeightQuantConfig.scale_dtype)
    assert offsets.dtype == np.float32  # the offsets of random weights are not


def test_8bit_tiles_by_hand() -> None:
    """8-bit: byte (t, s, p, r, j) = u(16t+r, 32s+4p+j); groups of 64 are two sub-blocks; no offsets."""
    q = weight(18, 100, 1, WeightQuantConfig(8, 64))  # 2 tiles, 2 groups of 64 = 4 sub-blocks (28 padding inputs)
    codes, scales, offsets = quant_tiles(q)
    assert codes.shape == (2, 4, 512) and scales.shape == (2, 2, 16) and offsets is None
    u = np.full((32, 128), 0, np.int64)
    u[:18] = q.codes
    for t in range(2):
        for s_ in range(4):
            for p in range(8):
                for r in range(16):
                    for j in range(4):
                        assert codes[t, s_, 64 * p + 4 * r + j] == u[16 * t + r, 32 * s_ + 4 * p + j]


def test_tiles_refuse_other_grids() -> None:
    with pytest.raises(WeightQuantError, match="GsmQuantMatMul"):  # an integer zero point of its own per group
        quant_tiles(quantize(np.ones((16, 64), np.float32), WeightQuantConfig(4, 32, symmetric=False)))
    with pytest.raises(WeightQuantError, match="GsmQuantMatMul"):  # groups of 16
        quant_tiles(quantize(np.ones((16, 64), np.float32), WeightQuantConfig(4, 16)))


def model(k: int, n: int, codes, scales, offsets, *, bits: int = 4, block: int = 32, residual: bool = False,
          swiglu: bool = False, norm: bool = False):
    names = ["x", "codes", "scales", "offsets" if offsets is not None else ""]
    names += ["residual"] if residual else [""] if norm else []
    names += ["norm_weight"] if norm else []
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block} | ({"swiglu": 1} if swiglu else {}) | (
        {"norm_epsilon": 1e-5} if norm else {})
    outs = ["y", "normed"] if norm else ["y"]
    node = helper.make_node("GsmQuantMatMul", names, outs, domain=ORT_OPS_DOMAIN, **attrs)
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    inits += [] if offsets is None else [numpy_helper.from_array(offsets, "offsets")]
    ins = [helper.make_tensor_value_info(i, TensorProto.FLOAT, None) for i in ("x", "residual", "norm_weight")
           if i in names]
    g = helper.make_graph([node], "q4", ins, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ORT_OPS_DOMAIN, 1)])
    m.ir_version = 8
    return m


def session(m, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(str(ort_ops_library()))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def reference(x: np.ndarray, q) -> np.ndarray:
    """float64 of the definition: per row and group, dx = max|x| / 127 (float32), xq = round-half-even(x / dx)
    (x times the float32 1 / dx), S = the group's sum; y = sum_b dot(u - z, xq) dx scale [+ (min + 8 scale) S]."""
    m, k = x.shape
    bl, z = q.block, 1 << (q.cfg.bits - 1)
    g = -(-k // bl)
    xb = np.zeros((m, g * bl), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(m, g, bl)
    dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)
    u = q.codes.astype(np.int64).reshape(q.n, g, bl) - z
    dots = np.einsum("ngk,mgk->mng", u, xq).astype(np.float64)
    y = dots * dx[:, None, :] * q.scales[None]
    if q.cfg.float_zero_point:
        offsets = q.mins.astype(np.float64) + z * q.scales.astype(np.float64)
        y = y + offsets[None] * xb.astype(np.float64).sum(-1)[:, None, :]
    return y.sum(-1)


def dense(x: np.ndarray, q) -> np.ndarray:
    from builder.wquant import dequantize

    return x.astype(np.float64) @ dequantize(q).T.astype(np.float64)


# (M, K, N): decode rows at SmolLM2's q / gate+up / down shapes and its LM head (split into parts on the pool); 4-row
# groups with a remainder; K not a multiple of 32 and N not of 16; a prefill chunk (tiles of 8 on the pool)
SHAPES = [(1, 576, 576), (1, 576, 3072), (1, 1536, 576), (1, 576, 49152), (5, 100, 37), (3, 64, 16), (9, 96, 200),
          (67, 576, 600)]


CASES = [(shape, config) for shape in SHAPES for config in CONFIGS
         if shape[2] != 49152 or config == "int4 asym-f g32"]  # the head's shape once


@needs_ops
@pytest.mark.parametrize("shape,config", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_numpy(shape, config, threads) -> None:
    M, K, N = shape
    cfg = CONFIGS[config]
    q = weight(N, K, M * 7 + K, cfg)
    x = np.random.default_rng(N).standard_normal((M, K)).astype(np.float32)
    x[:, ::37] *= 20  # outlier inputs: the per-block scale matters
    y = session(model(K, N, *quant_tiles(q), bits=cfg.bits, block=q.block), threads).run(None, {"x": x})[0]
    want = reference(x, q)
    assert y.shape == (M, N) and y.dtype == np.float32
    # float32 fused multiply-adds over G blocks: a few ulp of the output scale
    assert np.abs(y - want).max() <= 4e-6 * np.abs(want).max(), np.abs(y - want).max()
    # and it is the layer: INT8 activations in blocks of 32 keep it within a few percent of the float64 product
    ref = dense(x, q)
    assert np.abs(y - ref).max() <= 0.03 * np.abs(ref).max()


@needs_ops
@pytest.mark.parametrize("half", [False, True])
def test_float16_or_float32_parameters(half) -> None:
    """Scales and offsets as the tiles hold them (float16 where exact, a Q4_1 source's) or both float32: same values."""
    q = weight(48, 96, 3)
    q.mins[:] = (q.mins + 8 * q.scales).astype(np.float16) - 8 * q.scales  # float16 offsets, as a Q4_1 source's
    codes, scales, offsets = quant_tiles(q)
    assert offsets.dtype == np.float16
    if not half:
        scales, offsets = scales.astype(np.float32), offsets.astype(np.float32)
    x = np.random.default_rng(1).standard_normal((2, 96)).astype(np.float32)
    y = session(model(96, 48, codes, scales, offsets), 1).run(None, {"x": x})[0]
    want = reference(x, q)
    assert np.abs(y - want).max() <= 4e-6 * np.abs(want).max()


@needs_ops
@pytest.mark.parametrize("M,threads", [(3, 1), (37, 2)])
def test_residual_swiglu_norm(M, threads) -> None:
    """The epilogues GsmGroupOffset has: + residual; silu(gate) * up; the RMSNorm of (product + residual). 37 rows on
    2 threads: the epilogues' passes on the pool (more than a tile of 16 rows)."""
    rng = np.random.default_rng(5)
    K, N = 64, 32
    q = weight(N, K, 9)
    x = rng.standard_normal((M, K)).astype(np.float32)
    tiles = quant_tiles(q)
    base = reference(x, q)
    res = rng.standard_normal((M, N)).astype(np.float32)
    y = session(model(K, N, *tiles, residual=True), threads).run(None, {"x": x, "residual": res})[0]
    assert np.abs(y - (base + res)).max() <= 4e-6 * np.abs(base + res).max()
    y = session(model(K, N, *tiles, swiglu=True), threads).run(None, {"x": x})[0]
    h = N // 2
    want = base[:, :h] / (1 + np.exp(-base[:, :h])) * base[:, h:]
    assert y.shape == (M, h) and np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    w = rng.standard_normal(N).astype(np.float32)
    y, normed = session(model(K, N, *tiles, residual=True, norm=True), threads).run(
        None, {"x": x, "residual": res, "norm_weight": w})
    s = base + res
    want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w
    assert np.abs(y - s).max() <= 4e-6 * np.abs(s).max() and np.abs(normed - want).max() <= 1e-5 * np.abs(want).max()


_KERNEL_RUN = """
import json, sys
import numpy as np
sys.path[:0] = {path}
import test_ort_quant_matmul as t
ys = []
for cfg in t.CONFIGS.values():
    q = t.weight(200, 200, 11, cfg)
    x = np.random.default_rng(2).standard_normal((6, 200)).astype(np.float32)
    y = t.session(t.model(200, 200, *t.quant_tiles(q), bits=cfg.bits, block=q.block), 2).run(None, {{"x": x}})[0]
    ys += y.view(np.uint32).ravel().tolist()
print(json.dumps(ys))
"""


@needs_ops
def test_kernels_give_the_same_bits() -> None:
    """The generic, AVX2 and AVX-512 VNNI kernels (GSM_ORT_QMM_KERNEL picks a lower one; a CPU without one runs the
    next) spell the same fused multiply-adds in the same order: identical outputs, not merely close, for every grid."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _KERNEL_RUN.format(path=[here, os.path.dirname(here)])
    outs = {}
    for kernel in ("", "avx2", "generic"):
        env = dict(os.environ, GSM_ORT_QMM_KERNEL=kernel)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs[kernel] = json.loads(r.stdout)
    assert outs[""] == outs["avx2"] == outs["generic"]


@needs_ops
@pytest.mark.parametrize("field,shape,message", [
    ("codes", (2, 3, 128), "codes [2, 3, 128], scales [2, 3, 16], offsets [2, 3, 16]: expected [2, 3, 256] and "
                           "[2, 3, 16]"),
    ("scales", (2, 2, 16), "scales [2, 2, 16], offsets [2, 3, 16]: expected [2, 3, 256] and [2, 3, 16]"),
    ("x", (4, 90), "input x has shape [4, 90], expected [M, 70]"),
])
def test_bad_shape_names_input(field, shape, message) -> None:
    q = weight(20, 70, 0)
    codes, scales, offsets = quant_tiles(q)
    arrays = {"codes": codes, "scales": scales, "offsets": offsets}
    x = np.zeros((4, 70), np.float32)
    if field == "x":
        x = np.zeros(shape, np.float32)
    else:
        arrays[field] = np.zeros(shape, arrays[field].dtype)
    with pytest.raises(Exception, match="GsmQuantMatMul") as err:
        session(model(70, 20, **arrays), 1).run(None, {"x": x})
    assert message in str(err.value)


@needs_ops
def test_k_and_n_are_required() -> None:
    node = helper.make_node("GsmQuantMatMul", ["x", "codes", "scales", "offsets"], ["y"], domain=ORT_OPS_DOMAIN, K=64,
                            bits=4, block_size=32)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT if n != "codes" else TensorProto.UINT8, None)
           for n in ("x", "codes", "scales", "offsets")]
    with pytest.raises(Exception, match="attribute N"):
        ort_op_session(node, ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]).run(
            None, {"x": np.zeros((1, 64), np.float32), "codes": np.zeros((1, 2, 256), np.uint8),
                   "scales": np.zeros((1, 2, 16), np.float32), "offsets": np.zeros((1, 2, 16), np.float32)})


@needs_ops
@pytest.mark.parametrize("M", [1, 9])
def test_threads_do_not_change_bits(M) -> None:
    """A decode row's tiles split into parts on the pool (SmolLM2's q: 2 parts at 2^17 multiply-adds), a prefill's in
    parts of 8 tiles: each tile is computed alike whichever thread runs it."""
    q = weight(576, 576, 4, CONFIGS["int8 g32"])
    x = np.random.default_rng(3).standard_normal((M, 576)).astype(np.float32)
    m = model(576, 576, *quant_tiles(q), bits=8, block=32)
    one, two = (session(m, t).run(None, {"x": x})[0] for t in (1, 2))
    assert np.array_equal(one, two)


def gather_model(k: int, n: int, codes, scales, offsets, *, bits: int, block: int):
    names = ["ids", "codes", "scales"] + (["offsets"] if offsets is not None else [])
    node = helper.make_node("GsmTileGather", names, ["y"], domain=ORT_OPS_DOMAIN, K=k, N=n, bits=bits,
                            block_size=block)
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    inits += [] if offsets is None else [numpy_helper.from_array(offsets, "offsets")]
    g = helper.make_graph([node], "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ORT_OPS_DOMAIN, 1)])
    m.ir_version = 8
    return m


@needs_ops
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_tile_gather_rows_are_the_dequantised_weight(config: str) -> None:
    """GsmTileGather (an embedding tied to a tiled LM head) returns rows ids of the weight as the portable graph's
    GatherBlockQuantized (+ the float zero point's offsets) dequantises them: float32(u - z) * scale, rounded, then +
    offset, rounded; bit for bit, rows of a last partial tile and ids repeated or in any order included."""
    cfg = CONFIGS[config]
    n, k = 37, 160 if cfg.group_size <= 32 else 256  # 37 rows: the last tile is partial
    q = weight(n, k, 11, cfg)
    ids = np.array([[0, 36, 5], [5, 17, 31]], np.int64)
    y = session(gather_model(k, n, *quant_tiles(q), bits=cfg.bits, block=q.block), 1).run(None, {"ids": ids})[0]
    u = q.codes[:, :k].astype(np.int32) - (1 << (cfg.bits - 1))
    scale = np.repeat(q.scales, q.block, axis=1)[:, :k].astype(np.float32)
    want = u.astype(np.float32) * scale  # float32: one rounding
    if cfg.float_zero_point:
        want = want + np.repeat(q.group_offsets(), q.block, axis=1)[:, :k].astype(np.float32)
    assert y.shape == (ids.size, k)
    np.testing.assert_array_equal(y.view(np.int32), want[ids.reshape(-1)].view(np.int32))


@needs_ops
def test_tile_gather_names_an_id_out_of_range() -> None:
    q = weight(20, 64, 12)
    s = session(gather_model(64, 20, *quant_tiles(q), bits=4, block=32), 1)
    with pytest.raises(Exception, match=r"GsmTileGather: ids\[1\] = 20 is outside \[0, 20\)"):
        s.run(None, {"ids": np.array([3, 20], np.int64)})
