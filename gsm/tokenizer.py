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

import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
N_BYTE_TOKENS = 256
BYTE_LEVEL_MIN_VOCAB = 3 + N_BYTE_TOKENS  # <unk> <s> </s> + 256 bytes


SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")

# SentencePiece piece types (sentencepiece_model.proto ModelProto.SentencePiece.Type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


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


# Words of children's stories, most common first: the demo vocabulary's multi-character tokens.
_DEMO_WORDS = (
    " the", " a", " and", " was", " to", " he", " she", " it", " in", " of", " day", " big", " little",
    " girl", " boy", " dog", " cat", " ball", " tree", " sun", " park", " play", " happy", " saw", " said",
    " time", " upon", "Once", " there", " named", " Lily", " Tom", " friend", " mom", " home", " fun", " red",
    " blue", " bird", " sky", " toy", " box", " car", " cake", " fish", " frog", " hat", " jump", " run",
    " smile", " sing", " look", " found", " went", " wanted", " loved", " very", " with", " they", " her",
    " his", " one", " on", " at", " for", " but", " so", " not", " you", " we", " all", " is", " had", ".", ",",
)
_DEMO_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def demo_tokenizer_json(vocab_size: int) -> str:
    """A tokenizer.json whose every token decodes to printable ASCII text, for seeded random demo models.

    A random model samples tokens uniformly-ish; with a byte-level vocabulary half of them are lone
    bytes >= 0x80 that decode to U+FFFD, which a newcomer reads as an encoding bug. Here: id 0
    `<unk>`, 1 `<s>`, 2 `</s>`, then the 95 printable ASCII characters and newline, then words of
    children's stories (with their leading space) built by BPE merges, until vocab_size; ids left
    over are `<unused_N>` specials (skipped when decoding). Text outside printable ASCII encodes to
    `<unk>`. No special tokens are added: callers prepend BOS.
    """
    base = 3 + len(_DEMO_CHARS)
    if vocab_size < base:
        raise ValueError(f"demo tokenizer needs vocab_size >= {base} (3 special + {len(_DEMO_CHARS)} characters), "
                         f"got {vocab_size}")
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    vocab.update({c: 3 + i for i, c in enumerate(_DEMO_CHARS)})
    merges: list[tuple[str, str]] = []
    for word in _DEMO_WORDS:
        new = [word[:k] for k in range(2, len(word) + 1) if word[:k] not in vocab]
        if len(vocab) + len(new) > vocab_size:
            break
        for piece in new:  # each prefix merges with its next character: " t"+"h" -> " th"
            merges.append((piece[:-1], piece[-1]))
            vocab[piece] = len(vocab)
    unused = [f"<unused_{n}>" for n in range(vocab_size - len(vocab))]
    vocab.update({t: len(vocab) + n for n, t in enumerate(unused)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([_special(t) for t in (UNK, BOS, EOS, *unused)])
    return tok.to_str()


def llama_tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json content for the <unk>/<s>/</s> tokenizers built here from llama2.c and
    SentencePiece files: LLaMA's convention, BOS prepended, no EOS (run.c's encode(bos=1, eos=0))."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "unk_token": UNK, "add_bos_token": True, "add_eos_token": False}


def tokenizer_from_json(tokenizer_json: str) -> Tokenizer:
    """A `Tokenizer` from JSON text that encodes literal "<s>" etc. as plain text (see module doc)."""
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return tok


def load_tokenizer(dir_or_file: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (a directory holding one, or the file itself); see `tokenizer_from_json`."""
    path = Path(dir_or_file)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"{file}: no tokenizer.json there")
    try:
        return tokenizer_from_json(file.read_text(encoding="utf-8"))
    except Exception as e:  # tokenizers raises plain Exception on malformed JSON
        raise TokenizerError(f"{file}: not a valid tokenizers JSON ({e})") from e


_ALL = 2**31 - 1  # "strip every leading space" for decoders.Strip


# --- SentencePiece BPE ------------------------------------------------------------------------

@dataclass(frozen=True)
class _SpmBpe:
    """What a SentencePiece BPE model needs to be rebuilt: pieces by id, scores, types, normaliser."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    byte_fallback: bool
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    precompiled_charsmap: bytes = b""
    unk: str = UNK


def _bpe_merges(spm: _SpmBpe) -> list[tuple[str, str]]:
    """Merges as transformers' SentencePiece converter derives them.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the best-scoring
    normal piece; HF BPE applies the lowest-ranked merge. Every split of every normal piece into two
    normal pieces is a merge, ranked by the merged piece's score (then id, then split) so the ranks
    reproduce SentencePiece's choice. Control, byte and unused pieces never take part in merges.
    """
    normal = {p: (s, i) for i, (p, s, t) in enumerate(zip(spm.pieces, spm.scores, spm.types))
              if t == NORMAL}
    ranked = []
    for piece, (score, idx) in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-score, idx, left, right))
    return [(left, right) for _, _, left, right in sorted(ranked)]


