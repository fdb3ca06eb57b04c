"""Token selection of spec 4.1: lightning-indexer scores, then sinks + local window + top-k."""

from __future__ import annotations

import math

import torch

from gsm.config import GSMParams


def index_scores(x: torch.Tensor, idx_q: torch.Tensor, idx_w: torch.Tensor, keys: torch.Tensor,
                 n_heads: int, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """I(t, s) = sum_j w_j ReLU(q_j . e_s) / sqrt(dI) for every query row and cached key.

    x: [T, H] normalised inputs of the queries; idx_q: [nI*dI, H]; idx_w: [nI, H];
    keys: [n, dI] cached indexer keys -> scores [T, n] (causality is applied by `select`).
    key_scale [dI]: the keys are INT8 codes of that scale; each query head is scaled by it instead
    (gsm.golden.quant "INT8 indexer keys").
    """
    T, dI = x.shape[0], keys.shape[1]
    q = (x @ idx_q.T).view(T, n_heads, dI)  # [T, nI, dI]
    if key_scale is not None:
        q = q * key_scale.float()
    w = x @ idx_w.T  # [T, nI]
    dots = torch.relu(torch.einsum("tjd,sd->tjs", q, keys))  # [T, nI, n]
    return torch.einsum("tj,tjs->ts", w, dots) / math.sqrt(dI)  # [T, n]


def select(scores: torch.Tensor, q_pos: torch.Tensor, p: GSMParams) -> torch.Tensor:
    """Boolean mask Sel [T, n]: row t selects the cached positions its query at q_pos[t] attends to.

    scores: [T, n] over cached positions 0..n-1; q_pos: [T] absolute query positions (< n).
    Sel(t) = sinks ∪ window ∪ top-k(t) of the rest (ties: lower s first); every s <= t when
    t + 1 <= sinks + window + top_k(t) (spec 4.1; top_k(t) grows with t when p.sparse_top_k_divisor > 0).
    """
    T, n = scores.shape
    s = torch.arange(n)
    causal = s[None, :] <= q_pos[:, None]  # [T, n]
    fixed = causal & ((s[None, :] < p.sink_tokens) | (s[None, :] > q_pos[:, None] - p.sparse_window))
    cand = causal & ~fixed  # positions the indexer chooses among
    mask = fixed.clone()
    k_t = torch.tensor([min(p.top_k_at(int(t)), n) for t in q_pos], dtype=torch.long)  # [T]
    k = int(k_t.max()) if T else 0
    if k > 0:
        # stable descending sort: among equal scores the lower position comes first (spec tie rule)
        order = torch.sort(scores.masked_fill(~cand, float("-inf")), dim=-1, descending=True,
                           stable=True).indices[:, :k]  # [T, k]
        keep = torch.arange(k)[None, :] < k_t[:, None]  # each query its own count
        mask |= torch.zeros_like(mask).scatter_(1, order, keep) & cand
    dense_rows = torch.tensor([p.selection_is_dense(int(t) + 1) for t in q_pos], dtype=torch.bool)
    mask[dense_rows] = causal[dense_rows]
    return mask


def boundary_gap(scores: torch.Tensor, q_pos: torch.Tensor, p: GSMParams) -> torch.Tensor:
    """[T] how far row t's top-k is from another choice: the k-th largest candidate score less the (k+1)-th, over the
    row's largest |candidate score| (inf where no candidate is left out: every one selected, or none to choose, or a
    dense row). An engine whose scores move by less than this relative amount selects the same positions."""
    T, n = scores.shape
    s = torch.arange(n)
    cand = (s[None, :] <= q_pos[:, None]) & (s[None, :] >= p.sink_tokens) & (
        s[None, :] <= q_pos[:, None] - p.sparse_window)
    out = torch.full((T,), float("inf"))
    for t in range(T):
        v = scores[t][cand[t]].double()
        k = min(p.top_k_at(int(q_pos[t])), v.numel())
        if k == 0 or k == v.numel() or p.selection_is_dense(int(q_pos[t]) + 1):
            continue
        top = torch.topk(v, k + 1).values
        out[t] = float((top[k - 1] - top[k]) / v.abs().max().clamp_min(1e-30))
    return out
