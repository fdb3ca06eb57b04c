"""Many deployed-mode configurations decoded in lockstep: the golden model's decode step, batched.

Measuring tier fractions (measure.py) decodes the same teacher-forced tokens under several
configurations (scales x fractions) and sequences. The golden model runs one sequence at a time,
so each decode step is a matrix-vector product per weight: on a real model (SmolLM2-135M, 30
layers, vocabulary 49,152) streaming ~0.5 GB of float32 weights per token dominates, and the
measurement took most of calibration's 703 s. Here every (sequence, configuration) pair is one row
of a batch: all rows have the same length at every step (teacher forcing), so one matrix product
per weight serves them all.

It is the golden model's algorithm step for step (gsm/golden/model.py, cache.py, selection.py,
attention.py), reusing its functions where they broadcast (rms_norm, swiglu_mlp, select, rope,
quantize/dequantize):
- the prefill is the golden model's own forward call per sequence (its cache does not depend on
  scales or fractions before the end-of-prefill re-tier), copied into each configuration's rows;
- new latent rows enter FP16; hotness decay and update once per step; re-tier at the end of
  prefill and every `adaptation_rate` decode steps, demotion only, ranks by hotness with ties to
  the lower position, the same counts (gsm.tiers.tier_counts); INT12, INT8 and INT4 rounding through gsm.golden.quant
  (elementwise, so bit for bit the golden's);
- K/V reconstructed from the latents are kept between steps (RoPE'd) and recomputed only when a
  re-tier pass changes latent values: the golden model recomputes them for every position at every
  step, an O(n) cost per step that does not change any value.

Not bit-identical to the golden model: batched matrix products sum in another order than the
golden's matrix-vector products (differences ~1e-6 relative), which can flip an exact near-tie of
the indexer's top-k or of hotness ranks. tests/test_calibration_speed.py bounds the difference per
configuration against GoldenModel.decode (NLL and KL sums).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gsm.config import GSMParams, KVQuantConfig
from gsm.golden.blocks import rms_norm, swiglu_mlp
from gsm.golden.model import GoldenModel
from gsm.golden.quant import FP16, INT4, INT8, INT12, dequantize, quantize, quantize_keys, round_fp16
from gsm.golden.rope import apply_rope, rope_tables
from gsm.golden.selection import select
from gsm.golden.weights import GoldenWeights, KVCalibration, OwningKV
from gsm.tiers import tier_counts

Fractions = tuple[float, ...]  # FP16, INT12, INT8 (, INT4)


SCALE_FIELDS = ("scale_int8", "scale_int12", "comp_int8", "scale_int4", "comp_int4")


@dataclass(frozen=True)
class Config:
    """One deployed configuration: per-channel scales and tier fractions."""

    calib: KVCalibration
    fractions: Fractions


@dataclass
class Prefilled:
    """One sequence after the golden model's deployed-mode prefill forward (before any re-tier)."""

    latents: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # owning layer -> ck, cv, keys
    hotness: torch.Tensor  # [prefill_len]


def prefill_sequence(model: GoldenModel, ids: torch.Tensor) -> Prefilled:
    """The golden forward over the prompt, without the re-tier pass (it depends on the configuration)."""
    cache = model.new_cache()
    model.forward(cache, ids)
    return Prefilled({i: (c.ck.clone(), c.cv.clone(), c.keys.clone()) for i, c in cache.layers.items()},
                     cache.hotness.clone())


def bytes_per_row(weights: GoldenWeights, seq_len: int) -> int:
    """Memory of one row's state (latents, indexer keys, kept K/V of every layer), float32."""
    cfg = weights.cfg
    latent = sum(rk + rv + cfg.gsm.indexer_dim for rk, rv in weights.ranks.values())
    kv = cfg.num_hidden_layers * 2 * cfg.kv_dim
    return 4 * seq_len * (latent + kv) + 4 * cfg.vocab_size * 4  # + a few [V] rows of logits per step


