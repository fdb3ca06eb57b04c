"""GSM model for `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`: exact mode.

This file is copied into every GSM checkpoint directory (gsm.remote_code) and run by transformers
from its module cache, where the `gsm` package may not be installed: it imports only torch,
transformers and its sibling configuration_gsm. It is the reference path of the published GSM
description, not a fast one, and it computes what the golden model's `exact` mode computes
(spec section 4 of GSM_SPEC.md, float32, no quantisation):

- owning layer: latents c_k = (x Vt_k^T) * S_k, c_v = (x Vt_v^T) * S_v; K = RoPE(c_k U_k^T), V = c_v U_v^T
  (RoPE after reconstruction); lightning-indexer scores select sinks + window + top-k positions
  (ties to the lower position; dense when t + 1 <= sinks + window + top_k);
- sharing layer: [Kpre; V] = kv_projector([c_k; c_v] of its source layer), K = RoPE(Kpre), and the
  source layer's selection.

No transformers cache object (its API moved across 4.x/5.x): a plain forward computes the whole
sequence; inside `generate` the model keeps the previous step's latents per batch row (gsm_memo)
and computes only the new position when the ids extend the previous ones, as the golden model's
decode step does. Operations follow the golden model's shapes and order, so logits agree bit for
bit on the same machine (docs/remote_code.md).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_gsm import GSMConfig

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RANK_TENSOR = "model.layers.{i}.self_attn.{kv}_svd_S.weight"
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


# -- math: the golden model's formulas and operation order, one sequence at a time --------------
# Same shapes as gsm/golden (2-D per sequence), so the floats match bit for bit: the indexer's
# top-k meets exact ties (a repeated token has the same layer-0 indexer key) that any rounding
# difference would break differently from the golden model.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] in the HF rotate-half layout; angles in float64, rounded once to float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n, heads*D] -> [heads, n, D]."""
    return x.reshape(x.shape[0], n_heads, -1).transpose(0, 1)


def index_scores(x: torch.Tensor, idx_q: torch.Tensor, idx_w: torch.Tensor, keys: torch.Tensor,
                 n_heads: int) -> torch.Tensor:
    """I(t, s) = sum_j w_j ReLU(q_j . e_s) / sqrt(dI): x [T, H], keys [n, dI] -> [T, n]."""
    T, dI = x.shape[0], keys.shape[1]
    q = (x @ idx_q.T).view(T, n_heads, dI)
    w = x @ idx_w.T  # [T, nI]
    dots = torch.relu(torch.einsum("tjd,sd->tjs", q, keys))
    return torch.einsum("tj,tjs->ts", w, dots) / math.sqrt(dI)


