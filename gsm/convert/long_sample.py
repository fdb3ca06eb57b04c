"""Query rows of long calibration windows with their dense attention: what the indexer is fitted to.

A 256-token window never asks the indexer to rank positions thousands of tokens back, so an
indexer fitted there ranks them no better than recency does at 8K (docs/quality.md). Fitting on
[T, T] attention at the model's context is out of reach (8K: 256 MiB per layer and sequence), but
the fit's loss is a sum over query rows: a sample of rows spread over the window, with the head-mean
attention of each over all T positions, plus the indexer's input x at every position (keys are
computed from it), gives the same objective at a bounded cost:

    per layer and window: x [T, H] float16 + attention [R, T] float16

whatever the calibration length (SmolLM2, 3 windows of 4K, R = 256: 30 x 3 x (4.7 + 2.1) MB = 0.6 GB).
The dense model runs as a chunked prefill (gsm.convert.budget.add_sequence does the same), so the
pass itself holds the K/V cache and one chunk's [heads, chunk, T] slice, never [heads, T, T].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gsm.convert.budget import chunk_row_attention
from gsm.golden import attention as A

CHUNK = 256  # query positions per chunk of the dense prefill


@dataclass
class LongSample:
    """Sampled query rows of B windows of T positions, per layer."""

    rows: torch.Tensor  # [B, R] query positions, ascending in each window
    x: list[torch.Tensor]  # per layer [B, T, H] float16: the indexer's input at every position
    attn: list[torch.Tensor]  # per layer [B, R, T] float16: head-mean attention of each row (0 past the row)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, *self.x, *self.attn))


def sample_rows(T: int, first: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct query positions drawn uniformly from [first, T), ascending (all of them when fewer)."""
    n = min(n, T - first)
    return torch.sort(torch.randperm(T - first, generator=gen)[:n] + first).values


def chunks_of(ids: torch.Tensor, chunk: int = CHUNK) -> int:
    """Chunked prefill steps over windows ids [B, T]: the units of collect_long_sample's progress."""
    B, T = ids.shape
    return B * -(-T // chunk)


@torch.no_grad()
def collect_long_sample(dense, ids: torch.Tensor, *, rows_per_window: int, first: int, seed: int = 0,
                        advance: Callable[[int], None] | None = None) -> LongSample:
    """Run the dense model over windows ids [B, T]; keep x at every position and the attention of sampled rows.

    first: the lowest query position worth fitting (a row needs candidates beyond sinks + window). `advance(1)`
    after each chunk of CHUNK positions (chunks_of: how many).
    """
    cfg = dense.config
    B, T = ids.shape
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([sample_rows(T, first, rows_per_window, gen) for _ in range(B)])
    R = rows.shape[1]
    x = [torch.empty(B, T, H, dtype=torch.float16) for _ in range(L)]
    attn = [torch.zeros(B, R, T, dtype=torch.float16) for _ in range(L)]
    for b in range(B):
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for a in range(0, T, CHUNK):
            q_pos = torch.arange(a, min(a + CHUNK, T))
            _, layers = dense.run_cached(ids[None, b, a:a + CHUNK], kv, capture=True)  # extends kv in place
            here = (rows[b] >= a) & (rows[b] < a + CHUNK)
            cos, sin = A.rope_tables(q_pos, cfg.head_dim, cfg.rope_theta)
            for i, lc in enumerate(layers):
                x[i][b, a:a + CHUNK] = lc.x[0].to(torch.float16)
                if not here.any():
                    continue
                k = kv[i][0][0]  # [nKV, a + chunk, D], RoPE'd
                probs = chunk_row_attention(cfg, lc.q[0], k, q_pos, rows[b][here] - a, cos, sin)
                attn[i][b, here, :k.shape[1]] = probs.to(torch.float16)
            if advance is not None:
                advance(1)
    return LongSample(rows=rows, x=x, attn=attn)
