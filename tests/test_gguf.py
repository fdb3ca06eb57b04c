"""GGUF reader: dequantisation of every supported type against the gguf library's reference (and
transformers' own torch dequantiser), llama.cpp names and RoPE permutation undone on synthetic
models written with gguf.GGUFWriter, config and tokenizer from metadata, clear errors; on the real
files: stories260K.gguf equals stories260K.bin, SmolLM2 logits equal transformers' GGUF loader,
tokenizers equal transformers' GGUF tokenizer and SentencePiece on the whole eval text."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CALIB_TEXT, DATA, EVAL_TEXT, STORIES
from tokenizers import Tokenizer

from gsm import names
from gsm.config import ModelConfig
from gsm.dense import DenseLlama
from gsm.sources import DenseSource, SourceError, dense_shapes, read_source
from gsm.sources.gguf import SUPPORTED_TYPES, read_gguf
from gsm.tokenizer import tokenizer_from_json

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SMOL = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES_GGUF = DATA / "stories260K.gguf"
needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason=f"real data not found at {DATA}")
needs_stories_gguf = pytest.mark.skipif(not STORIES_GGUF.is_file(), reason=f"real data not found at {DATA}")

# HF short key -> llama.cpp per-layer name (written out here, independently of gsm.sources.gguf)
LLAMA_CPP = {"input_norm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "post_norm": "ffn_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {names.EMBED: "token_embd.weight", names.FINAL_NORM: "output_norm.weight", names.LM_HEAD: "output.weight"}
    if hf in top:
        return top[hf]
    i = int(hf.split(".")[2])
    key = next(k for k in LLAMA_CPP if names.layer_name(k, i) == hf)
    return f"blk.{i}.{LLAMA_CPP[key]}.weight"


def hf_to_gguf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse, by inverting the permutation of row indices (not by the formula under test)."""
    perm = hf_to_gguf_rows(np.arange(w.shape[0]), n_head)  # gguf row r holds HF row perm[r]
    out = np.empty_like(w)
    out[perm] = w
    return out


def random_hf(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in dense_shapes(cfg).items():
        scale = 1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[1])
        w = rng.standard_normal(shape) * scale
        out[name] = ((1.0 + 0.1 * w) if len(shape) == 1 else w).astype(np.float32)
    return out


# byte offsets of the fp16 scale fields in one block of each K-quant (ggml-common.h block layouts);
# random bytes elsewhere are valid quants, random scale bytes could be NaN/Inf halves
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Bytes (or F32/F16 values) of `w` in `qtype`; K-quants (no quantiser in gguf-py): random blocks."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            raw[..., off:off + 2] = rng.uniform(0.001, 0.01, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


