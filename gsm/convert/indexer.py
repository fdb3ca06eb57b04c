"""The lightning indexer (`sparse_mask_generator`) of an owning layer: initialisation and fitting.

Initialisation from the layer's own projections: the attention logit of query head h (KV group g)
is q_h · k_g = (Wq_h x) · (P_g c), with c the full-rank whitened K latent and P_g its rows of the
left singular vectors. So an indexer head j that stands for group g = j mod nKV gets
key e = the leading dI channels of c, and query q̂_j = P_g[:, :dI]ᵀ mean_{h in g} Wq_h x
(scaled from 1/√D to the indexer's 1/√dI); its weight w_j is fitted by least squares to 1.
That ignores RoPE (the indexer has none), so it is then fitted to the layer's dense attention on
calibration text, as DeepSeek-V3.2 warms up its indexer: minimise KL(p || softmax(I)), where p is
the layer's attention summed over heads and renormalised over the positions the indexer chooses
among (sinks and window are always selected, so they carry no signal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gsm.config import GSMParams
from gsm.convert.svd import LowRank
from gsm.golden.selection import select

GROUP_ROWS = 32  # query rows scored together in fit_rows: each run against its own causal prefix


@dataclass
class Indexer:
    q: torch.Tensor  # [nI*dI, H]
    k: torch.Tensor  # [dI, H]
    w: torch.Tensor  # [nI, H]


def init_from_projections(wq: torch.Tensor, k_lowrank: LowRank, xx: torch.Tensor, x_sum: torch.Tensor, *,
                          n_heads: int, n_kv: int, n_idx: int, d_idx: int) -> Indexer:
    """wq: [nH*D, H]; k_lowrank: full-rank whitened SVD of Wk; xx = Σ x xᵀ, x_sum = Σ x of the inputs."""
    H = wq.shape[1]
    D = wq.shape[0] // n_heads
    d = min(d_idx, k_lowrank.full_rank)
    P = k_lowrank.P.float()  # [kvD, m]
    key = torch.zeros(d_idx, H)
    key[:d] = k_lowrank.sigma[:d, None].float() * k_lowrank.QtLinv[:d].float()  # c = Σ Qᵀ L⁻¹ x
    group = n_heads // n_kv
    q = torch.zeros(n_idx, d_idx, H)
    for j in range(n_idx):
        g = j % n_kv
        wq_g = wq.view(n_heads, D, H)[g * group:(g + 1) * group].mean(0)  # [D, H]
        q[j, :d] = P[g * D:(g + 1) * D, :d].T @ wq_g * math.sqrt(d_idx / D)
    # least squares x·w ≈ 1 by its normal equations (Σ x xᵀ) w = Σ x; the tiny ridge only guards
    # input directions the calibration text never excites
    G = xx.double() + (1e-9 * float(torch.diagonal(xx).mean()) + 1e-30) * torch.eye(H, dtype=torch.float64)
    w = torch.linalg.solve(G, x_sum.double())[None].float()  # [1, H]
    return Indexer(q=q.reshape(n_idx * d_idx, H), k=key, w=w.repeat(n_idx, 1))


def candidates(q_pos: torch.Tensor, T: int, p: GSMParams) -> torch.Tensor:
    """[len(q_pos), T]: the positions the indexer chooses among for queries at q_pos (causal, neither sink nor
    window: those are always selected, so they carry no signal)."""
    pos = torch.arange(T, device=q_pos.device)
    causal = pos[None, :] <= q_pos[:, None]
    fixed = (pos[None, :] < p.sink_tokens) | (pos[None, :] > q_pos[:, None] - p.sparse_window)
    return causal & ~fixed


def targets(attn: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit's target, attention renormalised over the candidates, and its negative entropy (float32)."""
    t = attn.to(torch.float32) * cand
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-12)
    return t, (t * torch.log(t.clamp_min(1e-12))).sum(-1)


def _kl(params: list[torch.Tensor], x_q: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor, target: torch.Tensor,
        neg_entropy: torch.Tensor) -> torch.Tensor:
    """Mean KL(target || softmax(index scores over the candidates)); x_q [b, R, H] queries, keys [b, T, dI]."""
    n_heads, d_idx = params[2].shape[0], params[1].shape[0]
    q = (x_q @ params[0].T).unflatten(-1, (n_heads, d_idx))  # [b, R, nI, dI]
    w = x_q @ params[2].T  # [b, R, nI]
    dots = torch.relu(torch.einsum("brjd,bsd->brjs", q, keys))  # [b, R, nI, T]
    scores = torch.einsum("brj,brjs->brs", w, dots) / math.sqrt(d_idx)  # as index_scores
    logq = torch.log_softmax(scores.masked_fill(~cand, float("-inf")), dim=-1)
    return (neg_entropy - (target * logq.clamp_min(-1e4)).sum(-1)).mean()


