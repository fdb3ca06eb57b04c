"""The selection budget stage: the hit-rate curve from one sort per row equals a direct numpy computation of
sinks ∪ window ∪ top-k for every k (and the converter's select()-based hit rate), the ladder choice, and the
lengths/text bounds of the measurement."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import CALIB_TEXT, needs_data

from gsm.config import GSMParams
from gsm.convert import budget as bud
from gsm.convert import indexer as ixr
from gsm.convert.pipeline import ConvertOptions, Lengths, budget_sequences, check_lengths
from gsm.golden import attention as A
from gsm.golden.model import GoldenModel
from gsm.golden.selection import index_scores


def numpy_hit_rate(scores: np.ndarray, probs: np.ndarray, sinks: int, window: int, k: int) -> tuple[float, int]:
    """Mean over sparse rows of the head-mean attention mass of sinks ∪ window ∪ top-k, by hand.

    scores [T, T]; probs [nH, T, T] causal. Ties: the lower position first (spec 4.1)."""
    T = scores.shape[0]
    masses = []
    for t in range(T):
        if t + 1 <= sinks + window + k:
            continue
        fixed = [s for s in range(t + 1) if s < sinks or s > t - window]
        cand = [s for s in range(t + 1) if s not in fixed]
        chosen = sorted(cand, key=lambda s: (-scores[t, s], s))[:k]
        keep = fixed + chosen
        masses.append(probs[:, t, keep].sum(-1).mean())
    return (float(np.mean(masses)) if masses else float("nan")), len(masses)


def _layer(T=48, H=12, nH=3, nKV=1, D=4, nI=2, dI=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    iq, ik, iw = torch.randn(nI * dI, H, generator=g), torch.randn(dI, H, generator=g), torch.randn(nI, H, generator=g)
    q, k = 2 * torch.randn(nH, T, D, generator=g), 2 * torch.randn(nKV, T, D, generator=g)
    return x, iq, ik, iw, nI, q, k


@pytest.mark.parametrize("block", [1, 5, 256])
def test_curve_equals_direct_numpy_and_select(block):
    x, iq, ik, iw, nI, q, k = _layer()
    T = x.shape[0]
    sinks, window, ks = 2, 3, (0, 1, 4, 9, 20, 43, 60)
    curve = bud.HitRateCurve(ks, n_layers=2)
    for layer in range(2):  # the same layer twice: the accumulator keeps layers apart and averages them
        bud.add_layer(curve, layer, x, ixr.Indexer(iq, ik, iw), nI, q, k, sinks, window, block=block)
    probs = A.attention_probs(q, k, A.causal_mask(torch.arange(T), T))  # [nH, T, T]
    scores = index_scores(x, iq, iw, x @ ik.T, nI)
    p = GSMParams(sparse_window=window, max_sparse_window=8, sink_tokens=sinks, indexer_heads=nI, indexer_dim=3)
    rec = torch.arange(T, dtype=torch.float32)[None].expand(T, T)
    for j, kk in enumerate(ks):
        want, rows = numpy_hit_rate(scores.double().numpy(), probs.double().numpy(), sinks, window, kk)
        assert curve.rows[0, j] == rows == max(0, T - (sinks + window + kk))
        if rows == 0:
            assert np.isnan(curve.per_layer()[0, j]) and kk not in curve.measured_ks()
            continue
        assert curve.per_layer()[0, j] == pytest.approx(want, abs=1e-5)
        assert curve.mean()[j] == pytest.approx(want, abs=1e-5)
        pk = replace(p, sparse_top_k=kk)
        assert curve.per_layer()[1, j] == pytest.approx(ixr.hit_rate(scores, probs, pk), abs=1e-5)
        assert curve.mean("recency")[j] == pytest.approx(ixr.hit_rate(rec, probs, pk), abs=1e-5)
    assert curve.measured_ks() == [0, 1, 4, 9, 20]
    assert [r["sparse_top_k"] for r in curve.to_json()] == [0, 1, 4, 9, 20]


@pytest.mark.parametrize("block", [1, 256])
def test_wide_window_curve_equals_direct_numpy(block):
    """`indexer+w{W}` at ladder k: window W and the indexer's top k - (W - window), the same rows as window + k, on
    the same sparse rows; nan where k < W - window (the option does not exist), and a layer's options skip it."""
    x, iq, ik, iw, nI, q, k = _layer()
    T = x.shape[0]
    sinks, window, ks = 2, 3, (0, 1, 4, 9, 20, 43)
    curve = bud.HitRateCurve(ks, n_layers=1, wide=(5, 11))
    assert curve.selectors == ("indexer", "recency", "indexer+w5", "indexer+w11")
    bud.add_layer(curve, 0, x, ixr.Indexer(iq, ik, iw), nI, q, k, sinks, window, block=block)
    probs = A.attention_probs(q, k, A.causal_mask(torch.arange(T), T)).double().numpy()
    scores = index_scores(x, iq, iw, x @ ik.T, nI).double().numpy()
    for w in (5, 11):
        for j, kk in enumerate(ks):
            got = curve.per_layer(f"indexer+w{w}")[0, j]
            if kk < w - window or curve.rows[0, j] == 0:
                assert np.isnan(got)
                continue
            want, rows = numpy_hit_rate(scores, probs, sinks, w, kk - (w - window))
            assert rows == curve.rows[0, j]
            assert got == pytest.approx(want, abs=1e-5)
    opts = bud.layer_options(curve)[0]
    assert {(o.selector, o.k) for o in opts if o.wide == 11} == {("indexer+w11", 9), ("indexer+w11", 20)}
    sel = next(o for o in opts if o.selector == "indexer+w11" and o.k == 20).selection(window)
    assert (sel.sparse_window, sel.sparse_top_k) == (11, 12)  # 2 + 11 + 12 = 2 + 3 + 20 rows


