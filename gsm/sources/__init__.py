"""Readers of dense LLaMA-family models into one in-memory form, `DenseSource`.

The converter, the dense reference and the tests should not care whether a model came from a
llama2.c `.bin` or a Hugging Face directory, so each reader maps its format once onto the HF LLaMA
tensor names of gsm.names, in the HF rotate-half RoPE layout, as float32. Tensors are loaded lazily,
one at a time (a memory map or `safe_open`), so a large model is never held twice in RAM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gsm import names
from gsm.config import ModelConfig


class SourceError(ValueError):
    """A source model is missing, truncated, or not the dense LLaMA model we can read."""


class LazyTensors:
    """Name -> float32 tensor, each loaded when asked for (and not cached: callers keep what they need)."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]],
                 shapes: dict[str, tuple[int, ...]], origin: str) -> None:
        self._loaders = dict(loaders)
        self._shapes = dict(shapes)
        self._origin = origin

    @property
    def names(self) -> list[str]:
        return list(self._loaders)

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as a fresh, contiguous float32 tensor."""
        self._check(name)
        t = self._loaders[name]().to(torch.float32).contiguous()
        if tuple(t.shape) != self._shapes[name]:
            raise SourceError(f"{self._origin}: tensor {name} has shape {tuple(t.shape)}, "
                              f"expected {self._shapes[name]}")
        return t

    def subset(self, keep: list[str]) -> LazyTensors:
        """The tensors `keep` only (each still loaded when asked for)."""
        for name in keep:
            self._check(name)
        return LazyTensors({n: self._loaders[n] for n in keep}, {n: self._shapes[n] for n in keep}, self._origin)

    def _check(self, name: str) -> None:
        if name not in self._loaders:
            raise KeyError(f"{self._origin}: no tensor {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass(frozen=True)
class DenseSource:
    """A dense LLaMA model: config (default GSMParams), HF-named float32 tensors, tokenizer.json.

    Tensors are those of `dense_shapes(config)`: the common per-layer tensors, dense k/v projections,
    embedding, final norm, and lm_head unless tied. `tokenizer_config` is the content of HF's
    tokenizer_config.json (bos/eos tokens, add_bos_token, add_eos_token, chat_template) when the
    source states it.
    """

    config: ModelConfig
    tensors: LazyTensors
    tokenizer_json: str | None
    origin: str
    tokenizer_config: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return self.tensors.names

    def get(self, name: str) -> torch.Tensor:
        return self.tensors.get(name)


def dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a dense LLaMA model in HF names -> shape, in a stable order."""
    H, I, V, qd, kvd = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_dim,
                        cfg.kv_dim)
    per_layer = {"input_norm": (H,), "q_proj": (qd, H), "k_proj": (kvd, H), "v_proj": (kvd, H),
                 "o_proj": (H, qd), "post_norm": (H,), "gate_proj": (I, H), "up_proj": (I, H),
                 "down_proj": (H, I)}
    shapes: dict[str, tuple[int, ...]] = {names.EMBED: (V, H)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({names.layer_name(k, i): s for k, s in per_layer.items()})
    shapes[names.FINAL_NORM] = (H,)
    if not cfg.tie_word_embeddings:
        shapes[names.LM_HEAD] = (V, H)
    return shapes


def first_layers(src: DenseSource, n: int) -> DenseSource:
    """`src` cut to its first `n` decoder layers: the same embedding, final norm, LM head and tokenizer, the
    kept layers' weights unchanged (`gsm convert --layers`: a small model of real weights, for quick tests)."""
    total = src.config.num_hidden_layers
    if not 1 <= n <= total:
        raise SourceError(f"{src.origin}: --layers {n}: the model has {total} decoder layers; keep 1 to {total}")
    if n == total:
        return src
    cfg = dataclasses.replace(src.config, num_hidden_layers=n)
    return dataclasses.replace(src, config=cfg, tensors=src.tensors.subset(list(dense_shapes(cfg))),
                               origin=f"{src.origin} (first {n} of its {total} layers)")


def read_source(path: Path, tokenizer: Path | None = None) -> DenseSource:
    """A directory is read as a Hugging Face model, a `.gguf` file as GGUF, other files as llama2.c."""
    from gsm.sources.hf import read_hf
    from gsm.sources.llama2c import read_llama2c

    path = Path(path)
    if path.suffix == ".gguf" and not path.is_dir():
        from gsm.sources.gguf import read_gguf

        return read_gguf(path, tokenizer)
    if path.is_dir():
        src = read_hf(path)
        if tokenizer is not None:
            from gsm.tokenizer import tokenizer_json_from_file
            src = dataclasses.replace(src, tokenizer_json=tokenizer_json_from_file(tokenizer))
        return src
    return read_llama2c(path, tokenizer)


__all__ = ["DenseSource", "LazyTensors", "SourceError", "dense_shapes", "first_layers", "read_source"]
