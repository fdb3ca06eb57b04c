"""Structured output: a request's `response_format` compiled to a grammar, and the token mask it allows at
each step, with llguidance (the `structured` extra).

Why llguidance and not xgrammar: both compile JSON schemas, regexes and grammars to token masks at
microseconds per step; xgrammar's package requires torch, transformers and triton, which the runtime must not
need (a Jetson image ships neither), while llguidance is one Rust extension with a NumPy API and no
dependencies; llama.cpp builds it in, vLLM and SGLang offer it as a backend.

`response_format` takes OpenAI's shapes and two of ours:
    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex", "regex": "..."}                  the whole output matches the regex
    {"type": "grammar", "grammar": "...", "syntax": "gbnf" | "lark"}   llama.cpp's GBNF, or llguidance's Lark
A format the library cannot compile is a RequestError naming `response_format` and the library's reason.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.sampling import RequestError

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
# JSON without free whitespace between tokens (as vLLM's guidance backend defaults to): a small model given
# the choice can emit whitespace until max_tokens; a schema's own "x-guidance" options take precedence
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
GRAMMAR_SYNTAXES = ("gbnf", "lark")


def structured_usable() -> tuple[bool, str]:
    try:
        import llguidance  # noqa: F401
    except ImportError as e:
        return False, f"structured output needs llguidance: pip install 'gsm-edge[structured]' ({e})"
    return True, ""


def _bad(message: str) -> RequestError:
    return RequestError("response_format", message)


def grammar_of(fmt: Mapping[str, Any] | None) -> str | None:
    """The llguidance grammar (its JSON form) of a response_format, None for no constraint; RequestError when the
    format is malformed or does not compile."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _bad(f"expected an object with a 'type', got {fmt!r}")
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise _bad(f"type must be one of {list(FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    ok, why = structured_usable()
    if not ok:
        raise _bad(why)
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    m = llguidance.LLMatcher
    try:
        if kind == "json_object":
            grammar = m.grammar_from_json_schema({"type": "object", **COMPACT})
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
                raise _bad("json_schema: expected {'name': ..., 'schema': {...}} (OpenAI's shape)")
            grammar = m.grammar_from_json_schema({**COMPACT, **spec.get("schema", {})})
        elif kind == "regex":
            if not isinstance(fmt.get("regex"), str):
                raise _bad("regex: expected a string")
            grammar = m.grammar_from_regex(fmt["regex"])
        else:
            text, syntax = fmt.get("grammar"), fmt.get("syntax", "gbnf")
            if not isinstance(text, str) or syntax not in GRAMMAR_SYNTAXES:
                raise _bad(f"grammar: expected a string and syntax one of {list(GRAMMAR_SYNTAXES)}")
            lark = gbnf_to_lark(text) if syntax == "gbnf" else text
            grammar = m.grammar_from_lark(lark)
    except RequestError:
        raise
    except Exception as e:  # the library's own parse errors (ValueError, RuntimeError, ...)
        raise _bad(f"{kind} does not compile: {' '.join(str(e).split())}") from None
    return grammar


@dataclass
class GrammarTokenizer:
    """The bundle's tokenizer as llguidance sees it (built once per runtime: about a second for 49K tokens)."""

    ll: Any  # llguidance.LLTokenizer
    vocab_size: int

    @classmethod
    def from_json(cls, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> GrammarTokenizer:
        """llguidance reads the byte-level, byte-fallback and metaspace tokenizers of tokenizer.json itself; one
        whose decoder it cannot interpret (the demo's character vocabulary with a plain Fuse decoder) is given
        as each token's decoded bytes instead."""
        import llguidance

        try:
            ll = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        except ValueError:
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedTokens(tokenizer_json, vocab_size,
                                                                                   eos_token_id)))
        return cls(ll, vocab_size)