def write_gguf(path: Path, cfg: ModelConfig, weights: dict[str, np.ndarray], *, qtype: Q = Q.F32,
               seed: int = 0, vocab: dict | None = None, arch: str = "llama", extra=None) -> dict[str, np.ndarray]:
    """A GGUF file as llama.cpp's convert_hf_to_gguf.py writes one (q/k rows permuted, norms F32).

    Returns what each HF tensor must read back as: gguf's own dequantisation of the stored bytes,
    q/k rows permuted back."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    a = arch + "."
    w.add_uint32(a + "block_count", cfg.num_hidden_layers)
    w.add_uint32(a + "context_length", cfg.max_position_embeddings)
    w.add_uint32(a + "embedding_length", cfg.hidden_size)
    w.add_uint32(a + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(a + "attention.head_count", cfg.num_attention_heads)
    w.add_uint32(a + "attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(a + "rope.freq_base", cfg.rope_theta)
    w.add_uint32(a + "rope.dimension_count", cfg.head_dim)
    if vocab:
        w.add_tokenizer_model(vocab["model"])
        if "pre" in vocab:
            w.add_tokenizer_pre(vocab["pre"])
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        if "merges" in vocab:
            w.add_token_merges(vocab["merges"])
        if "scores" in vocab:
            w.add_token_scores(vocab["scores"])
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        if "add_bos" in vocab:
            w.add_add_bos_token(vocab["add_bos"])
        if "chat_template" in vocab:
            w.add_chat_template(vocab["chat_template"])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    expected = {}
    for name, t in weights.items():
        key = next((k for k in heads if name.endswith(f"self_attn.{k}.weight")), None)
        stored = hf_to_gguf_rows(t, heads[key]) if key else t
        if t.ndim == 1:
            w.add_tensor(gguf_name(name), stored)
            expected[name] = t
            continue
        data = encode(stored, qtype, rng)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(name), data)
        else:
            w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        deq = gguf.quants.dequantize(data, qtype).reshape(t.shape).astype(np.float32)
        expected[name] = gguf_to_hf_rows(deq, heads[key]) if key else deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# 256-wide rows: K-quants pack 256 values per block. Head dim 64, GQA 2:1.
QCFG = ModelConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
# Relative Frobenius error of quantise -> dequantise on Gaussian weights, an upper bound per type
ROUND_TRIP = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 0.01, "Q5_0": 0.05, "Q5_1": 0.05,
              "Q4_0": 0.1, "Q4_1": 0.1}
TRANSFORMERS_DEQUANT = {"Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("qname", SUPPORTED_TYPES)
def test_dequantisation(tmp_path: Path, qname: str) -> None:
    qtype = Q[qname]
    hf = random_hf(QCFG)
    expected = write_gguf(tmp_path / "m.gguf", QCFG, hf, qtype=qtype)
    src = read_gguf(tmp_path / "m.gguf")
    assert src.config == QCFG and src.names == list(dense_shapes(QCFG))
    assert src.tokenizer_json is None and src.tokenizer_config is None
    for name in src.names:
        got = src.get(name)
        assert got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), expected[name], err_msg=name)
        if qname in ROUND_TRIP:  # and close to the weights that were quantised: q/k rows back in HF order
            err = np.linalg.norm(got.numpy() - hf[name]) / np.linalg.norm(hf[name])
            assert err <= ROUND_TRIP[qname], (name, err)
    if qname in TRANSFORMERS_DEQUANT:
        # an independent implementation: transformers' torch dequantiser on the same stored bytes
        from transformers.integrations.gguf.dequant import dequantize as tf_dequantize

        reader = gguf.GGUFReader(tmp_path / "m.gguf")
        for t in reader.tensors:
            if t.tensor_type != qtype:
                continue
            ref = tf_dequantize(torch.from_numpy(np.array(t.data)).reshape(-1), int(qtype))
            ours = gguf.quants.dequantize(t.data, qtype).reshape(-1)
            np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=1e-7, err_msg=t.name)


# --- a tiny model, written as llama.cpp would ----------------------------------------------------

BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # printable ASCII: already byte-level spelled
GPT2_VOCAB = {"model": "gpt2", "pre": "smollm",
              "tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *BYTES, "Ġ", "Ġt", "he", "Ġthe", "12"],
              "merges": ["Ġ t", "h e", "Ġt he", "1 2"], "add_bos": False, "chat_template": "{{ messages }}"}
GPT2_VOCAB["types"] = [3, 3, 3] + [1] * (len(GPT2_VOCAB["tokens"]) - 3)
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=100000.0, torch_dtype="float32",
            vocab_size=len(GPT2_VOCAB["tokens"]), bos_token_id=1, eos_token_id=2)


def hf_logits(cfg: ModelConfig, weights: dict[str, np.ndarray], ids: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaForCausalLM with these HF-layout weights: the independent reference."""
    transformers = pytest.importorskip("transformers")
    from gsm.sources.hf import llama_config_dict

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **llama_config_dict(cfg), attn_implementation="eager")).eval()
    missing, unexpected = model.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=False)
    assert not unexpected and missing == ([names.LM_HEAD] if cfg.tie_word_embeddings else [])
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, True), (1, False)])
def test_tiny_model_reads_back(tmp_path: Path, kv_heads: int, tied: bool) -> None:
    cfg = ModelConfig(**TINY, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    hf = random_hf(cfg, seed=kv_heads)
    write_gguf(tmp_path / "m.gguf", cfg, hf, vocab=GPT2_VOCAB)
    src = read_source(tmp_path / "m.gguf")  # a .gguf path is recognised by read_source too
    assert src.config == cfg
    assert (names.LM_HEAD in src.tensors) == (not tied)
    for name in src.names:  # F32: the HF tensors exactly, q/k permutation undone
        np.testing.assert_array_equal(src.get(name).numpy(), hf[name], err_msg=name)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(DenseLlama(src)(ids), hf_logits(cfg, hf, ids), atol=2e-5, rtol=1e-5)
    assert src.tokenizer_config == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False, "add_eos_token": False, "chat_template": "{{ messages }}"}
    tok = tokenizer_from_json(src.tokenizer_json)
    # merges by rank: "Ġ t" then "h e" then "Ġt he"; no "t he" merge, so "the" stays two tokens
    assert tok.encode("the the").ids == [GPT2_VOCAB["tokens"].index(t) for t in ("t", "he", "Ġthe")]
    # pre-tokenizer "smollm" splits digits one by one before BPE, so the "1 2" merge never applies
    assert tok.encode("12").tokens == ["1", "2"]
    # control tokens are special added tokens (matched whole unless encode_special_tokens is set)
    assert Tokenizer.from_str(src.tokenizer_json).encode("x<|im_start|>").ids == [tok.token_to_id("x"), 1]


