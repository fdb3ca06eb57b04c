"""Calibration statistics of a dense model, streamed over batches: what the fits need, not activations.

Every fit of the converter is a least-squares problem in the layer inputs, so it needs only
moments, accumulated batch by batch in float64:
- per layer: Σ x xᵀ and Σ x of the normalised attention input (whitened SVD, indexer w init);
- per layer, when sharing is asked for: Σ y yᵀ and Σ y of its [Kpre; V] outputs (projector
  targets), and for each candidate pair (source s, sharing layer d): Σ x_s y_dᵀ;
- a bounded sample for the indexer fit and the window search: the inputs of the first
  `n_sample` sequences (float16) and their head-summed attention. Its size is fixed by
  n_sample × seq_len, never by the number of calibration tokens.
So memory is O(L·H² + pairs·H·kvD + sample), whatever the number of calibration tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from gsm.dense import DenseLlama

BATCH = 8  # sequences per forward: the capture of one batch is the only per-token memory


@dataclass
class LayerMoments:
    xx: torch.Tensor  # Σ x xᵀ [H, H] float64
    x_sum: torch.Tensor  # Σ x [H] float64
    yy: torch.Tensor | None = None  # Σ y yᵀ [2kvD, 2kvD], y = [Kpre; V] (only with sharing pairs)
    y_sum: torch.Tensor | None = None  # Σ y [2kvD]


@dataclass
class CalibStats:
    tokens: int
    layers: list[LayerMoments]
    cross: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (s, d) -> Σ x_s y_dᵀ [H, 2kvD]
    seq_x: list[torch.Tensor] = field(default_factory=list)  # per layer [n_sample, T, H] float16
    attn: list[torch.Tensor] = field(default_factory=list)  # per layer [n_sample, T, T] head-summed

    def covariance(self, i: int) -> torch.Tensor:
        """E[x xᵀ] of layer i's attention input [H, H] float64."""
        return self.layers[i].xx / self.tokens

    def nbytes(self) -> int:
        ts = [t for m in self.layers for t in (m.xx, m.x_sum, m.yy, m.y_sum) if t is not None]
        ts += list(self.cross.values()) + self.seq_x + self.attn
        return sum(t.numel() * t.element_size() for t in ts)


def sharing_pairs(n_layers: int, reach: int) -> list[tuple[int, int]]:
    """(source, sharing layer) candidates with 1 <= d - s <= reach: linear in the layer count."""
    return [(s, d) for d in range(1, n_layers) for s in range(max(0, d - reach), d)]


@torch.no_grad()
def collect_stats(dense: DenseLlama, ids: torch.Tensor, *, n_sample: int, pairs: Iterable[tuple[int, int]] = (),
                  device: torch.device | None = None, advance: Callable[[int], None] | None = None) -> CalibStats:
    """Stream calibration sequences ids [B, T] through the dense model, keeping only statistics."""
    dev = device or torch.device("cpu")
    cfg = dense.config
    L, H, kvD = cfg.num_hidden_layers, cfg.hidden_size, cfg.kv_dim
    pairs = sorted(set(pairs))
    targets = {d for _, d in pairs}
    f64 = dict(dtype=torch.float64, device=dev)
    layers = [LayerMoments(torch.zeros(H, H, **f64), torch.zeros(H, **f64)) for _ in range(L)]
    for d in targets:
        layers[d].yy, layers[d].y_sum = torch.zeros(2 * kvD, 2 * kvD, **f64), torch.zeros(2 * kvD, **f64)
    cross = {p: torch.zeros(H, 2 * kvD, **f64) for p in pairs}
    n_sample = min(n_sample, ids.shape[0])
    seq_x = [torch.empty(n_sample, ids.shape[1], H, dtype=torch.float16) for _ in range(L)]
    attn = [torch.empty(n_sample, ids.shape[1], ids.shape[1]) for _ in range(L)]
    for b0 in range(0, ids.shape[0], BATCH):
        chunk = ids[b0:b0 + BATCH]
        take = max(0, min(n_sample - b0, chunk.shape[0]))
        _, cap = dense.forward(chunk, capture=True, capture_probs=take > 0)
        xs: dict[int, torch.Tensor] = {}
        for i, lc in enumerate(cap.layers):
            x = lc.x.reshape(-1, H).to(dev, torch.float64)
            layers[i].xx += x.T @ x
            layers[i].x_sum += x.sum(0)
            if i in targets:
                y = torch.cat([lc.k, lc.v], dim=-1).reshape(-1, 2 * kvD).to(dev, torch.float64)
                layers[i].yy += y.T @ y
                layers[i].y_sum += y.sum(0)
                for s, d in pairs:
                    if d == i:
                        cross[(s, d)] += xs[s].T @ y
            xs[i] = x
            if take:
                seq_x[i][b0:b0 + take] = lc.x[:take].to(torch.float16)
                attn[i][b0:b0 + take] = lc.probs[:take].sum(1)
            # sources further back than any pair reaches are not needed again
            for s in [s for s in xs if not any(ps == s and pd > i for ps, pd in pairs)]:
                del xs[s]
        del cap
        if advance is not None:
            advance(chunk.shape[0])
    return CalibStats(tokens=int(ids.numel()), layers=[LayerMoments(
        m.xx.cpu(), m.x_sum.cpu(), None if m.yy is None else m.yy.cpu(),
        None if m.y_sum is None else m.y_sum.cpu()) for m in layers],
        cross={p: c.cpu() for p, c in cross.items()}, seq_x=seq_x, attn=attn)
