"""bench/selection_mass.py: each selection's captured mass against the rule written out row by row."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from selection_mass import selection_masses, summarise  # noqa: E402

from gsm.config import LayerSelection  # noqa: E402


def _by_hand(score: np.ndarray, prob: np.ndarray, t: int, sinks: int, window: int, rows: int) -> float:
    """Sinks, then the last `window` positions, then the best-scoring others, `rows` in all (scores distinct)."""
    forced = [s for s in range(t + 1) if s < sinks or s > t - window]
    rest = sorted((s for s in range(t + 1) if s not in forced), key=lambda s: -score[s])
    chosen = forced + rest[:max(0, rows - len(forced))]
    assert len(chosen) == min(rows, t + 1)
    return float(prob[chosen].sum())


def test_each_selection_is_its_rule():
    g = torch.Generator().manual_seed(3)
    n, sinks, window, windows = 300, 1, 8, (8, 24, 64)
    q_pos = torch.tensor([20, 70, 71, 150, 222, 299])
    logits = torch.randn(len(q_pos), n, generator=g) * 2
    causal = torch.arange(n)[None, :] <= q_pos[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    scores = torch.randn(len(q_pos), n, generator=g)
    ls = LayerSelection(window, 16, 5)  # the bench's rows per query: sinks + ls.rows_at(t)
    budget = torch.tensor([sinks + ls.rows_at(t) for t in q_pos.tolist()])
    assert budget.tolist() == [1 + 8 + max(16, (t + 1) // 5) for t in q_pos.tolist()]
    got = selection_masses(scores, probs, q_pos, sinks, window, budget, windows)
    assert set(got) == {"checkpoint", "recency", "oracle", "indexer+w8", "indexer+w24", "indexer+w64"}
    position = np.arange(n, dtype=np.float64)
    for r, t in enumerate(q_pos.tolist()):
        sc, pr, rows = scores[r].numpy(), probs[r].double().numpy(), int(budget[r])
        expected = {"checkpoint": _by_hand(sc, pr, t, sinks, window, rows),
                    "recency": _by_hand(position, pr, t, sinks, 0, rows),
                    "oracle": _by_hand(pr, pr, t, sinks, 0, rows)}
        for w in windows:  # a window as long as the rows beyond the sinks leaves no top-k: recency
            expected[f"indexer+w{w}"] = _by_hand(sc, pr, t, sinks, min(w, rows - sinks), rows)
        for name, v in expected.items():
            assert abs(float(got[name][r]) - v) < 1e-6, (name, t)
    # the oracle catches the most, and a row whose budget covers every position catches everything
    for name in got:
        assert (got["oracle"] >= got[name] - 1e-6).all(), name
    assert abs(float(got["checkpoint"][0]) - 1.0) < 1e-6  # t = 20: 25 rows >= 21 positions


def test_summary_buckets_by_position():
    pos = np.array([1100, 1500, 3000, 5000, 6000])
    per = {3: {"checkpoint": np.array([0.9, 0.8, 0.7, 0.6, 0.5]), "rows": np.full(5, 100.0)},
           5: {"checkpoint": np.array([1.0, 1.0, 0.5, 0.5, 0.4]), "rows": np.full(5, 200.0)}}
    s = summarise(per, pos, 8192)
    assert s["1-2K"]["query_rows"] == 2 and s["4-8K"]["query_rows"] == 2
    assert abs(s["1-2K"]["mean"]["checkpoint"] - (0.85 + 1.0) / 2) < 1e-12
    assert abs(s["4-8K"]["layers"][5]["checkpoint"] - 0.45) < 1e-12
    assert abs(s["all"]["mean"]["rows"] - 150.0) < 1e-12
    assert "4-8K" not in summarise(per, pos, 4096)