def test_llama_tokenizer_defaults(tmp_path: Path) -> None:
    """A 'llama' (SentencePiece) vocabulary: BOS added unless the file says otherwise, scores used."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"]
    vocab = {"model": "llama", "tokens": tokens, "types": [2, 3, 3] + [1] * 6,
             "scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.6, -0.1]}
    cfg = ModelConfig(**{**TINY, "vocab_size": len(tokens)}, num_key_value_heads=2, tie_word_embeddings=True)
    write_gguf(tmp_path / "m.gguf", cfg, random_hf(cfg), vocab=vocab)
    src = read_gguf(tmp_path / "m.gguf")
    assert src.tokenizer_config["add_bos_token"] is True and src.tokenizer_config["bos_token"] == "<s>"
    tok = tokenizer_from_json(src.tokenizer_json)
    assert tok.encode("ab a").tokens == ["▁ab", "▁a"]


def test_errors(tmp_path: Path) -> None:
    cfg = ModelConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True)
    hf = random_hf(cfg)

    def fails(name: str, match: str, **kw) -> None:
        write_gguf(tmp_path / name, cfg, kw.pop("weights", hf), vocab=GPT2_VOCAB, **kw)
        with pytest.raises(SourceError, match=match):
            read_gguf(tmp_path / name)

    fails("arch.gguf", r"arch.gguf: general.architecture is 'gpt2'.*only 'llama'", arch="gpt2")
    fails("moe.gguf", r"moe.gguf: llama.expert_count is 8", extra={"llama.expert_count": 8})
    fails("yarn.gguf", r"rope.scaling.type is 'yarn'", extra={"llama.rope.scaling.type": "yarn"})
    fails("pre.gguf", r"pre.gguf: tokenizer.ggml.pre 'no-such-pre' is not supported",
          extra={"tokenizer.ggml.pre": "no-such-pre"})  # a second key of the same name wins on read
    dropped = dict(hf)
    del dropped[names.layer_name("up_proj", 1)]
    fails("missing.gguf", r"missing.gguf: missing tensor blk.1.ffn_up.weight", weights=dropped)
    # missing metadata key: a writer without feed_forward_length
    w = gguf.GGUFWriter(str(tmp_path / "nokey.gguf"), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"nokey.gguf: missing metadata key llama.embedding_length"):
        read_gguf(tmp_path / "nokey.gguf")
    # an unsupported quant type, named with the tensor
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32 // 32 * 18), np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"iq.gguf: tensor token_embd.weight has type IQ4_NL, which is not supported"):
        read_gguf(tmp_path / "iq.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(SourceError, match="junk.gguf: not a readable GGUF file"):
        read_gguf(tmp_path / "junk.gguf")
    with pytest.raises(SourceError, match="absent.gguf: no such file"):
        read_gguf(tmp_path / "absent.gguf")


def test_cli_bad_gguf_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"nope")
    (tmp_path / "calib.txt").write_text("a b c")
    (tmp_path / "eval.txt").write_text("d e f")
    r = subprocess.run([sys.executable, "-m", "gsm", "convert", "--from", "gguf", str(tmp_path / "junk.gguf"),
                        "--out", str(tmp_path / "out"), "--calib-text", str(tmp_path / "calib.txt"),
                        "--eval-text", str(tmp_path / "eval.txt")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "error: " in r.stderr
    assert "junk.gguf: not a readable GGUF file" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


# --- the real files ------------------------------------------------------------------------------

@needs_stories_gguf
def test_stories260k_gguf_equals_bin() -> None:
    """The same trained weights as stories260K.bin (README: bit-identical); the .bin reader undoes
    llama2.c's Meta layout, this one llama.cpp's permutation: both must land on the same HF rows."""
    from gsm.sources.llama2c import read_llama2c

    g, b = read_gguf(STORIES_GGUF), read_llama2c(STORIES)
    # the file's context length, and the tied classifier stored as its own output.weight
    assert g.config == dataclasses.replace(b.config, max_position_embeddings=2048, tie_word_embeddings=False)
    assert g.names == b.names + [names.LM_HEAD]
    for n in b.names:
        assert torch.equal(g.get(n), b.get(n)), n
    assert torch.equal(g.get(names.LM_HEAD), b.get(names.EMBED))
    assert g.tokenizer_config["add_bos_token"] is True
    assert (g.tokenizer_config["bos_token"], g.tokenizer_config["eos_token"]) == ("<s>", "</s>")


@needs_stories_gguf
def test_stories260k_tokenizer_parity_with_sentencepiece(tmp_path: Path) -> None:
    """The whole eval text: ids equal SentencePiece's on tok512.model with whitespace clean-up off
    (llama.cpp's SentencePiece tokenizer never collapses spaces, and the file does not say to)."""
    spm = pytest.importorskip("sentencepiece")
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    proto = pb.ModelProto()
    proto.ParseFromString((DATA / "tok512.model").read_bytes())
    proto.normalizer_spec.remove_extra_whitespaces = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    tok = tokenizer_from_json(read_gguf(STORIES_GGUF).tokenizer_json)
    text = EVAL_TEXT.read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    assert ids == sp.encode(text)
    assert len(ids) > 70_000
    assert tok.decode(ids) == sp.decode(ids)


@pytest.fixture(scope="module")
def smol():
    if not SMOL.is_file():
        pytest.skip(f"real data not found at {DATA}")
    return read_gguf(SMOL)


@needs_smol
def test_smollm2_metadata(smol: DenseSource) -> None:
    c = smol.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.max_position_embeddings) == (576, 1536, 30, 9, 3, 64, 49152, 8192)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.bos_token_id, c.eos_token_id) == \
        (100000.0, 1e-5, True, 1, 2)
    tc = smol.tokenizer_config
    assert (tc["add_bos_token"], tc["add_eos_token"], tc["bos_token"], tc["eos_token"]) == \
        (False, False, "<|im_start|>", "<|im_end|>")
    assert tc["chat_template"].startswith("{% for message in messages %}")
    assert sum(smol.tensors.shape(n)[0] * (smol.tensors.shape(n)[1] if len(smol.tensors.shape(n)) > 1 else 1)
               for n in smol.names) == 134_515_008  # README: 134.5 M parameters


