"""bench/oracle_selection.py: the oracle's selection rule against a plain re-statement, and the restricted model
against the dense one where the budget covers every row."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from oracle_selection import OracleModel, oracle_mask, row_budget  # noqa: E402

from gsm.convert.quality import token_nll  # noqa: E402
from gsm.dense import DenseLlama  # noqa: E402


def _probs(nH: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(nH, T, T, generator=g) * 3
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    return logits.masked_fill(~causal[None], float("-inf")).softmax(-1)


def _expected(p: np.ndarray, t: int, rows: int, sinks: int, window: int) -> set[int]:
    """Sinks and window, then the highest-scoring other rows up to `rows` (scores distinct: random floats)."""
    forced = [s for s in range(t + 1) if s < sinks or s > t - window]
    rest = sorted((s for s in range(t + 1) if s not in forced), key=lambda s: -p[s])
    return set(forced[:rows]) | set(rest[:max(0, rows - len(forced))])


@pytest.mark.parametrize("mode", ["shared", "group", "head"])
def test_oracle_mask_is_the_rule(mode):
    nH, group, T, sinks, window = 6, 3, 40, 2, 5
    p = _probs(nH, T, seed=1)
    pos = torch.arange(T)
    budget = row_budget(pos, 9, 4)  # max(9, (t + 1) // 4), never past t + 1
    assert budget.tolist() == [min(t + 1, max(9, (t + 1) // 4)) for t in range(T)]
    sel = oracle_mask(p, pos, mode, group, budget, sinks, window).numpy()
    pn = p.numpy()
    for h in range(nH):
        score = {"shared": pn.mean(0), "group": pn[h // group * group:(h // group + 1) * group].mean(0),
                 "head": pn[h]}[mode]
        for t in range(T):
            got = set(np.nonzero(sel[h, t])[0].tolist())
            assert got == _expected(score[t], t, int(budget[t]), sinks, window), (h, t)


def test_oracle_mask_takes_a_query_slice():
    """Queries scored a chunk at a time select as if scored together (positions, not row indices, decide)."""
    p, T = _probs(4, 24, seed=2), 24
    whole = oracle_mask(p, torch.arange(T), "group", 2, row_budget(torch.arange(T), 6, 0), 1, 3)
    pos = torch.arange(16, 24)
    part = oracle_mask(p[:, 16:], pos, "group", 2, row_budget(pos, 6, 0), 1, 3)
    assert torch.equal(whole[:, 16:], part)


@pytest.fixture(scope="module")
def dense(stories_src):
    return DenseLlama(stories_src)


def test_full_budget_is_the_dense_model(dense):
    """With every row in budget each oracle is the dense model (DenseLlama's own logits over the whole window); a
    small budget is not. Scored in chunks, as the bench scores."""
    ids = torch.randint(3, dense.config.vocab_size, (96,), generator=torch.Generator().manual_seed(3))
    want = F.cross_entropy(dense.forward(ids[None])[0, :-1], ids[1:], reduction="none")
    for mode in ("dense", "shared", "group", "head"):
        model = OracleModel(dense, mode, floor=96, divisor=0, sinks=1, window=4)
        assert torch.allclose(token_nll(model, None, ids, 40), want, atol=2e-4), mode
    small = OracleModel(dense, "shared", floor=8, divisor=0, sinks=1, window=4)
    assert (token_nll(small, None, ids, 40) - want).abs().max() > 1e-2