def select(scores: torch.Tensor, n0: int, sinks: int, window: int, top_k: int, divisor: int = 0) -> torch.Tensor:
    """Sel [T, n] bool for queries at positions n0..n0+T-1 over positions 0..n-1 (spec 4.1); divisor > 0: the
    query at t picks max(top_k, (t + 1) // divisor) (a budget growing with the context)."""
    T, n = scores.shape
    s = torch.arange(n, device=scores.device)
    t = torch.arange(n0, n0 + T, device=scores.device)
    causal = s[None, :] <= t[:, None]
    fixed = causal & ((s[None, :] < sinks) | (s[None, :] > t[:, None] - window))
    cand = causal & ~fixed
    mask = fixed.clone()
    k_t = torch.clamp((t + 1) // divisor, min=top_k) if divisor > 0 else torch.full_like(t, top_k)  # [T]
    k = min(int(k_t.max()) if T else 0, n)
    if k > 0:
        # stable descending sort: equal scores keep the lower position first (spec tie rule)
        order = torch.sort(scores.masked_fill(~cand, float("-inf")), dim=-1, descending=True,
                           stable=True).indices[:, :k]
        keep = torch.arange(k, device=scores.device)[None, :] < k_t[:, None]
        mask |= torch.zeros_like(mask).scatter_(1, order, keep) & cand
    dense_rows = t + 1 <= sinks + window + k_t
    mask[dense_rows] = causal[dense_rows]
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [nH, T, D], k/v [nKV, n, D], mask [T, n] -> head outputs concatenated [T, nH*D]."""
    group = q.shape[0] // k.shape[0]
    logits = (q @ k.repeat_interleave(group, dim=0).transpose(1, 2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(logits.masked_fill(~mask[None], float("-inf")), dim=-1)
    out = probs @ v.repeat_interleave(group, dim=0)  # [nH, T, D]
    return out.transpose(0, 1).reshape(probs.shape[1], -1)


# -- modules: parameter names are the checkpoint's tensor names (spec section 3) ------------------

class GSMVector(nn.Module):
    """A module holding one 1-D `weight` (RMSNorm gains, singular values S)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class GSMIndexer(nn.Module):
    """`self_attn.sparse_mask_generator`: the lightning indexer of an owning layer."""

    def __init__(self, config: GSMConfig) -> None:
        super().__init__()
        H, nI, dI = config.hidden_size, config.gsm("indexer_heads"), config.gsm("indexer_dim")
        self.q_proj = nn.Linear(H, nI * dI, bias=False)
        self.k_proj = nn.Linear(H, dI, bias=False)
        self.w_proj = nn.Linear(H, nI, bias=False)


class GSMAttention(nn.Module):
    def __init__(self, config: GSMConfig, layer: int) -> None:
        super().__init__()
        H, kvd = config.hidden_size, config.kv_dim
        self.layer = layer
        self.source = config.kv_sharing.get(layer)  # None: the layer owns its KV cache
        self.q_proj = nn.Linear(H, config.num_attention_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, H, bias=False)
        if self.source is None:
            rk, rv = config.ranks_of(layer)
            self.k_svd_U = nn.Linear(rk, kvd, bias=False)  # weight [kvD, r_k]
            self.k_svd_S = GSMVector(rk)
            self.k_svd_Vt = nn.Linear(H, rk, bias=False)  # weight [r_k, H]
            self.v_svd_U = nn.Linear(rv, kvd, bias=False)
            self.v_svd_S = GSMVector(rv)
            self.v_svd_Vt = nn.Linear(H, rv, bias=False)
            self.sparse_mask_generator = GSMIndexer(config)
        else:
            rk, rv = config.ranks_of(self.source)
            self.kv_projector = nn.Linear(rk + rv, 2 * kvd, bias=True)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Owning layer: c_k [T, r_k], c_v [T, r_v], indexer keys e [T, dI] of x [T, H]."""
        w = lambda m: m.weight.float()  # noqa: E731
        ck = (x @ w(self.k_svd_Vt).T) * w(self.k_svd_S)
        cv = (x @ w(self.v_svd_Vt).T) * w(self.v_svd_S)
        return ck, cv, x @ w(self.sparse_mask_generator.k_proj).T

    def key_values(self, ck: torch.Tensor, cv: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [n, r] of the owning layer (this one or the source) -> K before RoPE, V: [nKV, n, D]."""
        if self.source is None:
            k = ck @ self.k_svd_U.weight.float().T
            v = cv @ self.v_svd_U.weight.float().T
        else:
            kv = torch.cat([ck, cv], dim=1) @ self.kv_projector.weight.float().T + self.kv_projector.bias.float()
            k, v = kv.chunk(2, dim=1)
        return heads(k, n_kv), heads(v, n_kv)


class GSMMLP(nn.Module):
    def __init__(self, config: GSMConfig) -> None:
        super().__init__()
        H, Im = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, Im, bias=False)
        self.up_proj = nn.Linear(H, Im, bias=False)
        self.down_proj = nn.Linear(Im, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = lambda m: m.weight.float()  # noqa: E731
        return F.linear(F.silu(F.linear(x, w(self.gate_proj))) * F.linear(x, w(self.up_proj)), w(self.down_proj))


class GSMDecoderLayer(nn.Module):
    def __init__(self, config: GSMConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = GSMVector(config.hidden_size)
        self.self_attn = GSMAttention(config, layer)
        self.post_attention_layernorm = GSMVector(config.hidden_size)
        self.mlp = GSMMLP(config)


class GSMPreTrainedModel(PreTrainedModel):
    config_class = GSMConfig
    base_model_prefix = "model"
    _no_split_modules = ["GSMDecoderLayer"]
    # dense K/V of owning layers may ride along in a checkpoint (spec 3); GSM attention ignores them
    _keys_to_ignore_on_load_unexpected = [r"self_attn\.[kv]_proj\.weight$"]

    def _init_weights(self, module: nn.Module) -> None:
        # only modules the checkpoint did not fill (a fresh model from a config)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, GSMVector):
            nn.init.ones_(module.weight)


class GSMModel(GSMPreTrainedModel):
    def __init__(self, config: GSMConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GSMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GSMVector(config.hidden_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor, memo: dict[int, Any] | None = None) -> torch.Tensor:
        """input_ids [B, n] at positions 0..n-1 -> final normalised hidden states [B, n, H] (float32).

        memo (generate only): per batch row, the ids and latents of the previous call. When a row
        extends those ids, only its new positions are computed (the golden model's decode step);
        every row must then have the same number of new positions, and only those are returned.
        """
        cfg = self.config
        if cfg.gsm("sparse_window") > cfg.gsm("max_sparse_window"):
            raise ValueError(f"gsm_config.sparse_window {cfg.gsm('sparse_window')} exceeds max_sparse_window "
                             f"{cfg.gsm('max_sparse_window')}")
        starts = [_reusable_prefix(None if memo is None else memo.get(b), row) for b, row in enumerate(input_ids)]
        if len(set(starts)) > 1:  # rows must return the same length: recompute all
            starts = [0] * len(starts)
        out = []
        for b, row in enumerate(input_ids):
            past = memo[b] if starts[b] else None
            hidden, latents = self.sequence(row, starts[b], None if past is None else past[1])
            if memo is not None:
                memo[b] = (row.clone(), latents)
            out.append(hidden)
        return torch.stack(out)

    def sequence(self, ids: torch.Tensor, n0: int, past: dict[int, tuple[torch.Tensor, ...]] | None
                 ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
        """One sequence ids [n] whose first n0 positions' latents are `past` -> hidden states of
        positions n0..n-1 [n-n0, H] and the latents (c_k, c_v, e) of all n positions."""
        cfg = self.config
        sinks = cfg.gsm("sink_tokens")
        nH, nKV, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        n = ids.shape[0]
        cos, sin = (t.to(ids.device) for t in rope_tables(torch.arange(n), cfg.head_dim, cfg.rope_theta))
        latents: dict[int, tuple[torch.Tensor, ...]] = {}
        sel: dict[int, torch.Tensor] = {}
        h = self.embed_tokens.weight.float()[ids[n0:]]  # [T, H], new positions only
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, eps)
            q = apply_rope(heads(x @ attn.q_proj.weight.float().T, nH), cos[n0:], sin[n0:])  # [nH, T, D]
            if attn.source is None:
                new = attn.latents(x)
                latents[i] = tuple(torch.cat([old, t]) for old, t in zip(past[i], new)) if past else new
                ix = attn.sparse_mask_generator
                scores = index_scores(x, ix.q_proj.weight.float(), ix.w_proj.weight.float(), latents[i][2],
                                      cfg.gsm("indexer_heads"))  # [T, n]
                sel[i] = select(scores, n0, sinks, *cfg.layer_selection(i))  # each layer's own (v2)
                ck, cv = latents[i][:2]
            else:
                ck, cv = latents[attn.source][:2]
                sel[i] = sel[attn.source]  # the mask is shared with the memory (spec 4.2)
            k, v = attn.key_values(ck, cv, nKV)
            h = h + attention(q, apply_rope(k, cos, sin), v, sel[i]) @ attn.o_proj.weight.float().T
            h = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm.weight, eps))
        return rms_norm(h, self.norm.weight, eps), latents


def _reusable_prefix(past: tuple[torch.Tensor, Any] | None, ids: torch.Tensor) -> int:
    """Number of leading positions of ids [n] whose latents `past` (ids, latents) holds (0: none)."""
    if past is None or past[0].shape[0] >= ids.shape[0] or not torch.equal(past[0], ids[:past[0].shape[0]]):
        return 0
    return past[0].shape[0]


class GSMForCausalLM(GSMPreTrainedModel, GenerationMixin):
    def __init__(self, config: GSMConfig) -> None:
        super().__init__(config)
        self.model = GSMModel(config)
        # A tied head reads the embedding directly: no second parameter, nothing for tying to miss.
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], *model_args: Any,
                        **kwargs: Any) -> Any:
        """Size the latent factors from the checkpoint's tensor shapes before loading (spec 2: the
        ranks are not in config.json), then load as usual."""
        hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
        config = kwargs.get("config")
        if not isinstance(config, GSMConfig):
            config = GSMConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        config.latent_ranks = read_latent_ranks(pretrained_model_name_or_path, config, hub)
        kwargs["config"] = config
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._realign_cpu_parameters()  # tuple: output_loading_info
        return loaded

    @torch.no_grad()
    def _realign_cpu_parameters(self) -> None:
        """Move CPU parameters left in memory-mapped safetensors storage (8-byte aligned) to fresh
        storage. With misaligned operands BLAS takes another vector path for one-row products (a
        decode step) and rounds differently from the golden model; exact indexer ties (a repeated
        token's keys) then break the other way and greedy outputs part after some tokens."""
        for p in self.parameters():
            if p.device.type == "cpu" and p.data_ptr() % 64:
                p.data = p.data.clone()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, gsm_memo: dict[int, Any] | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("GSM reference model: padded batches are not supported (attention_mask has "
                             "zeros); run sequences one at a time or of equal length")
        hidden = self.model(input_ids, gsm_memo)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = hidden @ head.float().T  # [B, n, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # -- generation: no transformers cache; the latents of the previous step ride in gsm_memo ----
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._gsm_memo: dict[int, Any] | None = {}
        try:
            return super().generate(*args, **kwargs)
        finally:
            self._gsm_memo = None

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        # always the whole sequence: forward reuses what gsm_memo holds for its prefix, so a
        # reordered or edited batch (beam search) is recomputed rather than misread
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "gsm_memo": getattr(self, "_gsm_memo", None)}