@needs_smol
def test_smollm2_tokenizer_parity_with_transformers(smol: DenseSource) -> None:
    """transformers' own GGUF tokenizer, on the whole eval text (README: 73,517 tokens) and on a
    chat-formatted prompt whose special tokens must map to their ids."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(DATA, gguf_file=SMOL.name)
    ours = Tokenizer.from_str(smol.tokenizer_json)
    text = EVAL_TEXT.read_text(encoding="utf-8")
    ids = ours.encode(text).ids
    assert len(ids) == 73_517
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    chat = ref.apply_chat_template([{"role": "user", "content": "Give me 3 numbers: 10, 200 and 4.5"}],
                                   tokenize=False, add_generation_prompt=True)
    assert ours.encode(chat).ids == ref(chat, add_special_tokens=False)["input_ids"]
    assert ours.encode(chat).ids[0] == 1  # <|im_start|> is one special token
    assert ours.decode(ids) == ref.decode(ids)
    # where we follow llama.cpp's "smollm" pre-tokenizer (digits split off first) and transformers
    # does not: the two spaces before a digit stay one chunk, "ĠĠ" (docs/sources.md)
    assert ours.encode("x  1").tokens == ["x", "ĠĠ", "1"]


@needs_smol
@pytest.mark.slow
def test_smollm2_logits_equal_transformers(smol: DenseSource) -> None:
    """Dense forward of the dequantised model vs transformers' GGUF loader (which dequantises to
    float32 with its own code), 64 positions of eval text."""
    transformers = pytest.importorskip("transformers")
    tok = tokenizer_from_json(smol.tokenizer_json)
    ids = torch.tensor([tok.encode(EVAL_TEXT.read_text(encoding="utf-8")[:2000]).ids[:64]])
    assert ids.shape == (1, 64)
    ours = DenseLlama(smol)(ids)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(DATA, gguf_file=SMOL.name,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_stories_gguf
@pytest.mark.slow
def test_convert_cli_from_gguf(tmp_path: Path) -> None:
    """The whole converter on stories260K.gguf: a verified checkpoint with tokenizer.json and the
    tokenizer_config.json the GGUF's metadata implies."""
    out = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "gsm", "convert", "--from", "gguf", str(STORIES_GGUF), "--out", str(out),
                        "--sharing", "none", "--calib-text", str(CALIB_TEXT), "--eval-text", str(EVAL_TEXT),
                        "--calib-tokens", "4096", "--eval-tokens", "2048", "--indexer-steps", "20", "--seq-len", "128"],
                       capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["add_bos_token"], tc["bos_token"], tc["eos_token"]) == (True, "<s>", "</s>")
    v = subprocess.run([sys.executable, "-m", "gsm", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 2048
