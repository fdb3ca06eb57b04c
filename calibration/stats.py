"""Per-channel statistics of the latent rows an owning layer writes (the calibration "observer").

The pattern is TensorRT-LLM's `capture_activation_range`: a hook on the model records, per owning
layer and per latent channel of c_k and c_v, what the scale methods need:
- a running abs-max (method `absmax`; also the search range of `mse`),
- a running count and float64 sum (a cheap mean per channel, for the report),
- a uniform reservoir of whole rows (Vitter's algorithm R, seeded), from which `percentile`,
  `mse` and the compensation table are computed. Rows, not single values, are sampled so every
  channel sees the same positions; below `capacity` rows the reservoir holds all of them and every
  number is exact.

What is recorded is the value the INT tiers would quantise: the FP16-rounded latent (spec 5: a row
enters FP16, and FP16 -> INT8 quantises the FP16 value). Positions that can never leave FP16 are
left out, because their values never meet a scale: the sinks (often outliers, StreamingLLM) and
tokens of `hot_token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gsm.golden.model import GoldenModel
from gsm.golden.quant import round_fp16


@dataclass
class ChannelStats:
    """Statistics of one latent ([rows, r]) of one owning layer."""

    r: int
    capacity: int
    generator: torch.Generator
    absmax: torch.Tensor = field(init=False)  # [r] float32
    total: torch.Tensor = field(init=False)  # [r] float64 sum
    count: int = 0
    # reservoir storage, grown by doubling up to capacity (appending by torch.cat would copy every row
    # held so far on every update); `rows` is its filled part
    _buf: torch.Tensor = field(init=False, repr=False)
    _held: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        self.absmax = torch.zeros(self.r)
        self.total = torch.zeros(self.r, dtype=torch.float64)
        self._buf = torch.zeros(0, self.r)

    @property
    def rows(self) -> torch.Tensor:
        """[min(count, capacity), r] float32 reservoir (a view)."""
        return self._buf[: self._held]

    def update(self, x: torch.Tensor) -> None:
        """x: [T, r] float32 rows, already the values to be quantised."""
        if x.numel() == 0:
            return
        x = x.detach().float()
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0))
        self.total += x.double().sum(dim=0)
        free = max(0, self.capacity - self._held)
        head, tail = x[:free], x[free:]
        if head.shape[0]:
            need = self._held + head.shape[0]
            if need > self._buf.shape[0]:
                grown = torch.zeros(min(self.capacity, max(need, 2 * self._buf.shape[0])), self.r)
                grown[: self._held] = self.rows
                self._buf = grown
            self._buf[self._held:need] = head
            self._held = need
        seen = self.count + head.shape[0]
        if tail.shape[0]:
            # algorithm R: the k-th row overall (0-based) replaces slot j ~ U[0, k] when j < capacity
            k = torch.arange(seen, seen + tail.shape[0], dtype=torch.float64)
            j = (torch.rand(tail.shape[0], generator=self.generator, dtype=torch.float64) * (k + 1)).long()
            for idx in (j < self.capacity).nonzero().squeeze(1).tolist():  # in order: later rows win
                self._buf[int(j[idx])] = tail[idx]
        self.count += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        return (self.total / max(self.count, 1)).float()

    @property
    def exact(self) -> bool:
        """Whether the reservoir holds every row seen (all derived numbers are then exact)."""
        return self.count <= self.capacity


class LatentObserver:
    """Hook for `GoldenModel.latent_hooks`: ChannelStats per (owning layer, "k" | "v").

    `begin_sequence(token_ids)` must be called before each sequence's forward call so the observer
    knows which positions are sinks or hot tokens (those never leave FP16 and are skipped).
    """

    def __init__(self, model: GoldenModel, *, capacity: int = 16384, seed: int = 0,
                 fp16: bool = True) -> None:
        self.fp16 = fp16  # False keeps float32 rows (held-out error of the FP16 tier itself)
        self.sink_tokens = model.p.sink_tokens
        self.hot_ids = frozenset(model.quant.hot_token_ids)
        self.stats: dict[tuple[int, str], ChannelStats] = {}
        for i in model.cfg.owning_layers:
            for n, (kv, r) in enumerate(zip(("k", "v"), model.w.owning(i).ranks)):
                g = torch.Generator().manual_seed(seed * 1_000_003 + 2 * i + n)
                self.stats[(i, kv)] = ChannelStats(r, capacity, g)
        self._tokens: list[int] = []
        # per owning layer: abs-max per channel of the indexer keys (their INT8 scale), sinks left out: a
        # sink is selected whatever its score, so its key never meets the scale's clip
        self.key_absmax = {i: torch.zeros(model.cfg.gsm.indexer_dim) for i in model.cfg.owning_layers}
        # sum of x x^T (float64) over every position's LM-head input: the Gram matrix GPTQ quantises the head
        # with (builder/gptq.py); [H, H] whatever the number of tokens
        self.head_gram = torch.zeros(model.cfg.hidden_size, model.cfg.hidden_size, dtype=torch.float64)
        self.head_rows = 0

    def attach(self, model: GoldenModel) -> None:
        model.latent_hooks.append(self)
        model.key_hooks.append(self.observe_keys)
        model.head_hooks.append(self.observe_head_input)

    def detach(self, model: GoldenModel) -> None:
        model.latent_hooks.remove(self)
        model.key_hooks.remove(self.observe_keys)
        model.head_hooks.remove(self.observe_head_input)

    def observe_head_input(self, x: torch.Tensor) -> None:
        x = x.detach().double()
        self.head_gram += x.T @ x
        self.head_rows += x.shape[0]

    def head_input_moment(self) -> torch.Tensor | None:
        """[H, H] float32 mean of x x^T over the head inputs seen (None before any)."""
        return (self.head_gram / self.head_rows).float() if self.head_rows else None

    def observe_keys(self, layer: int, start: int, keys: torch.Tensor) -> None:
        rows = keys[max(0, self.sink_tokens - start):]
        if rows.numel():
            self.key_absmax[layer] = torch.maximum(self.key_absmax[layer], rows.detach().float().abs().amax(dim=0))

    def begin_sequence(self, token_ids: list[int]) -> None:
        self._tokens = list(token_ids)

    def __call__(self, layer: int, start: int, ck: torch.Tensor, cv: torch.Tensor) -> None:
        keep = [t for t in range(ck.shape[0]) if self._quantisable(start + t)]
        if not keep:
            return
        rows = torch.tensor(keep)
        for kv, x in (("k", ck), ("v", cv)):
            self.stats[(layer, kv)].update(round_fp16(x[rows]) if self.fp16 else x[rows])

    def _quantisable(self, pos: int) -> bool:
        if pos < self.sink_tokens:
            return False
        return not (pos < len(self._tokens) and self._tokens[pos] in self.hot_ids)


@torch.inference_mode()
def observe(model: GoldenModel, sequences: torch.Tensor, observer: LatentObserver,
            advance: Callable[[int], None] | None = None) -> None:
    """Feed `observer` the latent rows of `model`'s forward calls over [B, T] ids, in order (advance(1) after
    each sequence)."""
    observer.attach(model)
    try:
        for row in sequences:
            observer.begin_sequence(row.tolist())
            model.forward(model.new_cache(), row)
            if advance is not None:
                advance(1)
    finally:
        observer.detach(model)


def collect_stats(model: GoldenModel, sequences: torch.Tensor, *, capacity: int = 16384,
                  seed: int = 0, fp16: bool = True) -> dict[tuple[int, str], ChannelStats]:
    """Run `model` (exact mode: float32 latents, rounded to FP16 by the observer) over [B, T] ids."""
    obs = LatentObserver(model, capacity=capacity, seed=seed, fp16=fp16)
    observe(model, sequences, obs)
    return obs.stats
