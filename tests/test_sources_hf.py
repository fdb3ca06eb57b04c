"""`--from hf` on what real tools write: transformers 4 (`rope_theta`) and 5 (`rope_parameters`)
configs, tied embeddings without lm_head.weight, sharded safetensors with an index, bf16 weights,
any GQA ratio. Each tiny directory must give the logits transformers itself computes from it;
RoPE scaling is refused by name; tokenizer_config.json is carried along."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gsm import names
from gsm.dense import DenseLlama
from gsm.sources import SourceError, read_source
from gsm.sources.hf import read_hf

transformers = pytest.importorskip("transformers")
THETA = 50000.0


def save_tiny(folder: Path, *, kv_heads: int = 2, tied: bool = False, shard: str | None = None,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, vocab_size=64, max_position_embeddings=64,
                                   rope_theta=THETA, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # norms away from 1 so a wrong norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def edit_config(folder: Path, **changes) -> dict:
    path = folder / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))
    return d


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))


def rope_theta_style(folder: Path) -> None:
    """transformers 4: top-level rope_theta, rope_scaling null, torch_dtype."""
    edit_config(folder, rope_parameters=None, rope_theta=THETA, rope_scaling=None, torch_dtype="float32", dtype=None)


def rope_parameters_style(folder: Path) -> None:
    """transformers 5: rope_parameters object, no rope_theta key."""
    edit_config(folder, rope_theta=None, rope_parameters={"rope_theta": THETA, "rope_type": "default"})


@pytest.mark.parametrize("variant", ["rope_theta", "rope_parameters", "tied", "sharded", "bf16", "mha", "mqa"])
def test_variant_logits_equal_transformers(tmp_path: Path, variant: str) -> None:
    kw = {"tied": dict(tied=True), "sharded": dict(shard="20KB"), "bf16": dict(dtype=torch.bfloat16),
          "mha": dict(kv_heads=4), "mqa": dict(kv_heads=1)}.get(variant, {})
    folder = save_tiny(tmp_path / variant, **kw)
    if variant == "rope_theta":
        rope_theta_style(folder)
    elif variant == "rope_parameters":
        rope_parameters_style(folder)
    if variant == "tied":
        from safetensors import safe_open
        with safe_open(folder / "model.safetensors", "pt") as f:
            assert names.LM_HEAD not in f.keys()
    if variant == "sharded":
        assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    src = read_source(folder)
    c = src.config
    assert (c.rope_theta, c.num_key_value_heads, c.tie_word_embeddings) == \
        (THETA, kw.get("kv_heads", 2), variant == "tied")
    torch.testing.assert_close(DenseLlama(src)(IDS), reference_logits(folder, IDS), atol=2e-5, rtol=1e-5)


def test_tied_inferred_when_key_and_tensor_absent(tmp_path: Path) -> None:
    """No tie_word_embeddings key and no lm_head.weight: read as tied (the same logits as the tied model)."""
    tied = save_tiny(tmp_path / "tied", tied=True)
    ref = DenseLlama(read_hf(tied))(IDS)
    edit_config(tied, tie_word_embeddings=None)
    src = read_hf(tied)
    assert src.config.tie_word_embeddings and names.LM_HEAD not in src.tensors
    torch.testing.assert_close(DenseLlama(src)(IDS), ref, atol=0, rtol=0)
    # but an explicit false with no lm_head.weight is a broken directory
    edit_config(tied, tie_word_embeddings=False)
    with pytest.raises(SourceError, match="missing tensor lm_head.weight"):
        read_hf(tied)


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "llama3", "longrope"])
def test_rope_scaling_refused(tmp_path: Path, where: str, rope_type: str) -> None:
    folder = save_tiny(tmp_path / "m")
    edit_config(folder, **{where: {"rope_type": rope_type, "factor": 2.0, "rope_theta": THETA}})
    with pytest.raises(SourceError, match=f"config.json: RoPE type '{rope_type}' is not supported"):
        read_hf(folder)


def test_legacy_scaling_type_key_refused(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path / "m")
    rope_theta_style(folder)
    edit_config(folder, rope_scaling={"type": "linear", "factor": 4.0})
    with pytest.raises(SourceError, match="RoPE type 'linear'"):
        read_hf(folder)


def test_tokenizer_config_carried(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path / "m")
    assert read_hf(folder).tokenizer_config is None
    tc = {"bos_token": "<s>", "add_bos_token": False, "chat_template": "{{ x }}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    assert read_hf(folder).tokenizer_config == tc
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(SourceError, match="tokenizer_config.json: expected a JSON object"):
        read_hf(folder)
