"""Reader of llama.cpp GGUF files holding a plain LLaMA model (dense, SwiGLU, plain RoPE).

The file is memory-mapped by the maintained `gguf` library; each tensor is dequantised to float32
(`gguf.quants.dequantize`) only when asked for, so reading a model costs about one tensor of RAM at
a time. Names are mapped once from llama.cpp's to HF's (`GGUF_NAMES`, `GGUF_LAYER_NAMES`), and the
q/k rows are taken back from the interleaved-pair RoPE layout llama.cpp's convert_hf_to_gguf.py
writes to HF's rotate-half layout. The tokenizer in the metadata becomes a tokenizer.json plus the
tokenizer_config.json fields (chat template, BOS/EOS and whether to add them). See docs/sources.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gsm import names
from gsm.config import ConfigError, ModelConfig
from gsm.sources import DenseSource, LazyTensors, SourceError, dense_shapes
from gsm.sources.llama2c import meta_to_hf_rope_rows
from gsm.tokenizer import GGUFVocab, TokenizerError, gguf_tokenizer_json, tokenizer_json_from_file

ARCHITECTURE = "llama"

# llama.cpp tensor name -> HF name (gsm.names)
GGUF_NAMES = {
    "token_embd.weight": names.EMBED,
    "output_norm.weight": names.FINAL_NORM,
    "output.weight": names.LM_HEAD,
}
# per-layer llama.cpp name `blk.{i}.<key>.weight` -> gsm.names short key
GGUF_LAYER_NAMES = {
    "attn_norm": "input_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
LAYER_PREFIX = "blk."

# Types dequantised to float32 (all through gguf.quants.dequantize); anything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp defaults when tokenizer.ggml.add_bos_token is absent, by tokenizer.ggml.model
DEFAULT_ADD_BOS = {"llama": True, "gpt2": False}

_REQUIRED = object()


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError as e:  # only the convert/test extras install it
        raise SourceError(f"reading GGUF files needs the 'gguf' package (pip install gguf): {e}") from e
    return gguf


class _Metadata:
    """Typed access to GGUF key/values with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self._fields:
            if default is _REQUIRED:
                raise SourceError(f"{self._path}: missing metadata key {key}")
            return default
        try:
            return self._fields[key].contents()
        except Exception as e:  # a malformed field: numpy/struct errors from gguf's parser
            raise SourceError(f"{self._path}: metadata key {key} is unreadable ({e})") from e

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self.get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if isinstance(v, list):
            # llama.cpp allows per-layer arrays (e.g. head_count_kv); we read only uniform models
            if not v or any(x != v[0] for x in v):
                raise SourceError(f"{self._path}: metadata key {key} varies per layer ({v[:8]}...); "
                                  "only uniform layers are supported")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise SourceError(f"{self._path}: metadata key {key} is {v!r}, expected an integer")
        return int(v)

    def real(self, key: str, default: Any = _REQUIRED) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise SourceError(f"{self._path}: metadata key {key} is {v!r}, expected a number")
        # GGUF stores float32: the shortest decimal that round-trips it is the value that was written
        # (1e-05, not 9.999999747378752e-06)
        return float(np.format_float_positional(np.float32(v), unique=True, trim="-")) \
            if isinstance(v, float) else float(v)


def _hf_name(gguf_name: str) -> tuple[str, str | None] | None:
    """(HF name, per-layer key or None) of a llama.cpp tensor name; None when not a LLaMA weight."""
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name], None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] + "." == LAYER_PREFIX and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in GGUF_LAYER_NAMES:
        key = GGUF_LAYER_NAMES[parts[2]]
        return names.layer_name(key, int(parts[1])), key
    return None


