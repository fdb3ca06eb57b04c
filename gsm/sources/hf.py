"""Reader of Hugging Face LLaMA model directories (config.json + safetensors, single or sharded).

Tensors stay in the files: each is read on demand through `safetensors.safe_open`, so converting a
model never merges its shards in RAM. Only plain LLaMA is accepted (SiLU MLP, no biases, default
RoPE): anything else would be silently mis-read by a dense LLaMA forward.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gsm import names
from gsm.config import DTYPE_NAMES, ConfigError, ModelConfig
from gsm.sources import DenseSource, LazyTensors, SourceError, dense_shapes

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise SourceError(f"{path}: missing") from e
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: not readable JSON ({e})") from e


def _rope_theta(d: dict[str, Any], where: Path) -> float:
    """rope_theta from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for obj, key in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        if not isinstance(obj, dict):
            raise SourceError(f"{where}: {key} is {obj!r}, expected an object")
    # both keys may be present (transformers 5 keeps rope_scaling as an alias): any scaling is refused
    for rope_type in (params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")):
        if rope_type not in (None, "default"):
            raise SourceError(f"{where}: RoPE type {rope_type!r} is not supported (only plain RoPE)")
    theta = params.get("rope_theta", scaling.get("rope_theta", d.get("rope_theta", 10000.0)))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise SourceError(f"{where}: rope_theta is {theta!r}, expected a positive number")
    return float(theta)


def hf_model_config(d: dict[str, Any], where: Path) -> ModelConfig:
    """Our ModelConfig (default GSMParams) from an HF LLaMA config.json object."""
    archs = d.get("architectures") or []
    if d.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise SourceError(f"{where}: not a LLaMA config (model_type={d.get('model_type')!r}, "
                          f"architectures={archs!r}); expected model_type 'llama' or LlamaForCausalLM")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise SourceError(f"{where}: {flag} is true; only bias-free LLaMA is supported")
    if d.get("hidden_act", "silu") != "silu":
        raise SourceError(f"{where}: hidden_act {d['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size")
    missing = [k for k in required if k not in d]
    if missing:
        raise SourceError(f"{where}: config lacks {', '.join(missing)}")
    eos = d.get("eos_token_id", 2)
    dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
    try:
        return ModelConfig(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            vocab_size=d["vocab_size"], head_dim=d.get("head_dim") or 0,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(d, where),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=dtype if dtype in DTYPE_NAMES else "float32",
            bos_token_id=d.get("bos_token_id", 1) if d.get("bos_token_id") is not None else 1,
            eos_token_id=(eos[0] if isinstance(eos, list) else eos) if eos is not None else 2)
    except (ConfigError, TypeError) as e:
        raise SourceError(f"{where}: {e}") from e


def _shard_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    if (folder / INDEX).is_file():
        index = _read_json(folder / INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise SourceError(f"{folder / INDEX}: no weight_map object")
        files = {f: folder / f for f in set(weight_map.values())}
        for f, p in files.items():
            if not p.is_file():
                raise SourceError(f"{folder / INDEX}: names shard {f}, which is missing")
        return {name: files[f] for name, f in weight_map.items()}
    if (folder / SINGLE).is_file():
        with safe_open(folder / SINGLE, framework="pt") as f:
            return {name: folder / SINGLE for name in f.keys()}
    raise SourceError(f"{folder}: no {SINGLE} or {INDEX} (only safetensors weights are read)")


def _load(file: Path, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def _shape(file: Path, name: str) -> tuple[int, ...]:
    with safe_open(file, framework="pt") as f:
        return tuple(f.get_slice(name).get_shape())


def read_hf(folder: Path) -> DenseSource:
    """Read a Hugging Face LLaMA directory; tensors are read lazily, one at a time, as float32."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"{folder}: not a directory")
    d = _read_json(folder / "config.json")
    if not isinstance(d, dict):
        raise SourceError(f"{folder / 'config.json'}: expected a JSON object")
    cfg = hf_model_config(d, folder / "config.json")
    where = _shard_map(folder)
    if "tie_word_embeddings" not in d and names.LM_HEAD not in where:
        # a tool that drops both the key and the tied lm_head.weight still means a tied model
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    want = dense_shapes(cfg)
    missing = [n for n in want if n not in where]
    if missing:
        raise SourceError(f"{folder}: missing tensor {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    for name, shape in want.items():
        got = _shape(where[name], name)
        if got != shape:
            raise SourceError(f"{where[name]}: tensor {name} has shape {got}, config.json implies {shape}")
    loaders = {name: (lambda f=where[name], n=name: _load(f, n)) for name in want}
    tok = folder / "tokenizer.json"
    tok_json = tok.read_text(encoding="utf-8") if tok.is_file() else None
    tok_config = None
    if (folder / TOKENIZER_CONFIG).is_file():
        tok_config = _read_json(folder / TOKENIZER_CONFIG)
        if not isinstance(tok_config, dict):
            raise SourceError(f"{folder / TOKENIZER_CONFIG}: expected a JSON object")
    return DenseSource(cfg, LazyTensors(loaders, want, str(folder)), tok_json, str(folder), tok_config)


def llama_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """HF LlamaConfig fields of the dense model `cfg` describes (for writing or comparing)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "torch_dtype": cfg.torch_dtype,
    }
