"""Calibration input -> [B, T] token sequences, with one clear error per kind of bad input.

Accepted inputs (`--data`, `--eval-data`):
- text (`.txt` or any non-token file): paragraphs, tokenised with the checkpoint's tokenizer.json
  (or `--tokenizer`), BOS + seq_len - 1 tokens per window, the converter's recipe
  (gsm.convert.data.token_sequences) -- but no BOS when the checkpoint's tokenizer_config.json says
  `add_bos_token: false` (SmolLM2): a token the model never saw at the start of its training
  windows would distort the latent statistics and the measured perplexity; then seq_len tokens of
  text per window;
- token ids: `.npy` of any integer dtype, or `.bin` of raw little-endian int32. A 1-D array is a
  token stream cut into windows like text (BOS prepended as for text); a 2-D [B, T] array is B
  ready-made sequences, cut to `--seq-len`. Ids must lie in [0, vocab_size);
- a directory: its single `*calib*` data file (and, for held-out quality, its single `*eval*` one).

Every failure is a `CalibrationInputError` naming the file and the flag it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from gsm.checkpoint import TOKENIZER_CONFIG_FILE
from gsm.convert.data import DataError
from gsm.convert.data import token_sequences as convert_token_sequences
from gsm.tokenizer import TokenizerError, load_tokenizer, tokenizer_from_json, tokenizer_json_from_file

TOKEN_SUFFIXES = (".npy", ".bin")
DATA_SUFFIXES = (".txt", *TOKEN_SUFFIXES)
MAX_UNK_FRACTION = 0.01  # more <unk> than this: the tokenizer does not cover the text


class CalibrationInputError(ValueError):
    """Bad calibration input: the message names the file and the flag."""


@dataclass(frozen=True)
class Sequences:
    ids: torch.Tensor  # [B, T] int64
    path: Path
    kind: str  # "text" | "token ids"


def pick_in_dir(folder: Path, pattern: str, flag: str) -> Path | None:
    """The single data file in `folder` whose name contains `pattern`; None when there is none."""
    found = sorted(p for p in folder.iterdir()
                   if p.is_file() and pattern in p.name and p.suffix in DATA_SUFFIXES)
    if len(found) > 1:
        raise CalibrationInputError(f"{flag} {folder}: several files match '*{pattern}*' "
                                    f"({', '.join(p.name for p in found)}); pass one file")
    return found[0] if found else None


def resolve_inputs(data: Path, eval_data: Path | None) -> tuple[Path, Path | None]:
    """(calibration file, held-out file or None) from --data FILE|DIR and --eval-data."""
    if not data.exists():
        raise CalibrationInputError(f"--data {data}: no such file or directory")
    if data.is_dir():
        calib = pick_in_dir(data, "calib", "--data")
        if calib is None:
            files = sorted(p for p in data.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
            if len(files) != 1:
                raise CalibrationInputError(f"--data {data}: expected one '*calib*' file (.txt/.npy/.bin) "
                                            f"or exactly one data file, found {[p.name for p in files]}")
            calib = files[0]
    else:
        calib = data
    if eval_data is None:
        eval_data = pick_in_dir(calib.parent, "eval", "--eval-data")
    elif not eval_data.is_file():
        raise CalibrationInputError(f"--eval-data {eval_data}: no such file")
    if eval_data is not None and eval_data.resolve() == calib.resolve():
        raise CalibrationInputError(f"--eval-data {eval_data} is the calibration file itself; held-out "
                                    "quality must be measured on text calibration did not see")
    return calib, eval_data


def checkpoint_tokenizer(checkpoint: Path, tokenizer: Path | None, vocab_size: int) -> Tokenizer:
    """--tokenizer if given (tokenizer.json, SentencePiece .model, llama2.c .bin), else DIR/tokenizer.json."""
    try:
        if tokenizer is not None:
            return tokenizer_from_json(tokenizer_json_from_file(tokenizer, vocab_size))
        return load_tokenizer(checkpoint)
    except TokenizerError as e:
        if tokenizer is None:
            raise CalibrationInputError(
                f"--checkpoint {checkpoint}: no usable tokenizer.json ({e}); pass --tokenizer FILE, or "
                "give token ids (.npy / .bin) as --data") from e
        raise CalibrationInputError(f"--tokenizer {tokenizer}: {e}") from e
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrationInputError(f"--tokenizer {tokenizer}: unreadable ({e})") from e


def checkpoint_bos(checkpoint: Path, bos_token_id: int) -> int | None:
    """The BOS id to start each window with, or None when tokenizer_config.json has add_bos_token false.

    Without the file (or the key) a BOS is prepended, as runtime.text does and as checkpoints did
    before the file existed.
    """
    path = checkpoint / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return bos_token_id
    try:
        add = json.loads(path.read_text(encoding="utf-8")).get("add_bos_token", True)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise CalibrationInputError(f"--checkpoint {path}: not a readable JSON object ({e})") from e
    if not isinstance(add, bool):
        raise CalibrationInputError(f"--checkpoint {path}: add_bos_token must be true or false, got {add!r}")
    return bos_token_id if add else None


def windows(stream: torch.Tensor, n: int, seq_len: int, bos_id: int | None) -> torch.Tensor:
    """n consecutive windows of a token stream, [n, seq_len]: BOS + seq_len - 1 tokens, or seq_len tokens."""
    body = seq_len - (bos_id is not None)
    rows = stream[: n * body].reshape(n, body)
    if bos_id is None:
        return rows.clone()
    return torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), rows], dim=1)


def token_sequences(path: Path, tokenizer: Tokenizer, *, seq_len: int, max_tokens: int, bos_id: int | None,
                    vocab_size: int) -> torch.Tensor:
    """The converter's windows of a text file (same paragraphs, stream and window count), BOS optional."""
    return convert_token_sequences(path, tokenizer, seq_len=seq_len, max_tokens=max_tokens, bos_id=bos_id,
                                   vocab_size=vocab_size)