# -- latent ranks from the safetensors headers -----------------------------------------------------

def _safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's JSON header (the data is not read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _resolve(where: str | os.PathLike[str], name: str, hub: dict[str, Any]) -> str | None:
    """Local path of checkpoint file `name` (a local directory or a Hub repo), or None if absent."""
    if os.path.isdir(where):
        path = os.path.join(where, hub.get("subfolder") or "", name)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    return cached_file(where, name, _raise_exceptions_for_missing_entries=False, **hub)


def read_latent_ranks(where: str | os.PathLike[str], config: GSMConfig,
                      hub: dict[str, Any]) -> dict[str, list[int]]:
    """Owning layer (as a string key, like JSON) -> [r_k, r_v], from the k/v_svd_S shapes."""
    wanted = {RANK_TENSOR.format(i=i, kv=kv) for i in range(config.num_hidden_layers)
              if i not in config.kv_sharing for kv in ("k", "v")}
    shapes: dict[str, list[int]] = {}
    single = _resolve(where, WEIGHTS_FILE, hub)
    if single is not None:
        shapes = _safetensors_shapes(single)
    else:
        index = _resolve(where, INDEX_FILE, hub)
        if index is None:
            raise OSError(f"{where}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        for shard in sorted({weight_map[name] for name in wanted if name in weight_map}):
            shapes.update(_safetensors_shapes(_resolve(where, shard, hub)))
    missing = sorted(wanted - shapes.keys())
    if missing:
        raise OSError(f"{where}: GSM checkpoint lacks {missing[0]} (needed for the latent rank)")
    return {str(i): [shapes[RANK_TENSOR.format(i=i, kv="k")][0], shapes[RANK_TENSOR.format(i=i, kv="v")][0]]
            for i in range(config.num_hidden_layers) if i not in config.kv_sharing}
