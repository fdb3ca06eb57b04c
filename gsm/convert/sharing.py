"""Cross-layer KV sharing (CLA / MiniCache): fit kv_projector of a sharing layer by least squares.

A sharing layer i reads the latents [c_k; c_v] of an earlier owning layer s and maps them to its
own pre-RoPE keys and values: [Kpre_i; V_i] ≈ W [c_k; c_v] + b. W and b are the least-squares fit
on calibration activations of the dense model, and the source is the owning layer with the
smallest relative residual. Which layers share at all is decided by the converter's policy
(`--sharing auto` tries layers in order of residual and keeps those whose calibration perplexity
cost stays within the budget).

The converter keeps moments, not activations: with latents c = x A (A = Vtᵀ diag(S)) the normal
equations need only Σ x_s x_sᵀ, Σ x_s, Σ x_s y_dᵀ, Σ y_d y_dᵀ and Σ y_d (`fit_projector_from_moments`).
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


def fit_projector_from_moments(ztz: torch.Tensor, zty: torch.Tensor, yty_trace: float, source: int,
                               ridge: float = 1e-6) -> ProjectorFit:
    """The same fit from moments of Z = [latents, 1]: ZᵀZ [r+1, r+1], ZᵀY [r+1, 2*kvD], tr(YᵀY)."""
    G = ztz.double()
    Gr = G + ridge * float(torch.diagonal(G).mean()) * torch.eye(G.shape[0], dtype=torch.float64)
    sol = torch.linalg.solve(Gr, zty.double())
    # ||Z sol - Y||² expanded; clamp: rounding can make a perfect fit's residual slightly negative
    resid = yty_trace - 2.0 * float((sol * zty).sum()) + float((sol * (G @ sol)).sum())
    rel = math.sqrt(max(resid, 0.0) / max(yty_trace, 1e-300))
    return ProjectorFit(source=source, weight=sol[:-1].T.float().contiguous(), bias=sol[-1].float().contiguous(),
                        rel_residual=rel)


def latent_moments(A: torch.Tensor, xx: torch.Tensor, x_sum: torch.Tensor, n: int, cross: torch.Tensor,
                   y_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ZᵀZ and ZᵀY for Z = [x_s A, 1] from the source's Σ x xᵀ, Σ x and the pair's Σ x_s y_dᵀ, Σ y_d."""
    A = A.double()
    top = torch.cat([A.T @ xx @ A, (A.T @ x_sum)[:, None]], dim=1)
    bottom = torch.cat([x_sum @ A, torch.tensor([float(n)], dtype=torch.float64)])[None]
    return torch.cat([top, bottom]), torch.cat([A.T @ cross, y_sum[None]])


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