def _adam(ix: Indexer, steps: int, lr: float, seed: int, dev: torch.device,
          loss_of: Callable[[list[torch.Tensor], int], torch.Tensor],
          advance: Callable[[int], None] | None = None) -> tuple[Indexer, list[float]]:
    torch.manual_seed(seed)
    params = [t.to(dev, torch.float32).clone().requires_grad_(True) for t in (ix.q, ix.k, ix.w)]
    opt = torch.optim.Adam(params, lr=lr)
    losses: list[float] = []
    for step in range(steps):
        loss = loss_of(params, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
        if advance is not None:
            advance(1)
    q, k, w = (t.detach().cpu() for t in params)
    return Indexer(q=q, k=k, w=w), losses


def fit(ix: Indexer, xs: torch.Tensor, attn: torch.Tensor, p: GSMParams, *, steps: int = 200,
        lr: float = 3e-3, batch: int = 8, seed: int = 0, device: torch.device | None = None,
        advance: Callable[[int], None] | None = None) -> tuple[Indexer, list[float]]:
    """Fit the indexer to attention. xs: [B, T, H] inputs (any float dtype); attn: [B, T, T] head-summed probs.

    Each step scores a minibatch of sequences in one batched pass (on `device`). Returns the fitted
    indexer and the loss every 20 steps (first and last included); `advance(1)` after each step.
    """
    dev = device or torch.device("cpu")
    B, T, _ = xs.shape
    cand = candidates(torch.arange(T), T, p)
    rows = cand.any(-1)  # query rows with a choice to make
    # the target and its entropy do not change during the fit: computed once, on the fixed sample
    target, neg_ent = targets(attn[:, rows], cand[rows])  # [B, R, T], [B, R]
    cand, rows = cand[rows].to(dev), rows.to(dev)
    gen = torch.Generator().manual_seed(seed)

    def loss_of(params: list[torch.Tensor], step: int) -> torch.Tensor:
        idx = torch.randint(0, B, (min(batch, B),), generator=gen)
        x = xs[idx].to(dev, torch.float32)  # [b, T, H]
        return _kl(params, x[:, rows], x @ params[1].T, cand, target[idx].to(dev), neg_ent[idx].to(dev))

    return _adam(ix, steps, lr, seed, dev, loss_of, advance)


def row_groups(rows: torch.Tensor, size: int = GROUP_ROWS) -> list[tuple[int, int, int]]:
    """(first, end, keys) of each run of `size` ascending query rows: the rows see only the first `keys` positions,
    so scoring each run against its own causal prefix skips the positions no row of it can see (with rows spread
    uniformly over T, (n + 1) / 2n of the work for n runs) and changes no loss or gradient."""
    return [(a, min(a + size, rows.numel()), int(rows[min(a + size, rows.numel()) - 1]) + 1)
            for a in range(0, rows.numel(), size)]


def fit_rows(ix: Indexer, xs: torch.Tensor, rows: torch.Tensor, attn: torch.Tensor, p: GSMParams, *,
             steps: int = 300, lr: float = 3e-3, seed: int = 0, device: torch.device | None = None,
             advance: Callable[[int], None] | None = None) -> tuple[Indexer, list[float]]:
    """Fit the indexer to sampled query rows of long windows (gsm.convert.long_sample): xs [B, T, H] inputs at
    every position, rows [B, R] query positions (ascending), attn [B, R, T] their attention. One window per step,
    all its rows; the same KL as `fit`. Returns the fitted indexer and the loss every 20 steps; `advance(1)` after
    each step."""
    dev = device or torch.device("cpu")
    B, T, _ = xs.shape
    prepared = []  # per window, once: its float32 inputs (every step reads all T) and each run's rows and target
    for b in range(B):
        cand = candidates(rows[b], T, p)
        target, neg_ent = targets(attn[b], cand)
        x = xs[b].to(dev, torch.float32)  # [T, H]
        x_q = x[rows[b].to(dev)]
        runs = [(x_q[None, a:e], n, cand[None, a:e, :n].to(dev), target[None, a:e, :n].to(dev),
                 neg_ent[None, a:e].to(dev), (e - a) / rows.shape[1]) for a, e, n in row_groups(rows[b])]
        prepared.append((x[None], runs))

    def loss_of(params: list[torch.Tensor], step: int) -> torch.Tensor:
        x, runs = prepared[step % B]
        keys = x @ params[1].T  # [1, T, dI]
        return sum(share * _kl(params, x_q, keys[:, :n], cand, target, neg_ent)
                   for x_q, n, cand, target, neg_ent, share in runs)

    return _adam(ix, steps, lr, seed, dev, loss_of, advance)


def hit_rate(scores: torch.Tensor, probs: torch.Tensor, p: GSMParams) -> float:
    """Mean dense attention mass of Sel over the queries whose selection is sparse.

    scores: [T, T] selection scores; probs: [nH, T, T] dense causal attention of the layer.
    """
    T = scores.shape[0]
    q_pos = torch.arange(T)
    sel = select(scores, q_pos, p)  # [T, T]
    mass = (probs * sel[None]).sum(-1).mean(0)  # [T]
    sparse_rows = ~torch.tensor([p.selection_is_dense(t + 1) for t in range(T)])
    return float(mass[sparse_rows].mean()) if sparse_rows.any() else 1.0


def baseline_scores(kind: str, T: int, seed: int = 0) -> torch.Tensor:
    """Scores of the baselines the indexer must beat at the same budget: 'random' or 'recency'."""
    if kind == "random":
        return torch.rand(T, T, generator=torch.Generator().manual_seed(seed))
    if kind == "recency":
        return torch.arange(T, dtype=torch.float32)[None, :].expand(T, T).clone()
    raise ValueError(f"unknown baseline {kind!r}")
