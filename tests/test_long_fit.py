"""The indexer's long fit: sampled query rows of long windows (gsm.convert.long_sample, indexer.fit_rows)."""

from __future__ import annotations

import math

import pytest
import torch

from gsm.config import GSMParams
from gsm.convert import indexer as ixr
from gsm.convert.long_sample import collect_long_sample, sample_rows
from gsm.golden.selection import index_scores


def test_sample_rows_are_distinct_ascending_and_in_range():
    g = torch.Generator().manual_seed(0)
    r = sample_rows(1000, 33, 256, g)
    assert r.numel() == 256 and (r[1:] > r[:-1]).all() and int(r[0]) >= 33 and int(r[-1]) < 1000
    assert sample_rows(40, 33, 256, g).tolist() == list(range(33, 40))  # fewer positions than asked: all


def test_collect_long_sample_equals_the_whole_sequence_capture(stories_src):
    """The chunked prefill's rows and inputs equal a whole-sequence forward's attention (mean over heads) and x."""
    from gsm.dense import DenseLlama

    cfg = stories_src.config
    dense = DenseLlama(stories_src)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (2, 300), generator=g)  # 300 > one 256-position chunk
    s = collect_long_sample(dense, ids, rows_per_window=40, first=17, seed=5)
    assert s.rows.shape == (2, 40) and int(s.rows.min()) >= 17
    assert (s.rows >= 256).any() and (s.rows < 256).any()  # rows from both chunks
    _, cap = dense.forward(ids, capture=True, capture_probs=True)
    for i, lc in enumerate(cap.layers):
        for b in range(2):
            want = lc.probs[b].mean(0)[s.rows[b]]  # [R, T]
            torch.testing.assert_close(s.attn[i][b].float(), want, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(s.x[i][b].float(), lc.x[b].float(), atol=2e-3, rtol=2e-3)
            causal = torch.arange(300)[None, :] <= s.rows[b][:, None]
            assert (s.attn[i][b][~causal] == 0).all()


def test_row_groups_score_each_run_against_its_own_causal_prefix():
    rows = torch.tensor([40, 41, 90, 200, 399])
    assert ixr.row_groups(rows, size=2) == [(0, 2, 42), (2, 4, 201), (4, 5, 400)]
    assert ixr.row_groups(rows, size=8) == [(0, 5, 400)]


def _kl_by_hand(ix: ixr.Indexer, x: torch.Tensor, rows: torch.Tensor, attn: torch.Tensor, p: GSMParams) -> float:
    """Mean over rows of KL(attention renormalised over the candidates || softmax of the golden's index scores)."""
    scores = index_scores(x, ix.q, ix.w, x @ ix.k.T, p.indexer_heads)  # [T, T]
    kls = []
    for j, t in enumerate(rows.tolist()):
        cand = [s for s in range(t + 1) if s >= p.sink_tokens and s <= t - p.sparse_window]
        tgt = attn[j, cand] / attn[j, cand].sum()
        logq = torch.log_softmax(scores[t, cand], -1)
        kls.append(float((tgt * (torch.log(tgt) - logq)).sum()))
    return sum(kls) / len(kls)


def _planted(B: int, T: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a rare planted feature and attention concentrated on the positions carrying it."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(B, T, H, generator=g)
    special = torch.rand(B, T, generator=g) < 0.05
    xs[..., 0] = torch.where(special, torch.full_like(xs[..., 0], 4.0), xs[..., 0])
    xs[..., 1] = 1.0
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    attn = torch.softmax((3.0 * special[:, None, :].float()).expand(B, T, T).masked_fill(~causal, -math.inf), -1)
    return xs, attn


def test_fit_rows_objective_is_the_kl_over_candidates_and_it_learns_far_positions():
    """fit_rows' first loss is the KL computed by hand from the golden's index scores on the sampled rows (48 rows:
    two runs of ixr.GROUP_ROWS, each scored against its own prefix, weighted by its rows); fitted
    on rows of long windows only, the indexer finds the planted positions far back (recency cannot)."""
    B, T, H = 3, 400, 16
    p = GSMParams(sparse_window=8, sink_tokens=1, sparse_top_k=32, indexer_heads=2, indexer_dim=8)
    xs, attn = _planted(B, T, H, 0)
    g = torch.Generator().manual_seed(2)
    rows = torch.stack([sample_rows(T, p.sink_tokens + p.sparse_window, 48, g) for _ in range(B)])
    row_attn = torch.stack([attn[b, rows[b]] for b in range(B)])
    init = ixr.Indexer(q=torch.randn(16, H, generator=g) * 0.1, k=torch.randn(8, H, generator=g) * 0.1,
                       w=torch.randn(2, H, generator=g) * 0.1)
    fitted, losses = ixr.fit_rows(init, xs.half(), rows, row_attn.half(), p, steps=1, lr=0.0)
    assert losses[0] == pytest.approx(_kl_by_hand(init, xs[0].half().float(), rows[0], row_attn[0].half().float(),
                                                  p), rel=1e-4)
    fitted, losses = ixr.fit_rows(init, xs.half(), rows, row_attn.half(), p, steps=240, lr=2e-2)
    assert losses[-1] < 0.5 * losses[0]
    x_new, attn_new = _planted(1, T, H, 7)  # scored on a window it was not fitted to
    sc = index_scores(x_new[0], fitted.q, fitted.w, x_new[0] @ fitted.k.T, 2)
    probs = attn_new[0][None]
    mine = ixr.hit_rate(sc, probs, p)
    assert mine > ixr.hit_rate(ixr.baseline_scores("recency", T), probs, p) + 0.3
    assert mine > ixr.hit_rate(ixr.baseline_scores("random", T), probs, p) + 0.3
    assert mine > ixr.hit_rate(index_scores(x_new[0], init.q, init.w, x_new[0] @ init.k.T, 2), probs, p) + 0.3


def test_default_indexer_heads_are_one_per_kv_group_at_most():
    """The converter's default indexer_heads is min(4, nKV) because a head beyond nKV starts as a copy of head
    j - nKV (the same group's mean query) and, the fit's gradient being symmetric in the two, stays one: 4 heads
    over 3 groups (SmolLM2) fit as 3 distinct heads, one of them counted twice."""
    from gsm.convert.cli import default_indexer_heads
    from gsm.convert.svd import input_covariance, whitened_svd

    assert [default_indexer_heads(n) for n in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 4]
    H, D, n_heads, n_kv, n_idx, d_idx = 48, 8, 9, 3, 4, 6
    g = torch.Generator().manual_seed(0)
    wq, wk, x = torch.randn(n_heads * D, H, generator=g), torch.randn(n_kv * D, H, generator=g), torch.randn(
        500, H, generator=g)
    ix = ixr.init_from_projections(wq, whitened_svd(wk, input_covariance(x)), x.T.double() @ x.double(),
                                   x.sum(0).double(), n_heads=n_heads, n_kv=n_kv, n_idx=n_idx, d_idx=d_idx)
    q = ix.q.view(n_idx, d_idx, H)
    assert torch.equal(q[0], q[3]) and torch.equal(ix.w[0], ix.w[3])
    assert not torch.allclose(q[0], q[1]) and not torch.allclose(q[1], q[2])
