"""Sampling: the parameters of one request, checked once, and the sampler they make.

Penalties first (`apply_penalties`: OpenAI's presence and frequency penalties over the generated tokens,
vLLM's / llama.cpp's repetition penalty over prompt and generated tokens), then: temperature 0 is greedy
(argmax, first index on ties); otherwise top-k, then top-p (smallest prefix of the sorted distribution
reaching p), then a draw from `numpy.random.default_rng(seed)`.
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


def check_penalty(name: str, v: float, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and lo <= v <= hi):
        raise RequestError(name, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


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
    presence_penalty: float = 0.0  # OpenAI: -2..2, subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: -2..2, times how often the token was generated so far
    repetition_penalty: float = 1.0  # vLLM / llama.cpp: > 0, 1 = off; divides positive logits of seen tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        object.__setattr__(self, "seed", check_seed(self.seed))
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, check_penalty(name, getattr(self, name), -2.0, 2.0))
        rp = check_penalty("repetition_penalty", self.repetition_penalty, 0.0, 100.0)
        if rp == 0:
            raise RequestError("repetition_penalty", "must be > 0 (1 is off), got 0")
        object.__setattr__(self, "repetition_penalty", rp)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def apply_penalties(logits: np.ndarray, p: SamplingParams, generated: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Penalised logits (a new float32 array). generated: int counts by token id of the tokens generated so far
    (OpenAI's presence / frequency penalties: logit - presence * [count > 0] - frequency * count); seen: bool by
    token id of the prompt's and generated tokens (repetition penalty, as vLLM and HF apply it: a positive logit
    divided by it, a negative one multiplied)."""
    z = np.array(logits, np.float32)
    if p.presence_penalty or p.frequency_penalty:
        z -= np.float32(p.presence_penalty) * (generated > 0) + np.float32(p.frequency_penalty) * generated
    if p.repetition_penalty != 1:
        r = np.float32(p.repetition_penalty)
        z = np.where(seen, np.where(z > 0, z / r, z * r), z).astype(np.float32)
    return z


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
