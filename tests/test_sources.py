"""Readers of dense models: the Meta -> HF RoPE row permutation, llama2.c v0/v1 layouts and their
errors, and HF directories (single and sharded safetensors) read back equal to the llama2.c source."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA, needs_data
from conftest import STORIES as MODEL

from gsm import names
from gsm.golden.rope import apply_rope, rope_tables
from gsm.sources import SourceError, dense_shapes, first_layers, read_source
from gsm.sources.hf import llama_config_dict, read_hf
from gsm.sources.llama2c import MAGIC, meta_to_hf_rope_rows, read_llama2c

# --- RoPE layout ------------------------------------------------------------------------------

def meta_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama2.c / Meta RoPE: rotate adjacent pairs (2i, 2i+1) by pos * theta^(-2i/D), as complex numbers.

    x: [T, nH, D], pos: [T]. Written independently of gsm.golden.rope on purpose.
    """
    D = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # [D/2]
    rot = torch.polar(torch.ones(len(pos), D // 2, dtype=torch.float64),
                      pos.double()[:, None] * freqs)  # [T, D/2]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))  # [T, nH, D/2]
    return torch.view_as_real(xc * rot[:, None, :]).reshape(x.shape)


@pytest.mark.parametrize("n_heads,head_dim", [(1, 2), (4, 8), (3, 16)])
def test_meta_to_hf_rope_rows(n_heads: int, head_dim: int) -> None:
    """Meta RoPE on the original rows == HF RoPE on the permuted rows (tolerance: fp32 rounding of
    the rotation tables vs the float64 reference)."""
    g = torch.Generator().manual_seed(n_heads * 100 + head_dim)
    H, T = 12, 20
    w = torch.randn(n_heads * head_dim, H, generator=g, dtype=torch.float64)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    pos = torch.arange(T)
    meta = meta_rope((x @ w.T).view(T, n_heads, head_dim), pos, 10000.0)  # [T, nH, D]
    cos, sin = rope_tables(pos, head_dim, 10000.0)  # [T, D]
    hf_in = (x @ meta_to_hf_rope_rows(w, n_heads).T).view(T, n_heads, head_dim).transpose(0, 1)
    hf = apply_rope(hf_in.float(), cos, sin).transpose(0, 1)  # [T, nH, D]
    # same rotated vector, rows permuted: even Meta rows first, then odd ones
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    torch.testing.assert_close(hf.double(), meta[..., perm], atol=1e-5, rtol=1e-5)
    # and the attention logits, which are what matters, are unchanged
    torch.testing.assert_close(torch.einsum("thd,shd->hts", hf.double(), hf.double()),
                               torch.einsum("thd,shd->hts", meta, meta), atol=1e-4, rtol=1e-5)


def test_meta_to_hf_rope_rows_order() -> None:
    w = torch.arange(8.0)[:, None]  # 2 heads of 4 rows
    assert meta_to_hf_rope_rows(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="heads"):
        meta_to_hf_rope_rows(torch.zeros(6, 2), 2)


# --- llama2.c files ---------------------------------------------------------------------------

DIM, HID, NL, NH, NKV, VOC, SEQ = 16, 24, 2, 4, 2, 300, 8


def _random_llama2c(version: int, tied: bool, seed: int = 0) -> tuple[bytes, dict[str, np.ndarray]]:
    """A llama2.c file written the way export.py writes it, and its tensors by llama2.c name."""
    rng = np.random.default_rng(seed)
    hd, kvd = DIM // NH, NKV * DIM // NH
    shapes = {"emb": (VOC, DIM), "rms_att": (NL, DIM), "wq": (NL, DIM, DIM), "wk": (NL, kvd, DIM),
              "wv": (NL, kvd, DIM), "wo": (NL, DIM, DIM), "rms_ffn": (NL, DIM), "w1": (NL, HID, DIM),
              "w2": (NL, DIM, HID), "w3": (NL, HID, DIM), "rms_final": (DIM,),
              "fcr": (SEQ, hd // 2), "fci": (SEQ, hd // 2), "wcls": (VOC, DIM)}
    t = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if version == 0:
        head = struct.pack("<7i", DIM, HID, NL, NH, NKV, VOC if tied else -VOC, SEQ)
        order = ["emb", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final",
                 "fcr", "fci"]
    else:
        head = struct.pack("<Ii7iB", MAGIC, 1, DIM, HID, NL, NH, NKV, VOC, SEQ, int(tied))
        head += b"\0" * (256 - len(head))
        order = ["rms_att", "rms_ffn", "rms_final", "emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    order += [] if tied else ["wcls"]
    return head + b"".join(t[k].tobytes() for k in order), t


@pytest.mark.parametrize("version,tied", [(0, True), (0, False), (1, True), (1, False)])
def test_llama2c_layouts(tmp_path: Path, version: int, tied: bool) -> None:
    blob, t = _random_llama2c(version, tied)
    (tmp_path / "m.bin").write_bytes(blob)
    src = read_llama2c(tmp_path / "m.bin")
    c = src.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.max_position_embeddings) == (DIM, HID, NL, NH, NKV, VOC, SEQ)
    assert c.tie_word_embeddings == tied and src.tokenizer_json is None
    assert src.names == list(dense_shapes(c))
    def eq(name: str, want: np.ndarray) -> None:
        np.testing.assert_array_equal(src.get(name).numpy(), want, err_msg=name)

    eq(names.EMBED, t["emb"])
    eq(names.FINAL_NORM, t["rms_final"])
    if not tied:
        eq(names.LM_HEAD, t["wcls"])
    for i in range(NL):
        def ln(key: str, i: int = i) -> str:
            return names.layer_name(key, i)

        eq(ln("input_norm"), t["rms_att"][i])
        eq(ln("post_norm"), t["rms_ffn"][i])
        eq(ln("q_proj"), meta_to_hf_rope_rows(torch.from_numpy(t["wq"][i]), NH).numpy())
        eq(ln("k_proj"), meta_to_hf_rope_rows(torch.from_numpy(t["wk"][i]), NKV).numpy())
        eq(ln("v_proj"), t["wv"][i])
        eq(ln("o_proj"), t["wo"][i])
        eq(ln("gate_proj"), t["w1"][i])
        eq(ln("down_proj"), t["w2"][i])
        eq(ln("up_proj"), t["w3"][i])


def test_llama2c_errors(tmp_path: Path) -> None:
    blob, _ = _random_llama2c(0, True)
    (tmp_path / "cut.bin").write_bytes(blob[:-4])
    with pytest.raises(SourceError, match=r"cut.bin: \d+ bytes, expected \d+ .*truncated"):
        read_llama2c(tmp_path / "cut.bin")
    (tmp_path / "long.bin").write_bytes(blob + b"\0" * 8)
    with pytest.raises(SourceError, match="long.bin.*longer than its header"):
        read_llama2c(tmp_path / "long.bin")
    v2 = struct.pack("<Ii7iB", MAGIC, 2, DIM, HID, NL, NH, NKV, VOC, SEQ, 1).ljust(256, b"\0")
    (tmp_path / "v2.bin").write_bytes(v2)
    with pytest.raises(SourceError, match="v2.bin: llama2.c version 2"):
        read_llama2c(tmp_path / "v2.bin")
    (tmp_path / "junk.bin").write_bytes(b"PK\x03\x04" + bytes(range(200)))
    with pytest.raises(SourceError, match="junk.bin: not a llama2.c model"):
        read_llama2c(tmp_path / "junk.bin")
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    with pytest.raises(SourceError, match="too short"):
        read_llama2c(tmp_path / "tiny.bin")
    with pytest.raises(SourceError, match="cannot read"):
        read_llama2c(tmp_path / "absent.bin")


@needs_data
def test_stories260k(tmp_path: Path) -> None:
    src = read_llama2c(MODEL)
    c = src.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.max_position_embeddings) == (64, 172, 5, 8, 4, 512, 512)
    assert c.tie_word_embeddings and names.LM_HEAD not in src.tensors
    assert (c.rms_norm_eps, c.rope_theta, c.bos_token_id, c.eos_token_id) == (1e-5, 10000.0, 1, 2)
    assert src.tokenizer_json is not None  # tok512.bin found beside the model
    for name, shape in dense_shapes(c).items():
        assert src.tensors.shape(name) == shape and src.get(name).dtype == torch.float32
    (tmp_path / "cut.bin").write_bytes(MODEL.read_bytes()[:500_000])
    with pytest.raises(SourceError, match="cut.bin: 500000 bytes, expected 1056540 .*truncated"):
        read_llama2c(tmp_path / "cut.bin")


# --- Hugging Face directories -----------------------------------------------------------------

@pytest.fixture(scope="module")
def stories_src():
    if not MODEL.is_file():
        pytest.skip(f"real data not found at {DATA}")
    return read_llama2c(MODEL)


@needs_data
@pytest.mark.parametrize("shard", [None, "100KB"])
def test_read_hf_equals_llama2c(tmp_path: Path, stories_src, shard: str | None) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**llama_config_dict(stories_src.config))
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict({n: stories_src.get(n) for n in stories_src.names}, strict=False)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kw)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    (tmp_path / "tokenizer.json").write_text(stories_src.tokenizer_json)
    src = read_source(tmp_path)
    assert src.config == stories_src.config and src.names == stories_src.names
    assert src.tokenizer_json == stories_src.tokenizer_json
    for n in src.names:
        assert torch.equal(src.get(n), stories_src.get(n)), n


