"""Converter math on synthetic data with known answers (float64 inside, so tolerances are tight)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gsm.config import GSMParams
from gsm.convert import indexer as ixr
from gsm.convert.sharing import best_source, fit_projector, parse_sharing_map
from gsm.convert.svd import input_covariance, ranks_for_budget, whitened_svd


def correlated_inputs(n: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(h, h, generator=g) * torch.logspace(0, -2, h)[None, :]
    return torch.randn(n, h, generator=g) @ mix.T


def test_whitened_svd_error_formula_matches_output_error():
    x = correlated_inputs(4000, 24, 0)
    w = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    lr = whitened_svd(w, input_covariance(x))
    y = x @ w.T
    for r in (1, 4, 8, 16):
        _, S, Vt = lr.factors(r)
        U = lr.P[:, :r].float()  # the SVD's own U: the formula is the truncation's error
        measured = float((x @ (U @ (S[:, None] * Vt)).T - y).norm() / y.norm())
        assert measured == pytest.approx(lr.rel_error(r), rel=1e-3, abs=1e-5)
    assert lr.rel_error(16) < 1e-5  # full rank reproduces W


def test_factors_put_u_on_the_fp16_grid():
    """The checkpoint's U is the SVD's rounded to float16 values (decisions "U on the FP16 grid"): exactly
    representable, each within half an FP16 unit of the SVD's, and the output error at full rank is that
    rounding's alone (a few 1e-4, far below any rank tolerance)."""
    x = correlated_inputs(4000, 24, 0)
    w = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    lr = whitened_svd(w, input_covariance(x))
    for r in (4, 16):
        U, S, Vt = lr.factors(r)
        assert torch.equal(U.half().float(), U)
        P = lr.P[:, :r].float()
        ulp = torch.where(P.abs() >= 2.0 ** -14, 2.0 ** (torch.floor(torch.log2(P.abs().clamp_min(2.0 ** -14))) - 10),
                          torch.tensor(2.0 ** -24))
        assert bool(((U - P).abs() <= ulp / 2).all())
        assert not torch.equal(U, P)  # the rounding happened
    y = x @ w.T
    measured = float((x @ (U @ (S[:, None] * Vt)).T - y).norm() / y.norm())
    assert 0 < measured < 1e-3


def test_whitening_beats_plain_svd_on_output_error():
    x = correlated_inputs(4000, 24, 2)
    w = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    y = x @ w.T
    aware, plain = whitened_svd(w, input_covariance(x)), whitened_svd(w, None)
    r = 6
    def err(lr):
        U, S, Vt = lr.factors(r)
        return float((x @ (U @ (S[:, None] * Vt)).T - y).norm() / y.norm())
    assert err(aware) < 0.8 * err(plain)


def test_rank_for_tolerance_is_smallest():
    x = correlated_inputs(2000, 12, 4)
    lr = whitened_svd(torch.randn(8, 12, generator=torch.Generator().manual_seed(5)), input_covariance(x))
    for tol in (0.3, 0.1, 0.01):
        r = lr.rank_for_tolerance(tol)
        assert lr.rel_error(r) <= tol
        assert r == 1 or lr.rel_error(r - 1) > tol


def test_ranks_for_budget_is_optimal_by_brute_force():
    g = torch.Generator().manual_seed(6)
    lrs = {}
    for key in (("a", "k"), ("a", "v"), ("b", "k")):
        x = correlated_inputs(500, 6, int(torch.randint(0, 100, (1,), generator=g)))
        lrs[key] = whitened_svd(torch.randn(5, 6, generator=g), input_covariance(x))
    budget = 8
    chosen = ranks_for_budget(lrs, budget)
    assert sum(chosen.values()) <= budget
    cost = lambda rs: sum(lrs[k].rel_error(r) ** 2 for k, r in rs.items())  # noqa: E731
    best = min(cost(dict(zip(lrs, combo))) for combo in itertools.product(range(1, 6), repeat=3)
               if sum(combo) <= budget)
    assert cost(chosen) == pytest.approx(best, rel=1e-9)


def test_projector_recovers_linear_map_and_picks_right_source():
    g = torch.Generator().manual_seed(7)
    lat = {0: torch.randn(800, 6, generator=g), 1: torch.randn(800, 6, generator=g)}
    W = torch.randn(8, 6, generator=g)
    b = torch.randn(8, generator=g)
    targets = lat[1] @ W.T + b
    fit = best_source(lat, targets, [0, 1])
    assert fit.source == 1
    assert fit.rel_residual < 1e-5
    torch.testing.assert_close(fit.weight, W, atol=1e-4, rtol=0)
    torch.testing.assert_close(fit.bias, b, atol=1e-4, rtol=0)
    assert fit_projector(lat[0], targets, 0).rel_residual > 0.5


def test_parse_sharing_map_errors():
    assert parse_sharing_map("3:1,4:2", 5) == {3: 1, 4: 2}
    for bad in ("3-1", "1:3", "3:1,3:2", "4:3,3:1", "7:1"):
        with pytest.raises(ValueError, match="--sharing"):
            parse_sharing_map(bad, 5)


def test_indexer_fit_lowers_kl_and_beats_baselines_on_planted_attention():
    """Attention concentrated on positions whose input has a planted feature: learnable, and
    invisible to recency or random selection."""
    torch.manual_seed(0)
    B, T, H = 6, 48, 16
    p = GSMParams(sparse_window=2, sink_tokens=1, sparse_top_k=4, indexer_heads=2, indexer_dim=8)
    xs = torch.randn(B, T, H)
    special = torch.rand(B, T) < 0.1
    xs[..., 0] = torch.where(special, torch.full_like(xs[..., 0], 4.0), xs[..., 0])
    xs[..., 1] = 1.0  # a constant direction lets the query side be position-independent
    logits = 3.0 * special[:, None, :].float().expand(B, T, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    attn = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)  # [B, T, T]
    init = ixr.Indexer(q=torch.randn(16, H) * 0.1, k=torch.randn(8, H) * 0.1, w=torch.randn(2, H) * 0.1)
    fitted, losses = ixr.fit(init, xs, attn, p, steps=150, lr=2e-2, batch=6)
    assert losses[-1] < 0.5 * losses[0]
    probs = attn[0][None]  # one "head"
    from gsm.golden.selection import index_scores
    x = xs[0]
    sc = index_scores(x, fitted.q, fitted.w, x @ fitted.k.T, 2)
    mine = ixr.hit_rate(sc, probs, p)
    assert mine > ixr.hit_rate(ixr.baseline_scores("recency", T), probs, p) + 0.1
    assert mine > ixr.hit_rate(ixr.baseline_scores("random", T), probs, p) + 0.1