def _spm_bpe_json(spm: _SpmBpe, origin: str) -> str:
    vocab: dict[str, int] = {}
    for i, piece in enumerate(spm.pieces):
        if piece in vocab:
            raise TokenizerError(f"{origin}: piece {piece!r} appears twice (ids {vocab[piece]} and {i})")
        vocab[piece] = i
    if spm.unk not in vocab:
        raise TokenizerError(f"{origin}: no {spm.unk} piece")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_bpe_merges(spm), unk_token=spm.unk, fuse_unk=True,
                               byte_fallback=spm.byte_fallback))
    # SentencePiece's normaliser order: charsmap, whitespace clean-up, dummy prefix, escaping.
    # SentencePiece's normaliser (normalizer.cc), step by step. Only the space character counts as
    # whitespace (newlines and tabs are kept), except at the end, where escaped spaces are trimmed
    # after escaping, so a literal "▁" there goes too.
    norm: list[normalizers.Normalizer] = []
    if spm.precompiled_charsmap:
        norm.append(normalizers.Precompiled(spm.precompiled_charsmap))
    if spm.remove_extra_whitespaces:
        norm += [normalizers.Replace(Regex(r"\A +"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spm.add_dummy_prefix:
        norm.append(normalizers.Prepend(SPACE))  # a no-op on empty text, as in SentencePiece
    if spm.escape_whitespaces:
        norm.append(normalizers.Replace(" ", SPACE))
    if spm.remove_extra_whitespaces:
        space = SPACE if spm.escape_whitespaces else " "
        norm.append(normalizers.Replace(Regex(f"{space}+\\z"), ""))
    tok.normalizer = normalizers.Sequence(norm)
    dec: list[decoders.Decoder] = [decoders.Replace(SPACE, " ")]
    if spm.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if spm.add_dummy_prefix:
        # After Fuse, so only the text's start is stripped. SentencePiece drops the dummy prefix, or
        # with whitespace clean-up on, every leading space.
        dec.append(decoders.Strip(content=" ", left=_ALL if spm.remove_extra_whitespaces else 1, right=0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_special_tokens([_special(p) for p, t in zip(spm.pieces, spm.types)
                            if t in (UNKNOWN, CONTROL, UNUSED)])
    # SentencePiece (and llama.cpp) match user-defined pieces whole, before BPE
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, t in zip(spm.pieces, spm.types) if t == USER_DEFINED])
    return tok.to_str()


def read_llama2c_tokenizer(tok_bin: Path, vocab_size: int | None = None) -> tuple[list[str], list[float]]:
    """Pieces and scores of a llama2.c tokenizer.bin, undoing its export (" " back to "▁", BOS/EOS names).

    Layout: int32 max_token_length, then per piece float32 score, int32 byte length, UTF-8 bytes.
    With `vocab_size`, the file must hold exactly that many pieces (run.c reads that many).
    """
    tok_bin = Path(tok_bin)
    try:
        data = tok_bin.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{tok_bin}: cannot read llama2.c tokenizer ({e})") from e
    if len(data) < 4:
        raise TokenizerError(f"{tok_bin}: {len(data)} bytes, too short for a llama2.c tokenizer header")
    (max_len,) = struct.unpack_from("<i", data, 0)
    off, pieces, scores = 4, [], []
    while off < len(data) and (vocab_size is None or len(pieces) < vocab_size):
        if off + 8 > len(data):
            raise TokenizerError(f"{tok_bin}: truncated in the header of piece {len(pieces)}")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n < 0 or n > max_len or off + n > len(data):
            raise TokenizerError(f"{tok_bin}: piece {len(pieces)} has length {n} (max_token_length "
                                 f"{max_len}, {len(data) - off} bytes left): not a llama2.c tokenizer")
        try:
            text = data[off:off + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{tok_bin}: piece {len(pieces)} is not UTF-8 ({e})") from e
        off += n
        pieces.append(text.replace(" ", SPACE))
        scores.append(score)
    if vocab_size is not None and (len(pieces) != vocab_size or off != len(data)):
        raise TokenizerError(f"{tok_bin}: expected exactly {vocab_size} pieces (the model's vocab_size), "
                             f"found {len(pieces)}{' and trailing bytes' if off != len(data) else ''}")
    if len(pieces) < 3:
        raise TokenizerError(f"{tok_bin}: {len(pieces)} pieces; need at least <unk>, <s>, </s>")
    # export.py writes BOS/EOS as "\n<s>\n" / "\n</s>\n"; ids 0/1/2 are always <unk>/<s>/</s>
    pieces[:3] = [UNK, BOS, EOS]
    return pieces, scores


def llama2c_tokenizer_json(tok_bin: Path, vocab_size: int | None = None, *,
                           remove_extra_whitespaces: bool = True) -> str:
    """tokenizer.json equal to the SentencePiece BPE model a llama2.c `tokenizer.bin` was exported from.

    The .bin keeps pieces and scores but not the normaliser settings; we assume SentencePiece's
    defaults (dummy prefix, escaped spaces, runs of spaces collapsed and ends trimmed), which is what
    llama2.c's `train_vocab` produces (tok{N}.bin). Meta's LLaMA tokenizer turns the whitespace
    clean-up off: pass `remove_extra_whitespaces=False` for a tokenizer.bin exported from it.
    Pieces `<0xXX>` are byte-fallback pieces; ids 0/1/2 are <unk>/<s>/</s>.
    """
    pieces, scores = read_llama2c_tokenizer(tok_bin, vocab_size)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE if _BYTE_PIECE.fullmatch(p) else NORMAL for p in pieces[3:]]
    byte_fallback = sum(t == BYTE for t in types) == N_BYTE_TOKENS
    spm = _SpmBpe(pieces, scores, types, byte_fallback=byte_fallback,
                  remove_extra_whitespaces=remove_extra_whitespaces)
    return _spm_bpe_json(spm, str(tok_bin))


def sentencepiece_tokenizer_json(model_path: Path) -> str:
    """tokenizer.json equal to a SentencePiece BPE `.model` (pieces, scores, types, normaliser spec).

    Needs `sentencepiece` and `protobuf` at conversion time only (the normaliser spec is read from
    the model proto). Unigram models and user-defined pieces are not supported (LLaMA-family
    tokenizers use neither).
    """
    model_path = Path(model_path)
    try:
        import sentencepiece as spm_lib
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise TokenizerError(f"{model_path}: converting a SentencePiece model needs the "
                             f"'sentencepiece' and 'protobuf' packages ({e})") from e
    try:
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model_path.read_bytes())
        sp = spm_lib.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except Exception as e:  # protobuf's DecodeError and sentencepiece's RuntimeError
        raise TokenizerError(f"{model_path}: not a SentencePiece model ({e})") from e
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        raise TokenizerError(f"{model_path}: only SentencePiece BPE models are supported")
    n = sp.get_piece_size()
    types = [p.type for p in proto.pieces]
    if USER_DEFINED in types:
        raise TokenizerError(f"{model_path}: user-defined pieces (id {types.index(USER_DEFINED)}) "
                             "are not supported")
    if n < 3 or [sp.unk_id(), sp.bos_id(), sp.eos_id()] != [0, 1, 2]:
        raise TokenizerError(f"{model_path}: expected <unk>/<s>/</s> at ids 0/1/2, got "
                             f"{[sp.unk_id(), sp.bos_id(), sp.eos_id()]}")
    pieces = [sp.id_to_piece(i) for i in range(n)]
    pieces[:3] = [UNK, BOS, EOS]
    ns = proto.normalizer_spec
    spm = _SpmBpe(pieces, [sp.get_score(i) for i in range(n)], types,
                  byte_fallback=proto.trainer_spec.byte_fallback,
                  add_dummy_prefix=ns.add_dummy_prefix,
                  remove_extra_whitespaces=ns.remove_extra_whitespaces,
                  escape_whitespaces=ns.escape_whitespaces,
                  precompiled_charsmap=bytes(ns.precompiled_charsmap))
    return _spm_bpe_json(spm, str(model_path))


def tokenizer_json_from_file(path: Path, vocab_size: int | None = None) -> str:
    """tokenizer.json text from any tokenizer file we know: .json as is, .model, else llama2.c .bin."""
    path = Path(path)
    if path.suffix == ".json":
        return path.read_text(encoding="utf-8")
    if path.suffix == ".model":
        return sentencepiece_tokenizer_json(path)
    return llama2c_tokenizer_json(path, vocab_size)


def find_llama2c_tokenizer(model_bin: Path, vocab_size: int) -> Path | None:
    """The tokenizer llama2.c's run.c would pair with `model_bin`: tok{vocab_size}.bin, then tokenizer.bin."""
    folder = Path(model_bin).parent
    for name in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        if (folder / name).is_file():
            return folder / name
    return None


# --- GGUF vocabularies (llama.cpp metadata) -----------------------------------------------------

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`. GPT-2's own regex is
# what tokenizers' ByteLevel(use_regex=True) applies, so those entries need no Split of their own.
_GPT2_REGEX = None
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (split digits one by one first, regex after)
GGUF_PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, _GPT2_REGEX), "gpt-2": (False, _GPT2_REGEX),
    "smollm": (True, _GPT2_REGEX), "starcoder": (True, _GPT2_REGEX), "refact": (True, _GPT2_REGEX),
    "llama-bpe": (False, _LLAMA3_REGEX), "llama3": (False, _LLAMA3_REGEX), "llama-v3": (False, _LLAMA3_REGEX),
}


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a GGUF file, as plain Python values.

    `model` is "llama" (SentencePiece BPE: pieces with scores) or "gpt2" (byte-level BPE with
    merges); `types` are llama.cpp token types, numbered as SentencePiece piece types.
    """

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    unk_id: int | None = None
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None
    precompiled_charsmap: bytes = b""


def gguf_tokenizer_json(vocab: GGUFVocab, origin: str) -> str:
    """tokenizer.json for a GGUF vocabulary, tokenizing as llama.cpp does (see docs/sources.md).

    Like every tokenizer here it adds no BOS/EOS itself; tokenizer_config.json says whether to.
    """
    if len(vocab.types) != len(vocab.tokens):
        raise TokenizerError(f"{origin}: tokenizer.ggml.token_type has {len(vocab.types)} entries for "
                             f"{len(vocab.tokens)} tokens")
    if vocab.model == "llama":
        return _gguf_spm_json(vocab, origin)
    if vocab.model == "gpt2":
        return _gguf_byte_level_json(vocab, origin)
    raise TokenizerError(f"{origin}: tokenizer.ggml.model {vocab.model!r} is not supported "
                         "(expected 'llama' or 'gpt2')")


def _gguf_spm_json(vocab: GGUFVocab, origin: str) -> str:
    if vocab.scores is None or len(vocab.scores) != len(vocab.tokens):
        raise TokenizerError(f"{origin}: tokenizer.ggml.scores missing or not one per token "
                             "(needed by a 'llama' tokenizer)")
    unk_id = vocab.unk_id if vocab.unk_id is not None and vocab.unk_id < len(vocab.tokens) else 0
    # llama.cpp's defaults when the keys are absent: dummy prefix on, whitespace clean-up off
    spm = _SpmBpe(list(vocab.tokens), [float(s) for s in vocab.scores], list(vocab.types),
                  byte_fallback=sum(t == BYTE for t in vocab.types) == N_BYTE_TOKENS,
                  add_dummy_prefix=True if vocab.add_space_prefix is None else vocab.add_space_prefix,
                  remove_extra_whitespaces=bool(vocab.remove_extra_whitespaces),
                  precompiled_charsmap=vocab.precompiled_charsmap, unk=vocab.tokens[unk_id])
    return _spm_bpe_json(spm, origin)


def _gguf_byte_level_json(vocab: GGUFVocab, origin: str) -> str:
    if vocab.merges is None:
        raise TokenizerError(f"{origin}: tokenizer.ggml.merges missing (needed by a 'gpt2' tokenizer)")
    pre = vocab.pre or "default"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(f"{origin}: tokenizer.ggml.pre {pre!r} is not supported "
                             f"(supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})")
    ids: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        if t in ids:
            raise TokenizerError(f"{origin}: token {t!r} appears twice (ids {ids[t]} and {i})")
        ids[t] = i
    merges = []
    for n, m in enumerate(vocab.merges):
        pair = m.split(" ")
        if len(pair) != 2:
            raise TokenizerError(f"{origin}: merge {n} {m!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False))
    digits, regex = GGUF_PRE_TOKENIZERS[pre]
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([_special(t) for t, ty in zip(vocab.tokens, vocab.types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(vocab.tokens, vocab.types) if ty == USER_DEFINED])
    return tok.to_str()
