"""Blocks shared by the dense reference and the GSM golden model: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] -> [..., H]; LLaMA RMSNorm computed in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x: [..., H]; gate/up: [I, H]; down: [H, I] -> [..., H]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
