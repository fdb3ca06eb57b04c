"""Tokenizer conversions: byte-level round trip; llama2.c .bin and SentencePiece .model converted to
tokenizer.json must give exactly `SentencePieceProcessor`'s ids and decoded text."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from gsm.tokenizer import (
    TokenizerError,
    byte_level_tokenizer_json,
    find_llama2c_tokenizer,
    llama2c_tokenizer_json,
    load_tokenizer,
    sentencepiece_tokenizer_json,
    tokenizer_from_json,
)

needs_data = pytest.mark.skipif(not (DATA / "tok512.model").is_file(),
                                reason=f"real data not found at {DATA}")

TRICKY = ["", " ", "  two leading", "trailing  ", "a  b   c", "\n", " \n ", "line\nbreak\n\n para",
          "digits 0123456789 3.14", "café 😀 日本", "tab\tand\r\n", "<s> literal </s> <unk>",
          "Ünïcødé ñ ß Ωμέγα Кириллица العربية", "\x00\x7f\u200b\ufeff", "▁literal ▁ meta-space▁"]


# --- byte level -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_tok():
    return tokenizer_from_json(byte_level_tokenizer_json(512))


def test_byte_level_layout(byte_tok) -> None:
    assert byte_tok.get_vocab_size() == 512
    assert [byte_tok.id_to_token(i) for i in (0, 1, 2, 3, 258, 259, 511)] == \
        ["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>", "<unused_0>", "<unused_252>"]
    assert byte_tok.encode("A").ids == [3 + 0x41]  # no BOS added by the tokenizer
    assert byte_level_tokenizer_json(259)
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        byte_level_tokenizer_json(258)


@pytest.mark.parametrize("text", TRICKY)
def test_byte_level_round_trip_tricky(byte_tok, text: str) -> None:
    ids = byte_tok.encode(text).ids
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert byte_tok.decode(ids) == text
    assert byte_tok.decode([1, *ids, 2]) == text  # BOS/EOS skipped on decode


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_level_round_trip_any_text(text: str) -> None:
    tok = tokenizer_from_json(byte_level_tokenizer_json(300))
    assert tok.decode(tok.encode(text).ids) == text


# --- SentencePiece parity ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sp():
    spm = pytest.importorskip("sentencepiece")
    return spm.SentencePieceProcessor(model_file=str(DATA / "tok512.model"))


@pytest.fixture(scope="module", params=["tok512.bin", "tok512.model"])
def hf_tok(request):
    if request.param.endswith(".bin"):
        return tokenizer_from_json(llama2c_tokenizer_json(DATA / request.param, 512))
    return tokenizer_from_json(sentencepiece_tokenizer_json(DATA / request.param))


def _paragraphs(n: int) -> list[str]:
    text = (DATA / "tinystories_calib.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()][:n]


def _clean_whitespace(text: str) -> str:
    """What tok512's normaliser keeps of the spaces (remove_extra_whitespaces is on)."""
    return " ".join(part for part in text.split(" ") if part)


@needs_data
def test_parity_with_sentencepiece(sp, hf_tok) -> None:
    texts = _paragraphs(200) + TRICKY
    assert len(texts) > 200
    for text in texts:
        ids = hf_tok.encode(text).ids
        assert ids == sp.encode(text), text
        decoded = hf_tok.decode(ids)
        assert decoded == sp.decode(ids), text
        if "▁" not in text:  # SentencePiece reads a literal "▁" as a space
            assert decoded == _clean_whitespace(text), text
        assert hf_tok.decode([1, *ids, 2]) == decoded


@needs_data
def test_vocab_matches_sentencepiece(sp, hf_tok) -> None:
    assert hf_tok.get_vocab_size() == sp.get_piece_size() == 512
    assert [hf_tok.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    for i in range(3, 512):
        assert hf_tok.id_to_token(i) == sp.id_to_piece(i)


_TEXT = st.text(alphabet=st.sampled_from(list(" \n\t▁abcdefghiLOS.,'!0123é😀日<s>")), max_size=40) | \
    st.text(max_size=30)


@needs_data
@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_parity_with_sentencepiece_fuzzed(sp, hf_tok, text: str) -> None:
    ids = hf_tok.encode(text).ids
    assert ids == sp.encode(text)
    assert hf_tok.decode(ids) == sp.decode(ids)


@needs_data
def test_parity_without_whitespace_cleanup(tmp_path: Path) -> None:
    """Meta's LLaMA tokenizers keep runs of spaces: the same pieces with that normaliser flag off."""
    spm = pytest.importorskip("sentencepiece")
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    proto = pb.ModelProto()
    proto.ParseFromString((DATA / "tok512.model").read_bytes())
    proto.normalizer_spec.remove_extra_whitespaces = False
    (tmp_path / "keep_ws.model").write_bytes(proto.SerializeToString())
    sp_keep = spm.SentencePieceProcessor(model_file=str(tmp_path / "keep_ws.model"))
    toks = [tokenizer_from_json(sentencepiece_tokenizer_json(tmp_path / "keep_ws.model")),
            tokenizer_from_json(llama2c_tokenizer_json(DATA / "tok512.bin",
                                                       remove_extra_whitespaces=False))]
    for text in _paragraphs(50) + TRICKY:
        for tok in toks:
            ids = tok.encode(text).ids
            assert ids == sp_keep.encode(text), text
            assert tok.decode(ids) == sp_keep.decode(ids), text
            if "▁" not in text:
                assert tok.decode(ids) == text


# --- files and errors -------------------------------------------------------------------------

@needs_data
def test_llama2c_tokenizer_errors(tmp_path: Path) -> None:
    data = (DATA / "tok512.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:1000])
    with pytest.raises(TokenizerError, match="cut.bin.*truncated|cut.bin.*piece"):
        llama2c_tokenizer_json(tmp_path / "cut.bin")
    with pytest.raises(TokenizerError, match="expected exactly 600 pieces"):
        llama2c_tokenizer_json(DATA / "tok512.bin", 600)
    with pytest.raises(TokenizerError, match="expected exactly 100 pieces"):
        llama2c_tokenizer_json(DATA / "tok512.bin", 100)
    with pytest.raises(TokenizerError, match="cannot read"):
        llama2c_tokenizer_json(tmp_path / "missing.bin")


def test_find_and_load(tmp_path: Path) -> None:
    model = tmp_path / "m.bin"
    assert find_llama2c_tokenizer(model, 512) is None
    (tmp_path / "tokenizer.bin").write_bytes(b"")
    assert find_llama2c_tokenizer(model, 512) == tmp_path / "tokenizer.bin"
    (tmp_path / "tok512.bin").write_bytes(b"")
    assert find_llama2c_tokenizer(model, 512) == tmp_path / "tok512.bin"
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json(260))
    tok = load_tokenizer(tmp_path)
    assert tok.get_vocab_size() == 260 and tok.encode("<s>").ids == [3 + ord(c) for c in "<s>"]
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nope")
