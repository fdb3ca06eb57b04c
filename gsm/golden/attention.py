"""Attention blocks of spec 4: K/V reconstruction from latents, GQA softmax over Sel(t), signals."""

from __future__ import annotations

import math

import torch

from gsm.golden.rope import apply_rope, rope_tables


def reconstruct_owning(ck: torch.Tensor, cv: torch.Tensor, k_U: torch.Tensor, v_U: torch.Tensor,
                       n_kv: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached latents [n, r] -> K, V [nKV, n, D]; RoPE after reconstruction (Palu's choice)."""
    n = ck.shape[0]
    k = (ck @ k_U.T).view(n, n_kv, -1).transpose(0, 1)  # [nKV, n, D]
    v = (cv @ v_U.T).view(n, n_kv, -1).transpose(0, 1)  # [nKV, n, D]
    cos, sin = rope_tables(torch.arange(n), k.shape[-1], theta)  # [n, D]
    return apply_rope(k, cos, sin), v


def reconstruct_sharing(ck: torch.Tensor, cv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        n_kv: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Source-layer latents [n, r_k], [n, r_v] -> [Kpre; V] = W [c_k; c_v] + b -> K, V [nKV, n, D]."""
    n = ck.shape[0]
    kv = torch.cat([ck, cv], dim=1) @ weight.T + bias  # [n, 2*kvD]
    k_pre, v = kv.chunk(2, dim=1)  # [n, kvD] each
    k = k_pre.reshape(n, n_kv, -1).transpose(0, 1)  # [nKV, n, D]
    v = v.reshape(n, n_kv, -1).transpose(0, 1)
    cos, sin = rope_tables(torch.arange(n), k.shape[-1], theta)
    return apply_rope(k, cos, sin), v


def queries(x: torch.Tensor, q_proj: torch.Tensor, q_pos: torch.Tensor, n_heads: int,
            theta: float) -> torch.Tensor:
    """x: [T, H] -> RoPE'd queries [nH, T, D]."""
    T = x.shape[0]
    q = (x @ q_proj.T).view(T, n_heads, -1).transpose(0, 1)  # [nH, T, D]
    cos, sin = rope_tables(q_pos, q.shape[-1], theta)  # [T, D]
    return apply_rope(q, cos, sin)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [nH, T, D], k: [nKV, n, D], mask: [T, n] bool -> softmax probabilities [nH, T, n]."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [nH, n, D]: query head h reads key head h // group
    logits = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # [nH, T, n]
    logits = logits.masked_fill(~mask[None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def attend(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs: [nH, T, n], v: [nKV, n, D] -> head outputs concatenated [T, nH*D]."""
    group = probs.shape[0] // v.shape[0]
    out = probs @ v.repeat_interleave(group, dim=0)  # [nH, T, D]
    return out.transpose(0, 1).reshape(probs.shape[1], -1)


def causal_mask(q_pos: torch.Tensor, n: int) -> torch.Tensor:
    """[T, n] bool: query at q_pos[t] may see positions <= q_pos[t]."""
    return torch.arange(n)[None, :] <= q_pos[:, None]


def mask_hit_rate(q: torch.Tensor, k: torch.Tensor, sel: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Spec 4.3: dense softmax mass of Sel(t) under the layer's full causal attention, mean over heads -> [T]."""
    dense = attention_probs(q, k, causal_mask(q_pos, k.shape[1]))  # [nH, T, n]
    return (dense * sel[None]).sum(-1).mean(0)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, zero-probability terms of p contribute nothing."""
    ratio = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - torch.log(q.clamp_min(1e-30))),
                        torch.zeros_like(p))
    return ratio.sum(-1)