class Lockstep:
    """State of R rows: row r is sequence seq_of[r] under configs[cfg_of[r]]."""

    def __init__(self, weights: GoldenWeights, quant: KVQuantConfig, params: GSMParams, seqs: torch.Tensor,
                 prefilled: Sequence[Prefilled], configs: Sequence[Config], rows: list[tuple[int, int]]) -> None:
        self.w, self.cfg, self.quant, self.p = weights, weights.cfg, quant, params
        seq_of = torch.tensor([b for b, _ in rows])
        self.rows = rows
        self.R, self.T = len(rows), int(seqs.shape[1])
        self.tokens = seqs[seq_of]  # [R, T]
        hot = torch.zeros_like(self.tokens, dtype=torch.bool)
        for t in quant.hot_token_ids:
            hot |= self.tokens == t
        self.hot_token = hot
        self.fracs = [configs[c].fractions for _, c in rows]
        n0 = int(prefilled[0].hotness.numel())
        self.n = n0
        self.decode_steps = 0
        D = self.cfg.head_dim
        self.cos, self.sin = rope_tables(torch.arange(self.T), D, self.cfg.rope_theta)  # [T, D]
        # per owning layer: latent buffers [R, T, r] (values attention reads) and indexer keys
        self.ck: dict[int, torch.Tensor] = {}
        self.cv: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.scales: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        # INT8 indexer keys: one [dI] scale per owning layer (None: FP16 keys), the same in every configuration,
        # since the prefills (per sequence) already hold the codes
        self.key_scale: dict[int, torch.Tensor] | None = None
        if quant.int8_keys:
            self.key_scale = {i: configs[0].calib.index_key_scales[i].float() for i in self.cfg.owning_layers}
            if any(not torch.equal(configs[c].calib.index_key_scales[i].float(), s)
                   for _, c in rows for i, s in self.key_scale.items()):
                raise ValueError("lockstep configurations must share their INT8 indexer-key scales (the prefills "
                                 "hold the keys' codes)")
        for i in self.cfg.owning_layers:
            rk, rv = weights.owning(i).ranks
            self.ck[i] = torch.zeros(self.R, self.T, rk)
            self.cv[i] = torch.zeros(self.R, self.T, rv)
            self.keys[i] = torch.zeros(self.R, self.T, self.cfg.gsm.indexer_dim)
            for r, (b, _) in enumerate(rows):
                ck, cv, keys = prefilled[b].latents[i]
                self.ck[i][r, :n0], self.cv[i][r, :n0], self.keys[i][r, :n0] = ck, cv, keys
            for kv in ("k", "v"):
                sc = [configs[c].calib.scales[(i, kv)] for _, c in rows]
                self.scales[(i, kv)] = tuple(torch.stack([getattr(s, a).float() for s in sc])[:, None, :]
                                             for a in SCALE_FIELDS)
        self.tier = torch.full((self.R, self.T), FP16, dtype=torch.int8)
        self.hotness = torch.zeros(self.R, self.T)
        for r, (b, _) in enumerate(rows):
            self.hotness[r, :n0] = prefilled[b].hotness
        nkv = self.cfg.num_key_value_heads
        self.K = torch.zeros(self.cfg.num_hidden_layers, self.R, nkv, self.T, D)  # RoPE'd keys
        self.V = torch.zeros(self.cfg.num_hidden_layers, self.R, nkv, self.T, D)

    # -- K/V kept between steps --------------------------------------------------------------------
    def _reconstruct(self, i: int, a: int, b: int) -> None:
        """K/V of layer i at positions a..b-1 from the latents it reads (golden attention.reconstruct_*)."""
        lw, R, nkv = self.w.layers[i], self.R, self.cfg.num_key_value_heads
        if isinstance(lw.kv, OwningKV):
            k = self.ck[i][:, a:b] @ lw.kv.k_U.T  # [R, m, kvD]
            v = self.cv[i][:, a:b] @ lw.kv.v_U.T
        else:
            s = lw.kv.source
            kv = torch.cat([self.ck[s][:, a:b], self.cv[s][:, a:b]], dim=2) @ lw.kv.weight.T + lw.kv.bias
            k, v = kv.chunk(2, dim=2)
        m = b - a
        k = k.reshape(R, m, nkv, -1).transpose(1, 2)  # [R, nKV, m, D]
        self.K[i, :, :, a:b] = apply_rope(k, self.cos[a:b], self.sin[a:b])
        self.V[i, :, :, a:b] = v.reshape(R, m, nkv, -1).transpose(1, 2)

    def reconstruct_all(self) -> None:
        for i in range(self.cfg.num_hidden_layers):
            self._reconstruct(i, 0, self.n)

    # -- tier policy (golden cache.ranked_tiers / retier, one row per configuration) ---------------------
    def retier(self) -> int:
        n, R = self.n, self.R
        s = torch.arange(n)
        eligible = (s[None, :] >= self.p.sink_tokens) & (s[None, :] < n - self.quant.fp16_window) \
            & ~self.hot_token[:, :n]
        hot = self.hotness[:, :n].masked_fill(~eligible, float("-inf"))
        # stable descending sort: eligible positions (hotness >= 0) first, ties to the lower position
        order = torch.sort(hot, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n).expand(R, n))
        counts = eligible.sum(1).tolist()
        # first rank of each narrower tier: n16, n16 + n12, n16 + n12 + n8 (gsm.tiers.tier_counts)
        bounds = torch.tensor([list(itertools.accumulate(tier_counts(f, N)[:3])) for f, N in zip(self.fracs, counts)])
        target = torch.full((R, n), FP16, dtype=torch.int8)
        for tier, b in zip((INT12, INT8, INT4), bounds.T):
            target[eligible & (rank >= b[:, None])] = tier
        old = self.tier[:, :n]
        new = torch.maximum(old, target)
        changed = int((new != old).sum())
        if changed:
            to = {t: ((new != old) & (new == t))[..., None] for t in (INT12, INT8, INT4)}
            to = {t: m for t, m in to.items() if bool(m.any())}  # a tier no row enters costs nothing
            for i in self.cfg.owning_layers:
                for kv, buf in (("k", self.ck[i]), ("v", self.cv[i])):
                    s8, s12, comp, s4, comp4 = self.scales[(i, kv)]
                    rule = {INT12: (s12, None), INT8: (s8, comp), INT4: (s4, comp4)}  # scale, compensation
                    vals = buf[:, :n]
                    out = vals
                    for t, m in to.items():  # every source value is the held one (demotion re-quantises it)
                        s, c = rule[t]
                        out = torch.where(m, dequantize(quantize(vals, s, t), s, c), out)
                    buf[:, :n] = out
            self.tier[:, :n] = new
            self.reconstruct_all()
        return changed

    # -- one decode step -----------------------------------------------------------------------------
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token: [R] ids at position n for every row -> logits [R, V]; then the periodic re-tier."""
        cfg, w, R, t = self.cfg, self.w, self.R, self.n
        self.n = n = t + 1
        nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = nh // nkv
        q_pos = torch.full((R,), t, dtype=torch.long)
        mass = torch.zeros(R, n)
        sel_of: dict[int, torch.Tensor] = {}
        h = w.embed[token]  # [R, H]
        for i, lw in enumerate(w.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            q = apply_rope((x @ lw.q_proj.T).view(R, nh, D), self.cos[t], self.sin[t])  # [R, nH, D]
            if isinstance(lw.kv, OwningKV):
                kv = lw.kv
                self.ck[i][:, t] = round_fp16((x @ kv.k_Vt.T) * kv.k_S)
                self.cv[i][:, t] = round_fp16((x @ kv.v_Vt.T) * kv.v_S)
                if self.key_scale is None:
                    self.keys[i][:, t] = round_fp16(x @ kv.idx_k.T)
                else:
                    self.keys[i][:, t] = quantize_keys(x @ kv.idx_k.T, self.key_scale[i])
                sel_of[i] = select(self._index_scores(i, x, kv, self.keys[i][:, :n]), q_pos, self.p.for_layer(i))
            else:
                sel_of[i] = sel_of[lw.kv.source]
            self._reconstruct(i, t, n)
            logits = (q.view(R, nkv, g, D) @ self.K[i, :, :, :n].transpose(-1, -2)) / math.sqrt(D)  # [R, nKV, g, n]
            probs = torch.softmax(logits.masked_fill(~sel_of[i][:, None, None, :], float("-inf")), dim=-1)
            if isinstance(lw.kv, OwningKV):
                mass += probs.sum(dim=(1, 2))
            out = (probs @ self.V[i, :, :, :n]).reshape(R, nh * D)  # head h = kv * g + j, as repeat_interleave
            h = h + out @ lw.o_proj.T
            h = h + swiglu_mlp(rms_norm(h, lw.post_norm, cfg.rms_norm_eps), lw.gate_proj, lw.up_proj, lw.down_proj)
        decay = self.quant.hotness_decay
        self.hotness[:, :n] = decay * self.hotness[:, :n] + (1.0 - decay) * mass
        logits = rms_norm(h, w.final_norm, cfg.rms_norm_eps) @ w.lm_head.T
        self.decode_steps += 1
        if self.decode_steps % self.p.quantization_adaptation_rate == 0:
            self.retier()
        return logits

    def _index_scores(self, i: int, x: torch.Tensor, kv: OwningKV, keys: torch.Tensor) -> torch.Tensor:
        """golden selection.index_scores with one key set per row: keys [R, n, dI] -> [R, n]."""
        i_heads, d_i = self.cfg.gsm.indexer_heads, self.cfg.gsm.indexer_dim
        q = (x @ kv.idx_q.T).view(self.R, i_heads, d_i)
        if self.key_scale is not None:
            q = q * self.key_scale[i]
        wts = x @ kv.idx_w.T  # [R, nI]
        dots = torch.relu(q @ keys.transpose(1, 2))  # [R, nI, n]
        return (wts[:, None, :] @ dots).squeeze(1) / math.sqrt(d_i)


def decode_scores(weights: GoldenWeights, quant: KVQuantConfig, params: GSMParams, seqs: torch.Tensor,
                  prefilled: Sequence[Prefilled], configs: Sequence[Config], reference: torch.Tensor,
                  rows: list[tuple[int, int]], advance: Callable[[int], None] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced decode of `rows` (sequence, config); sums over steps of NLL and KL(ref || deployed).

    reference: [B, S, V] exact-mode log-probs of the S = T - 1 - prefill_len scored positions.
    Returns float64 [R] NLL sums and [R] KL sums. `advance(1)` after each decode step (of all rows).
    """
    ls = Lockstep(weights, quant, params, seqs, prefilled, configs, rows)
    if not ls.retier():  # end of prefill; a pass that changes nothing leaves K/V to build here
        ls.reconstruct_all()
    seq_of = torch.tensor([b for b, _ in rows])
    p0 = ls.n
    nll = torch.zeros(ls.R, dtype=torch.float64)
    kl = torch.zeros(ls.R, dtype=torch.float64)
    for s in range(ls.T - 1 - p0):
        logits = ls.step(ls.tokens[:, p0 + s])
        lp = F.log_softmax(logits, dim=-1)
        target = ls.tokens[:, p0 + s + 1]
        nll -= lp.gather(1, target[:, None]).squeeze(1).double()
        ref = reference[seq_of, s]
        kl += (ref.exp() * (ref - lp)).sum(1).double()
        if advance is not None:
            advance(1)
    return nll, kl
