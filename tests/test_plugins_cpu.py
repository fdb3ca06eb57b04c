"""C++ CPU reference of the GSM plugins (plugins/, docs/engine_io.md) against the golden model.

Tolerances: attention outputs, index scores and attention mass are float32 computations whose
summation order differs from torch's, so they must agree to 1e-5 (absolute and relative); the
shared numerics (FP16 rounding, INT12/INT8/INT4 codes, dequantised latents, packing, selection given
the scores, tier ranking) are contract-exact and must agree bit for bit. Every buffer part the
nodes must not read is poisoned with NaN (gsm_edge_plugins.testing), so an out-of-bounds read
fails the comparison.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch

from gsm import tiers
from gsm.config import GSMParams, KVQuantConfig
from gsm.golden import attention as A
from gsm.golden import quant as Q
from gsm.golden.cache import SequenceCache
from gsm.golden.rope import apply_rope, rope_tables
from gsm.golden.selection import index_scores, select

gep = pytest.importorskip("gsm_edge_plugins", reason="gsm_edge_plugins not installed: run `pip install -e .`")
if not gep.reference_available():
    pytest.skip("libgsm_plugins_ref.so was not built (plugins/CMakeLists.txt): run `pip install -e .`",
                allow_module_level=True)

from gsm_edge_plugins import ref  # noqa: E402
from gsm_edge_plugins.testing import (  # noqa: E402
    PATH_FP16,
    PATH_INT4_FROM_INT8,
    PATH_INT8_FROM_FP16,
    PATH_INT8_FROM_INT12,
    PATH_INT12,
    PATH_TIERS,
    Scenario,
    make_scenario,
    numpy_selection,
)

TOL = 1e-5
THETA = 10000.0


# ---- golden side -------------------------------------------------------------------------------
ALL_PATHS = (0.2, 0.1, 0.1, 0.1, 0.15, 0.1, 0.15, 0.1)  # every path of testing.PATH_TIERS, INT4 ones included


def golden_held(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """Latents as the golden's deployed cache holds them, from the raw values and each row's path: every
    demotion re-quantises the value held after the previous one (decisions "A 4-bit tier")."""
    tables = {Q.INT12: (sc.s12, None), Q.INT8: (sc.s8, sc.comp), Q.INT4: (sc.s4, sc.comp4)}
    rk = sc.dims.rank_k
    path = torch.from_numpy(sc.path)[..., None]
    out = []
    for raw, sl in ((sc.ck_raw, slice(0, rk)), (sc.cv_raw, slice(rk, None))):
        x = Q.round_fp16(torch.from_numpy(raw))
        held = x
        for kind, steps in PATH_TIERS.items():
            v = x
            for tier in steps:
                s, c = (None if a is None else torch.from_numpy(a[sl]) for a in tables[tier])
                v = Q.dequantize(Q.quantize(v, s, tier), s, c)
            held = torch.where(path == kind, v, held)
        out.append(held.numpy())
    return out[0], out[1]


def golden_check(sc: Scenario, res: ref.AttentionResult, selected_in: np.ndarray | None = None) -> None:
    """Compare one reference call with the golden ops, sequence by sequence."""
    d = sc.dims
    ck_h, cv_h = golden_held(sc)
    for b in range(len(sc.past)):
        # the golden selects with one sparse_top_k: this sequence's own budget
        p = GSMParams(sparse_window=sc.window, max_sparse_window=d.max_sparse_window, sparse_top_k=sc.budget(b),
                      sink_tokens=d.sink_tokens, indexer_heads=d.index_heads, indexer_dim=d.index_dim)
        n, T, past = int(sc.lengths[b]), int(sc.new[b]), int(sc.past[b])
        q_pos = torch.arange(past, past + T)
        ck, cv = torch.from_numpy(ck_h[b, :n]), torch.from_numpy(cv_h[b, :n])
        w0, w1 = torch.from_numpy(sc.w0), torch.from_numpy(sc.w1)
        if d.layer_kind == 0:
            k, v = A.reconstruct_owning(ck, cv, w0, w1, d.num_kv_heads, THETA)
        else:
            k, v = A.reconstruct_sharing(ck, cv, w0, w1, d.num_kv_heads, THETA)
        q = torch.from_numpy(sc.q[b, :T]).view(T, d.num_heads, d.head_dim).transpose(0, 1)
        cos, sin = rope_tables(q_pos, d.head_dim, THETA)
        q = apply_rope(q, cos, sin)  # [nH, T, D]
        if d.layer_kind == 0:
            # golden index scores on exactly the plugin's q^ and w: x = [q^ | w], W_q = [I | 0], W_w = [0 | I]
            nq = d.index_heads * d.index_dim
            x = torch.from_numpy(np.concatenate([sc.index_q[b, :T], sc.index_w[b, :T]], axis=1))
            eye = torch.eye(nq + d.index_heads)
            if d.index_key_bits == 8:  # the node stores clip(rint(x), -127, 127) of the (already scaled) key it gets
                keys = torch.from_numpy(np.clip(np.rint(sc.keys_raw[b, :n]), -127, 127))
                assert np.array_equal(ref.key_codes_of(d, sc.index_keys[b, :n]).astype(np.float32), keys.numpy())
                assert (np.rint(sc.keys_raw[b, :n]) != sc.keys_raw[b, :n]).all()  # the store rounds (and clamps)
            else:
                keys = Q.round_fp16(torch.from_numpy(sc.keys_raw[b, :n]))
                assert np.array_equal(sc.index_keys[b, :n].astype(np.float32), keys.numpy())
            g_scores = index_scores(x, eye[:nq], eye[nq:], keys, d.index_heads)
            ours = torch.from_numpy(res.scores[b, :T, :n].copy())
            causal = A.causal_mask(q_pos, n)
            # float32 sums of large keys cancel: the error bound follows sum |w| |q||k|, not the (small) score
            cond = index_scores(x.abs(), eye[:nq], eye[nq:], keys.abs(), d.index_heads)[causal]
            err = (ours[causal] - g_scores[causal]).abs()
            assert (err <= TOL * (1 + cond)).all(), f"index scores off by {(err / (1 + cond)).max():.3g} x cond"
            # the selection rule itself is exact: golden `select` on the plugin's own scores
            scored = torch.where(causal, ours, torch.zeros(()))
            if d.sparse_top_k_divisor > 0:  # each query has its own top-k: the golden's rule row by row at it
                mask = torch.cat([select(scored[j:j + 1], q_pos[j:j + 1],
                                         dataclasses.replace(p, sparse_top_k=sc.query_top_k(b, past + j)))
                                  for j in range(T)])
            else:
                mask = select(scored, q_pos, p)
        else:
            mask = torch.zeros(T, n, dtype=torch.bool)
            for j in range(T):
                s = selected_in[b, j]
                mask[j, s[s >= 0]] = True
        sel = res.selected if d.layer_kind == 0 else selected_in
        for j in range(T):
            got = sel[b, j][sel[b, j] >= 0]
            assert np.array_equal(got, mask[j].nonzero().squeeze(1).numpy()), f"selection of row {b},{j}"
            assert np.all(sel[b, j][got.size:] == -1)
        probs = A.attention_probs(q, k, mask)
        out_g = A.attend(probs, v).numpy()
        np.testing.assert_allclose(res.out[b, :T], out_g, rtol=TOL, atol=TOL)
        assert np.all(res.out[b, T:] == 0), "padding rows must be zero"
        if d.layer_kind == 0:
            mass = probs.sum(dim=(0, 1)).numpy()
            np.testing.assert_allclose(res.mass[b, :n], mass, rtol=TOL, atol=TOL)
            assert np.all(res.mass[b, n:] == 0)


# ---- shared numerics ---------------------------------------------------------------------------
def test_fp16_rounding_is_bit_exact() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    # ties: float32 values exactly halfway between two float16 values (normal and subnormal range)
    h = rng.integers(0, 0x7BFF, 20_000).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float32)
    hi = (h + 1).view(np.float16).astype(np.float32)
    ties = ((lo.astype(np.float64) + hi) / 2).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 2**-24, 2**-25, 2**-25 * 1.0001,
                        2**-14, 6.0e-8, 1e-30, -1e-30], np.float32)
    x = np.concatenate([x, ties, -ties, special])
    got = ref.f32_to_f16_bits(x)
    want = torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], want[finite])
    assert np.all(np.isnan(got[~finite].view(np.float16)))
    back = ref.f16_bits_to_f32(got[finite])
    assert np.array_equal(back.view(np.uint32), want[finite].view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("tier", [Q.INT12, Q.INT8])
def test_quantize_dequantize_bit_exact(tier: int) -> None:
    rng = np.random.default_rng(1 + tier)
    r = 37
    s8 = (rng.uniform(0.5, 2.0, r) / 127).astype(np.float32)
    scale = Q.default_int12_scale(torch.from_numpy(s8)).numpy() if tier == Q.INT12 else s8
    x = (rng.standard_normal((500, r)) * 1.5).astype(np.float32)
    # exact ties: x = (k + 0.5) * s with s a power of two, so x / s is exactly k + 0.5
    pow2 = np.full(r, 2.0**-6, np.float32)
    k = rng.integers(-200, 200, (200, r)).astype(np.float32)
    xt = ((k + np.float32(0.5)) * pow2).astype(np.float32)
    for xs, s in ((x, scale), (xt, pow2)):
        got = ref.quantize(xs, s, Q.QMAX[tier])
        want = Q.quantize(torch.from_numpy(xs), torch.from_numpy(s), tier).numpy()
        assert np.array_equal(got, want)
        comp = (rng.standard_normal(r) * 1e-3).astype(np.float32) if tier == Q.INT8 else None
        dq = ref.dequantize(got, s, comp)
        dq_g = Q.dequantize(torch.from_numpy(want), torch.from_numpy(s),
                            None if comp is None else torch.from_numpy(comp)).numpy()
        assert np.array_equal(dq.view(np.uint32), dq_g.view(np.uint32))
    assert np.array_equal(ref.quantize(xt, pow2, 2047)[k == 1], np.full((k == 1).sum(), 2))  # 1.5 -> 2
    assert np.array_equal(ref.quantize(xt, pow2, 2047)[k == 2], np.full((k == 2).sum(), 2))  # 2.5 -> 2


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_int12_packing_matches_golden(n: int) -> None:
    codes = np.random.default_rng(n).integers(-2048, 2048, n).astype(np.int32)
    packed = ref.pack_int12(codes)
    assert np.array_equal(packed, Q.pack_int12(codes))
    assert np.array_equal(ref.unpack_int12(packed, n), codes)


def test_int4_quantize_dequantize_bit_exact() -> None:
    """INT4 codes and values against gsm.golden.quant: random values through a calibrated-like s4 (a few % clamp),
    exact ties k + 0.5 (half to even), values far beyond +-7 steps, signed zeros; comp4 non-zero, -0.0 in places."""
    rng = np.random.default_rng(44)
    r = 37
    s4 = (rng.uniform(0.5, 2.0, r) / 7).astype(np.float32)
    x = (rng.standard_normal((2000, r)) * 0.6).astype(np.float32)
    pow2 = np.full(r, 2.0**-3, np.float32)
    k = rng.integers(-12, 12, (400, r)).astype(np.float32)  # ties from -11.5 to 11.5: +-7.5 and beyond clamp
    xt = ((k + np.float32(0.5)) * pow2).astype(np.float32)
    far = np.array([[1e30, -1e30, 8.0, -8.0, 7.49, -7.51, -0.0, 0.0, -1e-30, 1e-30, 0.4999, -0.5]], np.float32)
    far = np.repeat(far[:, :, None], r, axis=2).reshape(-1, r) * s4  # in units of each column's step
    comp4 = (rng.standard_normal(r) * s4 * 0.3).astype(np.float32)
    comp4[::5] = -0.0
    cases = [(x, s4), (xt, pow2), (far.astype(np.float32), s4)]
    for xs, s in cases:
        got = ref.quantize(xs, s, Q.QMAX[Q.INT4])
        want = Q.quantize(torch.from_numpy(xs), torch.from_numpy(s), Q.INT4).numpy()
        assert np.array_equal(got, want)
        assert got.min() >= -7 and got.max() <= 7  # the code -8 is never produced
        for comp in (comp4, np.zeros(r, np.float32)):
            dq = ref.dequantize(got, s, comp, tier=ref.INT4)
            dq_g = Q.dequantize(torch.from_numpy(want), torch.from_numpy(s), torch.from_numpy(comp)).numpy()
            assert np.array_equal(dq.view(np.uint32), dq_g.view(np.uint32))
    assert (ref.quantize(x, s4, 7) == 7).any() and (ref.quantize(x, s4, 7) == -7).any()
    ties = ref.quantize(xt, pow2, 7)
    for kk, code in ((0, 0), (1, 2), (2, 2), (-1, 0), (-2, -2), (-3, -2), (5, 6), (6, 6), (7, 7), (-8, -7), (11, 7)):
        assert np.all(ties[k == kk] == code), (kk, code)  # x / s = kk + 0.5
    f = ref.quantize(far.astype(np.float32), s4, 7)
    assert f[:, 0].tolist() == [7, -7, 7, -7, 7, -7, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ref.PluginContractError, match="comp is required"):
        ref.dequantize(got, s, None, tier=ref.INT4)


def test_default_scales_match_golden() -> None:
    s8 = (np.random.default_rng(3).uniform(0.05, 3.0, 5000) / 127).astype(np.float32)
    for tier, golden in ((ref.INT12, Q.default_int12_scale), (ref.INT4, Q.default_int4_scale)):
        want = golden(torch.from_numpy(s8)).numpy()
        assert np.array_equal(ref.default_scale(s8, tier).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_int4_packing_matches_golden(n: int) -> None:
    codes = np.random.default_rng(n).integers(-8, 8, n).astype(np.int32)
    if n >= 2:
        codes[:2] = (-8, 7)  # both nibble extremes, low nibble first
    packed = ref.pack_int4(codes)
    assert np.array_equal(packed, Q.pack_int4(codes))
    assert np.array_equal(ref.unpack_int4(packed, n), codes)
    if n >= 2:
        assert packed[0] == 0x78  # -8 -> 0x8 in the low nibble, 7 -> 0x7 in the high one


# ---- the cache: dequantised latents bit-identical to the golden simulation ---------------------
@pytest.mark.parametrize("ranks", [(6, 5), (8, 8), (1, 3)])
def test_cache_latents_bit_identical(ranks: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(ranks))
    sc = make_scenario(rng, num_heads=2, num_kv_heads=1, head_dim=8, rank_k=ranks[0], rank_v=ranks[1],
                       index_heads=1, index_dim=4, sink_tokens=1, top_k=4, max_sparse_window=2, window=2,
                       n_max=96, past=[80, 3, 0], new=[4, 1, 2], tier_mix=(0.2, 0.3, 0.25, 0.25))
    assert {PATH_FP16, PATH_INT12, PATH_INT8_FROM_FP16, PATH_INT8_FROM_INT12} <= set(np.unique(sc.path))
    ck, cv = ref.read_latents(sc.dims, sc.pool, sc.slots, sc.quant)
    gk, gv = golden_held(sc)
    for b in range(3):
        n = int(sc.lengths[b])
        assert np.array_equal(ck[b, :n].view(np.uint32), gk[b, :n].view(np.uint32))
        assert np.array_equal(cv[b, :n].view(np.uint32), gv[b, :n].view(np.uint32))
        assert np.all(np.isnan(ck[b, n:])), "uncached positions point at the poisoned row"


def _int4_rows_by_region(d: ref.Dims, slots: np.ndarray) -> set[int]:
    """Regions (tier codes of the region, 0..3) holding the INT4 rows of a slot table."""
    g = slots[(slots >= 0) & (ref.slot_tier(slots) == ref.INT4)] & 0xFFFFFF
    bounds = np.cumsum([d.rows_fp16, d.rows_int12, d.rows_int8, d.rows_int4])
    return set(np.searchsorted(bounds, g, side="right").tolist())


def _numpy_latents(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised latents read from the pool's bytes in plain NumPy, independently of the C++ layout code: row
    offsets from gsm.tiers.row_bytes and the region sizes, FP16 / INT12 / INT8 / INT4 decoded with the golden's
    unpackers, values as float32 (q * s) then + comp (NumPy rounds each operation)."""
    d = sc.dims
    w16, w12, w8, w4 = tiers.row_bytes(d.rank_k, d.rank_v)
    widths = (w16, w12, w8, w4)
    counts = (d.rows_fp16, d.rows_int12, d.rows_int8, d.rows_int4)
    starts = np.concatenate([[0], np.cumsum(np.multiply(widths, counts))])
    firsts = np.concatenate([[0], np.cumsum(counts)])
    s12, s8, comp8, s4, comp4 = sc.quant
    rk, rv = d.rank_k, d.rank_v
    out = np.full((*sc.slots.shape, d.rank), np.nan, np.float32)
    for b in range(sc.slots.shape[0]):
        pool = sc.pool[b].view(np.uint8)
        for p in range(int(sc.lengths[b])):
            tier, g = int(sc.slots[b, p]) >> 24, int(sc.slots[b, p]) & 0xFFFFFF
            reg = int(np.searchsorted(firsts[1:], g, side="right"))
            row = pool[starts[reg] + (g - firsts[reg]) * widths[reg]:]
            if tier == ref.FP16:
                out[b, p] = row[:2 * d.rank].view(np.float16).astype(np.float32)
            elif tier == ref.INT12:
                nk = 3 * ((rk + 1) // 2)
                q = np.concatenate([Q.unpack_int12(row[:nk], rk), Q.unpack_int12(row[nk:nk + 3 * ((rv + 1) // 2)], rv)])
                out[b, p] = q.astype(np.float32) * s12
            elif tier == ref.INT8:
                out[b, p] = (row[:d.rank].view(np.int8).astype(np.float32) * s8).astype(np.float32) + comp8
            else:
                nk = (rk + 1) // 2
                q = np.concatenate([Q.unpack_int4(row[:nk], rk), Q.unpack_int4(row[nk:nk + (rv + 1) // 2], rv)])
                out[b, p] = (q.astype(np.float32) * s4).astype(np.float32) + comp4
    return out[..., :rk], out[..., rk:]


@pytest.mark.parametrize("ranks", [(6, 5), (1, 3), (7, 9)])
def test_int4_demotion_paths_bit_identical(ranks: tuple[int, int]) -> None:
    """Every path to INT4 (FP16 -> INT4, FP16 -> INT12 -> INT4, FP16 -> INT8 -> INT4, FP16 -> INT12 -> INT8 ->
    INT4), INT4 rows in their own region and in FP16, INT12 and INT8 rows, odd ranks: the reference's latents equal
    the golden's re-quantisation of the value held, and a plain NumPy decode of the pool's bytes."""
    rng = np.random.default_rng(100 + sum(ranks))
    sc = make_scenario(rng, num_heads=2, num_kv_heads=1, head_dim=8, rank_k=ranks[0], rank_v=ranks[1],
                       index_heads=1, index_dim=4, sink_tokens=1, top_k=4, max_sparse_window=2, window=2,
                       n_max=200, past=[180, 60], new=[3, 1], tier_mix=ALL_PATHS)
    d = sc.dims
    assert set(PATH_TIERS) == set(np.unique(sc.path[sc.path >= 0]))
    assert _int4_rows_by_region(d, sc.slots) == {0, 1, 2, 3}
    ck, cv = ref.read_latents(d, sc.pool, sc.slots, sc.quant)
    gk, gv = golden_held(sc)
    nk, nv = _numpy_latents(sc)
    for b in range(2):
        n = int(sc.lengths[b])
        for got, want, npy in ((ck, gk, nk), (cv, gv, nv)):
            assert np.array_equal(got[b, :n].view(np.uint32), want[b, :n].view(np.uint32))
            assert np.array_equal(npy[b, :n].view(np.uint32), want[b, :n].view(np.uint32))
    # spelled out once for FP16 -> INT8 -> INT4: INT4 quantises the INT8 value with comp8 added
    s8, c8, s4, c4 = (torch.from_numpy(a[:ranks[0]]) for a in (sc.s8, sc.comp, sc.s4, sc.comp4))
    v8 = Q.dequantize(Q.quantize(Q.round_fp16(torch.from_numpy(sc.ck_raw)), s8, Q.INT8), s8, c8)
    v4 = Q.dequantize(Q.quantize(v8, s4, Q.INT4), s4, c4).numpy()
    via8 = sc.path == PATH_INT4_FROM_INT8
    assert np.array_equal(ck[via8].view(np.uint32), v4[via8].view(np.uint32))


def test_int4_row_bytes_and_pool_layout() -> None:
    """An INT4 row is pack_int4(codes_k) then pack_int4(codes_v) at its row's first byte; the pool holds
    C16 W16 + C12 W12 + C8 W8 + C4 W4 bytes (gsm.tiers.row_bytes), rows of the INT4 region W4 apart; a move with the
    tier unchanged copies an INT4 row into another row byte for byte."""
    d = ref.Dims(num_heads=1, num_kv_heads=1, head_dim=2, rank_k=5, rank_v=3, n_max=8, rows_fp16=3, rows_int12=2,
                 rows_int8=2, rows_int4=3, index_dim=2)
    w16, w12, w8, w4 = tiers.row_bytes(5, 3)
    assert w4 == 5 and ref.pool_words(d) == -(-(3 * w16 + 2 * w12 + 2 * w8 + 3 * w4) // 4)
    assert [ref.row_offset(d, g) for g in (7, 8, 9)] == [3 * w16 + 2 * w12 + 2 * w8 + i * w4 for i in range(3)]
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 1, 8)).astype(np.float32) * 3
    s4 = np.full(8, 0.5, np.float32)
    quant = np.stack([np.full(8, 1e-3), np.full(8, 0.02), np.zeros(8), s4, np.full(8, 0.125)]).astype(np.float32)
    pool = ref.empty_pool(d, 1, 0xAB)
    keys = np.zeros((1, 8, 2), np.float16)
    slots = np.full((1, 8), -1, np.int32)
    slots[0, 0] = ref.make_slot(ref.FP16, 1)
    ref.kv_update(d, x[..., :5], x[..., 5:], np.zeros((1, 1, 2), np.float32), pool, keys, slots, [0], [1])
    ref.kv_demote(d, np.array([[0, slots[0, 0], ref.make_slot(ref.INT4, 8)]]), pool, quant)
    codes = Q.quantize(Q.round_fp16(torch.from_numpy(x[0, 0])), torch.from_numpy(s4), Q.INT4).numpy()
    want = np.concatenate([Q.pack_int4(codes[:5]), Q.pack_int4(codes[5:])])
    raw = pool[0].view(np.uint8)
    at = ref.row_offset(d, 8)
    assert np.array_equal(raw[at:at + w4], want)
    assert raw[at - 1] == 0xAB and raw[at + w4] == 0xAB, "an INT4 row writes its W4 bytes only"
    ref.kv_demote(d, np.array([[0, ref.make_slot(ref.INT4, 8), ref.make_slot(ref.INT4, 5)]]), pool, quant)
    at5 = ref.row_offset(d, 5)
    assert np.array_equal(raw[at5:at5 + w4], want)  # an INT4 row in an INT8 row


def test_int4_slots_are_checked() -> None:
    """Tier 3 is a valid slot tier in every region; no tier may sit in a narrower region, and an INT4 row never
    regains precision."""
    sc = _scenario("decode-int4-mixed")
    d = sc.dims
    base4 = d.rows_fp16 + d.rows_int12 + d.rows_int8
    src = int(sc.slots[0, 3])
    int4_row = ref.make_slot(ref.INT4, base4)
    with pytest.raises(ref.PluginContractError, match="region is narrower"):
        ref.kv_demote(d, np.array([[0, src, ref.make_slot(ref.INT8, base4)]]), sc.pool.copy(), sc.quant)
    with pytest.raises(ref.PluginContractError, match="malformed"):
        ref.kv_demote(d, np.array([[0, src, ref.make_slot(ref.INT4, base4 + d.rows_int4)]]), sc.pool.copy(),
                      sc.quant)
    with pytest.raises(ref.PluginContractError, match="malformed"):
        ref.kv_demote(d, np.array([[0, src, ref.make_slot(4, 0)]]), sc.pool.copy(), sc.quant)
    pool = ref.kv_demote(d, np.array([[0, src, int4_row]]), sc.pool.copy(), sc.quant)
    with pytest.raises(ref.PluginContractError, match="promotion"):
        ref.kv_demote(d, np.array([[0, int4_row, ref.make_slot(ref.INT8, base4 - 1)]]), pool, sc.quant)
    with pytest.raises(ValueError, match=r"quant: expected shape \(5, "):
        ref.read_latents(d, sc.pool, sc.slots, sc.quant[:3])


# ---- attention ---------------------------------------------------------------------------------
# (nH, nKV, D, r_k, r_v, nI, dI, sinks, top_k, max_window, window, n_max, past, new, tier_mix)
CASES = {
    "prefill-ragged-gqa2": (4, 2, 16, 6, 5, 2, 8, 1, 8, 4, 3, 64, [0, 0, 0], [1, 7, 40], (1, 0, 0, 0)),
    "chunked-prefill-mixed-tiers": (4, 1, 8, 7, 9, 2, 4, 2, 6, 4, 4, 160, [13, 0, 100], [5, 2, 5],
                                    (0.3, 0.3, 0.2, 0.2)),
    "decode-mqa-long": (8, 1, 32, 16, 12, 4, 16, 4, 64, 8, 8, 2048, [0, 5, 300, 2047], [1, 1, 1, 1],
                        (0.25, 0.25, 0.25, 0.25)),
    "decode-mha-window1": (2, 2, 64, 24, 20, 1, 32, 1, 16, 2, 1, 512, [200, 511], [1, 1], (0.5, 0.5, 0, 0)),
    "topk-covers-context": (4, 2, 16, 8, 8, 2, 8, 1, 4096, 8, 3, 300, [250, 0], [10, 37], (0.5, 0.5, 0, 0)),
    "topk0-no-sinks": (2, 1, 8, 4, 4, 2, 4, 0, 0, 5, 5, 64, [30], [6], (1, 0, 0, 0)),
    "gqa4-odd-ranks": (8, 2, 16, 11, 3, 3, 8, 3, 10, 6, 2, 200, [150, 20], [3, 3], (0.4, 0.2, 0.2, 0.2)),
    "prefill-2048": (2, 2, 8, 4, 4, 2, 8, 1, 64, 8, 3, 2048, [0], [2048], (1, 0, 0, 0)),
    # INT4 rows by every path and in every region (testing.PATH_TIERS), odd ranks
    "decode-int4-mixed": (4, 2, 16, 7, 5, 2, 8, 2, 12, 4, 3, 300, [280, 40], [1, 1], ALL_PATHS),
    "prefill-chunk-int4-only": (4, 1, 8, 6, 9, 2, 4, 1, 8, 4, 4, 160, [120], [6], (0, 0, 0, 0, 1, 0, 0, 0)),
    # INT8 indexer keys ("keys8" in the name): dI 8 fills two int32 words, 12 pads the last one
    "decode-keys8-gqa4": (8, 2, 16, 11, 3, 3, 8, 3, 10, 6, 2, 200, [150, 20], [1, 1], (0.4, 0.2, 0.2, 0.2)),
    "chunked-keys8-int4-odd-dim": (4, 1, 8, 7, 5, 2, 12, 2, 12, 4, 3, 300, [280, 40], [4, 1], ALL_PATHS),
}


def _scenario(name: str, *, layer_kind: int = 0, seed: int = 0) -> Scenario:
    nH, nKV, D, rk, rv, nI, dI, sinks, topk, mw, w, n_max, past, new, mix = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()) + seed)  # str hash() is salted per process
    return make_scenario(rng, num_heads=nH, num_kv_heads=nKV, head_dim=D, rank_k=rk, rank_v=rv, index_heads=nI,
                         index_dim=dI, sink_tokens=sinks, top_k=topk, max_sparse_window=mw, window=w, n_max=n_max,
                         past=past, new=new, tier_mix=mix, layer_kind=layer_kind,
                         index_key_bits=8 if "keys8" in name else 16)


@pytest.mark.parametrize("name", list(CASES))
def test_owning_attention_matches_golden(name: str) -> None:
    sc = _scenario(name)
    res = sc.call(return_scores=True)
    golden_check(sc, res)
    if "keys8" in name:  # some keys reach the clamp
        assert (np.abs(ref.key_codes_of(sc.dims, sc.index_keys)[sc.path >= 0]) == 127).any()
    if "int4" in name:
        assert (ref.slot_tier(sc.slots[sc.path >= 0]) == ref.INT4).any()
        # the latents attention read are a plain NumPy decode of the pool's bytes (golden_check's are the golden's)
        nk, nv = _numpy_latents(sc)
        gk, gv = golden_held(sc)
        for b in range(len(sc.past)):
            n = int(sc.lengths[b])
            assert np.array_equal(nk[b, :n].view(np.uint32), gk[b, :n].view(np.uint32))
            assert np.array_equal(nv[b, :n].view(np.uint32), gv[b, :n].view(np.uint32))
    dense = [int(t) + 1 <= sc.dims.sink_tokens + sc.window + sc.dims.max_top_k
             for b in range(len(sc.past)) for t in range(sc.past[b], sc.lengths[b])]
    if name.startswith("topk-covers"):
        assert all(dense)
    if name in ("decode-mqa-long", "prefill-2048", "gqa4-odd-ranks"):
        assert not all(dense), "the case must exercise sparse selection"


@pytest.mark.parametrize("name", ["chunked-prefill-mixed-tiers", "decode-mqa-long", "gqa4-odd-ranks",
                                  "decode-int4-mixed"])
def test_sharing_attention_matches_golden(name: str) -> None:
    src = _scenario(name)
    sel = src.call().selected  # the source (owning) layer's selection of the same call
    sc = _scenario(name, layer_kind=1)  # same cache content (same seed), kv_projector weights
    assert np.array_equal(sc.pool, src.pool)
    res = sc.call(selected=sel)
    assert res.selected is None and res.mass is None
    golden_check(sc, res, selected_in=sel)


# ---- per-sequence selection budget (node input sparse_top_k [B], attribute max_top_k) ----
@pytest.mark.parametrize("new", [[1, 1, 1, 1, 1], [3, 1, 4, 2, 5]], ids=["decode", "chunked-prefill"])
def test_per_sequence_budgets_equal_golden_at_each_top_k(new: list[int]) -> None:
    """One call, five sequences: budgets 0, small, the checkpoint-like default, max_top_k = N_max
    (dense: it covers every context), and a budget that covers only this short sequence's context.
    Each equals the golden configured with that sequence's sparse_top_k (golden_check)."""
    sinks, window, n_max = 2, 3, 160
    budgets = [0, 5, 24, n_max, 40]
    rng = np.random.default_rng(11 + len(set(new)))
    sc = make_scenario(rng, num_heads=4, num_kv_heads=2, head_dim=8, rank_k=6, rank_v=5, index_heads=2,
                       index_dim=4, sink_tokens=sinks, top_k=n_max, max_sparse_window=4, window=window,
                       n_max=n_max, past=[100, 120, 60, 90, 30], new=new, tier_mix=(0.4, 0.2, 0.2, 0.2),
                       seq_top_k=budgets)
    res = sc.call(return_scores=True)
    golden_check(sc, res)
    assert res.selected.shape[-1] == sinks + 4 + n_max  # K_sel is fixed by max_top_k, not by the budgets
    for b, k in enumerate(budgets):
        for j in range(int(sc.new[b])):
            t = int(sc.past[b]) + j
            got = int((res.selected[b, j] >= 0).sum())
            assert got == (t + 1 if t + 1 <= sinks + window + k else sinks + window + k), (b, j)
    assert int(sc.past[4]) + int(sc.new[4]) <= sinks + window + 40  # sequence 4 really is the short dense case
    # without budgets (a direct caller of the reference passes none) every sequence selects max_top_k
    legacy, explicit = sc.call(sparse_top_k=None), sc.call(sparse_top_k=np.full(5, n_max, np.int32))
    assert np.array_equal(legacy.selected, explicit.selected)
    assert np.array_equal(legacy.out.view(np.uint32), explicit.out.view(np.uint32))


@pytest.mark.parametrize("bad, b", [(-1, 0), (17, 1)])
def test_budget_outside_max_top_k_is_refused(bad: int, b: int) -> None:
    sc = _scenario("gqa4-odd-ranks")  # max_top_k 10
    assert sc.dims.max_top_k == 10
    budgets = np.array([3, 10], np.int32)
    budgets[b] = bad if bad < 0 else sc.dims.max_top_k + 7
    with pytest.raises(ref.PluginContractError, match=rf"sparse_top_k\[{b}\] = {budgets[b]} outside "
                                                        r"0\.\.max_top_k = 10"):
        sc.call(sparse_top_k=budgets)
    with pytest.raises(ValueError, match="sparse_top_k: expected shape"):
        sc.call(sparse_top_k=np.array([3], np.int32))


# ---- a top-k that grows with the context (attribute sparse_top_k_divisor) ----------------------------------
# name: make_scenario arguments, and the positions each valid query keeps, worked out by hand from
# max(sparse_top_k[b], (t + 1) // divisor) capped at max_top_k
GROWTH = {
    # t = 399, 100, 30, 7 with divisor 8: top-k 50 (grown past 10; t // 8 would be 49), 20 (12 < 20), 3 (= 3),
    # 2 (1 < 2; 8 > 2 + 3 + 2)
    "decode-b4": (dict(past=[399, 100, 30, 7], new=[1, 1, 1, 1], seq_top_k=[10, 20, 3, 2], sparse_top_k_divisor=8,
                       top_k=64, n_max=512), [[55], [25], [8], [7]]),
    # t = 90..101: 11 until t = 94, then 12 (96 // 8) inside the chunk; t = 40..45: 5 > 4
    "chunked-straddle": (dict(past=[90, 40], new=[12, 6], seq_top_k=[11, 4], sparse_top_k_divisor=8, top_k=64,
                              n_max=160), [[16] * 5 + [17] * 7, [10] * 6]),
    # (t + 1) // 2 = 50 at t = 100, capped at max_top_k 16
    "capped": (dict(past=[100], new=[3], seq_top_k=[4], sparse_top_k_divisor=2, top_k=16, n_max=160), [[21] * 3]),
    # top-k 0 grown to (t + 1) // 2: dense while t + 1 <= 2 + 3 + (t + 1) // 2, i.e. t <= 9; t = 10, 11 keep
    # 5 + 5 and 5 + 6
    "dense-threshold": (dict(past=[0], new=[12], seq_top_k=[0], sparse_top_k_divisor=2, top_k=16, n_max=64),
                        [list(range(1, 11)) + [10, 11]]),
}


def _growth_scenario(name: str, **override) -> Scenario:
    kw, _ = GROWTH[name]
    kw = {**kw, **override}
    return make_scenario(np.random.default_rng(zlib.crc32(name.encode())), num_heads=4, num_kv_heads=2, head_dim=8,
                         rank_k=6, rank_v=5, index_heads=2, index_dim=4, sink_tokens=2, max_sparse_window=4, window=3,
                         tier_mix=(0.4, 0.2, 0.2, 0.2), **kw)


@pytest.mark.parametrize("name", list(GROWTH))
def test_growing_top_k_matches_numpy_and_golden(name: str) -> None:
    """Each query selects max(sparse_top_k[b], (t + 1) // divisor) (at most max_top_k): the counts worked out by
    hand, the positions a plain-Python selection takes on the reference's own scores, and the golden's attention
    over them (golden_check, the golden's selection at each query's top-k)."""
    sc = _growth_scenario(name)
    res = sc.call(return_scores=True)
    kept = GROWTH[name][1]
    d = sc.dims
    for b in range(len(sc.past)):
        assert (res.selected[b, :int(sc.new[b])] >= 0).sum(axis=-1).tolist() == kept[b], b
        for j in range(int(sc.new[b])):
            t = int(sc.past[b]) + j
            top_k = min(max(int(sc.top_k[b]), (t + 1) // d.sparse_top_k_divisor), d.max_top_k)
            want = numpy_selection(res.scores[b, j], t, d.sink_tokens, sc.window, top_k)
            assert res.selected[b, j, :len(want)].tolist() == want, (b, j)
            assert (res.selected[b, j, len(want):] == -1).all()
    golden_check(sc, res)


def test_growth_off_selects_the_fixed_top_k() -> None:
    """Divisor 0 (a node without the attribute) is the fixed per-sequence budget; the same call with a divisor
    selects more where growth exceeds the budget, and the same where it does not."""
    grown = _growth_scenario("decode-b4")
    fixed = _growth_scenario("decode-b4", sparse_top_k_divisor=0)
    assert ref.Dims(**{f.name: getattr(fixed.dims, f.name) for f in dataclasses.fields(fixed.dims)
                       if f.name != "sparse_top_k_divisor"}) == fixed.dims
    a, b = fixed.call(), grown.call()
    assert (a.selected >= 0).sum(axis=-1)[:, 0].tolist() == [2 + 3 + 10, 2 + 3 + 20, 2 + 3 + 3, 2 + 3 + 2]
    assert (b.selected >= 0).sum(axis=-1)[:, 0].tolist() == [55, 25, 8, 7]
    assert np.array_equal(a.selected[1:], b.selected[1:])
    assert np.array_equal(a.out[1:].view(np.uint32), b.out[1:].view(np.uint32))


def test_negative_divisor_is_refused() -> None:
    sc = _growth_scenario("decode-b4")
    with pytest.raises(ValueError, match="sparse_top_k_divisor must be >= 0"):
        dataclasses.replace(sc.dims, sparse_top_k_divisor=-1)
    object.__setattr__(sc.dims, "sparse_top_k_divisor", -3)  # past the dataclass's check: the C++ one answers
    with pytest.raises(ref.PluginContractError, match="sparse_top_k_divisor -3 is negative"):
        sc.call()


def test_selection_ties_go_to_lower_positions() -> None:
    """All keys zero: every score is zero (negative weights times ReLU 0 included), all tie."""
    rng = np.random.default_rng(5)
    sc = make_scenario(rng, num_heads=2, num_kv_heads=1, head_dim=8, rank_k=4, rank_v=4, index_heads=3,
                       index_dim=4, sink_tokens=2, top_k=5, max_sparse_window=3, window=3, n_max=64,
                       past=[40], new=[2], key_value=0.0)
    sc.index_w[:] = np.array([-1.0, 0.5, -2.0], np.float32)
    res = sc.call(return_scores=True)
    assert np.all(res.scores[0, :, :42][~np.isnan(res.scores[0, :, :42])] == 0)
    for j, t in enumerate((40, 41)):
        want = [0, 1] + list(range(2, 7)) + list(range(t - 2, t + 1))
        assert res.selected[0, j, :len(want)].tolist() == want
    golden_check(sc, res)


# ---- each logit row's own mass (query_mass), a row of a call as a one-token step ------------------------------
@pytest.mark.parametrize("name", ["chunked-prefill-mixed-tiers", "gqa4-odd-ranks", "topk-covers-context",
                                  "chunked-keys8-int4-odd-dim"])
def test_each_row_of_a_call_is_its_one_token_step_bit_for_bit(name: str) -> None:
    """Row j of a call (a speculative verification, a prefill chunk): its attention output and selection are the
    one-token call's at its position, and query_mass of the logit row naming it is that call's attention mass, all bit
    for bit; the rows' query masses added in row order are the call's attn_mass, bit for bit."""
    sc = _scenario(name)
    B, rows = len(sc.past), sc.all_rows()
    res = sc.call(logit_rows=rows)
    assert res.query_mass.shape == (B, sc.S, sc.dims.n_max)
    for j in range(sc.S):
        one = sc.one_token(j).call(logit_rows=np.zeros((B, 1), np.int32))
        assert np.array_equal(one.query_mass.view(np.uint32), one.mass[:, None].view(np.uint32))
        for b in range(B):
            if j >= sc.new[b]:
                continue
            assert np.array_equal(res.out[b, j].view(np.uint32), one.out[b, 0].view(np.uint32)), (b, j)
            assert np.array_equal(res.selected[b, j], one.selected[b, 0]), (b, j)
            assert np.array_equal(res.query_mass[b, j].view(np.uint32), one.mass[b].view(np.uint32)), (b, j)
    for b in range(B):
        total = np.zeros(sc.dims.n_max, np.float32)
        for j in range(int(sc.new[b])):
            total = total + res.query_mass[b, j]
        assert np.array_equal(total.view(np.uint32), res.mass[b].view(np.uint32))
        assert np.array_equal(res.query_mass[b, int(sc.new[b]):], np.broadcast_to(
            res.query_mass[b, int(sc.new[b]) - 1], res.query_mass[b, int(sc.new[b]):].shape))


def test_query_mass_of_a_padding_row_is_zero_and_rows_are_checked() -> None:
    sc = _scenario("chunked-prefill-mixed-tiers")  # new [5, 2, 5]: row 4 of sequence 1 is padding
    res = sc.call(logit_rows=np.array([[4, 0], [4, 1], [0, 4]], np.int32))
    assert not res.query_mass[1, 0].any() and res.query_mass[1, 1].any()
    want = sc.call(logit_rows=sc.all_rows())
    assert np.array_equal(res.query_mass[0, 0], want.query_mass[0, 4]) and np.array_equal(res.out, want.out)
    with pytest.raises(ref.PluginContractError, match=r"logit_rows\[2, 1\] = 5 is outside 0..S-1 = 4"):
        sc.call(logit_rows=np.array([[0, 0], [0, 0], [0, 5]], np.int32))


def test_results_do_not_depend_on_thread_count() -> None:
    sc = _scenario("chunked-prefill-mixed-tiers")
    a, b = sc.call(threads=1), sc.call(threads=3)
    assert np.array_equal(a.out.view(np.uint32), b.out.view(np.uint32))
    assert np.array_equal(a.mass.view(np.uint32), b.mass.view(np.uint32))
    assert np.array_equal(a.selected, b.selected)


# ---- cache rows: each sequence's pools are one row of [R, ...] ---------------------
@pytest.mark.parametrize("layer_kind", [0, 1], ids=["owning", "sharing"])
def test_cache_rows_select_each_sequence_row(layer_kind: int) -> None:
    """The same call with the sequences' caches scattered over rows 4, 0, 2 of 6 poisoned rows gives the packed
    call's results bit for bit (a wrong row would read 0xFF words or NaN keys)."""
    sc = _scenario("chunked-prefill-mixed-tiers", layer_kind=layer_kind)
    sel = _scenario("chunked-prefill-mixed-tiers").call().selected if layer_kind else None
    want = sc.call(selected=sel)
    got = sc.in_rows(np.array([4, 0, 2]), 6).call(selected=sel)
    assert np.array_equal(got.out.view(np.uint32), want.out.view(np.uint32))
    if layer_kind == 0:
        assert np.array_equal(got.selected, want.selected)
        assert np.array_equal(got.mass.view(np.uint32), want.mass.view(np.uint32))


def test_cache_rows_update_writes_only_the_named_rows() -> None:
    sc = _scenario("chunked-prefill-mixed-tiers")
    d, rng = sc.dims, np.random.default_rng(5)
    B, S = 3, 5
    ck = rng.standard_normal((B, S, d.rank_k), dtype=np.float32)
    cv = rng.standard_normal((B, S, d.rank_v), dtype=np.float32)
    key = rng.standard_normal((B, S, d.index_dim), dtype=np.float32)
    past, new = sc.past.copy(), sc.new.copy()
    want_pool, want_keys = ref.kv_update(d, ck, cv, key, sc.pool.copy(), sc.index_keys.copy(), sc.slots, past, new)
    rows = np.array([4, 0, 2])
    scat = sc.in_rows(rows, 6)
    untouched = [r for r in range(6) if r not in rows]
    before = scat.pool[untouched].copy(), scat.index_keys[untouched].view(np.uint16).copy()
    pool, keys = ref.kv_update(d, ck, cv, key, scat.pool, scat.index_keys, sc.slots, past, new, cache_rows=rows)
    assert np.array_equal(pool[rows], want_pool)
    assert np.array_equal(keys[rows].view(np.uint16), want_keys.view(np.uint16))
    assert np.array_equal(pool[untouched], before[0]) and np.array_equal(keys[untouched].view(np.uint16), before[1])
    with pytest.raises(ref.PluginContractError, match=r"cache_rows\[1\] = 6 is not a row of the pools \(0..5\)"):
        ref.kv_update(d, ck, cv, key, scat.pool, scat.index_keys, sc.slots, past, new, cache_rows=np.array([4, 6, 2]))
    with pytest.raises(ref.PluginContractError, match=r"cache_rows\[0\] = -1 is not a row"):
        scat.call(cache_rows=np.array([-1, 0, 2]))


# ---- contract violations are reported, not silently computed ------------------------------------
def test_contract_errors() -> None:
    sc = _scenario("topk0-no-sinks")
    with pytest.raises(ref.PluginContractError, match="sparse_window 6 outside"):
        ref.sparse_attention(sc.dims, sc.q, sc.pool, sc.slots, sc.past, sc.new, sc.quant, sc.rope_cos,
                             sc.rope_sin, sc.w0, sc.w1, index_q=sc.index_q, index_w=sc.index_w,
                             index_keys=sc.index_keys, sparse_window=6)
    d, B = sc.dims, 1
    z = np.zeros((B, 1, d.rank_k), np.float32)
    slots = sc.slots.copy()
    slots[0, 36] = ref.make_slot(ref.INT8, d.rows_fp16 + d.rows_int12)
    with pytest.raises(ref.PluginContractError, match=r"kv_slots\[0, 36\].*not an FP16 row"):
        ref.kv_update(d, z, np.zeros((B, 1, d.rank_v), np.float32), np.zeros((B, 1, d.index_dim), np.float32),
                      sc.pool, sc.index_keys, slots, np.array([36]), np.array([1]))
    src = int(sc.slots[0, 3])
    int8_row = ref.make_slot(ref.INT8, d.rows_fp16 + d.rows_int12)
    with pytest.raises(ref.PluginContractError, match="promotion"):
        ref.kv_demote(d, np.array([[0, int8_row, src]]), sc.pool, sc.quant)
    with pytest.raises(ref.PluginContractError, match="destination row used twice"):
        ref.kv_demote(d, np.array([[0, src, int8_row], [0, int(sc.slots[0, 4]), int8_row]]), sc.pool, sc.quant)
    with pytest.raises(ref.PluginContractError, match="region is narrower"):
        ref.kv_demote(d, np.array([[0, src, ref.make_slot(ref.FP16, d.rows_fp16 + 1)]]), sc.pool, sc.quant)


# ---- tier policy helpers vs the golden cache ----------------------------------------------------
@pytest.mark.parametrize("fractions", [(0.3, 0.3, 0.4), (0.2, 0.2, 0.3, 0.3)])
def test_hotness_and_ranking_match_golden(fractions: tuple[float, ...]) -> None:
    rng = np.random.default_rng(9)
    n = 700
    quant = KVQuantConfig(tier_fractions=fractions, fp16_window=16, hotness_decay=0.9, hot_token_ids=(3, 7),
                          **({"bit_widths": (16, 12, 8, 4)} if len(fractions) == 4 else {}))
    cache = SequenceCache(deployed=True, layers={})
    cache.add_positions(rng.integers(0, 12, n).tolist())
    for _ in range(3):
        mass = torch.from_numpy(rng.random(n).astype(np.float32).round(1))  # rounding makes ties
        ours = ref.hotness_update(cache.hotness.numpy(), mass.numpy(), quant.hotness_decay)
        cache.update_hotness(mass, quant.hotness_decay)
        assert np.array_equal(ours.view(np.uint32), cache.hotness.numpy().view(np.uint32))
    want = cache.ranked_tiers(quant, sink_tokens=2).numpy().astype(np.int32)
    got = ref.ranked_tiers(cache.hotness.numpy(), np.asarray(cache.tokens), hot_token_ids=quant.hot_token_ids,
                           sink_tokens=2, fp16_window=quant.fp16_window, tier_fractions=quant.tier_fractions)
    assert np.array_equal(got, want)
    assert (got == ref.INT4).any() == (len(fractions) == 4)


def _ranked_by_tier_counts(hotness: np.ndarray, tokens: np.ndarray, hot_ids: tuple[int, ...], sinks: int,
                           window: int, fractions: tuple[float, ...]) -> np.ndarray:
    """decisions "Re-tier pass" with gsm.tiers.tier_counts: eligible positions by hotness descending (ties to the
    lower position), the first n16 FP16, then n12 INT12, n8 INT8, the rest INT4."""
    n = hotness.size
    out = np.zeros(n, np.int32)
    eligible = [s for s in range(sinks, max(sinks, n - window)) if int(tokens[s]) not in hot_ids]
    order = np.asarray(eligible, np.int64)[np.argsort(-hotness[eligible], kind="stable")]
    counts = tiers.tier_counts(fractions, len(eligible))
    out[order] = np.repeat(np.arange(4, dtype=np.int32), counts)
    return out


@pytest.mark.parametrize("fractions", [
    (0.25, 0.25, 0.25, 0.25), (0.1, 0.2, 0.3, 0.4), (0.0, 0.0, 0.0, 1.0), (0.5, 0.0, 0.0, 0.5),
    (1 / 3, 1 / 3, 1 / 3, 0.0), (0.2, 0.7, 0.1, 0.0), (0.2, 0.7, 0.1), (0.3, 0.3, 0.3), (0.3, 0.3, 0.3, 0.0),
    (0.05, 0.3, 0.6499999999999999, 1e-9), (0.3, 0.3, 0.39, 0.01)])
def test_ranking_with_four_fractions_follows_tier_counts(fractions: tuple[float, ...]) -> None:
    """Four fractions rank by gsm.tiers.tier_counts; three (or f4 = 0) never make an INT4 row, even when the float
    sum of the fractions is 0.9999999999999999 (0.2 + 0.7 + 0.1) or well below 1."""
    rng = np.random.default_rng(len(fractions) + int(1000 * fractions[0]))
    for n in (0, 1, 5, 37, 700, 1001):
        hot = rng.random(n).astype(np.float32).round(1)  # many ties
        tokens = rng.integers(0, 12, n).astype(np.int32)
        got = ref.ranked_tiers(hot, tokens, hot_token_ids=(3, 7), sink_tokens=2, fp16_window=16,
                               tier_fractions=fractions)
        want = _ranked_by_tier_counts(hot, tokens, (3, 7), 2, 16, fractions)
        assert np.array_equal(got, want), n
        if len(fractions) == 3 or fractions[3] == 0:
            assert not (got == ref.INT4).any()
    assert sum((0.2, 0.7, 0.1)) == 0.9999999999999999
    with pytest.raises(ValueError, match="3 or 4 numbers"):
        ref.ranked_tiers(np.zeros(3, np.float32), np.zeros(3, np.int32), sink_tokens=0, fp16_window=0,
                         tier_fractions=(0.5, 0.5))