def _hf_dir(tmp_path: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@needs_data
def test_read_hf_errors(tmp_path: Path, stories_src) -> None:
    llama = llama_config_dict(stories_src.config)
    with pytest.raises(SourceError, match="config.json: missing"):
        read_hf(tmp_path)
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64}
    (tmp_path / "a").mkdir()
    with pytest.raises(SourceError, match="not a LLaMA config.*gpt2"):
        read_hf(_hf_dir(tmp_path / "a", gpt2))
    (tmp_path / "b").mkdir()
    with pytest.raises(SourceError, match="no model.safetensors"):
        read_hf(_hf_dir(tmp_path / "b", llama))
    tensors = {n: stories_src.get(n) for n in stories_src.names}
    dropped = names.layer_name("v_proj", 3)
    del tensors[dropped]
    (tmp_path / "c").mkdir()
    with pytest.raises(SourceError, match=f"missing tensor {dropped}"):
        read_hf(_hf_dir(tmp_path / "c", llama, tensors))
    tensors[dropped] = torch.zeros(3, 3)
    (tmp_path / "d").mkdir()
    with pytest.raises(SourceError, match=f"{dropped} has shape \\(3, 3\\)"):
        read_hf(_hf_dir(tmp_path / "d", llama, tensors))
    (tmp_path / "e").mkdir()
    with pytest.raises(SourceError, match="RoPE type 'llama3'"):
        read_hf(_hf_dir(tmp_path / "e", {**llama, "rope_scaling": {"rope_type": "llama3"}}))


# --- the first layers of a source (`gsm convert --layers`) ------------------------------------

@needs_data
def test_first_layers_keep_the_source_as_read(stories_src) -> None:
    """The first N decoder layers, the embedding, final norm and tokenizer exactly as read; the config says N layers,
    and nothing of a later layer is left."""
    cut = first_layers(stories_src, 2)
    assert cut.config == dataclasses.replace(stories_src.config, num_hidden_layers=2)
    assert cut.names == list(dense_shapes(cut.config))
    assert {n for n in stories_src.names if n not in cut.names} == {
        n for n in stories_src.names if n.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4."))}
    for n in cut.names:
        assert cut.tensors.shape(n) == stories_src.tensors.shape(n) and torch.equal(cut.get(n), stories_src.get(n))
    assert (cut.tokenizer_json, cut.tokenizer_config) == (stories_src.tokenizer_json, stories_src.tokenizer_config)
    assert cut.origin == f"{stories_src.origin} (first 2 of its 5 layers)"
    assert first_layers(stories_src, 5) is stories_src
    for n in (0, 6):
        with pytest.raises(SourceError, match=f"--layers {n}: the model has 5 decoder layers; keep 1 to 5"):
            first_layers(stories_src, n)
