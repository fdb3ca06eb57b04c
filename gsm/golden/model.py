"""The GSM golden model (spec 4–5): the reference every engine test compares against.

Plain, one sequence at a time, float32. Two modes:
- `exact`: no quantisation anywhere; latents and indexer keys kept in float32.
- `deployed`: the cache as engines hold it: new rows rounded to FP16, demotion to INT12/INT8 by the
  tier policy at the end of prefill and every `quantization_adaptation_rate` decode steps, with
  the rounding of gsm.golden.quant. Everything else (weights, activations, softmax) stays float32.

Order of one forward call over new tokens at positions n0..n0+T-1 (prefill, a prefill chunk, or a
decode step): per layer, write the new latent rows (owning layers), select, attend; after the last
layer, update hotness once; then, in deployed mode, re-tier when `prefill` ends or when the
decode step count reaches a multiple of `quantization_adaptation_rate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from gsm.config import GSMParams, KVQuantConfig, ModelConfig
from gsm.golden import attention as A
from gsm.golden.blocks import rms_norm, swiglu_mlp
from gsm.golden.cache import LayerCache, SequenceCache
from gsm.golden.quant import quantize_keys
from gsm.golden.selection import index_scores, select
from gsm.golden.weights import GoldenWeights, KVCalibration, OwningKV

Mode = Literal["exact", "deployed"]
# (owning layer, first new position, c_k rows [T, r_k], c_v rows [T, r_v]) as the cache stores them
LatentHook = Callable[[int, int, torch.Tensor, torch.Tensor], None]
# (owning layer, first new position, indexer keys [T, dI] float32, before any INT8 coding)
KeyHook = Callable[[int, int, torch.Tensor], None]
# (owning layer, query positions [T], index scores [T, n], the layer's selection params) before selection
ScoreHook = Callable[[int, torch.Tensor, torch.Tensor, GSMParams], None]


@dataclass
class Trace:
    """Diagnostics of one forward call (only filled when asked: they cost a dense attention)."""

    selected: dict[int, torch.Tensor] = field(default_factory=dict)  # owning layer -> [T, n] bool
    hit_rate: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T]
    kv_noise: dict[int, torch.Tensor] = field(default_factory=dict)  # sharing layer -> [T] KL
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [nH, T, n]
    cache_bytes: float = 0.0
    dense_fp16_bytes: float = 0.0


@dataclass
class StepResult:
    logits: torch.Tensor  # [T, V]
    trace: Trace | None = None


class GoldenModel:
    def __init__(self, weights: GoldenWeights, *, mode: Mode = "exact", quant: KVQuantConfig | None = None,
                 calibration: KVCalibration | None = None, params: GSMParams | None = None,
                 dense_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """params overrides gsm_config's selection numbers (run-time sparse_window, top_k, ...);
        dense_kv: sharing layer -> its original (Wk, Wv), to measure KV noise (spec 4.3)."""
        if mode not in ("exact", "deployed"):
            raise ValueError(f"mode must be 'exact' or 'deployed', got {mode!r}")
        self.w = weights
        self.cfg: ModelConfig = weights.cfg
        self.p: GSMParams = params or self.cfg.gsm
        if self.p.sparse_window > self.cfg.gsm.max_sparse_window:
            raise ValueError(f"sparse_window {self.p.sparse_window} exceeds the checkpoint's "
                             f"max_sparse_window {self.cfg.gsm.max_sparse_window}")
        self.mode = mode
        self.quant = quant or KVQuantConfig()
        self.calib = calibration or KVCalibration.data_free(weights)
        if self.key_scales is not None and not self.calib.keys_fitted(self.cfg):
            raise ValueError("kv_quantization.index_key_bits is 8 but the calibration has no index_key.scale_int8 "
                             "for every owning layer")
        self.dense_kv = dense_kv or {}
        # observers of new latent rows (calibration statistics, as TensorRT-LLM's forward hooks)
        self.latent_hooks: list[LatentHook] = []
        self.key_hooks: list[KeyHook] = []
        self.head_hooks: list[Callable[[torch.Tensor], None]] = []  # the LM head's input [T, H] (GPTQ's moment)
        self.score_hooks: list[ScoreHook] = []  # index scores of owning layers (the golden probe's selection gaps)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, mode: Mode = "exact", **kw) -> GoldenModel:
        from gsm import checkpoint

        cfg = checkpoint.load_config(path)
        weights = GoldenWeights.from_tensors(cfg, checkpoint.load_state_dict(path))
        calib_t = checkpoint.load_kv_calibration(path)
        calib = KVCalibration.from_tensors(cfg, calib_t) if calib_t is not None else None
        return cls(weights, mode=mode, quant=checkpoint.load_quant(path), calibration=calib, **kw)

    @property
    def key_scales(self) -> dict[int, torch.Tensor] | None:
        """INT8 indexer keys (decisions "INT8 indexer keys"): what deployed engines hold under `quant`; exact mode
        keeps float32 keys. None: FP16 keys."""
        return self.calib.index_key_scales if self.mode == "deployed" and self.quant.int8_keys else None

    # -- cache -----------------------------------------------------------------------------------
    def new_cache(self) -> SequenceCache:
        layers = {i: LayerCache.empty(*self.w.owning(i).ranks, self.cfg.gsm.indexer_dim)
                  for i in self.cfg.owning_layers}
        return SequenceCache(deployed=self.mode == "deployed", layers=layers,
                             key_bytes=1 if self.key_scales is not None else 2)

    # -- one forward call ------------------------------------------------------------------------
    def forward(self, cache: SequenceCache, ids: list[int] | torch.Tensor, *, trace: bool = False) -> StepResult:
        """Run new tokens `ids` [T] at positions cache.length.. ; returns logits [T, V]."""
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        cfg, T, n0 = self.cfg, ids.numel(), cache.length
        q_pos = torch.arange(n0, n0 + T)
        cache.add_positions(ids.tolist())
        n = cache.length
        tr = Trace() if trace else None
        mass = torch.zeros(n)
        sel_of: dict[int, torch.Tensor] = {}
        h = self.w.embed[ids]  # [T, H]
        for i, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)  # [T, H]
            q = A.queries(x, lw.q_proj, q_pos, cfg.num_attention_heads, cfg.rope_theta)  # [nH, T, D]
            if isinstance(lw.kv, OwningKV):
                kv = lw.kv
                ks = self.key_scales[i] if self.key_scales is not None else None
                keys = x @ kv.idx_k.T
                for key_hook in self.key_hooks:
                    key_hook(i, n0, keys)
                keys = keys if ks is None else quantize_keys(keys, ks)
                cache.append(i, (x @ kv.k_Vt.T) * kv.k_S, (x @ kv.v_Vt.T) * kv.v_S, keys)
                c = cache.layers[i]
                for hook in self.latent_hooks:
                    hook(i, n0, c.ck[n0:], c.cv[n0:])
                lp = self.p.for_layer(i)
                if lp.sparse_top_k > 0 or lp.sparse_top_k_divisor > 0:
                    scores = index_scores(x, kv.idx_q, kv.idx_w, c.keys, cfg.gsm.indexer_heads, ks)  # [T, n]
                else:  # a streaming layer (sinks + window): no indexer pick to score
                    scores = torch.zeros(T, n)
                sel_of[i] = select(scores, q_pos, lp)
                for score_hook in self.score_hooks:
                    score_hook(i, q_pos, scores, lp)
                k, v = A.reconstruct_owning(c.ck, c.cv, kv.k_U, kv.v_U, cfg.num_key_value_heads,
                                            cfg.rope_theta)
            else:
                src = cache.layers[lw.kv.source]
                sel_of[i] = sel_of[lw.kv.source]  # the mask is shared with the memory (spec 4.2)
                k, v = A.reconstruct_sharing(src.ck, src.cv, lw.kv.weight, lw.kv.bias,
                                             cfg.num_key_value_heads, cfg.rope_theta)
            probs = A.attention_probs(q, k, sel_of[i])  # [nH, T, n]
            if isinstance(lw.kv, OwningKV):
                mass += probs.sum(dim=(0, 1))
            if tr is not None:
                self._record(tr, cache, i, x, q, k, probs, sel_of[i], q_pos)
            h = h + A.attend(probs, v) @ lw.o_proj.T
            h = h + swiglu_mlp(rms_norm(h, lw.post_norm, cfg.rms_norm_eps), lw.gate_proj, lw.up_proj,
                               lw.down_proj)
        cache.update_hotness(mass, self.quant.hotness_decay)
        x = rms_norm(h, self.w.final_norm, cfg.rms_norm_eps)
        for head_hook in self.head_hooks:
            head_hook(x)
        logits = x @ self.w.lm_head.T  # [T, V]
        if tr is not None:
            tr.cache_bytes = cache.bytes_used()
            tr.dense_fp16_bytes = float(cfg.num_hidden_layers * 2 * cfg.kv_dim * 2 * n)
        return StepResult(logits, tr)

    def _record(self, tr: Trace, cache: SequenceCache, i: int, x: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, probs: torch.Tensor, sel: torch.Tensor, q_pos: torch.Tensor) -> None:
        if self.cfg.is_owning(i):
            tr.selected[i] = sel
        tr.probs[i] = probs
        tr.hit_rate[i] = A.mask_hit_rate(q, k, sel, q_pos)
        if i in self.dense_kv:  # KV noise: full causal attention with projected vs original K/V
            wk, wv = self.dense_kv[i]
            old_k, old_v = cache.dense_kv.get(i, (torch.zeros(0, wk.shape[0]), torch.zeros(0, wv.shape[0])))
            cache.dense_kv[i] = (torch.cat([old_k, x @ wk.T]), torch.cat([old_v, x @ wv.T]))
            dk = cache.dense_kv[i][0]
            n, nkv = dk.shape[0], self.cfg.num_key_value_heads
            k_dense = dk.view(n, nkv, -1).transpose(0, 1)
            cos, sin = A.rope_tables(torch.arange(n), k_dense.shape[-1], self.cfg.rope_theta)
            causal = A.causal_mask(q_pos, n)
            p_dense = A.attention_probs(q, A.apply_rope(k_dense, cos, sin), causal)
            p_proj = A.attention_probs(q, k, causal)
            tr.kv_noise[i] = A.kl_divergence(p_dense, p_proj).mean(0)  # [T]

    # -- phases ----------------------------------------------------------------------------------
    def prefill(self, cache: SequenceCache, ids: list[int] | torch.Tensor, *, trace: bool = False) -> StepResult:
        """Forward over the prompt (or its last chunk), then the end-of-prefill re-tier pass."""
        out = self.forward(cache, ids, trace=trace)
        self._maybe_retier(cache)
        return out

    def decode(self, cache: SequenceCache, token: int, *, trace: bool = False) -> StepResult:
        out = self.forward(cache, [int(token)], trace=trace)
        cache.decode_steps += 1
        if cache.decode_steps % self.p.quantization_adaptation_rate == 0:
            self._maybe_retier(cache)
        return out

    def _maybe_retier(self, cache: SequenceCache) -> None:
        if self.mode == "deployed":
            cache.retier(self.quant, self.calib, self.p.sink_tokens)

    # -- conveniences ----------------------------------------------------------------------------
    def greedy(self, prompt: list[int], n_new: int) -> list[int]:
        """Greedy continuation: prefill the prompt, then n_new decode steps; returns new tokens."""
        cache = self.new_cache()
        logits = self.prefill(cache, prompt).logits[-1]
        out: list[int] = []
        for _ in range(n_new):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if len(out) == n_new:
                break
            logits = self.decode(cache, tok).logits[-1]
        return out

    @torch.no_grad()
    def nll(self, ids: list[int] | torch.Tensor, *, prefill_len: int | None = None) -> float:
        """Mean next-token negative log-likelihood of `ids`, teacher forced.

        prefill_len=None scores everything in one prefill; otherwise the first prefill_len tokens
        are prefilled and the rest decoded one at a time, so deployed mode's tiers take effect.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        cache = self.new_cache()
        if prefill_len is None or prefill_len >= ids.numel() - 1:
            logits = self.forward(cache, ids[:-1]).logits
        else:
            parts = [self.prefill(cache, ids[:prefill_len]).logits]
            parts += [self.decode(cache, int(t)).logits for t in ids[prefill_len:-1]]
            logits = torch.cat(parts)
        return float(F.cross_entropy(logits, ids[1:]))