def gguf_model_config(meta: _Metadata, path: Path, vocab_size: int, tied: bool) -> ModelConfig:
    """ModelConfig (default GSMParams) from `llama.*` metadata."""
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise SourceError(f"{path}: general.architecture is {arch!r}; only {ARCHITECTURE!r} "
                          "(plain LLaMA) is supported")
    a = ARCHITECTURE + "."
    if meta.integer(a + "expert_count", 0) > 0:
        raise SourceError(f"{path}: {a}expert_count is {meta.integer(a + 'expert_count')}; mixture-of-"
                          "experts models are not supported")
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise SourceError(f"{path}: {a}rope.scaling.type is {scaling!r}; only plain RoPE is supported")
    hidden = meta.integer(a + "embedding_length")
    heads = meta.integer(a + "attention.head_count")
    head_dim = meta.integer(a + "attention.key_length", 0) or (hidden // heads if heads else 0)
    if meta.integer(a + "attention.value_length", head_dim) != head_dim:
        raise SourceError(f"{path}: {a}attention.value_length differs from key_length {head_dim}")
    rope_dim = meta.integer(a + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise SourceError(f"{path}: {a}rope.dimension_count is {rope_dim}, head dim {head_dim}; "
                          "partial rotary embeddings are not supported")
    declared_vocab = meta.integer(a + "vocab_size", vocab_size)
    if declared_vocab != vocab_size:
        raise SourceError(f"{path}: {a}vocab_size is {declared_vocab}, token_embd.weight has {vocab_size} rows")
    try:
        return ModelConfig(
            hidden_size=hidden, intermediate_size=meta.integer(a + "feed_forward_length"),
            num_hidden_layers=meta.integer(a + "block_count"), num_attention_heads=heads,
            num_key_value_heads=meta.integer(a + "attention.head_count_kv", heads),
            vocab_size=vocab_size, head_dim=head_dim,
            max_position_embeddings=meta.integer(a + "context_length"),
            rms_norm_eps=meta.real(a + "attention.layer_norm_rms_epsilon"),
            rope_theta=meta.real(a + "rope.freq_base", 10000.0),  # llama.cpp's default
            tie_word_embeddings=tied, torch_dtype="float32",
            bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", 1),
            eos_token_id=meta.integer("tokenizer.ggml.eos_token_id", 2))
    except ConfigError as e:
        raise SourceError(f"{path}: {e}") from e


def _token_id(meta: _Metadata, key: str, n_tokens: int) -> int | None:
    """A token id from metadata, None when absent or out of range (llama.cpp writes -1 as 2**32-1)."""
    v = meta.get(key, None)
    return int(v) if isinstance(v, (int, np.integer)) and 0 <= int(v) < n_tokens else None


def gguf_vocab(meta: _Metadata) -> GGUFVocab | None:
    """The tokenizer metadata, or None when the file carries no tokenizer."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens")]
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap", None)
    return GGUFVocab(
        model=str(meta.get("tokenizer.ggml.model")), tokens=tokens,
        types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))],
        scores=meta.get("tokenizer.ggml.scores", None), merges=meta.get("tokenizer.ggml.merges", None),
        pre=meta.get("tokenizer.ggml.pre", None),
        unk_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens)),
        add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", None),
        remove_extra_whitespaces=meta.get("tokenizer.ggml.remove_extra_whitespaces", None),
        precompiled_charsmap=bytes(np.asarray(charsmap, dtype=np.uint8)) if charsmap is not None else b"")


def gguf_tokenizer_config(meta: _Metadata, vocab: GGUFVocab) -> dict[str, Any]:
    """The HF tokenizer_config.json fields a GGUF's metadata states (defaults as llama.cpp's)."""
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for field, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        tid = _token_id(meta, f"tokenizer.ggml.{key}", len(vocab.tokens))
        if tid is not None:
            cfg[field] = vocab.tokens[tid]
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", DEFAULT_ADD_BOS.get(vocab.model, False)))
    cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        cfg["chat_template"] = str(template)
    return cfg


def _load(gguf: Any, tensor: Any, shape: tuple[int, ...], rope_heads: int) -> torch.Tensor:
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, from the memory map
    # F32 comes back as a read-only view of the map: copy it, as the other types already are
    arr = np.array(arr, dtype=np.float32, copy=True) if not arr.flags.writeable else arr.astype(np.float32)
    t = torch.from_numpy(arr.reshape(shape))
    # convert_hf_to_gguf.py permuted HF q/k rows into interleaved pairs; take them back
    return meta_to_hf_rope_rows(t, rope_heads) if rope_heads else t


def read_gguf(path: Path, tokenizer: Path | None = None) -> DenseSource:
    """Read a LLaMA GGUF file lazily; tensors are dequantised to float32 one at a time.

    `tokenizer` (a tokenizer.json, SentencePiece .model or llama2.c .bin) replaces the one in the
    file's metadata.
    """
    gguf = _gguf_module()
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError / struct / numpy errors on a non-GGUF file
        raise SourceError(f"{path}: not a readable GGUF file ({e})") from e
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    for gname, t in tensors.items():
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise SourceError(f"{path}: tensor {gname} has type {qtype.name}, which is not supported "
                              f"(supported: {', '.join(SUPPORTED_TYPES)})")
    if "token_embd.weight" not in tensors:
        raise SourceError(f"{path}: missing tensor token_embd.weight")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    cfg = gguf_model_config(meta, path, vocab_size, tied="output.weight" not in tensors)
    want = dense_shapes(cfg)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    for gname, t in tensors.items():
        mapped = _hf_name(gname)
        if mapped is None:
            hint = " (llama3 RoPE scaling)" if gname.startswith("rope_freqs") else ""
            raise SourceError(f"{path}: unexpected tensor {gname}{hint}; only plain LLaMA weights are supported")
        name, key = mapped
        if name not in want:
            raise SourceError(f"{path}: tensor {gname} ({name}) is beyond the {cfg.num_hidden_layers} "
                              f"layers of {ARCHITECTURE}.block_count")
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape != want[name]:
            raise SourceError(f"{path}: tensor {gname} has shape {shape}, the metadata implies {want[name]}")
        loaders[name] = partial(_load, gguf, t, shape, heads.get(key or "", 0))
    missing = [n for n in want if n not in loaders]
    if missing:
        inverse = {v: k for k, v in GGUF_NAMES.items()}
        inverse.update({names.layer_name(k, i): f"{LAYER_PREFIX}{i}.{g}.weight"
                        for g, k in GGUF_LAYER_NAMES.items() for i in range(cfg.num_hidden_layers)})
        raise SourceError(f"{path}: missing tensor {inverse.get(missing[0], missing[0])}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    loaders = {n: loaders[n] for n in want}  # the same order for every source
    vocab = gguf_vocab(meta)
    tok_json, tok_config = None, None
    try:
        if vocab is not None:
            if len(vocab.tokens) != vocab_size:
                raise SourceError(f"{path}: tokenizer.ggml.tokens has {len(vocab.tokens)} tokens, "
                                  f"token_embd.weight {vocab_size} rows")
            tok_config = gguf_tokenizer_config(meta, vocab)
            if tokenizer is None:
                tok_json = gguf_tokenizer_json(vocab, str(path))
        if tokenizer is not None:
            tok_json = tokenizer_json_from_file(Path(tokenizer), vocab_size)
    except TokenizerError as e:
        raise SourceError(str(e)) from e
    return DenseSource(cfg, LazyTensors(loaders, want, str(path)), tok_json, str(path), tok_config)
