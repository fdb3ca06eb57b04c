"""bench/quality_real.py: the block-wise hit rate equals the converter's whole-matrix scoring, recency equals
the hand-computed mass of sinks + the last window + top-k positions, and held-out windows follow the BOS rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gsm.config import GSMParams
from gsm.convert import indexer as ixr
from gsm.golden import attention as A
from gsm.golden.selection import index_scores

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality_real.py"


@pytest.fixture(scope="module")
def qr():
    spec = importlib.util.spec_from_file_location("quality_real", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layer(T=40, H=16, nH=4, nKV=2, D=8, nI=2, dI=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    kv = SimpleNamespace(idx_q=torch.randn(nI * dI, H, generator=g), idx_k=torch.randn(dI, H, generator=g),
                         idx_w=torch.randn(nI, H, generator=g))
    q = 2 * torch.randn(nH, T, D, generator=g)
    k = 2 * torch.randn(nKV, T, D, generator=g)
    p = GSMParams(sparse_window=3, max_sparse_window=8, sparse_top_k=5, sink_tokens=1, indexer_heads=nI,
                  indexer_dim=dI)
    return x, kv, q, k, p


@pytest.mark.parametrize("block", [1, 7, 512])
def test_blockwise_hit_rate_equals_whole_matrix_scoring(qr, block):
    x, kv, q, k, p = _layer()
    T = x.shape[0]
    got = qr.layer_hit_rates(SimpleNamespace(gsm=p), kv, x, q, k, block=block)
    probs = A.attention_probs(q, k, A.causal_mask(torch.arange(T), T))  # [nH, T, T]
    scores = index_scores(x, kv.idx_q, kv.idx_w, x @ kv.idx_k.T, p.indexer_heads)
    assert got["indexer"] == pytest.approx(ixr.hit_rate(scores, probs, p), abs=1e-6)
    assert got["recency"] == pytest.approx(ixr.hit_rate(ixr.baseline_scores("recency", T), probs, p), abs=1e-6)
    assert got["rows"] == T - (1 + 3 + 5)
    assert 0.0 < got["random"] < 1.0


def test_recency_is_sinks_plus_last_positions_by_hand(qr):
    x, kv, q, k, p = _layer(T=20)
    T, budget = 20, 1 + 3 + 5
    probs = A.attention_probs(q, k, A.causal_mask(torch.arange(T), T))
    masses = []
    for t in range(budget, T):  # sink 0, then the budget - 1 most recent positions t-7..t
        keep = [0] + list(range(t - (budget - 2), t + 1))
        masses.append(float(probs[:, t, keep].sum(-1).mean()))
    got = qr.layer_hit_rates(SimpleNamespace(gsm=p), kv, x, q, k, block=3)
    assert got["recency"] == pytest.approx(sum(masses) / len(masses), abs=1e-6)


def test_windows_follow_the_bos_rule(qr):
    stream = list(range(100, 130))
    no_bos = qr.windows(stream, 8, 10, None)
    assert no_bos.tolist() == [stream[i:i + 8] for i in range(0, 24, 8)]
    bos = qr.windows(stream, 8, 2, 1)
    assert bos.tolist() == [[1] + stream[0:7], [1] + stream[7:14]]
    with pytest.raises(ValueError, match="fewer than one window"):
        qr.windows(stream[:5], 8, 1, None)
