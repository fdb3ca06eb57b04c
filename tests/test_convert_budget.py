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
        bud.add_layer(curve, layer, x, iq, ik, iw, nI, q, k, sinks, window, block=block)
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
        bud.add_layer(whole, i, lc.x[0], ixs[i].q, ixs[i].k, ixs[i].w, nI, q, k, sinks, window, block=50)
    assert (chunked.rows == whole.rows).all()
    for sel in bud.SELECTORS:
        np.testing.assert_allclose(chunked.per_layer(sel), whole.per_layer(sel), atol=1e-5)
