"""CUDA kernels of the GSM plugins against the C++ CPU reference, on a GPU or emulated on the CPU.

`GSM_CUDA=device` (default) runs libgsm_plugins_cuda.so on a GPU and skips without one; `GSM_CUDA=emulated`
runs libgsm_plugins_cuda_emulated.so, the same kernel sources on the HIP CPU Runtime (one fiber per GPU
thread: the kernels' shared-memory staging, __syncthreads, warp shuffles and launch geometry execute), and
fails rather than skips when that library is missing, so CI cannot pass without running the kernels.

Tolerances. The cache kernels implement the bit-exact contract in both modes: pools and indexer keys must be
byte-identical to the reference's. Attention:
- emulated: compiled like the reference (float32, no FMA contraction), so the index scores are computed in the
  same order and bit-identical to the reference's: selections must be identical in every row, ties included.
  The attention output sums the same float32 terms in another order (a latent-space V sum per key head, warp
  reductions of the logits), so values may differ by float32 rounding of sums of up to K_sel terms: atol = rtol
  = 1e-5 (measured over every case here: at most 8.3e-7 absolute for owning and 1.3e-6 for sharing layers, on
  outputs of magnitude <= 3.0, i.e. <= 4.4e-7 of the scale). The attention mass is summed with atomics in no fixed
  order: the same 1e-5 (measured: 1.1e-6 relative at most); each logit row's own mass (query_mass) sums the
  query heads in the reference's order, of weights that differ by float32 rounding: 1e-5 too.
- a row of a call against the kernels' own one-token call at its position: bit for bit in both modes (the same
  blocks compute it; a one-token call's attn_mass adds each pick's mass to zero once), which is what lets a
  speculative verification stand for one-token steps.
- device: nvcc contracts the kernels' products into FMAs, so scores may differ in the last bit: 1e-4, and
  selections must be equal except where the reference's own scores put two candidates within 1e-4 of the
  top-k boundary (a near tie the GPU may break the other way); such rows are reported and skipped.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

gep = pytest.importorskip("gsm_edge_plugins")
from gsm_edge_plugins import cuda as gcuda  # noqa: E402

MODE = gcuda.mode()
EMULATED = MODE == "emulated"
if EMULATED:
    if not gcuda.library_available() or not gep.reference_available():
        pytest.fail("GSM_CUDA=emulated, but libgsm_plugins_cuda_emulated.so / libgsm_plugins_ref.so were not built "
                    "(the HIP CPU Runtime and TBB must be found at build time: apt-get install libtbb-dev, "
                    "-DGSM_HIP_CPU_ROOT=)", pytrace=False)
else:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (GSM_CUDA=emulated runs these tests on the CPU)", allow_module_level=True)
    if not gcuda.library_available() or not gep.reference_available():
        pytest.skip("libgsm_plugins_cuda.so / libgsm_plugins_ref.so not built (needs nvcc at build time)",
                    allow_module_level=True)

from gsm_edge_plugins import ref  # noqa: E402
from gsm_edge_plugins.testing import make_scenario, numpy_selection  # noqa: E402

TOL = 1e-5 if EMULATED else 1e-4

# (nH, nKV, D, r_k, r_v, nI, dI, sinks, top_k, max_window, window, n_max, past, new, tier_mix)
CASES = {
    "prefill-ragged": (4, 2, 16, 6, 5, 2, 8, 1, 8, 4, 3, 64, [0, 0, 0], [1, 7, 40], (1, 0, 0, 0)),
    "chunked-mixed-tiers": (4, 1, 8, 7, 9, 2, 4, 2, 6, 4, 4, 160, [13, 0, 100], [5, 2, 5], (0.3, 0.3, 0.2, 0.2)),
    "decode-mqa-2048": (8, 1, 32, 16, 12, 4, 16, 4, 64, 8, 8, 2048, [0, 5, 300, 2047], [1, 1, 1, 1],
                        (0.25, 0.25, 0.25, 0.25)),
    "decode-gqa8-d128": (32, 4, 128, 160, 160, 4, 32, 1, 64, 8, 3, 4096, [4095, 1000], [1, 1], (0.25, 0.25, 0.5, 0)),
    "topk-covers-context": (4, 2, 16, 8, 8, 2, 8, 1, 4096, 8, 3, 300, [250, 0], [10, 37], (0.5, 0.5, 0, 0)),
    "topk0-no-sinks": (2, 1, 8, 4, 4, 2, 4, 0, 0, 5, 5, 64, [30], [6], (1, 0, 0, 0)),
    "prefill-1024": (2, 2, 64, 32, 24, 2, 16, 1, 64, 8, 3, 1024, [0], [1024], (1, 0, 0, 0)),
    # SmolLM2-135M's geometry: 9 query / 3 KV heads, D 64, latent ranks near 190 (odd: padded INT12 pairs),
    # indexer 4 x 32, its sink/window shape, a few hundred positions, every tier.
    "smollm2-decode": (9, 3, 64, 97, 93, 4, 32, 4, 128, 64, 64, 512, [300, 17, 511, 200], [1, 1, 1, 1],
                       (0.4, 0.3, 0.2, 0.1)),
    "smollm2-prefill-chunks": (9, 3, 64, 97, 93, 4, 32, 4, 128, 64, 64, 512, [260, 0, 131], [48, 37, 1],
                               (0.4, 0.3, 0.2, 0.1)),
    # per-layer selection: a streaming layer's node, top-k 0 behind a window far wider than the
    # model's (its own max_sparse_window), decode and a prefill chunk crossing the window's edge
    "streaming-wide-window": (9, 3, 64, 97, 93, 4, 32, 1, 0, 1056, 1056, 2048, [1500, 40, 2047, 1000], [1, 1, 1, 80],
                              (0.4, 0.3, 0.2, 0.1)),
    # the INT4 tier: rows reached by every path (testing.PATH_TIERS) and held in every region, odd ranks
    "smollm2-decode-int4": (9, 3, 64, 97, 93, 4, 32, 4, 128, 64, 64, 512, [300, 17, 511, 200], [1, 1, 1, 1],
                            (0.2, 0.1, 0.1, 0.1, 0.15, 0.1, 0.15, 0.1)),
    "chunked-int4-only": (4, 1, 8, 7, 9, 2, 4, 2, 6, 4, 4, 160, [13, 0, 100], [5, 2, 5], (0, 0, 0, 0, 1, 0, 0, 0)),
    # INT8 indexer keys: SmolLM2's geometry, and an index dim that pads its last int32 word
    "smollm2-decode-keys8": (9, 3, 64, 97, 93, 4, 32, 4, 128, 64, 64, 512, [300, 17, 511, 200], [1, 1, 1, 1],
                             (0.2, 0.1, 0.1, 0.1, 0.15, 0.1, 0.15, 0.1)),
    "chunked-keys8-odd-dim": (4, 1, 8, 7, 9, 2, 12, 2, 6, 4, 4, 160, [13, 0, 100], [5, 2, 5], (0.4, 0.3, 0.2, 0.1)),
}


def _scenario(name: str, layer_kind: int = 0, seq_top_k: list[int] | None = None, key_value: float | None = None,
              divisor: int = 0):
    nH, nKV, D, rk, rv, nI, dI, sinks, topk, mw, w, n_max, past, new, mix = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # str hash() is salted per process
    return make_scenario(rng, num_heads=nH, num_kv_heads=nKV, head_dim=D, rank_k=rk, rank_v=rv, index_heads=nI,
                         index_dim=dI, sink_tokens=sinks, top_k=topk, max_sparse_window=mw, window=w, n_max=n_max,
                         past=past, new=new, tier_mix=mix, layer_kind=layer_kind, seq_top_k=seq_top_k,
                         key_value=key_value, index_key_bits=8 if "keys8" in name else 16,
                         sparse_top_k_divisor=divisor)


def _near_tie_rows(sc, scores: np.ndarray) -> set[tuple[int, int]]:
    """Rows whose k-th and (k+1)-th best candidate scores are within TOL (a GPU's FMA may flip them).
    Empty when emulated: the emulated scores are the reference's, bit for bit."""
    d, rows = sc.dims, set()
    if EMULATED:
        return rows
    for b in range(len(sc.past)):
        for j in range(int(sc.new[b])):
            t = int(sc.past[b]) + j
            k = sc.query_top_k(b, t)
            if t + 1 <= d.sink_tokens + sc.window + k or k == 0:
                continue
            cand = np.sort(scores[b, j, d.sink_tokens:t - sc.window + 1])[::-1]
            if abs(cand[k - 1] - cand[k]) <= TOL * max(1.0, abs(cand[k])):
                rows.add((b, j))
    return rows


def _compare(sc, want: ref.AttentionResult, got: ref.AttentionResult, skip: set[tuple[int, int]]) -> None:
    for b in range(len(sc.past)):
        T = int(sc.new[b])
        for j in range(T):
            if (b, j) in skip:
                continue
            if want.selected is not None:
                assert np.array_equal(got.selected[b, j], want.selected[b, j]), f"selection {b},{j}"
            np.testing.assert_allclose(got.out[b, j], want.out[b, j], rtol=TOL, atol=TOL, err_msg=f"row {b},{j}")
        assert np.all(got.out[b, T:] == 0), f"padding rows of sequence {b} not zero"
        if want.selected is not None:
            assert np.all(got.selected[b, T:] == -1), f"padding rows of sequence {b} select something"
        if want.mass is not None and not any(r[0] == b for r in skip):
            np.testing.assert_allclose(got.mass[b], want.mass[b], rtol=TOL, atol=TOL, err_msg=f"mass {b}")


def test_mode_runs_the_library_it_names() -> None:
    archs = gcuda.architectures()
    assert archs == "emulated" if EMULATED else archs and "emulated" not in archs


@pytest.mark.parametrize("name", list(CASES))
def test_owning_attention_cuda_matches_reference(name: str) -> None:
    sc = _scenario(name)
    want = sc.call(return_scores=True)
    got = gcuda.sparse_attention(sc)
    skip = _near_tie_rows(sc, want.scores)
    assert len(skip) <= max(1, sum(sc.new) // 50), f"too many near ties to be a fair test: {len(skip)}"
    _compare(sc, want, got, skip)


@pytest.mark.parametrize("name", ["chunked-mixed-tiers", "chunked-int4-only", "chunked-keys8-odd-dim"])
def test_each_row_is_the_kernels_one_token_call_bit_for_bit(name: str) -> None:
    """query_mass against the reference, then row j of the call against the kernels' one-token call at its position:
    attention output, selection and the row's query_mass (that call's attn_mass) bit for bit."""
    sc = _scenario(name)
    B, rows = len(sc.past), sc.all_rows()
    want = sc.call(return_scores=True, logit_rows=rows)
    got = gcuda.sparse_attention(sc, logit_rows=rows)
    skip = _near_tie_rows(sc, want.scores)
    _compare(sc, want, got, skip)
    for b in range(B):
        for i in range(sc.S):
            if (b, int(rows[b, i])) not in skip:
                np.testing.assert_allclose(got.query_mass[b, i], want.query_mass[b, i], rtol=TOL, atol=TOL,
                                           err_msg=f"query_mass {b},{i}")
    for j in range(sc.S):
        one = gcuda.sparse_attention(sc.one_token(j), logit_rows=np.zeros((B, 1), np.int32))
        assert np.array_equal(one.query_mass[:, 0].view(np.uint32), one.mass.view(np.uint32))
        for b in range(B):
            if j < sc.new[b]:
                assert np.array_equal(got.out[b, j].view(np.uint32), one.out[b, 0].view(np.uint32)), (b, j)
                assert np.array_equal(got.selected[b, j], one.selected[b, 0]), (b, j)
                assert np.array_equal(got.query_mass[b, j].view(np.uint32), one.mass[b].view(np.uint32)), (b, j)


def test_query_mass_of_a_padding_row_is_zero_cuda() -> None:
    """A logit row past its sequence's new rows (or outside the call, which the kernel cannot refuse) is zero; the
    SmolLM2 geometry's logit rows against the reference."""
    sc = _scenario("smollm2-prefill-chunks")  # new [48, 37, 1]
    rows = np.array([[47, 60], [36, 40], [0, 2]], np.int32)
    want = sc.call(return_scores=True, logit_rows=np.minimum(rows, sc.S - 1))
    got = gcuda.sparse_attention(sc, logit_rows=rows)
    skip = _near_tie_rows(sc, want.scores)
    for b, i in ((0, 0), (1, 0), (2, 0)):
        if (b, int(rows[b, i])) not in skip:
            np.testing.assert_allclose(got.query_mass[b, i], want.query_mass[b, i], rtol=TOL, atol=TOL)
    assert got.query_mass[0, 0].any() and not got.query_mass[:, 1].any()


def test_per_sequence_budgets_cuda_match_reference_and_clamp() -> None:
    """Each sequence selects with its own sparse_top_k (0, small, max_top_k, and dense by
    covering its context); the kernel clamps what the reference refuses (< 0, > max_top_k)."""
    sc = _scenario("decode-mqa-2048", seq_top_k=[0, 3, 64, 64])  # max_top_k 64; sequence 1 (t = 5) is dense
    want = sc.call(return_scores=True)
    skip = _near_tie_rows(sc, want.scores)
    _compare(sc, want, gcuda.sparse_attention(sc), skip)
    sc.top_k = np.array([-4, 3, 64, 1000], np.int32)
    _compare(sc, want, gcuda.sparse_attention(sc), skip)


def test_smollm2_budgets_zero_small_and_covering_the_context() -> None:
    """SmolLM2 geometry, prefill chunks of unequal lengths: top-k 0 (sinks + window only), a small budget, and a
    budget >= the context (every row dense)."""
    sc = _scenario("smollm2-prefill-chunks", seq_top_k=[0, 5, 128])
    sc_dense = _scenario("smollm2-prefill-chunks", seq_top_k=[128, 128, 128])
    for s in (sc, sc_dense):
        want = s.call(return_scores=True)
        _compare(s, want, gcuda.sparse_attention(s), _near_tie_rows(s, want.scores))


# A top-k that grows with the context (attribute sparse_top_k_divisor d): the query at t selects
# max(sparse_top_k[b], (t + 1) // d), at most max_top_k. name: case, sparse_top_k, d
GROWTH = {
    # t = 300, 17, 511, 200, d 4: 75 (past 10), 4 (dense: 18 <= 4 + 64 + 4), 128 (= max_top_k, past 100; t // 4
    # would be 127), 50 (past 40)
    "smollm2-decode-grows": ("smollm2-decode", [10, 3, 100, 40], 4),
    # sequence 0 (t = 260..307) keeps its 90 until t = 272 (273 // 3 = 91), then grows every third position
    "smollm2-prefill-straddles": ("smollm2-prefill-chunks", [90, 5, 10], 3),
    # (t + 1) // 2 beyond max_top_k 6 in every sparse row: capped
    "chunked-capped": ("chunked-mixed-tiers", [2, 1, 3], 2),
}


@pytest.mark.parametrize("name", list(GROWTH))
def test_growing_top_k_cuda_matches_reference_and_numpy(name: str) -> None:
    case, seq_top_k, divisor = GROWTH[name]
    sc = _scenario(case, seq_top_k=seq_top_k, divisor=divisor)
    d = sc.dims
    want = sc.call(return_scores=True)
    got = gcuda.sparse_attention(sc)
    skip = _near_tie_rows(sc, want.scores)
    _compare(sc, want, got, skip)
    tops: dict[int, set[int]] = {}
    for b in range(len(sc.past)):
        for j in range(int(sc.new[b])):
            t = int(sc.past[b]) + j
            k = min(max(seq_top_k[b], (t + 1) // divisor), d.max_top_k)
            tops.setdefault(b, set()).add(k)
            sel = numpy_selection(want.scores[b, j], t, d.sink_tokens, sc.window, k)
            assert int((got.selected[b, j] >= 0).sum()) == len(sel), (b, j)
            if (b, j) not in skip:
                assert got.selected[b, j, :len(sel)].tolist() == sel, (b, j)
    if name == "smollm2-prefill-straddles":
        assert min(tops[0]) == 90 and max(tops[0]) == 102, tops[0]  # different top-k inside one chunk
    if name == "chunked-capped":
        assert tops[2] == {d.max_top_k}


@pytest.mark.parametrize("name", ["chunked-mixed-tiers", "smollm2-decode", "smollm2-prefill-chunks"])
def test_all_scores_tied_select_lowest_positions(name: str) -> None:
    """Every indexer key equal: every candidate scores the same, so the selection is decided by the tie rule
    alone (equal scores go to the lower position, spec 4.1) through the radix select's equal-key compaction."""
    sc = _scenario(name, key_value=0.25)
    want = sc.call(return_scores=True)
    got = gcuda.sparse_attention(sc)
    d = sc.dims
    for b in range(len(sc.past)):
        for j in range(int(sc.new[b])):
            t = int(sc.past[b]) + j
            if t + 1 > d.sink_tokens + sc.window + d.max_top_k:  # sparse row: the lowest top_k candidates
                expect = np.arange(d.sink_tokens, d.sink_tokens + d.max_top_k)
                np.testing.assert_array_equal(got.selected[b, j, d.sink_tokens:d.sink_tokens + d.max_top_k],
                                              expect, err_msg=f"row {b},{j}")
    _compare(sc, want, got, set())


@pytest.mark.parametrize("name", ["chunked-mixed-tiers", "decode-mqa-2048", "decode-gqa8-d128", "smollm2-decode",
                                  "smollm2-prefill-chunks", "smollm2-decode-int4"])
def test_sharing_attention_cuda_matches_reference(name: str) -> None:
    sel = _scenario(name).call().selected
    sc = _scenario(name, layer_kind=1)
    _compare(sc, sc.call(selected=sel), gcuda.sparse_attention(sc, sel), set())


def _fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("name", ["chunked-mixed-tiers", "smollm2-decode", "smollm2-prefill-chunks"])
def test_fp16_activations_match_reference_on_the_rounded_inputs(name: str) -> None:
    """The kernels' __half instantiation (TensorRT's kHALF plugin I/O): activations read as float16, math in
    float32, out rounded to float16. Against the reference on the same float16-rounded inputs: selections as in
    float32 mode, outputs within one float16 ulp (2^-10 relative) on top of the float32 tolerance."""
    sc = _scenario(name)
    got = gcuda.sparse_attention(sc, fp16=True)
    sc.q, sc.index_q, sc.index_w = _fp16(sc.q), _fp16(sc.index_q), _fp16(sc.index_w)
    want = sc.call(return_scores=True)
    skip = _near_tie_rows(sc, want.scores)
    for b in range(len(sc.past)):
        T = int(sc.new[b])
        for j in range(T):
            if (b, j) not in skip:
                assert np.array_equal(got.selected[b, j], want.selected[b, j]), f"selection {b},{j}"
                np.testing.assert_allclose(got.out[b, j], want.out[b, j], rtol=2**-10 + TOL, atol=TOL,
                                           err_msg=f"row {b},{j}")
        assert np.all(got.out[b, T:] == 0)


@pytest.mark.parametrize("name", ["chunked-mixed-tiers", "smollm2-decode"])
def test_cache_rows_cuda_match_reference(name: str) -> None:
    """Sequence b reads row cache_rows[b] of [R, ...] pools and keys (the others poisoned); a row
    outside 0..R-1 makes that sequence read and write nothing (a kernel cannot raise)."""
    sc = _scenario(name)
    B = len(sc.past)
    rows = np.arange(B, dtype=np.int32)[::-1] * 2  # reversed and spread: every sequence moves
    scat = sc.in_rows(rows, 2 * B + 1)
    want = sc.call(return_scores=True)
    _compare(scat, want, gcuda.sparse_attention(scat), _near_tie_rows(sc, want.scores))
    shared = _scenario(name, layer_kind=1).in_rows(rows, 2 * B + 1)
    _compare(shared, shared.call(selected=want.selected), gcuda.sparse_attention(shared, want.selected), set())
    scat.cache_rows = np.array([rows[0], 2 * B + 1, *rows[2:]], np.int32)  # sequence 1 has no row
    got = gcuda.sparse_attention(scat)
    assert np.all(got.out[1] == 0) and np.all(got.selected[1] == -1)
    d, S = sc.dims, 3
    rng = np.random.default_rng(1)
    ck = rng.standard_normal((B, S, d.rank_k), dtype=np.float32)
    cv = rng.standard_normal((B, S, d.rank_v), dtype=np.float32)
    key = rng.standard_normal((B, S, d.index_dim), dtype=np.float32)
    slots, new = sc.slots.copy(), np.minimum(sc.new, S).astype(np.int32)
    pool0, keys0 = sc.in_rows(rows, 2 * B + 1).pool, sc.in_rows(rows, 2 * B + 1).index_keys
    want_pool, want_keys = ref.kv_update(d, ck, cv, key, pool0.copy(), keys0.copy(), slots, sc.past, new,
                                         cache_rows=rows)
    got_pool, got_keys = gcuda.kv_update(d, ck, cv, key, pool0, keys0, slots, sc.past, new, cache_rows=rows)
    assert not np.array_equal(want_pool, pool0)
    assert np.array_equal(got_pool, want_pool)
    assert np.array_equal(got_keys.view(np.uint16), want_keys.view(np.uint16))
    bad = rows.copy()
    bad[0] = -1
    got_pool, _ = gcuda.kv_update(d, ck, cv, key, pool0, keys0, slots, sc.past, new, cache_rows=bad)
    assert np.array_equal(got_pool[rows[0]], pool0[rows[0]]), "a sequence without a row wrote into one"


@pytest.mark.parametrize("ranks", [(6, 5), (1, 3), (97, 93), (160, 160)])
@pytest.mark.parametrize("key_bits", [16, 8])
def test_cache_update_and_demote_bit_identical(ranks: tuple[int, int], key_bits: int) -> None:
    rng = np.random.default_rng(sum(ranks))
    sc = make_scenario(rng, num_heads=2, num_kv_heads=1, head_dim=8, rank_k=ranks[0], rank_v=ranks[1],
                       index_heads=1, index_dim=32 if key_bits == 16 else 30, sink_tokens=1, top_k=4,
                       max_sparse_window=2, window=2, n_max=128, past=[100, 3], new=[4, 1], tier_mix=(1, 0, 0, 0),
                       index_key_bits=key_bits)
    d = sc.dims
    B, S = 2, 6
    ck = rng.standard_normal((B, S, d.rank_k), dtype=np.float32)
    cv = rng.standard_normal((B, S, d.rank_v), dtype=np.float32)
    # INT8 keys: the codes-to-be, off-integer and past the clamp now and then (the store rounds and clamps)
    key = rng.standard_normal((B, S, d.index_dim), dtype=np.float32) * np.float32(1 if key_bits == 16 else 60)
    past, new = np.array([104, 4], np.int32), np.array([6, 2], np.int32)  # sequence 1: 4 padding rows
    slots = sc.slots.copy()
    free = iter(range(d.rows_fp16 - 1 - 20, d.rows_fp16 - 1))  # rows the scenario left unused
    for b in range(B):
        for j in range(int(new[b])):
            slots[b, past[b] + j] = ref.make_slot(ref.FP16, next(free))
    want_pool, want_keys = ref.kv_update(d, ck, cv, key, sc.pool.copy(), sc.index_keys.copy(), slots, past, new)
    got_pool, got_keys = gcuda.kv_update(d, ck, cv, key, sc.pool, sc.index_keys, slots, past, new)
    assert not np.array_equal(want_pool, sc.pool)  # the update wrote something
    assert np.array_equal(got_pool, want_pool)
    assert np.array_equal(got_keys.view(np.uint16), want_keys.view(np.uint16))
    if key_bits == 8:
        codes = ref.key_codes_of(d, want_keys)
        for b in range(B):
            n = int(new[b])
            assert np.array_equal(codes[b, past[b]:past[b] + n], np.clip(np.rint(key[b, :n]), -127, 127))
    # float16 inputs (TensorRT's kHALF): the same bytes as the reference writes from the rounded values
    want16 = ref.kv_update(d, _fp16(ck), _fp16(cv), _fp16(key), sc.pool.copy(), sc.index_keys.copy(), slots, past,
                           new)
    got16 = gcuda.kv_update(d, ck, cv, key, sc.pool, sc.index_keys, slots, past, new, fp16=True)
    assert np.array_equal(got16[0], want16[0])
    assert np.array_equal(got16[1].view(np.uint16), want16[1].view(np.uint16))
    # demotions of every kind, in place and moved, FP16 -> INT12 -> INT8 -> INT4; INT4 rows in every region
    base12, base8 = d.rows_fp16, d.rows_fp16 + d.rows_int12
    base4 = base8 + d.rows_int8
    same = 0xFFFFFF  # slot & same: the row an entry already holds (an in-place re-encoding)
    first = [(0, int(slots[0, s]), ref.make_slot(ref.INT12, base12 + i)) for i, s in enumerate(range(1, 30))]
    first += [(0, int(slots[0, s]), ref.make_slot(ref.INT8, base8 + i)) for i, s in enumerate(range(30, 50))]
    first += [(1, int(slots[1, 1]), ref.make_slot(ref.INT12, int(slots[1, 1]) & same))]
    first += [(0, int(slots[0, s]), ref.make_slot(ref.INT4, base4 + i)) for i, s in enumerate(range(50, 70))]
    first += [(0, int(slots[0, s]), ref.make_slot(ref.INT4, int(slots[0, s]) & same)) for s in range(70, 80)]
    first += [(1, int(slots[1, 2]), ref.make_slot(ref.INT4, base4))]

    def to_int4(entries, first_free):  # every other row re-encoded in place, the others moved to the INT4 region
        return [(b, e, ref.make_slot(ref.INT4, e & same if i % 2 == 0 else base4 + first_free + i))
                for i, (b, _, e) in enumerate(entries)]

    second = [(0, e[2], ref.make_slot(ref.INT8, e[2] & same)) for e in first[:10]]
    second += to_int4(first[10:20], 20) + to_int4(first[29:39], 40)  # INT12 -> INT4, INT8 -> INT4
    third = [(0, e[2], ref.make_slot(ref.INT4, e[2] & same)) for e in second[:10]]  # INT8 in an INT12 row -> INT4
    third += [(0, e[2], ref.make_slot(ref.INT4, base4 + 55 + i)) for i, e in enumerate(first[70:75])]  # INT4 moves
    for entries in (first, second, third):
        before = want_pool.copy()
        want_pool = ref.kv_demote(d, np.asarray(entries), want_pool, sc.quant)
        got_pool = gcuda.kv_demote(d, np.asarray(entries), got_pool, sc.quant)
        assert not np.array_equal(want_pool, before)
        assert np.array_equal(got_pool, want_pool)
