"""Deployed-mode quality on decoded spans: what the tier fractions and scales cost.

Protocol (decided here, documented in docs/calibration.md): each sequence of T tokens is split
into a prefill of `prefill_len` tokens and T - prefill_len - 1 teacher-forced decode steps
(`GoldenModel.prefill` / `decode`). Only the decode steps' predictions are scored: the prefill's
logits are computed before the end-of-prefill re-tier pass, so they never see an INT tier.
The engine's `quantization_adaptation_rate` (spec default 1000) is longer than a calibration
sequence, so measurements run with a small rate (`adaptation_rate`, default 16): the end-of-prefill
pass plus a pass every 16 decode steps, so demotions happen inside the measured span and the
rows attention reads are in the tiers the policy gives them. Exact mode (no quantisation) is
scored on the same tokens with one forward call (equal to decoding step by step in exact mode).

Figures per configuration: mean NLL (perplexity = exp), and the mean KL(exact || deployed) of the
next-token distributions, a much less noisy measure of the same damage.

Speed: deployed configurations are not decoded one sequence at a time through GoldenModel.decode
(deployed_logprobs, kept as the plain reference) but all together by calibration/lockstep.py, the
same algorithm with one row per (sequence, configuration); tests/test_calibration_speed.py holds
the two together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from calibration.lockstep import Config, Fractions, Prefilled, bytes_per_row, decode_scores, prefill_sequence
from calibration.stats import LatentObserver
from gsm.config import KVQuantConfig
from gsm.golden.model import GoldenModel
from gsm.golden.weights import GoldenWeights, KVCalibration
from gsm.tiers import avg_bytes

MAX_STATE_BYTES = 512 << 20  # decode state of the rows measured together (lockstep.bytes_per_row each)


@dataclass(frozen=True)
class Protocol:
    prefill_len: int
    adaptation_rate: int = 16

    def check(self, seq_len: int) -> None:
        if not 1 <= self.prefill_len <= seq_len - 2:
            raise ValueError(f"--prefill-len {self.prefill_len} must leave at least one decode step in "
                             f"--seq-len {seq_len} (1 <= prefill_len <= seq_len - 2)")
        if self.adaptation_rate < 1:
            raise ValueError(f"--adaptation-rate must be >= 1, got {self.adaptation_rate}")


@dataclass(frozen=True)
class Score:
    """Per-sequence sums over scored tokens (so several sequences add up, and pair up)."""

    nll: tuple[float, ...] = ()
    kl: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()

    def __add__(self, other: Score) -> Score:
        return Score(self.nll + other.nll, self.kl + other.kl, self.tokens + other.tokens)

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def mean_nll(self) -> float:
        return sum(self.nll) / max(self.n_tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / max(self.n_tokens, 1)


def relative_increase(s: Score, ref: Score, z: float = 0.0) -> float:
    """exp(mean NLL difference + z * standard error) - 1: the relative perplexity increase of s over ref.

    z = 0 gives the point estimate (ppl_s / ppl_ref - 1). z > 0 gives a one-sided upper bound: the
    standard error comes from the per-sequence mean NLL differences (paired: same tokens), since
    tokens of one sequence are not independent. One sequence has no error bar (bound = estimate).
    """
    if s.tokens != ref.tokens:
        raise ValueError("scores of different token sets cannot be compared")
    diff = (sum(s.nll) - sum(ref.nll)) / max(s.n_tokens, 1)
    se = 0.0
    b = len(s.tokens)
    if z and b >= 2:
        d = [(a - r) / t for a, r, t in zip(s.nll, ref.nll, s.tokens)]
        m = sum(d) / b
        se = math.sqrt(sum((x - m) ** 2 for x in d) / (b - 1) / b)
    return math.exp(diff + z * se) - 1.0


def kv_bytes_per_position(weights: GoldenWeights, fractions: Fractions, key_bytes: int = 2) -> float:
    """Spec 6: sum over owning layers of (r_k + r_v) * avg bytes + dI * key_bytes (2 FP16, 1 INT8 indexer keys)."""
    d_i = weights.cfg.gsm.indexer_dim
    avg = avg_bytes(fractions)
    return float(sum((rk + rv) * avg + d_i * key_bytes for rk, rv in weights.ranks.values()))


def deployed_model(weights: GoldenWeights, quant: KVQuantConfig, calib: KVCalibration, fractions: Fractions,
                   protocol: Protocol) -> GoldenModel:
    params = replace(weights.cfg.gsm, quantization_adaptation_rate=protocol.adaptation_rate)
    return GoldenModel(weights, mode="deployed", quant=quant.with_fractions(tuple(fractions)),
                       calibration=calib, params=params)


@torch.no_grad()
def exact_logprobs(model: GoldenModel, ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
    """log p of the next token at positions prefill_len .. T-2 ([T - 1 - prefill_len, V]), exact mode.

    The forward call covers all T tokens (the last logits unused) so that latent hooks see every
    row, as a statistics pass over the same sequence does."""
    logits = model.forward(model.new_cache(), ids).logits[prefill_len:-1]
    return F.log_softmax(logits, dim=-1)


@torch.no_grad()
def deployed_logprobs(model: GoldenModel, ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
    """The same positions, decoded one token at a time so re-tier passes take effect."""
    cache = model.new_cache()
    model.prefill(cache, ids[:prefill_len])
    rows = [model.decode(cache, int(t)).logits for t in ids[prefill_len:-1]]
    return F.log_softmax(torch.cat(rows), dim=-1)


def score(logprobs: torch.Tensor, ids: torch.Tensor, prefill_len: int,
          reference: torch.Tensor | None = None) -> Score:
    """NLL of the targets ids[prefill_len+1:], and KL(reference || logprobs) when given."""
    targets = ids[prefill_len + 1:]
    nll = float(-logprobs.gather(1, targets.view(-1, 1)).sum())
    kl = 0.0
    if reference is not None:
        kl = float((reference.exp() * (reference - logprobs)).sum())
    return Score((nll,), (kl,), (int(targets.numel()),))


class Evaluator:
    """Scores configurations on fixed sequences; exact-mode log-probs and the prefills are computed once.

    Configurations are decoded together in lockstep (calibration/lockstep.py): every (sequence,
    configuration) pair is one row of a batch, at most `max_state_bytes` of decode state at a time,
    so memory does not grow with the number of configurations measured.
    """

    def __init__(self, weights: GoldenWeights, quant: KVQuantConfig, sequences: torch.Tensor,
                 protocol: Protocol, *, max_state_bytes: int = MAX_STATE_BYTES,
                 observer: LatentObserver | None = None, advance: Callable[[int], None] | None = None) -> None:
        """observer: also fed the exact pass's latent rows (stats.LatentObserver), so statistics
        over the same sequences need no forward pass of their own; advance(1) after each sequence's exact pass."""
        protocol.check(int(sequences.shape[1]))
        self.weights, self.quant, self.seqs, self.protocol = weights, quant, sequences, protocol
        self.params = replace(weights.cfg.gsm, quantization_adaptation_rate=protocol.adaptation_rate)
        exact = GoldenModel(weights, mode="exact", quant=quant)
        with torch.inference_mode():
            # [B, S, V]: every row is scored against its own sequence's exact distribution
            if observer is not None:
                observer.attach(exact)
            ref = []
            for row in sequences:
                if observer is not None:
                    observer.begin_sequence(row.tolist())
                ref.append(exact_logprobs(exact, row, protocol.prefill_len))
                if advance is not None:
                    advance(1)
            self.reference = torch.stack(ref)
            if observer is not None:
                observer.detach(exact)
        self._key_scales: dict[int, torch.Tensor] | None = None
        self._prefilled: list[Prefilled] | None = None
        self.exact = sum((score(lp, row, protocol.prefill_len) for lp, row in zip(self.reference, sequences)),
                         Score())
        self.rows_per_batch = max(1, max_state_bytes // bytes_per_row(weights, int(sequences.shape[1])))

    def use_int8_keys(self, scales: dict[int, torch.Tensor]) -> None:
        """Deployed configurations hold INT8 indexer keys of these scales (index_key_bits 8); each configuration's
        calibration must carry the same scales (scales.with_key_scales)."""
        self.quant = self.quant.replace(index_key_bits=8)
        self._key_scales, self._prefilled = dict(scales), None

    @property
    def prefilled(self) -> list[Prefilled]:
        """The sequences' deployed prefills (before any re-tier), made on first use: with INT8 keys they depend on
        the key scales, which calibration fits after this evaluator's exact pass."""
        if self._prefilled is None:
            calib = None
            if self._key_scales is not None:
                calib = replace(KVCalibration.data_free(self.weights), index_key_scales=self._key_scales)
            prefiller = GoldenModel(self.weights, mode="deployed", quant=self.quant, params=self.params,
                                    calibration=calib)
            with torch.inference_mode():
                self._prefilled = [prefill_sequence(prefiller, row[: self.protocol.prefill_len]) for row in self.seqs]
        return self._prefilled

    def deployed(self, calib: KVCalibration, fractions: Fractions) -> Score:
        return self.deployed_many([(calib, fractions)])[0]

    def decode_units(self, n_configs: int) -> int:
        """Lockstep decode steps deployed_many makes for n_configs configurations (its progress units): one per
        scored position and batch of rows."""
        batches = -(-n_configs * int(self.seqs.shape[0]) // self.rows_per_batch)
        return batches * (int(self.seqs.shape[1]) - 1 - self.protocol.prefill_len)

    def deployed_many(self, configs: list[tuple[KVCalibration, Fractions]],
                      advance: Callable[[int], None] | None = None) -> list[Score]:
        """One Score per configuration (per-sequence sums, sequences in order), decoded in lockstep; advance(1)
        after each decode step of a batch (decode_units: how many)."""
        cfgs = [Config(c, tuple(f)) for c, f in configs]
        B = int(self.seqs.shape[0])
        rows = [(b, c) for c in range(len(cfgs)) for b in range(B)]
        nll = torch.zeros(len(rows), dtype=torch.float64)
        kl = torch.zeros(len(rows), dtype=torch.float64)
        with torch.inference_mode():
            for a in range(0, len(rows), self.rows_per_batch):
                part = rows[a:a + self.rows_per_batch]
                nll[a:a + len(part)], kl[a:a + len(part)] = decode_scores(
                    self.weights, self.quant, self.params, self.seqs, self.prefilled, cfgs, self.reference, part,
                    advance)
        n_tok = int(self.seqs.shape[1]) - 1 - self.protocol.prefill_len
        return [Score(tuple(float(x) for x in nll[c * B:(c + 1) * B]), tuple(float(x) for x in kl[c * B:(c + 1) * B]),
                      (n_tok,) * B) for c in range(len(cfgs))]

    def relative_increase(self, s: Score, z: float = 0.0) -> float:
        """Relative perplexity increase over exact mode on the same tokens (upper bound when z > 0)."""
        return relative_increase(s, self.exact, z)
