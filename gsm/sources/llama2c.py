"""Reader of karpathy/llama2.c float32 model files (legacy version 0 and version 1 "ak42").

Both versions hold the same tensors in different orders; one table per version lists them, and one
table maps llama2.c names to HF names. llama2.c rotates interleaved pairs (Meta RoPE layout), so wq
and wk rows are permuted to HF's rotate-half layout on load (`meta_to_hf_rope_rows`), exactly as
Hugging Face's LLaMA conversion script does.
"""

from __future__ import annotations

import struct
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gsm import names
from gsm.config import ModelConfig
from gsm.sources import DenseSource, LazyTensors, SourceError, dense_shapes
from gsm.tokenizer import find_llama2c_tokenizer, llama_tokenizer_config, tokenizer_json_from_file

MAGIC = 0x616B3432  # "ak42"
V1_HEADER_BYTES = 256
V0_HEADER_BYTES = 7 * 4

# llama2.c name -> HF name template (None: present in the file, not a model weight)
HF_NAME: dict[str, str | None] = {
    "token_embedding_table": names.EMBED,
    "rms_att": names.COMMON["input_norm"],
    "wq": names.COMMON["q_proj"],
    "wk": names.DENSE_KV["k_proj"],
    "wv": names.DENSE_KV["v_proj"],
    "wo": names.COMMON["o_proj"],
    "rms_ffn": names.COMMON["post_norm"],
    "w1": names.COMMON["gate_proj"],
    "w2": names.COMMON["down_proj"],
    "w3": names.COMMON["up_proj"],
    "rms_final": names.FINAL_NORM,
    "freq_cis_real": None,
    "freq_cis_imag": None,
    "wcls": names.LM_HEAD,
}
# File order per version (export.py legacy_export / version1_export); wcls follows when untied.
ORDER = {
    0: ["token_embedding_table", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3",
        "rms_final", "freq_cis_real", "freq_cis_imag"],
    1: ["rms_att", "rms_ffn", "rms_final", "token_embedding_table", "wq", "wk", "wv", "wo", "w1",
        "w2", "w3"],
}
PER_LAYER = {"rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3"}


