"""libgsm_ort_ops.so (plugins/ortCpu): the ONNX Runtime CPU op GsmCachedAttention against an independent NumPy
reference of its specification (plugins/ortCpu/GsmCachedAttention; the normative definition is the portable graph,
builder/graph_portable.py PortableOps.attention): same selection, values to float32 rounding, 1 and 2 threads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gsm_edge_plugins import ort_ops_library

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

LIB = ort_ops_library()
pytestmark = pytest.mark.skipif(LIB is None, reason="libgsm_ort_ops.so not built (ONNX Runtime C API headers not "
                                                    "found: run scripts/fetch_ort_headers.sh and rebuild the plugins)")

DOMAIN = "ai.gsm_edge.cpu"
INPUTS = [("q", TensorProto.FLOAT), ("index_q", TensorProto.FLOAT), ("index_w", TensorProto.FLOAT),
          ("new_latent_k", TensorProto.FLOAT), ("new_latent_v", TensorProto.FLOAT),
          ("new_index_keys", TensorProto.FLOAT16), ("latent_v", TensorProto.FLOAT),
          ("index_keys", TensorProto.FLOAT16), ("k_rows", TensorProto.FLOAT), ("k_up", TensorProto.FLOAT),
          ("v_up", TensorProto.FLOAT), ("rope_cos", TensorProto.FLOAT), ("rope_sin", TensorProto.FLOAT),
          ("cache_rows", TensorProto.INT32), ("past_lengths", TensorProto.INT32), ("new_lengths", TensorProto.INT32),
          ("sparse_window", TensorProto.INT32), ("sparse_top_k", TensorProto.INT32)]
OUTPUTS = [("attn_out", TensorProto.FLOAT), ("new_k_rows", TensorProto.FLOAT), ("selected", TensorProto.INT32),
           ("attn_mass", TensorProto.FLOAT)]

# (nH, nKV, D, nI, dI, rk, rv): odd sizes (scalar tails everywhere), vector-friendly sizes, and SmolLM2's head
# geometry (9 heads over 3 key heads of 64, 3 indexer heads of 32: a partial block of heads in the index scores)
# with ranks that leave every kernel a vector tail
GEOMETRIES = {"odd": (4, 2, 6, 3, 12, 5, 10), "vec": (6, 2, 16, 4, 16, 20, 36), "gqa3": (9, 3, 64, 3, 32, 23, 52)}
R, N = 4, 64


KEY_INPUTS = ("new_index_keys", "index_keys")


# attribute v_rows = 1: input 6 holds the cached V rows (named v_rows here) and a fifth output the call's new ones
V_ROWS_INPUTS = [(("v_rows", t) if n == "latent_v" else (n, t)) for n, t in INPUTS]
V_ROWS_OUTPUTS = OUTPUTS + [("new_v_rows", TensorProto.FLOAT)]


def model_bytes(geo: tuple[int, ...], sinks: int, key_type: int = TensorProto.FLOAT16,
                divisor: int | float | None = None, v_rows: int | None = None, outputs: int | None = None) -> bytes:
    """divisor: the node's sparse_top_k_divisor attribute (None: a node without it, as graphs before it had);
    v_rows: its v_rows attribute (None: absent; 1: V_ROWS_INPUTS and V_ROWS_OUTPUTS); outputs: that many of the
    node's outputs (default: all the form has)."""
    nH, nKV, D, nI, dI, _, _ = geo
    extra = {} if divisor is None else {"sparse_top_k_divisor": divisor}
    ins, outs = (V_ROWS_INPUTS, V_ROWS_OUTPUTS) if v_rows else (INPUTS, OUTPUTS)
    if v_rows is not None:
        extra["v_rows"] = v_rows
    if outputs is not None:
        outs = V_ROWS_OUTPUTS[:outputs]
    node = helper.make_node("GsmCachedAttention", [n for n, _ in ins], [n for n, _ in outs], domain=DOMAIN,
                            num_heads=nH, num_kv_heads=nKV, head_dim=D, index_heads=nI, index_dim=dI,
                            sink_tokens=sinks, **extra)
    graph = helper.make_graph([node], "gsm_cached_attention",
                              [helper.make_tensor_value_info(n, key_type if n in KEY_INPUTS else t, None)
                               for n, t in ins],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outs])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = 8
    return m.SerializeToString()


def session(geo: tuple[int, ...], sinks: int, threads: int, key_type: int = TensorProto.FLOAT16,
            divisor: int | float | None = None, **form: int | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(LIB))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model_bytes(geo, sinks, key_type, divisor, **form), so,
                                providers=["CPUExecutionProvider"])