def test_selected_mass_ties_take_the_lower_position():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0]])
    scores = torch.zeros(1, 6)  # all tied: top-1 among candidates 1..2 (sink 0, window {3}) is position 1
    m = bud.selected_mass(scores, probs, torch.tensor([3]), sinks=1, window=1, ks=[0, 1, 2, 5])
    assert m[0].tolist() == pytest.approx([0.5, 0.7, 1.0, 1.0])


def _curve_with(means: list[float], ks=(64, 128, 256)) -> bud.HitRateCurve:
    c = bud.HitRateCurve(ks, n_layers=1)
    c.rows[:] = 10
    c.sums["indexer"][0] = np.array(means) * 10
    return c


def test_choose_top_k_is_the_smallest_reaching_the_target():
    assert bud.choose_top_k(_curve_with([0.80, 0.91, 0.97]), 0.9) == (128, True)
    assert bud.choose_top_k(_curve_with([0.80, 0.91, 0.97]), 0.8) == (64, True)
    assert bud.choose_top_k(_curve_with([0.80, 0.91, 0.97]), 0.99) == (256, False)
    empty = bud.HitRateCurve((64,), n_layers=1)
    with pytest.raises(ValueError, match="no top-k"):
        bud.choose_top_k(empty, 0.9)


def test_budget_length_clamped_to_context_and_checked_first():
    opts = ConvertOptions(calib_text=CALIB_TEXT, auto_top_k=True, budget_seq_len=2048)
    assert check_lengths(8192, opts).budget_seq_len == 2048
    short = check_lengths(512, opts)
    assert short.budget_seq_len == 512
    assert any("selection budget measured at 512" in n for n in short.notes)
    assert check_lengths(8192, replace(opts, auto_top_k=False)).budget_seq_len == 0
    # a given top-k larger than the fit sequences: fitted at the default budget, the report says it is dense
    fixed = replace(opts, auto_top_k=False, gsm=GSMParams(sparse_top_k=512))
    ls = check_lengths(8192, fixed)
    assert ls.seq_len == 256 and any("every position" in n for n in ls.notes)


@needs_data
def test_budget_sequences_start_after_the_fit_sample(stories_tok):
    from gsm.convert.data import token_stream

    opts = ConvertOptions(calib_text=CALIB_TEXT, auto_top_k=True, indexer_sequences=4, budget_sequences=2)
    lengths = Lengths(seq_len=64, agreement_steps=10, budget_seq_len=300)
    seqs, notes = budget_sequences(CALIB_TEXT, stories_tok, lengths, opts, None, 512)
    stream = token_stream(CALIB_TEXT, stories_tok, 4 * 64 + 600)
    assert notes == []
    assert seqs.tolist() == [stream[256:556], stream[556:856]]
    seqs, _ = budget_sequences(CALIB_TEXT, stories_tok, lengths, opts, 1, 512)
    assert seqs[:, 0].tolist() == [1, 1] and seqs[0, 1:].tolist() == stream[256:555]