def meta_to_hf_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute the output rows of a q/k projection from Meta (interleaved pairs) to HF (halves) RoPE.

    Per head of D rows, the new order is [0, 2, 4, ..., D-2, 1, 3, ..., D-1]: Meta rotates pairs
    (2i, 2i+1) by frequency i, HF rotates (i, i + D/2). Same as `permute` in HF's
    convert_llama_weights_to_hf.py. w: [n_heads*D, in] -> [n_heads*D, in].
    """
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    if d * n_heads != out_dim or d % 2:
        raise ValueError(f"cannot split {out_dim} rows into {n_heads} heads of even size")
    return w.reshape(n_heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _read_header(path: Path, data: bytes) -> tuple[int, list[int], bool, int]:
    """(version, [dim, hidden, layers, heads, kv_heads, vocab, seq_len], tied, header bytes)."""
    if len(data) < V0_HEADER_BYTES:
        raise SourceError(f"{path}: {len(data)} bytes, too short for a llama2.c header")
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic == MAGIC:
        if len(data) < V1_HEADER_BYTES:
            raise SourceError(f"{path}: 'ak42' magic but only {len(data)} bytes: truncated header")
        (version,) = struct.unpack_from("<i", data, 4)
        if version != 1:
            raise SourceError(f"{path}: llama2.c version {version}; only float32 versions 0 and 1 "
                              "are supported (version 2 is int8 Q8_0)")
        params = list(struct.unpack_from("<7i", data, 8))
        tied = bool(data[36])
        return 1, params, tied, V1_HEADER_BYTES
    params = list(struct.unpack_from("<7i", data, 0))
    tied = params[5] > 0  # legacy: a negative vocab_size says an untied classifier follows
    params[5] = abs(params[5])
    return 0, params, tied, V0_HEADER_BYTES


def _config(path: Path, params: list[int], tied: bool) -> ModelConfig:
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = params
    if min(params) <= 0 or dim % n_heads or n_heads % n_kv or (dim // n_heads) % 2:
        raise SourceError(
            f"{path}: not a llama2.c model (header dim={dim} hidden_dim={hidden} n_layers={n_layers} "
            f"n_heads={n_heads} n_kv_heads={n_kv} vocab_size={vocab} seq_len={seq_len}; expected "
            "positive values, dim divisible by n_heads into even heads, n_heads by n_kv_heads)")
    return ModelConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=n_layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv, vocab_size=vocab,
                       max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=tied, torch_dtype="float32", bos_token_id=1, eos_token_id=2)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of ONE layer's tensor (per-layer ones) or of the whole tensor, by llama2.c name."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    half = cfg.head_dim // 2
    return {"token_embedding_table": (V, H), "rms_att": (H,), "wq": (cfg.q_dim, H),
            "wk": (cfg.kv_dim, H), "wv": (cfg.kv_dim, H), "wo": (H, cfg.q_dim), "rms_ffn": (H,),
            "w1": (I, H), "w2": (H, I), "w3": (I, H), "rms_final": (H,),
            "freq_cis_real": (cfg.max_position_embeddings, half),
            "freq_cis_imag": (cfg.max_position_embeddings, half), "wcls": (V, H)}


def _load(mm: np.memmap, start: int, shape: tuple[int, ...], rope_heads: int) -> torch.Tensor:
    n = int(np.prod(shape))
    t = torch.from_numpy(np.array(mm[start:start + n], dtype=np.float32).reshape(shape))
    return meta_to_hf_rope_rows(t, rope_heads) if rope_heads else t


def read_llama2c(path: Path, tokenizer: Path | None = None) -> DenseSource:
    """Read a llama2.c float32 model (version 0 or 1); sizes are checked against the file length.

    The tokenizer is `tokenizer` (a llama2.c .bin, a SentencePiece .model or a tokenizer.json) or
    else tok{vocab_size}.bin / tokenizer.bin beside the model; None when there is none.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(V1_HEADER_BYTES)
        size = path.stat().st_size
    except OSError as e:
        raise SourceError(f"{path}: cannot read llama2.c model ({e})") from e
    version, params, tied, header_bytes = _read_header(path, head)
    cfg = _config(path, params, tied)
    shapes = _shapes(cfg)
    order = ORDER[version] + ([] if tied else ["wcls"])
    L = cfg.num_hidden_layers
    counts = {k: int(np.prod(shapes[k])) * (L if k in PER_LAYER else 1) for k in order}
    expected = header_bytes + 4 * sum(counts.values())
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise SourceError(
            f"{path}: {size} bytes, expected {expected} for a llama2.c version {version} model with "
            f"dim={cfg.hidden_size} hidden_dim={cfg.intermediate_size} n_layers={L} "
            f"n_heads={cfg.num_attention_heads} n_kv_heads={cfg.num_key_value_heads} "
            f"vocab_size={cfg.vocab_size} seq_len={cfg.max_position_embeddings} "
            f"({'tied' if tied else 'untied'} classifier): file is {what}")
    mm = np.memmap(path, dtype="<f4", mode="r", offset=header_bytes)
    loaders, hf_shapes, start = {}, {}, 0
    for key in order:
        layers = range(L) if key in PER_LAYER else [None]
        step = counts[key] // len(layers)
        for i in layers:
            hf = HF_NAME[key]
            if hf is not None:
                name = hf.format(i=i) if i is not None else hf
                heads = {"wq": cfg.num_attention_heads, "wk": cfg.num_key_value_heads}.get(key, 0)
                loaders[name] = partial(_load, mm, start, shapes[key], heads)
                hf_shapes[name] = shapes[key]
            start += step
    want = dense_shapes(cfg)
    assert set(loaders) == set(want) and all(hf_shapes[n] == want[n] for n in want), "llama2.c table bug"
    loaders = {n: loaders[n] for n in want}  # the same order for every source
    tok_file = Path(tokenizer) if tokenizer is not None else find_llama2c_tokenizer(path, cfg.vocab_size)
    tok_json, tok_config = None, None
    if tok_file is not None:
        tok_json = tokenizer_json_from_file(tok_file, cfg.vocab_size)
        tok_config = llama_tokenizer_config()
    return DenseSource(cfg, LazyTensors(loaders, hf_shapes, str(path)), tok_json, str(path), tok_config)
