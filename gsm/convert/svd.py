"""Activation-aware low-rank factors of K/V projections (Palu / SVD-LLM style whitening).

With inputs X [N, H] and covariance C = XᵀX / N = L Lᵀ (Cholesky), the output error of a rank-r
approximation W_r of W [kvD, H] is ||X (W - W_r)ᵀ||_F² = N ||(W - W_r) L||_F². The best W_r is
therefore the truncated SVD of W L = P Σ Qᵀ mapped back: W_r = P_r Σ_r Q_rᵀ L⁻¹, and the relative
output error at rank r is sqrt(Σ_{i>r} σ_i² / Σ σ_i²). Plain weight SVD (C = I) of a small trained
model needs nearly full rank; whitening by the real input statistics is what makes ranks drop.

GSM factors: U = P_r [kvD, r], S = Σ_r [r], Vt = Q_rᵀ L⁻¹ [r, H] (so W_r = U diag(S) Vt, spec 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LowRank:
    """Whitened SVD of one projection; `factors(r)` truncates it."""

    P: torch.Tensor  # [kvD, m] left singular vectors, float64
    sigma: torch.Tensor  # [m] singular values of W L, descending
    QtLinv: torch.Tensor  # [m, H] rows of Qᵀ L⁻¹, float64

    @property
    def full_rank(self) -> int:
        return self.sigma.numel()

    def rel_error(self, r: int) -> float:
        """Relative K/V output error on the fitting activations at rank r."""
        e = self.sigma.pow(2)
        return math.sqrt(float(e[r:].sum() / e.sum().clamp_min(1e-300)))

    def errors(self) -> list[float]:
        """rel_error(r) for r = 0..full_rank."""
        e = self.sigma.pow(2)
        tail = torch.flip(torch.cumsum(torch.flip(e, [0]), 0), [0])  # tail[r] = sum_{i>=r}
        tot = float(e.sum().clamp_min(1e-300))
        return [math.sqrt(float(t) / tot) for t in tail] + [0.0]

    def rank_for_tolerance(self, tol: float) -> int:
        """Smallest r >= 1 whose relative output error is <= tol."""
        for r, err in enumerate(self.errors()):
            if r >= 1 and err <= tol:
                return r
        return self.full_rank

    def factors(self, r: int, *, u_grid: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U [kvD, r], S [r], Vt [r, H]) in float32; with u_grid (what the converter writes) U on the FP16 grid:
        every value a float16 (|U| <= 1, a relative change of at most 2^-11 per value, below the FP16 rounding the
        cached latents get anyway), so an FP16 engine and the CPU op's float16 copy (docs/decisions.md "U on the
        FP16 grid") hold exactly the golden's numbers. Without it the SVD's own U (full rank: W exactly)."""
        U = self.P[:, :r].float()
        return ((U.half().float() if u_grid else U).contiguous(), self.sigma[:r].float().contiguous(),
                self.QtLinv[:r].float().contiguous())


    def latent_map(self, r: int) -> torch.Tensor:
        """A [H, r] float64 with latents c = x A = (x Vtᵀ) ⊙ S at rank r."""
        return self.QtLinv[:r].T * self.sigma[:r]


def input_covariance(x: torch.Tensor) -> torch.Tensor:
    """x: [N, H] -> C = xᵀx / N in float64."""
    x64 = x.double()
    return (x64.T @ x64) / x64.shape[0]


def whitened_svd(w: torch.Tensor, cov: torch.Tensor | None, device: torch.device | None = None) -> LowRank:
    """w: [kvD, H]; cov: [H, H] input covariance (None: plain weight SVD); computed on `device`."""
    dev = device or torch.device("cpu")
    w64 = w.to(dev, torch.float64)
    H = w64.shape[1]
    if cov is None:
        L = torch.eye(H, dtype=torch.float64, device=dev)
    else:
        # a tiny ridge keeps Cholesky defined when some input directions never occur in the data
        ridge = 1e-6 * float(torch.diagonal(cov).mean()) + 1e-12
        L = torch.linalg.cholesky(cov.to(dev, torch.float64) + ridge * torch.eye(H, dtype=torch.float64, device=dev))
    P, sigma, Qt = torch.linalg.svd(w64 @ L, full_matrices=False)
    # Qᵀ L⁻¹ = (L⁻ᵀ Q)ᵀ: solve Lᵀ Z = Q rather than forming the inverse
    Z = torch.linalg.solve_triangular(L.T, Qt.T, upper=True)
    return LowRank(P=P.cpu(), sigma=sigma.cpu(), QtLinv=Z.T.cpu())


def ranks_for_budget(lowranks: dict[tuple[int, str], LowRank], budget_values: int) -> dict[tuple[int, str], int]:
    """Choose ranks with sum(r) <= budget_values minimising the summed squared relative errors.

    Greedy removal of the cheapest singular direction is optimal here: within one projection the
    marginal cost sigma_i² / sum sigma² grows as i falls, so the costs are sorted per projection.
    Every projection keeps rank >= 1.
    """
    ranks = {key: lr.full_rank for key, lr in lowranks.items()}
    if budget_values < len(ranks):
        raise ValueError(f"a budget of {budget_values} latent values cannot give every "
                         f"projection rank >= 1 ({len(ranks)} projections)")
    norm = {key: float(lr.sigma.pow(2).sum().clamp_min(1e-300)) for key, lr in lowranks.items()}
    while sum(ranks.values()) > budget_values:
        key = min((k for k in ranks if ranks[k] > 1),
                  key=lambda k: float(lowranks[k].sigma[ranks[k] - 1] ** 2) / norm[k])
        ranks[key] -= 1
    return ranks