def int8_keys(x: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The same inputs with INT8 key codes (decisions "INT8 indexer keys"; the op reads them as float32 integers)."""
    return {**x, **{n: rng.integers(-127, 128, x[n].shape).astype(np.int8) for n in KEY_INPUTS}}


def make_inputs(rng: np.random.Generator, geo: tuple[int, ...], past: list[int], new: list[int], S: int,
                window: int, top_k: list[int], zero_w: bool = False, *, rows: int = R, positions: int = N
                ) -> dict[str, np.ndarray]:
    """Random inputs of one call over cache buffers of `rows` sequences x `positions` (FP16 index keys)."""
    nH, nKV, D, nI, dI, rk, rv = geo
    B, R, N = len(past), rows, positions
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = np.arange(N)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    w = f(B, S, nI)
    if zero_w:  # every non-fixed score is 0 (signed zeros included): ties, decided by position
        w = np.where(rng.random((B, S, nI)) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    return {"q": f(B, S, nH * D), "index_q": f(B, S, nI * dI), "index_w": w,
            "new_latent_k": f(B, S, rk).astype(np.float16).astype(np.float32), "new_latent_v": f(B, S, rv),
            "new_index_keys": f(B, S, dI).astype(np.float16), "latent_v": f(R, N, rv),
            "index_keys": f(R, N, dI).astype(np.float16), "k_rows": f(R, N, nKV * D),
            "k_up": f(nKV * D, rk) * np.float32(0.3), "v_up": f(nKV * D, rv) * np.float32(0.3),
            "rope_cos": np.cos(ang).astype(np.float32), "rope_sin": np.sin(ang).astype(np.float32),
            "cache_rows": rng.permutation(R)[:B].astype(np.int32), "past_lengths": np.array(past, np.int32),
            "new_lengths": np.array(new, np.int32), "sparse_window": np.array([window], np.int32),
            "sparse_top_k": np.array(top_k, np.int32)}


def reference(x: dict[str, np.ndarray], geo: tuple[int, ...], sinks: int, divisor: int = 0) -> dict[str, np.ndarray]:
    """The specification in plain loops (float32 NumPy; the decode V sum in float64). divisor > 0: the query at
    position t selects max(top_k[b], (t + 1) // divisor) by score. With x["v_rows"] (the op's v_rows = 1 form) V
    is those rows for cached positions and U_v c for the call's new ones (also returned, as new_v_rows), the
    weighted sum over them in float32."""
    nH, nKV, D, nI, dI, rk, rv = geo
    f32 = np.float32
    B, S = x["q"].shape[:2]
    grp, half, kvD = nH // nKV, D // 2, nKV * D
    past, new, rows, topk = (x[n].astype(int) for n in ("past_lengths", "new_lengths", "cache_rows", "sparse_top_k"))
    W = int(x["sparse_window"][0])
    tc = int(past.max())
    L = tc + S

    def budget(b: int, t: int) -> int:
        return sinks + W + (max(topk[b], (t + 1) // divisor) if divisor > 0 else topk[b])

    k = min(max(budget(b, past[b] + j) for b in range(B) for j in range(S)), L)

    def rope(v: np.ndarray, p: int) -> np.ndarray:
        c, s = x["rope_cos"][p], x["rope_sin"][p]
        return np.concatenate([v[:half] * c[:half] - v[half:] * s[:half], v[half:] * c[half:] + v[:half] * s[half:]])

    new_k = np.zeros((B, S, kvD), f32)
    new_v = x["new_latent_v"] @ x["v_up"].T  # [B, S, kvD]
    for b in range(B):
        for j in range(S):
            kv = x["k_up"] @ x["new_latent_k"][b, j]
            for g in range(nKV):
                new_k[b, j, g * D:(g + 1) * D] = rope(kv[g * D:(g + 1) * D], past[b] + j)
    out = np.zeros((B, S, nH * D), f32)
    sel = np.full((B, S, k), -1, np.int32)
    mass = np.zeros((B, L), f32)
    for b in range(B):
        row = rows[b]
        cols = [(c, c < past[b], x["index_keys"][row, c]) for c in range(tc)]
        cols += [(past[b] + jj, True, x["new_index_keys"][b, jj]) for jj in range(S)]
        for j in range(S):
            t = past[b] + j
            iq = x["index_q"][b, j].reshape(nI, dI)
            vals = []
            for pos, usable, key in cols:
                if not usable or pos > t:
                    vals.append(-math.inf)
                elif pos < sinks or pos + W > t:
                    vals.append(math.inf)
                else:
                    e = key.astype(f32)
                    acc = f32(0)
                    for h in range(nI):
                        acc = f32(acc + x["index_w"][b, j, h] * max(f32(np.dot(iq[h], e)), f32(0)))
                    vals.append(float(acc / f32(math.sqrt(dI))))
            order = sorted(range(len(cols)), key=lambda c: (-vals[c], c))[:k]
            kept = sorted(cols[c][0] for r, c in enumerate(order) if vals[c] > -math.inf and r < budget(b, t))
            sel[b, j, :len(kept)] = kept
            K = np.stack([x["k_rows"][row, p] if p < past[b] else new_k[b, p - past[b]] for p in kept])
            lat = None if "v_rows" in x else np.stack(
                [x["latent_v"][row, p] if p < past[b] else x["new_latent_v"][b, p - past[b]] for p in kept])
            probs = np.zeros((nH, len(kept)), f32)
            for h in range(nH):
                g = h // grp
                qr = rope(x["q"][b, j, h * D:(h + 1) * D], t)
                logit = (K[:, g * D:(g + 1) * D] @ qr) / f32(math.sqrt(D))
                e = np.exp(logit - logit.max())
                probs[h] = e / e.sum()
                vg = x["v_up"][g * D:(g + 1) * D]
                if "v_rows" in x:
                    V = np.stack([x["v_rows"][row, p] if p < past[b] else new_v[b, p - past[b]] for p in kept])
                    out[b, j, h * D:(h + 1) * D] = probs[h] @ V[:, g * D:(g + 1) * D]
                elif S == 1:
                    ctx = (probs[h].astype(np.float64) @ lat.astype(np.float64)).astype(f32)
                    out[b, j, h * D:(h + 1) * D] = vg @ ctx
                else:
                    out[b, j, h * D:(h + 1) * D] = probs[h] @ (lat @ vg.T)
            if j < new[b]:
                for s, p in enumerate(kept):
                    mass[b, p] += probs[:, s].sum()
    res = {"attn_out": out, "new_k_rows": new_k, "selected": sel, "attn_mass": mass}
    return {**res, "new_v_rows": new_v} if "v_rows" in x else res


# name: geometry, past, new, S, window, sinks, top_k, zero index weights
CASES = {
    "decode_b1": ("vec", [40], [1], 1, 3, 1, [6], False),
    "decode_b3_unequal": ("vec", [40, 0, 23], [1, 1, 0], 1, 2, 2, [5, 0, 9], False),
    "decode_odd": ("odd", [17, 30, 5], [1, 1, 1], 1, 4, 1, [3, 7, 0], False),
    "prefill_b3_padding": ("vec", [20, 0, 33], [5, 3, 5], 5, 2, 1, [4, 0, 7], False),
    "prefill_odd": ("odd", [9, 26], [4, 5], 5, 0, 0, [3, 6], False),
    "dense": ("vec", [10, 3], [5, 2], 5, 2, 1, [100, 100], False),
    "dense_decode": ("odd", [10, 3], [1, 1], 1, 2, 1, [100, 100], False),
    "ties_decode": ("vec", [30, 12], [1, 1], 1, 2, 1, [5, 4], True),
    "ties_prefill": ("odd", [30, 12], [5, 5], 5, 1, 2, [6, 3], True),
    "no_window_no_sinks": ("vec", [25, 31, 8], [1, 1, 1], 1, 0, 0, [4, 2, 3], False),
    "decode_gqa3": ("gqa3", [45, 9], [1, 1], 1, 3, 1, [11, 2], False),
    "prefill_gqa3": ("gqa3", [13, 0], [6, 4], 6, 2, 1, [7, 3], False),
}


def check_against_reference(x: dict[str, np.ndarray], geo: tuple[int, ...], sinks: int, key_type: int,
                            divisor: int | None = None) -> dict[str, np.ndarray]:
    """The op on 1 and 2 threads equals the reference (selection exactly, values to float32 rounding) and itself;
    returns the reference's outputs. x with "v_rows" in place of "latent_v": the op's v_rows = 1 form."""
    want = reference(x, geo, sinks, divisor or 0)
    rows = "v_rows" in x
    names = [n for n, _ in (V_ROWS_OUTPUTS if rows else OUTPUTS)]
    values = [n for n in names if n != "selected"]
    got = {}
    for threads in (1, 2):
        res = session(geo, sinks, threads, key_type, divisor, v_rows=1 if rows else None).run(None, x)
        got[threads] = dict(zip(names, res))
        np.testing.assert_array_equal(got[threads]["selected"], want["selected"])
        for n in values:
            assert got[threads][n].shape == want[n].shape, n
            np.testing.assert_allclose(got[threads][n], want[n], rtol=1e-5, atol=1e-5, err_msg=n)
    np.testing.assert_array_equal(got[1]["selected"], got[2]["selected"])
    for n in values:
        np.testing.assert_allclose(got[1][n], got[2][n], rtol=1e-6, atol=1e-7, err_msg=n)
    return want


def with_v_rows(x: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The v_rows = 1 form's inputs: cached V rows [R, N, kvD] in place of the latents, drawn independently of them
    (the op must read the rows, not rebuild them from anything else)."""
    R_, N_ = x["latent_v"].shape[:2]
    kvd = x["v_up"].shape[0]
    return {**{n: a for n, a in x.items() if n != "latent_v"},
            "v_rows": rng.standard_normal((R_, N_, kvd)).astype(np.float32)}


@pytest.mark.parametrize("keys", ["fp16", "int8"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, keys: str) -> None:
    geo_name, past, new, S, window, sinks, top_k, zero_w = CASES[name]
    geo = GEOMETRIES[geo_name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    x = make_inputs(rng, geo, past, new, S, window, top_k, zero_w)
    key_type = TensorProto.FLOAT16
    if keys == "int8":
        x, key_type = int8_keys(x, rng), TensorProto.INT8
    check_against_reference(x, geo, sinks, key_type)


@pytest.mark.parametrize("name", sorted(CASES))
def test_v_rows_form_matches_reference(name: str) -> None:
    """Attribute v_rows = 1: V read from the cached V rows (and U_v c of the call's new latents, returned as
    new_v_rows), decode and prefill alike; the rest as the latent form."""
    geo_name, past, new, S, window, sinks, top_k, zero_w = CASES[name]
    geo = GEOMETRIES[geo_name]
    rng = np.random.default_rng(200 + sorted(CASES).index(name))
    x = with_v_rows(make_inputs(rng, geo, past, new, S, window, top_k, zero_w), rng)
    check_against_reference(x, geo, sinks, TensorProto.FLOAT16)


@pytest.mark.parametrize("name", ["decode_gqa3", "prefill_gqa3", "decode_b3_unequal"])
def test_v_rows_of_the_latents_give_the_latent_forms_outputs(name: str) -> None:
    """V rows that are U_v c of the cached latents give the latent form's outputs (to float32 rounding: the two sum
    in different orders), and the same selection, K rows and mass."""
    geo_name, past, new, S, window, sinks, top_k, zero_w = CASES[name]
    geo = GEOMETRIES[geo_name]
    x = make_inputs(np.random.default_rng(31), geo, past, new, S, window, top_k, zero_w)
    rows = {**{n: a for n, a in x.items() if n != "latent_v"}, "v_rows": x["latent_v"] @ x["v_up"].T}
    a = dict(zip([n for n, _ in OUTPUTS], session(geo, sinks, 1).run(None, x)))
    b = dict(zip([n for n, _ in V_ROWS_OUTPUTS], session(geo, sinks, 1, v_rows=1).run(None, rows)))
    for n in ("selected", "new_k_rows", "attn_mass"):
        assert np.array_equal(a[n], b[n]), n
    np.testing.assert_allclose(b["attn_out"], a["attn_out"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b["new_v_rows"], x["new_latent_v"] @ x["v_up"].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form,message", [
    ({"v_rows": 2}, "attribute v_rows = 2 must be 0 or 1"),
    ({"v_rows": 1, "outputs": 4}, "the node has 4 outputs; attribute v_rows = 1 needs 5 (the fifth: new_v_rows)"),
    ({"v_rows": 0, "outputs": 5}, "the node has 5 outputs; attribute v_rows = 0 needs 4"),
])
def test_v_rows_form_must_be_whole(form: dict[str, int], message: str) -> None:
    geo = GEOMETRIES["odd"]
    rng = np.random.default_rng(14)
    x = make_inputs(rng, geo, [4], [1], 1, 1, [2])
    if form["v_rows"] == 1:
        x = with_v_rows(x, rng)
    with pytest.raises(Exception, match="GsmCachedAttention") as err:
        session(geo, 1, 1, **form).run(None, x)
    assert message in str(err.value)


def test_v_rows_of_the_wrong_width_are_named() -> None:
    geo = GEOMETRIES["vec"]
    rng = np.random.default_rng(15)
    x = with_v_rows(make_inputs(rng, geo, [4], [1], 1, 1, [2]), rng)
    x["v_rows"] = x["v_rows"][..., :-1].copy()
    with pytest.raises(Exception, match=r"input latent_v \(the V rows, v_rows = 1\) has shape \[4, 64, 31\], "
                                        r"expected \[\*, \*, 32\]"):
        session(geo, 1, 1, v_rows=1).run(None, x)


@pytest.mark.parametrize("keys", ["fp16", "int8"])
def test_thousands_of_tied_scores_select_by_position(keys: str) -> None:
    """A decode over ~3,000 positions whose index scores take a few dozen exact values of either sign (small integer
    keys and queries, head weights 1, -1/2, 1/4: every product and sum exact in float32, so the reference's scores are
    the op's bit for bit): the selection's cut falls inside a run of hundreds of equal scores, decided by position."""
    geo = GEOMETRIES["gqa3"]
    nH, nKV, D, nI, dI, rk, rv = geo
    rng = np.random.default_rng(41)
    past, positions = [2950, 1700], 3072
    x = make_inputs(rng, geo, past, [1, 1], 1, 5, [301, 77], rows=2, positions=positions)
    small = lambda *shape: rng.integers(-2, 3, shape)  # noqa: E731
    x["index_q"] = small(2, 1, nI * dI).astype(np.float32)
    x["index_w"] = np.tile(np.array([1.0, -0.5, 0.25], np.float32), (2, 1, 1))
    kt = np.int8 if keys == "int8" else np.float16
    x["index_keys"] = small(2, positions, dI).astype(kt)
    x["new_index_keys"] = small(2, 1, dI).astype(kt)
    want = check_against_reference(x, geo, 1, TensorProto.INT8 if keys == "int8" else TensorProto.FLOAT16)
    # the cut is inside a tie: the last score kept is also the score of a position left out
    b, t = 0, past[0]
    iq = x["index_q"][b, 0].reshape(nI, dI).astype(np.float64)
    keys_f = x["index_keys"][x["cache_rows"][b], :t].astype(np.float64)
    score = (np.maximum(keys_f @ iq.T, 0) * x["index_w"][b, 0].astype(np.float64)).sum(1)
    kept = set(want["selected"][b, 0].tolist())
    cand = range(1, t - 5 + 1)  # neither the sink nor the window
    last = min(score[p] for p in cand if p in kept)
    assert any(score[p] == last for p in cand if p not in kept)
    assert len(np.unique(score[1:])) < 200


@pytest.mark.parametrize("keys", ["fp16", "int8"])
def test_scores_in_one_binade_select_as_the_reference(keys: str) -> None:
    """A decode over ~3,000 positions whose index scores all share their sign, exponent and first mantissa bits
    (keys near 100, queries near 1: every score within a few percent of 3,200), the case of a real layer: the op's
    radix select counts the next bits of the bucket that holds the cut, again and again, and must pick the
    reference's positions exactly."""
    geo = GEOMETRIES["gqa3"]
    nH, nKV, D, nI, dI, rk, rv = geo
    rng = np.random.default_rng(43)
    past, positions = [2950, 2100], 3072
    x = make_inputs(rng, geo, past, [1, 1], 1, 5, [301, 977], rows=2, positions=positions)
    x["index_q"] = (1 + 0.01 * rng.standard_normal((2, 1, nI * dI))).astype(np.float32)
    x["index_w"] = np.ones((2, 1, nI), np.float32)
    kt = np.int8 if keys == "int8" else np.float16
    x["index_keys"] = rng.integers(95, 106, (2, positions, dI)).astype(kt)
    x["new_index_keys"] = rng.integers(95, 106, (2, 1, dI)).astype(kt)
    want = check_against_reference(x, geo, 1, TensorProto.INT8 if keys == "int8" else TensorProto.FLOAT16)
    b = 0
    iq = x["index_q"][b, 0].reshape(nI, dI).astype(np.float64)
    score = (x["index_keys"][x["cache_rows"][b], :past[b]].astype(np.float64) @ iq.T).sum(1) / np.sqrt(dI)
    top = np.frexp(score[1:])  # one binade, and the first bucket of 11 bits holds most of the positions
    assert len(np.unique(top[1])) == 1 and (want["selected"][b, 0] >= 0).sum() > 300


@pytest.mark.parametrize("scores", ["binade", "ties", "spread"])
def test_a_long_context_selects_as_the_reference(scores: str) -> None:
    """Past 2,048 candidates the op ranks only the positions a sample's threshold keeps (topPositionsBySample): over
    ~9,000 positions whose scores share one binade, take a few dozen tied values, or spread over many binades, the
    picks are the reference's exactly, at a top-k where the cut falls among many near or equal scores."""
    geo = GEOMETRIES["gqa3"]
    nH, nKV, D, nI, dI, rk, rv = geo
    rng = np.random.default_rng(47)
    past, positions = [8900, 2300], 9216
    x = make_inputs(rng, geo, past, [1, 1], 1, 5, [555, 1100], rows=2, positions=positions)
    kt = np.float16
    if scores == "binade":
        x["index_q"] = (1 + 0.01 * rng.standard_normal((2, 1, nI * dI))).astype(np.float32)
        x["index_w"] = np.ones((2, 1, nI), np.float32)
        x["index_keys"] = rng.integers(95, 106, (2, positions, dI)).astype(kt)
    elif scores == "ties":
        x["index_q"] = rng.integers(-2, 3, (2, 1, nI * dI)).astype(np.float32)
        x["index_w"] = np.tile(np.array([1.0, -0.5, 0.25], np.float32), (2, 1, 1))
        x["index_keys"] = rng.integers(-2, 3, (2, positions, dI)).astype(kt)
    else:
        x["index_keys"] = (rng.standard_normal((2, positions, dI)) * np.exp(rng.uniform(-6, 6, (2, positions, 1)))
                           ).astype(kt)
    x["new_index_keys"] = x["index_keys"][:, :1].copy()
    want = check_against_reference(x, geo, 1, TensorProto.FLOAT16)
    assert (want["selected"][0, 0] >= 0).sum() == 1 + 5 + 555 and (want["selected"][1, 0] >= 0).sum() == 1 + 5 + 1100


# A budget that grows with the context (attribute sparse_top_k_divisor d > 0): the query at t selects
# max(top_k[b], (t + 1) // d) by score. name: geometry, past, new, S, window, sinks, top_k, divisor, and the number
# of positions each valid query keeps, worked out by hand (sinks + window + that top-k, or t + 1 when dense)
GROWTH_CASES = {
    # t = 39: 40 // 4 = 10 > 3 (t // 4 would be 9)
    "decode_grows": ("vec", [39], [1], 1, 2, 1, [3], 4, [[13]]),
    # t = 40: 41 // 4 = 10 < 12: the sequence's own budget stands
    "decode_budget_stands": ("vec", [40], [1], 1, 2, 1, [12], 4, [[15]]),
    # t = 18..27: (t + 1) // 4 = 4 5 5 5 5 6 6 6 6 7, so growth takes over from t = 23 inside the chunk
    "prefill_straddles": ("odd", [18], [10], 10, 2, 1, [5], 4, [[8] * 5 + [9] * 4 + [10]]),
    # two sequences, different past lengths: t = 49 grows to 10, t = 12 keeps 2
    "decode_b2_unequal": ("vec", [49, 12], [1, 1], 1, 3, 1, [2, 2], 5, [[14], [6]]),
    # SmolLM2's heads; sequence 0 grows (t = 40..44: 6 7 7 7 7; one padding row), sequence 1 is dense up to t = 7
    # (8 <= 1 + 3 + 4), then t = 8 keeps 1 + 3 + 4
    "prefill_gqa3_b2": ("gqa3", [40, 3], [5, 6], 6, 3, 1, [4, 4], 6, [[10, 11, 11, 11, 11], [4, 5, 6, 7, 8, 8]]),
    # growth moves the dense threshold: (t + 1) - (t + 1) // 2 <= 1 + 2 while t + 1 <= 6, so t = 0..5 are dense
    # with top_k 0, then t = 6..8 keep 1 + 2 + 3, 1 + 2 + 4, 1 + 2 + 4
    "dense_threshold_grows": ("vec", [0], [9], 9, 2, 1, [0], 2, [[1, 2, 3, 4, 5, 6, 6, 7, 7]]),
    # divisor 1: (t + 1) // 1 = t + 1, every query dense
    "divisor_one_dense": ("odd", [30, 7], [1, 1], 1, 1, 0, [2, 0], 1, [[31], [8]]),
}


@pytest.mark.parametrize("keys", ["fp16", "int8"])
@pytest.mark.parametrize("name", sorted(GROWTH_CASES))
def test_growing_top_k_matches_reference(name: str, keys: str) -> None:
    geo_name, past, new, S, window, sinks, top_k, divisor, kept = GROWTH_CASES[name]
    geo = GEOMETRIES[geo_name]
    rng = np.random.default_rng(100 + sorted(GROWTH_CASES).index(name))
    x = make_inputs(rng, geo, past, new, S, window, top_k)
    key_type = TensorProto.FLOAT16
    if keys == "int8":
        x, key_type = int8_keys(x, rng), TensorProto.INT8
    sel = check_against_reference(x, geo, sinks, key_type, divisor)["selected"]
    for b, want in enumerate(kept):
        assert (sel[b, :len(want)] >= 0).sum(axis=-1).tolist() == want, b
    # the width: the call's largest budget (its last rows'), at most Tc + S
    budgets = [sinks + window + max(top_k[b], (past[b] + S) // divisor) for b in range(len(past))]
    assert sel.shape[-1] == min(max(budgets), max(past) + S)


def test_growth_differs_per_query_of_a_chunk() -> None:
    """One prefill chunk whose queries select different top-k: each query keeps its own count, not the chunk's
    last budget, and the padded width is the largest one."""
    geo = GEOMETRIES["vec"]
    x = make_inputs(np.random.default_rng(11), geo, [30], [6], 6, 2, [3])
    sel = session(geo, 1, 1, divisor=5).run(["selected"], x)[0]
    # t = 30..35: (t + 1) // 5 = 6 6 6 6 7 7
    assert (sel[0] >= 0).sum(axis=-1).tolist() == [9, 9, 9, 9, 10, 10]
    assert sel.shape == (1, 6, 10)
    assert (sel[0, :4, 9] == -1).all()


def test_missing_divisor_is_a_fixed_top_k() -> None:
    """A graph without the attribute (written before it existed) selects exactly as with divisor 0."""
    geo = GEOMETRIES["vec"]
    x = make_inputs(np.random.default_rng(12), geo, [40, 21], [4, 4], 4, 2, [3, 5])
    old = session(geo, 1, 1).run(None, x)
    zero = session(geo, 1, 1, divisor=0).run(None, x)
    for a, b in zip(old, zero):
        np.testing.assert_array_equal(a, b)
    want = reference(x, geo, 1)
    np.testing.assert_array_equal(old[2], want["selected"])
    assert old[2].shape[-1] == 1 + 2 + 5
    assert reference(x, geo, 1, divisor=4)["selected"].shape[-1] > old[2].shape[-1]  # growth would have shown


@pytest.mark.parametrize("value,message", [
    (-1, "attribute sparse_top_k_divisor = -1 must be >= 0"),
    (2.0, "attribute sparse_top_k_divisor must be an int64"),
])
def test_bad_divisor_names_the_attribute(value: int | float, message: str) -> None:
    geo = GEOMETRIES["odd"]
    x = make_inputs(np.random.default_rng(13), geo, [4], [1], 1, 1, [2])
    with pytest.raises(Exception, match="GsmCachedAttention") as err:
        session(geo, 1, 1, divisor=value).run(None, x)
    assert message in str(err.value)


def test_tie_rule_keeps_lower_positions() -> None:
    """With every index score 0 the top-k are the lowest non-fixed positions (hand-derived, not the reference)."""
    geo = GEOMETRIES["vec"]
    x = make_inputs(np.random.default_rng(7), geo, [20], [1], 1, 2, [3], zero_w=True)
    sel = session(geo, 1, 1).run(["selected"], x)[0]
    # sink 0, top-3 of positions 1..18 by (0, position) -> 1, 2, 3; window 19, 20
    assert sel.tolist() == [[[0, 1, 2, 3, 19, 20]]]


@pytest.mark.parametrize("field,value,names", [
    ("past_lengths", [60, 3], "past_lengths[0] = 60 + S = 5 exceeds the cache's N_max 64"),
    ("cache_rows", [0, 4], "cache_rows[1] = 4"),
    ("new_lengths", [5, 6], "new_lengths[1] = 6"),
    ("sparse_top_k", [-1, 2], "sparse_top_k[0] = -1"),
])
def test_bad_input_names_it(field: str, value: list[int], names: str) -> None:
    geo = GEOMETRIES["odd"]
    x = make_inputs(np.random.default_rng(3), geo, [4, 3], [5, 5], 5, 1, [2, 2])
    x[field] = np.array(value, np.int32)
    with pytest.raises(Exception, match="GsmCachedAttention") as err:
        session(geo, 1, 1).run(None, x)
    assert names in str(err.value)


def retyped(model: bytes, types: dict[str, int]) -> bytes:
    """`model` with the graph inputs named in `types` declared of those element types."""
    m = onnx.load_from_string(model)
    for v in m.graph.input:
        if v.name in types:
            v.type.tensor_type.elem_type = types[v.name]
    return m.SerializeToString()


def typed_session(geo: tuple[int, ...], sinks: int, types: dict[str, int], threads: int = 1) -> ort.InferenceSession:
    """The op with some inputs declared of another element type than INPUTS gives them."""
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(LIB))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(retyped(model_bytes(geo, sinks), types), so, providers=["CPUExecutionProvider"])


def test_key_types_must_agree() -> None:
    geo = GEOMETRIES["vec"]
    x = make_inputs(np.random.default_rng(5), geo, [4], [1], 1, 1, [2])
    x["index_keys"] = int8_keys(x, np.random.default_rng(6))["index_keys"]  # int8 cache, float16 new keys
    sess = typed_session(geo, 1, {"index_keys": TensorProto.INT8})
    with pytest.raises(Exception, match="index_keys and new_index_keys must both be float16 or both int8"):
        sess.run(None, x)


UP_INPUTS = ("k_up", "v_up")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["decode_b3_unequal", "decode_gqa3", "prefill_gqa3", "prefill_odd", "dense"])
def test_float16_up_projections_give_the_float32_bits(name: str, threads: int) -> None:
    """U_k and U_v as float16 (a checkpoint whose U lie on the FP16 grid: the builder then stores them so) give the
    outputs of the same values as float32 bit for bit: the K rows of the call's latents, the decode form's U_v after
    the latent sum and the prefill form's V rows; and both agree with the reference."""
    geo_name, past, new, S, window, sinks, top_k, zero_w = CASES[name]
    geo = GEOMETRIES[geo_name]
    x = make_inputs(np.random.default_rng(11), geo, past, new, S, window, top_k, zero_w)
    x.update({n: x[n].astype(np.float16).astype(np.float32) for n in UP_INPUTS})  # on the grid
    want = check_against_reference(x, geo, sinks, TensorProto.FLOAT16)
    names = [n for n, _ in OUTPUTS]
    f32 = dict(zip(names, session(geo, sinks, threads).run(None, x)))
    half = {**x, **{n: x[n].astype(np.float16) for n in UP_INPUTS}}
    sess = typed_session(geo, sinks, dict.fromkeys(UP_INPUTS, TensorProto.FLOAT16), threads)
    got = dict(zip(names, sess.run(None, half)))
    for n in names:
        assert np.array_equal(got[n], f32[n]), n
    np.testing.assert_array_equal(got["selected"], want["selected"])


def test_up_projection_types_must_agree() -> None:
    geo = GEOMETRIES["vec"]
    x = make_inputs(np.random.default_rng(5), geo, [4], [1], 1, 1, [2])
    x["k_up"] = x["k_up"].astype(np.float16)  # float16 U_k, float32 U_v
    sess = typed_session(geo, 1, {"k_up": TensorProto.FLOAT16})
    with pytest.raises(Exception, match="k_up and v_up must both be float or both float16"):
        sess.run(None, x)
    x["v_up"] = x["v_up"].astype(np.float64)
    sess = typed_session(geo, 1, {"k_up": TensorProto.FLOAT16, "v_up": TensorProto.DOUBLE})
    with pytest.raises(Exception, match="k_up and v_up must both be float or both float16"):
        sess.run(None, x)


@pytest.mark.parametrize("name", ["prefill_b3_padding", "decode_b3_unequal", "decode_gqa3"])
def test_flat_q_gives_the_same_outputs(name: str) -> None:
    """q as the projection leaves it, [B*S, nH*D] (model.cpu.onnx, no Reshape before the op), gives the 3-D call's
    outputs bit for bit, attn_out as [B*S, nH*D]; B and S come from index_q."""
    geo_name, past, new, S, window, sinks, top_k, zero_w = CASES[name]
    geo = GEOMETRIES[geo_name]
    x = make_inputs(np.random.default_rng(7), geo, past, new, S, window, top_k, zero_w)
    sess = session(geo, sinks, 2)
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(None, x)))
    flat = {**x, "q": x["q"].reshape(len(past) * S, -1)}
    got = dict(zip(names, sess.run(None, flat)))
    assert got["attn_out"].shape == (len(past) * S, want["attn_out"].shape[-1])
    assert np.array_equal(got["attn_out"], want["attn_out"].reshape(got["attn_out"].shape))
    for n in ("new_k_rows", "selected", "attn_mass"):
        assert np.array_equal(got[n], want[n]), n
    with pytest.raises(Exception, match=r"input q has shape .*\(\[B\*S, num_heads\*head_dim\], or \[B, S, \.\.\.\]\)"):
        sess.run(None, {**x, "q": x["q"].reshape(len(past) * S, -1)[:-1].copy()})


def test_bad_shape_names_input() -> None:
    geo = GEOMETRIES["odd"]
    x = make_inputs(np.random.default_rng(4), geo, [4], [1], 1, 1, [2])
    x["v_up"] = x["v_up"][:, :-1].copy()
    with pytest.raises(Exception, match="input v_up has shape"):
        session(geo, 1, 1).run(None, x)


def test_op_benchmark_runs(capsys) -> None:
    """bench/attention_op_cpu.py times the op on this model: one line per context, hot and cold rows."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "attention_op_cpu.py"
    spec = importlib.util.spec_from_file_location("attention_op_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for extra in ([], ["--cold"], ["--cold", "--latent-v"]):
        assert mod.main(["--geometry", ",".join(map(str, GEOMETRIES["gqa3"])), "--past", "3,40", "--top-k", "5",
                         "--window", "2", "--calls", "2", "--repeats", "1", "--cache-mib", "8", *extra]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "us per call" in ln]
        # positions attended: every position at past 3, sink + window + top-k at past 40
        assert [int(ln.split(" positions attended")[0].split()[-1]) for ln in lines] == [4, 8], lines