@needs_data
def test_budget_sequences_shrink_to_a_short_text(tmp_path, stories_tok):
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(CALIB_TEXT.read_text().split("\n\n")[:40]))
    from gsm.convert.data import token_stream

    n_tok = len(token_stream(text, stories_tok, 10**9))
    opts = ConvertOptions(calib_text=text, auto_top_k=True, indexer_sequences=32, budget_sequences=2)
    lengths = Lengths(seq_len=64, agreement_steps=10, budget_seq_len=n_tok)  # asks for 2 x the whole text
    seqs, notes = budget_sequences(text, stories_tok, lengths, opts, None, 512)
    assert any("too short" in n for n in notes) and any("fewer than" in n for n in notes)
    assert seqs.numel() <= n_tok and seqs.shape[1] >= 64


@needs_data
def test_chunked_prefill_sequence_equals_whole_capture(stories_src):
    """add_sequence (the converter's path: chunked prefill through the dense K/V cache) gives the curve of
    add_layer on a whole-sequence capture, whose per-k values the tests above check by hand."""
    from types import SimpleNamespace

    from gsm.dense import DenseLlama

    cfg = stories_src.config
    dense = DenseLlama(stories_src)
    g = torch.Generator().manual_seed(3)
    H, nI, dI = cfg.hidden_size, 2, 8
    ixs = [SimpleNamespace(q=torch.randn(nI * dI, H, generator=g), k=torch.randn(dI, H, generator=g),
                           w=torch.randn(nI, H, generator=g)) for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(3, cfg.vocab_size, (300,), generator=g)
    ks, sinks, window = (8, 64, 128, 256), 1, 16
    chunked = bud.HitRateCurve(ks, cfg.num_hidden_layers)
    bud.add_sequence(chunked, dense, ids, ixs, nI, sinks, window, chunk=70)
    whole = bud.HitRateCurve(ks, cfg.num_hidden_layers)
    _, cap = dense.forward(ids[None], capture=True)
    for i, lc in enumerate(cap.layers):
        q, k = bud.rope_qk(lc.q[0], lc.k[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.rope_theta)
        bud.add_layer(whole, i, lc.x[0], ixs[i], nI, q, k, sinks, window, block=50)
    assert (chunked.rows == whole.rows).all()
    for sel in whole.selectors:
        np.testing.assert_allclose(chunked.per_layer(sel), whole.per_layer(sel), atol=1e-5)


def _curve_from(table: dict[str, list[list[float]]], ks: tuple[int, ...]) -> bud.HitRateCurve:
    """A curve whose per-layer hit rates are `table[selector][layer][j]` at ks[j] (one sparse row each)."""
    n = len(table["indexer"])
    c = bud.HitRateCurve(ks, n, wide=tuple(int(s.split("+w")[1]) for s in table if "+w" in s))
    for s in c.selectors:
        c.sums[s] = np.array(table[s], dtype=np.float64)
    c.rows = np.ones((n, len(ks)), dtype=np.int64)
    return c


def _best_by_enumeration(curve: bud.HitRateCurve, target: float) -> float:
    """The fewest mean rows over every combination of per-layer options reaching the target (brute force)."""
    import itertools

    opts = bud.layer_options(curve)
    best = float("inf")
    for combo in itertools.product(*opts):
        if np.mean([o.hit_rate for o in combo]) >= target:
            best = min(best, float(np.mean([o.k for o in combo])))
    return best


def test_allocate_gives_rows_where_they_buy_hit_rate():
    """A local layer (recency saturates at once) and a far-attending one (only the indexer helps): the local layer
    gets a short window, the other the indexer's rows; the mean rows equal the brute-force optimum, and below the
    uniform choice's at the same target."""
    ks = (0, 16, 64, 256)
    curve = _curve_from({"indexer": [[0.90, 0.92, 0.94, 0.96], [0.30, 0.70, 0.90, 0.99]],
                         "recency": [[0.90, 0.99, 1.00, 1.00], [0.30, 0.35, 0.45, 0.60]]}, ks)
    picks, reached = bud.allocate(curve, 0.94)
    assert reached
    assert (picks[0].selector, picks[0].k) == ("recency", 16) and (picks[1].selector, picks[1].k) == ("indexer", 64)
    assert np.mean([p.hit_rate for p in picks]) >= 0.94
    assert np.mean([p.k for p in picks]) == _best_by_enumeration(curve, 0.94) == 40
    k, _ = bud.choose_top_k(curve, 0.94)
    assert k == 256  # uniform: the indexer's mean reaches 0.94 only there
    sel = [p.selection(window=3) for p in picks]
    assert [(x.sparse_window, x.sparse_top_k) for x in sel] == [(19, 0), (3, 64)]
    # out of reach: each layer's best, flagged
    picks, reached = bud.allocate(curve, 0.999)
    assert not reached and [p.hit_rate for p in picks] == [1.0, 0.99]


def test_allocate_takes_a_wider_window_where_it_buys_hit_rate():
    """A layer whose attention is local beyond the model's window and far back too: the indexer beside a wider
    window reaches the target with fewer rows than either the indexer beside the model's window or recency, and is
    written as that window and the smaller top-k."""
    ks = (0, 16, 64, 256)
    nan = float("nan")
    curve = _curve_from({"indexer": [[0.50, 0.60, 0.80, 0.93]], "recency": [[0.50, 0.55, 0.70, 0.85]],
                         "indexer+w35": [[nan, nan, 0.95, 0.99]]}, ks)
    picks, reached = bud.allocate(curve, 0.95)
    assert reached and (picks[0].selector, picks[0].k, picks[0].wide) == ("indexer+w35", 64, 35)
    sel = picks[0].selection(window=3)
    assert (sel.sparse_window, sel.sparse_top_k) == (35, 32)


@pytest.mark.parametrize("seed", range(6))
def test_allocate_is_near_the_brute_force_optimum(seed):
    """Random concave-ish curves: the price sweep reaches the target with at most the optimum's rows plus the
    hull gap (one ladder step in one layer), never fewer than the optimum (it would then miss the target)."""
    rng = np.random.default_rng(seed)
    ks = (0, 16, 32, 64, 128)
    table = {s: [list(np.sort(rng.uniform(0.3, 1.0, len(ks)))) for _ in range(3)]
             for s in (*bud.SELECTORS, "indexer+w19")}
    for row in table["indexer+w19"]:
        row[:2] = [float("nan")] * 2  # k 0 and 16 leave no top-k beside a window 16 wider
    curve = _curve_from(table, ks)
    target = 0.8
    picks, reached = bud.allocate(curve, target)
    opt = _best_by_enumeration(curve, target)
    if opt == float("inf"):
        assert not reached
        return
    rows = float(np.mean([p.k for p in picks]))
    assert reached and np.mean([p.hit_rate for p in picks]) >= target
    assert opt <= rows <= opt + max(ks) / 3


def test_long_check_chunked_nll_equals_one_pass(stories_src, tmp_path, monkeypatch):
    """The report's long-context check scores a window as a chunked prefill (memory: one chunk's attention); that
    equals one whole-sequence pass, for the dense model and for the golden (per-layer selection included)."""
    from gsm.config import LayerSelection
    from gsm.convert import quality
    from gsm.dense import DenseLlama
    from gsm.synth import synth_checkpoint

    monkeypatch.setattr(quality, "LONG_CHUNK", 70)
    dense = DenseLlama(stories_src)
    ids = torch.randint(3, stories_src.config.vocab_size, (300,), generator=torch.Generator().manual_seed(5))
    assert quality.chunked_nll(dense, None, ids) == pytest.approx(dense.nll(ids), abs=1e-5)
    g = GoldenModel.from_checkpoint(synth_checkpoint("tiny", tmp_path / "tiny"), mode="exact")
    g.p = replace(g.p, layer_selection={0: LayerSelection(20, 0), 2: LayerSelection(2, 30)})
    ids = ids % g.cfg.vocab_size
    assert quality.chunked_nll(None, g, ids) == pytest.approx(g.nll(ids), abs=1e-5)
