"""The latent KV cache of one sequence and its tier policy (spec 5), simulated plainly.

Each owning layer keeps, per position, the latent rows c_k [r_k], c_v [r_v] *as the engine would
dequantise them* plus the integer codes of their current tier, and the indexer key e [dI]. The
tier, hotness and token id of a position are shared by all owning layers (hotness is summed over
them, so every layer would rank positions identically).

Decisions the spec leaves open (docs/decisions.md repeats them):
- hotness update, once per forward call: h <- decay * h + (1 - decay) * m, where m is the attention
  probability a position received in that call, summed over query heads, owning layers and the
  call's queries; a new position starts at h = 0 before the update;
- re-tier pass: eligible = positions outside the sinks and the last `fp16_window` positions whose
  token id is not in hot_token_ids; ranked by hotness, descending, ties to the lower position;
  counts per tier by gsm.tiers.tier_counts (FP16, INT12, INT8, then INT4 when tier_fractions has a
  fourth, non-zero share); a row's new tier is max(old, ranked) — demotion only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gsm.config import KVQuantConfig
from gsm.golden.quant import FP16, INT4, INT8, INT12, TIER_BYTES, dequantize, quantize, round_fp16
from gsm.golden.weights import KVCalibration
from gsm.tiers import tier_counts


@dataclass
class LayerCache:
    ck: torch.Tensor  # [n, r_k] values attention reads
    cv: torch.Tensor  # [n, r_v]
    keys: torch.Tensor  # [n, dI] indexer keys
    qk: torch.Tensor  # [n, r_k] int32 codes of the current tier (0 while FP16)
    qv: torch.Tensor  # [n, r_v]

    @classmethod
    def empty(cls, r_k: int, r_v: int, d_i: int) -> LayerCache:
        z = torch.zeros
        return cls(z(0, r_k), z(0, r_v), z(0, d_i), z(0, r_k, dtype=torch.int32),
                   z(0, r_v, dtype=torch.int32))


@dataclass
class SequenceCache:
    """Cache of one sequence: owning layer -> LayerCache, plus per-position tier and hotness."""

    deployed: bool
    layers: dict[int, LayerCache]
    tier: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int8))  # [n]
    hotness: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [n] float32
    tokens: list[int] = field(default_factory=list)
    decode_steps: int = 0
    # side caches of the golden's own diagnostics (dense K/V of sharing layers for KV noise)
    dense_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    key_bytes: int = 2  # bytes per indexer key channel: 2 FP16, 1 INT8 codes

    @property
    def length(self) -> int:
        return len(self.tokens)

    def append(self, layer: int, ck: torch.Tensor, cv: torch.Tensor, keys: torch.Tensor) -> None:
        """Write the rows of new positions; they enter FP16 (rounded in deployed mode)."""
        if self.deployed:
            ck, cv, keys = round_fp16(ck), round_fp16(cv), round_fp16(keys)
        c = self.layers[layer]
        c.ck = torch.cat([c.ck, ck])
        c.cv = torch.cat([c.cv, cv])
        c.keys = torch.cat([c.keys, keys])
        c.qk = torch.cat([c.qk, torch.zeros(ck.shape, dtype=torch.int32)])
        c.qv = torch.cat([c.qv, torch.zeros(cv.shape, dtype=torch.int32)])

    def add_positions(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        self.tokens.extend(token_ids)
        self.tier = torch.cat([self.tier, torch.full((n,), FP16, dtype=torch.int8)])
        self.hotness = torch.cat([self.hotness, torch.zeros(n)])

    def update_hotness(self, mass: torch.Tensor, decay: float) -> None:
        """mass: [n] attention received in this call (summed over heads, layers, queries)."""
        self.hotness = decay * self.hotness + (1.0 - decay) * mass.float()

    # -- tier policy -------------------------------------------------------------------------
    def ranked_tiers(self, quant: KVQuantConfig, sink_tokens: int) -> torch.Tensor:
        """Tier each position would get from its hotness rank alone (before demotion-only)."""
        n = self.length
        target = torch.full((n,), FP16, dtype=torch.int8)
        hot_ids = set(quant.hot_token_ids)
        eligible = [s for s in range(sink_tokens, max(sink_tokens, n - quant.fp16_window))
                    if self.tokens[s] not in hot_ids]
        if not eligible:
            return target
        pos = torch.tensor(eligible)
        order = torch.sort(self.hotness[pos], descending=True, stable=True).indices  # ties: lower s
        n16, n12, n8, _ = tier_counts(quant.tier_fractions, len(eligible))
        ranked = pos[order]
        target[ranked[n16:n16 + n12]] = INT12
        target[ranked[n16 + n12:n16 + n12 + n8]] = INT8
        target[ranked[n16 + n12 + n8:]] = INT4
        return target

    def retier(self, quant: KVQuantConfig, calib: KVCalibration, sink_tokens: int) -> int:
        """Demote rows to their ranked tier (never promote). Returns the number of rows demoted."""
        new = torch.maximum(self.tier, self.ranked_tiers(quant, sink_tokens))
        changed = (new != self.tier).nonzero().squeeze(1)
        for s in changed.tolist():
            for i, c in self.layers.items():
                for kv, vals, codes in (("k", c.ck, c.qk), ("v", c.cv, c.qv)):
                    sc = calib.scales[(i, kv)]
                    t = int(new[s])
                    if t == INT12:
                        codes[s] = quantize(vals[s], sc.scale_int12, INT12)
                        vals[s] = dequantize(codes[s], sc.scale_int12)
                    elif t == INT8:  # from the FP16 or the INT12-dequantised value
                        codes[s] = quantize(vals[s], sc.scale_int8, INT8)
                        vals[s] = dequantize(codes[s], sc.scale_int8, sc.comp_int8)
                    else:  # INT4, from whatever value the row holds
                        codes[s] = quantize(vals[s], sc.scale_int4, INT4)
                        vals[s] = dequantize(codes[s], sc.scale_int4, sc.comp_int4)
        self.tier = new
        return int(changed.numel())

    # -- accounting (spec 6) --------------------------------------------------------------------
    def bytes_used(self) -> float:
        """Bytes of the latent cache under the current tiers, plus the indexer keys (FP16 or INT8)."""
        total = 0.0
        for c in self.layers.values():
            r = c.ck.shape[1] + c.cv.shape[1]
            per_tier = torch.tensor([r * b for b in TIER_BYTES])
            total += float(per_tier[self.tier.long()].sum()) + self.length * c.keys.shape[1] * self.key_bytes
        return total
