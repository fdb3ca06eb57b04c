"""Real text -> fixed-length token sequences for fitting (calibration part) and measuring (eval part)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer


class DataError(ValueError):
    """Text data that cannot serve: missing, empty, too short, or not decodable."""


def read_paragraphs(path: Path) -> list[str]:
    """Paragraphs separated by blank lines (TinyStories layout); one story per paragraph."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such text file") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    paras = [p for p in paras if p]
    if not paras:
        raise DataError(f"{path}: no text")
    return paras


def text_sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def add_bos_of(tokenizer_config: dict[str, Any] | None) -> bool:
    """The source's `add_bos_token` (HF tokenizer_config.json); true when absent, as LLaMA tokenizers do."""
    value = (tokenizer_config or {}).get("add_bos_token", True)
    if not isinstance(value, bool):
        raise DataError(f"tokenizer_config.json: add_bos_token must be true or false, got {value!r}")
    return value


def token_sequences(path: Path, tokenizer: Tokenizer, *, seq_len: int, max_tokens: int, bos_id: int | None,
                    vocab_size: int) -> torch.Tensor:
    """[B, seq_len] windows: BOS, then seq_len - 1 tokens of the text read as one stream; with
    bos_id None (a model whose tokenizer adds no BOS, e.g. SmolLM2) seq_len tokens of text.

    Paragraphs are encoded one by one (a SentencePiece dummy prefix makes that equal to joining
    them with spaces) and concatenated in file order; windows do not overlap; at most max_tokens
    tokens in all. A story may span paragraphs, so BOS marks window starts, not paragraphs.
    Raises DataError when not even one window fits.
    """
    if seq_len < 2:
        raise DataError(f"sequence length must be >= 2, got {seq_len}")
    return stream_windows(token_stream(path, tokenizer, max_tokens), seq_len=seq_len, max_tokens=max_tokens,
                          bos_id=bos_id, vocab_size=vocab_size, where=str(path))


def token_stream(path: Path, tokenizer: Tokenizer, max_tokens: int) -> list[int]:
    """The text's paragraphs encoded one by one and concatenated in file order: at least max_tokens ids
    when the text has them (the last paragraph is not cut)."""
    stream: list[int] = []
    for para in read_paragraphs(path):
        stream.extend(tokenizer.encode(para, add_special_tokens=False).ids)
        if len(stream) >= max_tokens:
            break
    return stream


def stream_windows(stream: list[int], *, seq_len: int, max_tokens: int, bos_id: int | None, vocab_size: int,
                   where: str) -> torch.Tensor:
    """token_sequences' windows of an already encoded stream."""
    body = seq_len if bos_id is None else seq_len - 1
    n = min(len(stream), max_tokens) // seq_len
    if n == 0:
        raise DataError(f"{where}: {len(stream)} tokens, fewer than one sequence of {seq_len}")
    rows = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    ids = rows if bos_id is None else torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), rows], dim=1)
    if int(ids.max()) >= vocab_size:
        raise DataError(f"{where}: tokenizer produced id {int(ids.max())}, model vocabulary is {vocab_size}")
    return ids
