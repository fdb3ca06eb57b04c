"""A random dense LLaMA-1B-shaped Hugging Face directory for conversion-at-scale measurements.

Quality is meaningless (random weights); the shapes are real: hidden 2048, 16 layers, 32 query /
8 KV heads, intermediate 5632, vocab 32000, bfloat16 safetensors (as published checkpoints ship),
config.json and a byte-level tokenizer.json. Written one tensor at a time into shards so the
generator itself stays small.

    python scripts/make_synthetic_llama1b.py /tmp/llama1b-synth
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gsm.config import ModelConfig
from gsm.sources import dense_shapes
from gsm.sources.hf import llama_config_dict
from gsm.tokenizer import byte_level_tokenizer_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    cfg = ModelConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, head_dim=64,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, shard, n_shard = {}, {}, 0

    def flush() -> None:
        nonlocal shard, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, str(args.out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, n_shard = {}, n_shard + 1

    for name, shape in dense_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape)
        else:  # std 1/sqrt(fan_in) keeps activations O(1) through 16 random layers
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5
        shard[name] = t.to(torch.bfloat16)
        if sum(v.numel() for v in shard.values()) > 300_000_000:
            flush()
    flush()
    (args.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (args.out / "config.json").write_text(json.dumps(llama_config_dict(cfg), indent=1))
    (args.out / "tokenizer.json").write_text(byte_level_tokenizer_json(cfg.vocab_size))
    print(f"wrote {args.out}: {sum(1 for _ in args.out.glob('*.safetensors'))} shards")


if __name__ == "__main__":
    main()
