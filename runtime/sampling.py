"""Sampling: the parameters of one request, checked once, and the sampler they make.

temperature 0 is greedy (argmax, first index on ties); otherwise top-k, then top-p (smallest prefix
of the sorted distribution reaching p), then a draw from `numpy.random.default_rng(seed)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class RequestError(ValueError):
    """A request parameter is out of range; `field` names it (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


def check_temperature(t: float) -> float:
    if not (math.isfinite(t) and t >= 0):
        raise RequestError("temperature", f"must be a finite number >= 0 (0 is greedy), got {t}")
    return float(t)


def check_top_p(p: float) -> float:
    if not (math.isfinite(p) and 0 < p <= 1):
        raise RequestError("top_p", f"must be in (0, 1] (1 keeps every token), got {p}")
    return float(p)


def check_top_k(k: int) -> int:
    if int(k) != k or k < 0:
        raise RequestError("top_k", f"must be an integer >= 0 (0 keeps every token), got {k}")
    return int(k)


def check_seed(s: int | None) -> int | None:
    if s is not None and (int(s) != s or s < 0):
        raise RequestError("seed", f"must be an integer >= 0, got {s}")
    return None if s is None else int(s)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; out-of-range values are a RequestError naming the field."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        object.__setattr__(self, "seed", check_seed(self.seed))


@dataclass
class Sampler:
    """Draws token ids from logits; holds its own generator, so one Sampler per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)  # raises RequestError
        self.rng = np.random.default_rng(self.seed)

    @classmethod
    def from_params(cls, p: SamplingParams) -> Sampler:
        return cls(p.temperature, p.top_k, p.top_p, p.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # smallest prefix reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))
