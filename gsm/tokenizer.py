"""Tokenizers as Hugging Face `tokenizers` JSON, the one tokenizer format the pipeline ships.

Checkpoints arrive with a llama2.c `tokenizer.bin`, a SentencePiece `.model`, or nothing (synthetic
test models). Converting all of them once, at import, to a `tokenizer.json` means the runtime and the
tests depend on `tokenizers` only; `sentencepiece` is needed at conversion time alone.

Conventions shared by every tokenizer built here:
- ids 0, 1, 2 are `<unk>`, `<s>` (BOS), `</s>` (EOS), as in llama2.c and LLaMA SentencePiece models;
- the tokenizer adds no special tokens itself: `encode(text)` returns the text's pieces only and
  callers prepend BOS (llama2.c's `encode(..., bos=1, eos=0)` does the same at the call site);
- `decode` skips the special tokens by default (Hugging Face behaviour);
- literal text such as "<s>" is encoded as ordinary pieces, never as a control token, as
  SentencePiece does: use `tokenizer_from_json` / `load_tokenizer`, which set
  `encode_special_tokens`, a flag the JSON itself cannot carry.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
N_BYTE_TOKENS = 256
BYTE_LEVEL_MIN_VOCAB = 3 + N_BYTE_TOKENS  # <unk> <s> </s> + 256 bytes


class TokenizerError(ValueError):
    """A tokenizer file is missing, truncated or not in the expected format."""


def _byte_piece(b: int) -> str:
    return f"<0x{b:02X}>"


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


def byte_level_tokenizer_json(vocab_size: int) -> str:
    """A byte-level tokenizer.json for synthetic models of `vocab_size` >= 259 tokens.

    id 0 `<unk>`, 1 `<s>`, 2 `</s>`, ids 3..258 the bytes 0x00..0xFF (pieces `<0xXX>`, the layout of
    LLaMA SentencePiece byte-fallback pieces), ids 259..vocab_size-1 unused `<unused_N>` special
    tokens (N counts from 0). Implemented as a merge-free BPE whose vocab holds no character, so
    every character falls back to its UTF-8 bytes; decoding fuses the bytes back, so
    `decode(encode(text)) == text` for any Unicode text. No special tokens are added: callers
    prepend BOS.
    """
    if vocab_size < BYTE_LEVEL_MIN_VOCAB:
        raise ValueError(f"byte-level tokenizer needs vocab_size >= {BYTE_LEVEL_MIN_VOCAB} "
                         f"(3 special + 256 byte tokens), got {vocab_size}")
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    vocab.update({_byte_piece(b): 3 + b for b in range(N_BYTE_TOKENS)})
    unused = [f"<unused_{n}>" for n in range(vocab_size - BYTE_LEVEL_MIN_VOCAB)]
    vocab.update({t: BYTE_LEVEL_MIN_VOCAB + n for n, t in enumerate(unused)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([_special(t) for t in (UNK, BOS, EOS, *unused)])
    return tok.to_str()


def tokenizer_from_json(tokenizer_json: str) -> Tokenizer:
    """A `Tokenizer` from JSON text that encodes literal "<s>" etc. as plain text (see module doc)."""
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return tok