class _DecodedTokens:
    """What llguidance.TokenizerWrapper asks of a tokenizer: token bytes by id, special ids, and encode."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json)
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids = [i for i, t in added.items() if t.special]
        self.tokens = [b"" if i in self.special_token_ids else self._tok.decode([i]).encode("utf-8")
                       for i in range(vocab_size)]
        for i in self.special_token_ids:
            self.tokens[i] = added[i].content.encode("utf-8")
        self.eos_token_id, self.bos_token_id = eos_token_id, None

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s, add_special_tokens=False).ids


class GrammarConstraint:
    """runtime.request_state.TokenConstraint over one llguidance matcher."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        import llguidance
        import llguidance.numpy as lnp

        self.matcher = llguidance.LLMatcher(tokenizer.ll, grammar)
        self._ll = tokenizer.ll
        if self.matcher.is_error():
            raise _bad(f"does not compile: {' '.join(self.matcher.get_error().split())}")
        self.vocab_size = tokenizer.vocab_size
        self._bits = lnp.allocate_token_bitmask(1, tokenizer.ll.vocab_size)
        self._lnp = lnp
        self._filled = False  # _bits holds the mask for the next token already

    def allowed(self) -> np.ndarray:
        if not self._filled:  # not prefetched (prefetch_masks) since the last token
            self._lnp.fill_next_token_bitmask(self.matcher, self._bits, 0)
        self._filled = False
        return unpack_mask(self._bits[0], self.vocab_size)

    def advance(self, token: int) -> None:
        self._filled = False
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {token} was not allowed ({self.matcher.get_error()})")

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())

    def only_token(self) -> int | None:
        """The token the grammar allows next when it allows exactly one (then any logits would pick it), else None."""
        if not self._filled:
            self._lnp.fill_next_token_bitmask(self.matcher, self._bits, 0)
            self._filled = True  # the mask stays valid for allowed() until the next token
        words = self._bits[0]
        nonzero = np.flatnonzero(words)
        if nonzero.size != 1:
            return None
        w = int(words[nonzero[0]]) & 0xFFFFFFFF
        if w & (w - 1):  # more than one bit
            return None
        tok = 32 * int(nonzero[0]) + w.bit_length() - 1
        return tok if tok < self.vocab_size else None

    def forced_end(self, limit: int) -> list[int]:
        """The tokens from here to the grammar's end when each is the only one its step allows and they end it
        within `limit` tokens (a JSON object's closing quote and brace); else []. The matcher is left as it was."""
        if limit <= 0 or not self.matcher.compute_ff_tokens():  # cheap: most steps force nothing
            return []
        out: list[int] = []
        while len(out) < limit and not self.matcher.is_stopped():
            tok = self.only_token()
            if tok is None:
                break
            self.advance(tok)
            out.append(tok)
        ended = bool(self.matcher.is_stopped())
        if out:
            self.matcher.rollback(len(out))
            self._filled = False
        return out if ended else []

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` drafts for what the grammar forces next (a JSON key, its quotes and colon; the matcher's
        state is unchanged): the tokens it forces, else its forced bytes as the tokenizer splits them (after a key
        the bytes `":"` may be one token or several: the model's pick under the mask decides, the verification
        checks)."""
        if limit <= 0:
            return []
        toks = self.matcher.compute_ff_tokens()
        if not toks:
            forced = self.matcher.compute_ff_bytes()
            toks = self._ll.tokenize_bytes(forced) if forced else []
        return [int(t) for t in toks[:limit]]


def unpack_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """llguidance's bitmask (int32 words, bit j of word w = token 32 w + j) -> bool [vocab_size]."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


_EXECUTOR: Any = None


def prefetch_masks(constraints: list[GrammarConstraint]) -> threading.Thread | None:
    """Start computing the next-token masks of several requests, in parallel on llguidance's own threads and
    beside the model call that runs meanwhile (it releases the GIL); join the thread before sampling. Each
    constraint then finds its mask ready in `allowed`."""
    global _EXECUTOR
    if not constraints:
        return None
    import llguidance
    import llguidance.numpy as lnp

    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    words = constraints[0]._bits.shape[1]
    bits = np.full((len(constraints), words), -1, np.int32)

    def fill() -> None:
        lnp.fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, i) for i, c in enumerate(constraints)], bits)
        for i, c in enumerate(constraints):
            c._bits[0] = bits[i]
            c._filled = True

    t = threading.Thread(target=fill, name="gsm-masks", daemon=True)
    t.start()
    return t


class GrammarCache:
    """Compiled grammars by format (requests of one schema share the compile) and the tokenizer, per runtime."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        self._args = (tokenizer_json, vocab_size, eos_token_id)
        self._tok: GrammarTokenizer | None = None
        self._grammars: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def constraint(self, fmt: Mapping[str, Any] | None) -> GrammarConstraint | None:
        key = json.dumps(fmt, sort_keys=True, default=str)
        with self._lock:
            if key not in self._grammars:
                self._grammars[key] = grammar_of(fmt)
            grammar = self._grammars[key]
            if grammar is None:
                return None
            if self._tok is None:
                self._tok = GrammarTokenizer.from_json(*self._args)
            tok = self._tok
        return GrammarConstraint(tok, grammar)
