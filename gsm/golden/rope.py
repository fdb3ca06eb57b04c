"""Rotary position embedding in the Hugging Face "rotate-half" layout (GSM tensors follow HF names
and layout; the llama2.c/Meta interleaved layout is converted at import, see gsm.sources.llama2c)."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for integer `positions` [...]: each [..., head_dim] (halves repeated, HF layout).

    Angles are computed in float64 and rounded once to float32, so every implementation that
    follows this recipe gets the same tables bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [..., D/2]
    ang = torch.cat([ang, ang], dim=-1)  # [..., D]
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D] with cos/sin broadcastable to it (usually [T, D] or [B, 1, T, D])."""
    return x * cos + rotate_half(x) * sin