def read_token_file(path: Path, flag: str, vocab_size: int) -> np.ndarray:
    """int64 ids of a .npy (integer dtype, 1-D or 2-D) or a .bin (raw int32 little-endian)."""
    try:
        if path.suffix == ".npy":
            a = np.load(path, allow_pickle=False)
        else:
            raw = path.read_bytes()
            if len(raw) % 4:
                raise CalibrationInputError(f"{flag} {path}: {len(raw)} bytes is not a whole number of "
                                            "int32 token ids (.bin token files are raw little-endian int32)")
            a = np.frombuffer(raw, dtype="<i4")
    except CalibrationInputError:
        raise
    except (OSError, ValueError) as e:
        raise CalibrationInputError(f"{flag} {path}: not a readable token-id file ({e})") from e
    if not np.issubdtype(a.dtype, np.integer):
        raise CalibrationInputError(f"{flag} {path}: token ids must be integers, the array holds {a.dtype}")
    if a.ndim not in (1, 2) or a.size == 0:
        raise CalibrationInputError(f"{flag} {path}: expected a non-empty 1-D stream or 2-D [B, T] array of "
                                    f"token ids, got shape {list(a.shape)}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab_size:
        raise CalibrationInputError(f"{flag} {path}: token ids span [{lo}, {hi}], the model's vocabulary is "
                                    f"[0, {vocab_size}): ids from another tokenizer or not token ids at all")
    return a.astype(np.int64)


def token_file_sequences(path: Path, flag: str, *, seq_len: int, max_sequences: int, bos_id: int | None,
                         vocab_size: int) -> torch.Tensor:
    a = read_token_file(path, flag, vocab_size)
    if a.ndim == 2:
        if a.shape[1] < seq_len:
            raise CalibrationInputError(f"{flag} {path}: sequences of {a.shape[1]} tokens, shorter than "
                                        f"--seq-len {seq_len}")
        return torch.from_numpy(a[:max_sequences, :seq_len].copy())
    n = min(a.size // (seq_len - (bos_id is not None)), max_sequences)
    if n == 0:
        raise CalibrationInputError(f"{flag} {path}: {a.size} tokens, fewer than one sequence of "
                                    f"--seq-len {seq_len}")
    return windows(torch.from_numpy(a.copy()), n, seq_len, bos_id)


def text_sequences(path: Path, flag: str, tokenizer: Tokenizer, *, seq_len: int, max_sequences: int,
                   bos_id: int | None, vocab_size: int) -> torch.Tensor:
    try:
        head = path.read_bytes()[:1 << 20]
    except OSError as e:
        raise CalibrationInputError(f"{flag} {path}: unreadable ({e})") from e
    if b"\x00" in head:
        raise CalibrationInputError(f"{flag} {path}: holds NUL bytes, so it is not text; token ids must "
                                    f"be .npy or .bin files")
    try:
        ids = token_sequences(path, tokenizer, seq_len=seq_len, max_tokens=seq_len * max_sequences,
                              bos_id=bos_id, vocab_size=vocab_size)
    except DataError as e:
        raise CalibrationInputError(f"{flag} {e} (--seq-len {seq_len})") from e
    unk = tokenizer.token_to_id("<unk>")
    if unk is not None:
        frac = float((ids[:, int(bos_id is not None):] == unk).float().mean())
        if frac > MAX_UNK_FRACTION:
            raise CalibrationInputError(f"{flag} {path}: {frac:.1%} of the tokens are <unk>; the checkpoint's "
                                        "tokenizer cannot encode this text (wrong language or file?)")
    return ids


def load_sequences(path: Path, flag: str, tokenizer_fn, *, seq_len: int, max_sequences: int, bos_id: int | None,
                   vocab_size: int) -> Sequences:
    """[B, seq_len] ids of a data file; tokenizer_fn() is only called for text (it may raise).

    bos_id None: windows of text alone (checkpoint_bos: add_bos_token false)."""
    if seq_len < 3:
        raise CalibrationInputError(f"--seq-len must be >= 3, got {seq_len}")
    if max_sequences < 1:
        raise CalibrationInputError(f"{flag}: at least one sequence is needed, --samples is {max_sequences}")
    if not path.is_file():
        raise CalibrationInputError(f"{flag} {path}: no such file")
    if path.suffix in TOKEN_SUFFIXES:
        ids = token_file_sequences(path, flag, seq_len=seq_len, max_sequences=max_sequences, bos_id=bos_id,
                                   vocab_size=vocab_size)
        return Sequences(ids, path, "token ids")
    ids = text_sequences(path, flag, tokenizer_fn(), seq_len=seq_len, max_sequences=max_sequences,
                         bos_id=bos_id, vocab_size=vocab_size)
    return Sequences(ids, path, "text")


def ids_sha256(ids: torch.Tensor) -> str:
    """`sha256:` of the int32 little-endian bytes of the token matrix actually calibrated on."""
    import hashlib

    return "sha256:" + hashlib.sha256(ids.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()
