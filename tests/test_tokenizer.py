"""Tokenizer conversions: byte-level round trip; llama2.c / SentencePiece parity with sentencepiece."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gsm.tokenizer import byte_level_tokenizer_json, tokenizer_from_json

TRICKY = ["", " ", "  two leading", "trailing  ", "a  b   c", "\n", "line\nbreak\n\n para",
          "digits 0123456789 3.14", "café 😀 日本", "tab\tand\r\n", "<s> literal </s> <unk>",
          "Ünïcødé ñ ß Ωμέγα Кириллица العربية", "\x00\x7f\u200b\ufeff"]


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
