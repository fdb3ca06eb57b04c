"""Cross-layer KV sharing (CLA / MiniCache): fit kv_projector of a sharing layer by least squares.

A sharing layer i reads the latents [c_k; c_v] of an earlier owning layer s and maps them to its
own pre-RoPE keys and values: [Kpre_i; V_i] ≈ W [c_k; c_v] + b. W and b are the least-squares fit
on calibration activations of the dense model, and the source is the owning layer with the
smallest relative residual. Which layers share at all is decided by the converter's policy
(`--sharing auto` tries layers in order of residual and keeps those whose calibration perplexity
cost stays within the budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ProjectorFit:
    source: int
    weight: torch.Tensor  # [2*kvD, r_k + r_v]
    bias: torch.Tensor  # [2*kvD]
    rel_residual: float  # ||Z W^T + b - Y|| / ||Y|| on the fitting data


def fit_projector(latents: torch.Tensor, targets: torch.Tensor, source: int, ridge: float = 1e-6) -> ProjectorFit:
    """latents: [N, r_k + r_v] of the source; targets: [N, 2*kvD] = [Kpre; V] of the sharing layer."""
    Z = torch.cat([latents.double(), torch.ones(latents.shape[0], 1, dtype=torch.float64)], dim=1)
    Y = targets.double()
    # normal equations with a small ridge: latents of tiny models can be nearly collinear
    G = Z.T @ Z
    G += ridge * float(torch.diagonal(G).mean()) * torch.eye(G.shape[0], dtype=torch.float64)
    sol = torch.linalg.solve(G, Z.T @ Y)  # [r+1, 2*kvD]
    resid = Z @ sol - Y
    rel = math.sqrt(float(resid.pow(2).sum() / Y.pow(2).sum().clamp_min(1e-300)))
    return ProjectorFit(source=source, weight=sol[:-1].T.float().contiguous(), bias=sol[-1].float().contiguous(),
                        rel_residual=rel)


def best_source(latents: dict[int, torch.Tensor], targets: torch.Tensor, candidates: list[int]) -> ProjectorFit:
    """The candidate source layer whose latents predict `targets` with the smallest residual."""
    if not candidates:
        raise ValueError("no earlier KV-owning layer to share from")
    fits = [fit_projector(latents[s], targets, s) for s in candidates]
    return min(fits, key=lambda f: (f.rel_residual, f.source))


def parse_sharing_map(text: str, n_layers: int) -> dict[int, int]:
    """`--sharing MAP`: "3:1,4:2" (sharing layer:source layer) -> {3: 1, 4: 2}, validated."""
    out: dict[int, int] = {}
    for part in text.split(","):
        try:
            dst_s, src_s = part.split(":")
            dst, src = int(dst_s), int(src_s)
        except ValueError as e:
            raise ValueError(f"--sharing: expected 'auto', 'none' or pairs like '3:1,4:2', got {text!r}") from e
        if not (0 <= src < dst < n_layers):
            raise ValueError(f"--sharing: pair {dst}:{src} needs 0 <= source < layer < {n_layers}")
        if dst in out:
            raise ValueError(f"--sharing: layer {dst} given twice")
        out[dst] = src
    for dst, src in out.items():
        if src in out:
            raise ValueError(f"--sharing: source layer {src} of layer {dst} is itself sharing")
    return out
