"""Hugging Face configuration of a GSM checkpoint, for `trust_remote_code=True` loading.

This file is copied into every GSM checkpoint directory (gsm.remote_code) and run by transformers
from its module cache, where the `gsm` package may not be installed: it imports only transformers.
It reads the config.json the GSM tools write (HF-LLaMA fields plus `gsm_config`, spec section 2)
and keeps `gsm_config` exactly as written, so save_pretrained round-trips its checksum.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

# Spec section 2 defaults of the gsm_config fields the forward pass reads.
GSM_DEFAULTS: dict[str, Any] = {
    "sparse_window": 3,
    "max_sparse_window": 8,
    "sparse_top_k": 64,
    "sink_tokens": 1,
    "indexer_heads": 4,
    "indexer_dim": 32,
    "kv_compression_ratio": 3.2,
    "kv_sharing": {},
}


class GSMConfig(PretrainedConfig):
    model_type = "gsm"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32,
                 num_key_value_heads: int | None = None, head_dim: int | None = None,
                 max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
                 bos_token_id: int | None = 1, eos_token_id: int | list[int] | None = 2,
                 gsm_config: dict[str, Any] | None = None,
                 latent_ranks: dict[str, list[int]] | None = None, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        # GSM config.json writes head_dim 0 for "H / nH" (gsm.config.ModelConfig)
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.gsm_config = dict(gsm_config or {})
        # Owning layer -> [r_k, r_v]. Not part of the GSM config.json (spec 2: ranks come from tensor
        # shapes); GSMForCausalLM.from_pretrained fills it from the safetensors headers.
        self.latent_ranks = dict(latent_ranks or {})
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def gsm(self, name: str) -> Any:
        """One gsm_config value, or its spec default."""
        return self.gsm_config.get(name, GSM_DEFAULTS[name])

    def layer_selection(self, layer: int) -> tuple[int, int, int]:
        """(window, top_k, top_k divisor) owning layer `layer` selects with: its gsm_config layer_selection entry,
        else the model's (divisor 0: a fixed top-k)."""
        own = (self.gsm_config.get("layer_selection") or {}).get(str(layer))
        if own is None:
            return (self.gsm("sparse_window"), self.gsm("sparse_top_k"),
                    int(self.gsm_config.get("sparse_top_k_divisor", 0)))
        return int(own["sparse_window"]), int(own["sparse_top_k"]), int(own.get("sparse_top_k_divisor", 0))

    @property
    def kv_sharing(self) -> dict[int, int]:
        """Sharing layer -> source layer (JSON keys are strings)."""
        return {int(k): int(v) for k, v in (self.gsm("kv_sharing") or {}).items()}

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def ranks_of(self, layer: int) -> tuple[int, int]:
        """(r_k, r_v) of an owning layer; without recorded ranks (a fresh random model), the rank
        the informational kv_compression_ratio implies."""
        r = self.latent_ranks.get(str(layer), self.latent_ranks.get(layer))
        if r is not None:
            return int(r[0]), int(r[1])
        guess = max(1, round(self.kv_dim / float(self.gsm("kv_compression_ratio"))))
        return guess, guess
