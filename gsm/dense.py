"""Plain dense LLaMA forward in PyTorch: the reference the converter measures GSM against.

The converter needs each layer's attention input, q/k/v and attention probabilities on calibration
text, and the quality report needs dense perplexity and greedy text. One small, readable forward
built from the same RoPE / RMSNorm / SwiGLU blocks as the GSM golden model gives all of that and is
checked against transformers' LlamaForCausalLM in tests/test_dense.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gsm import names
from gsm.config import ModelConfig
from gsm.golden.blocks import rms_norm, swiglu_mlp
from gsm.golden.rope import apply_rope, rope_tables
from gsm.sources import DenseSource


@dataclass
class LayerCapture:
    """One layer's activations; shapes for ids [B, T]."""

    x: torch.Tensor  # normalised attention input: [B, T, H]
    q: torch.Tensor  # q projection, before RoPE: [B, T, nH*D]
    k: torch.Tensor  # k projection, before RoPE: [B, T, kvD]
    v: torch.Tensor  # v projection: [B, T, kvD]
    probs: torch.Tensor | None  # causal attention probabilities [B, nH, T, T] when asked for


@dataclass
class DenseCapture:
    layers: list[LayerCapture]


class DenseLlama:
    """Dense LLaMA with float32 weights from a `DenseSource` (HF names and RoPE layout)."""

    def __init__(self, source: DenseSource) -> None:
        self.config: ModelConfig = source.config
        self.origin = source.origin
        self.w = {name: source.get(name) for name in source.names}
        self.lm_head = self.w[names.EMBED] if self.config.tie_word_embeddings else self.w[names.LM_HEAD]

    def _layer(self, key: str, i: int) -> torch.Tensor:
        return self.w[names.layer_name(key, i)]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, capture: bool = False, capture_probs: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, DenseCapture]:
        """ids [B, T] (int64) -> logits [B, T, V]; with `capture`, also the per-layer activations.

        `capture_probs` adds each layer's [B, nH, T, T] attention probabilities to the capture (they
        are computed anyway; keeping them for every layer is what costs memory).
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
        logits, layers = self.run_cached(ids, None, capture, capture_probs)
        return (logits, DenseCapture(layers)) if capture else logits

    __call__ = forward

    def run_cached(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
                   capture: bool = False, capture_probs: bool = False
                   ) -> tuple[torch.Tensor, list[LayerCapture]]:
        """The forward pass over ids [B, T] after the positions `kv` holds: per-layer RoPE'd K and V
        [B, nKV, S, D] of the S positions before `ids`, extended in place (greedy decoding, chunked
        passes over long calibration windows); None for a pass over the whole sequence."""
        cfg = self.config
        B, T = ids.shape
        start = kv[0][0].shape[2] if kv else 0
        if start + T > cfg.max_position_embeddings:
            raise ValueError(f"{start + T} positions exceed max_position_embeddings "
                             f"{cfg.max_position_embeddings} of {self.origin}")
        nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pos = torch.arange(start, start + T)  # [T]
        cos, sin = rope_tables(pos, D, cfg.rope_theta)  # [T, D]
        causal = torch.arange(start + T)[None, :] <= pos[:, None]  # [T, S+T], key s <= query t
        h = self.w[names.EMBED][ids]  # [B, T, H]
        layers: list[LayerCapture] = []
        for i in range(cfg.num_hidden_layers):
            x = rms_norm(h, self._layer("input_norm", i), cfg.rms_norm_eps)  # [B, T, H]
            q = F.linear(x, self._layer("q_proj", i))  # [B, T, nH*D]
            k = F.linear(x, self._layer("k_proj", i))  # [B, T, kvD]
            v = F.linear(x, self._layer("v_proj", i))  # [B, T, kvD]
            qh = apply_rope(q.view(B, T, nH, D).transpose(1, 2), cos, sin)  # [B, nH, T, D]
            kh = apply_rope(k.view(B, T, nKV, D).transpose(1, 2), cos, sin)  # [B, nKV, T, D]
            vh = v.view(B, T, nKV, D).transpose(1, 2)  # [B, nKV, T, D]
            if kv is not None:
                if i < len(kv):
                    kh = torch.cat([kv[i][0], kh], dim=2)  # [B, nKV, S+T, D]
                    vh = torch.cat([kv[i][1], vh], dim=2)
                    kv[i] = (kh, vh)
                else:
                    kv.append((kh, vh))
            # GQA: query head j reads key head j // group, as HF's repeat_kv
            kh = kh.repeat_interleave(cfg.gqa_group, dim=1)  # [B, nH, S+T, D]
            vh = vh.repeat_interleave(cfg.gqa_group, dim=1)  # [B, nH, S+T, D]
            scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)  # [B, nH, T, S+T]
            probs = self.attention_probs(scores, causal, pos)  # [B, nH, T, S+T]
            o = (probs @ vh).transpose(1, 2).reshape(B, T, nH * D)  # [B, T, nH*D]
            h = h + F.linear(o, self._layer("o_proj", i))
            xm = rms_norm(h, self._layer("post_norm", i), cfg.rms_norm_eps)  # [B, T, H]
            h = h + swiglu_mlp(xm, self._layer("gate_proj", i), self._layer("up_proj", i),
                               self._layer("down_proj", i))
            if capture:
                layers.append(LayerCapture(x, q, k, v, probs if capture_probs else None))
        logits = F.linear(rms_norm(h, self.w[names.FINAL_NORM], cfg.rms_norm_eps), self.lm_head)
        return logits, layers  # logits: [B, T, V]

    def attention_probs(self, scores: torch.Tensor, causal: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Attention probabilities [B, nH, T, S] from scores [B, nH, T, S], the causal mask [T, S] and the queries'
        positions [T]: the softmax over every causal key. A model that attends to fewer rows overrides this
        (bench/oracle_selection.py)."""
        return scores.masked_fill(~causal, float("-inf")).softmax(-1)

    @torch.no_grad()
    def greedy(self, ids: Sequence[int] | torch.Tensor, n: int, *, stop_at_eos: bool = False) -> list[int]:
        """The `n` tokens greedy decoding appends to prompt `ids` (the prompt is not returned).

        Uses a K/V cache, so logits can differ from a whole-sequence `forward` by float32 rounding.
        The prompt plus `n` must fit in max_position_embeddings.
        """
        seq = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if not seq:
            raise ValueError("greedy needs a non-empty prompt (start with BOS)")
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits, _ = self.run_cached(torch.tensor([seq]), kv)
        out: list[int] = []
        for step in range(n):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if step == n - 1 or (stop_at_eos and nxt == self.config.eos_token_id):
                break
            logits, _ = self.run_cached(torch.tensor([[nxt]]), kv)
        return out

    @torch.no_grad()
    def nll(self, ids: torch.Tensor) -> float:
        """Mean next-token negative log-likelihood (nats) of ids [T] or [B, T] (T >= 2)."""
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        if ids.shape[1] < 2:
            raise ValueError("nll needs at least two positions")
        logits = self.forward(ids)  # [B, T, V]
        return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                     ids[:, 1:].reshape(-1)))
