"""Text side of a bundle: tokenizer.json, tokenizer_config.json (BOS rule, chat template) and the
incremental detokeniser.

Detokenising a stream: the text of generated tokens is `text(prompt + new) - text(prompt)`, never
`text(new)` — SentencePiece-style decoders strip the leading space of a decoded sequence, so decoding
the new tokens alone turns "Once upon a time" into "Once upon atime". Like the streaming
detokenisers of TGI and vLLM, `Detokenizer` decodes only a window `ids[start:]` and emits what the
window adds past `ids[start:read]`; it holds text back while it ends in U+FFFD (a UTF-8 character
split across byte tokens) and flushes it when the sequence ends. The window start moves forward only
to a clean cut: the end of an earlier emission (a complete character) whose following tokens hold a
non-space character, so a decoder's start-of-text space stripping stops inside the part both decodes
share.

Chat templates are rendered as transformers' `apply_chat_template` does (sandboxed jinja2 with
trim_blocks, lstrip_blocks, `raise_exception`, a `tojson` that does not escape HTML, the special
tokens as variables) and the result is encoded with special tokens recognised and no BOS added.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.bundle import BundleError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
REPLACEMENT = "\ufffd"
# End-of-turn tokens of common templates: a chat stops at any of them that the template writes and
# the vocabulary holds, as well as at the EOS token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
# Special-token variables transformers passes to every chat template (special_tokens_map).
TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """No chat template in the bundle, or the template refused the messages."""


def _token_str(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class TokenizerConfig:
    """What the runtime reads from a Hugging Face tokenizer_config.json."""

    add_bos_token: bool = True  # without the file (or the key): BOS prepended, as before the file existed
    chat_template: str | None = None
    special_tokens: Mapping[str, str] | None = None  # bos_token/eos_token/... -> token text

    @classmethod
    def from_json(cls, data: Mapping[str, Any], origin: str) -> TokenizerConfig:
        if not isinstance(data, Mapping):
            raise BundleError(f"{origin}: expected a JSON object")
        add_bos = data.get("add_bos_token", True)
        if not isinstance(add_bos, bool):
            raise BundleError(f"{origin}: add_bos_token must be true or false, got {add_bos!r}")
        template = data.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise BundleError(f"{origin}: chat_template must be a string, got {type(template).__name__}")
        tokens = {k: s for k in TEMPLATE_TOKEN_KEYS if (s := _token_str(data.get(k))) is not None}
        return cls(add_bos_token=add_bos, chat_template=template or None, special_tokens=tokens)

    @classmethod
    def load(cls, bundle: Path) -> TokenizerConfig:
        path = bundle / TOKENIZER_CONFIG_FILE
        if not path.is_file():
            return cls(special_tokens={})
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BundleError(f"{path}: not readable JSON ({e})") from None
        return cls.from_json(data, str(path))


def compile_chat_template(template: str) -> Any:
    """The jinja2 template as transformers compiles it (utils/chat_template_utils.py)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat(template: Any, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str], *,
                add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with a compiled chat template."""
    import jinja2

    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ChatTemplateError(f"message {i}: expected a dict with 'role' and 'content', got {m!r}")
        msgs.append(dict(m))
    try:
        return template.render(messages=msgs, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template refused the messages: {e}") from None


class TextCodec:
    """A bundle's tokenizer and tokenizer config: prompt encoding, chat rendering, decoding.

    Two tokenizer instances because `encode_special_tokens` is a property of the instance and requests
    may run on several threads: plain prompts encode "<s>" as text (SentencePiece behaviour), rendered
    chat templates must turn their control tokens into ids. The chat one is made on first use: a tokenizer of
    SmolLM2's 49K pieces holds ~11 MiB, which a process that never renders a chat does not need.
    """

    def __init__(self, bundle: Path, bos_token_id: int, eos_token_id: int) -> None:
        from gsm.tokenizer import TokenizerError, load_tokenizer

        try:
            self.tokenizer = load_tokenizer(bundle)  # encode_special_tokens = True
        except TokenizerError as e:
            raise BundleError(str(e)) from None
        self._bundle = bundle
        self._chat: Any = None
        self._chat_lock = threading.Lock()
        self.config = TokenizerConfig.load(bundle)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._template: Any = None  # compiled on first use: jinja2 is needed for chat only

    @classmethod
    def load(cls, bundle: Path, bos_token_id: int, eos_token_id: int) -> TextCodec | None:
        """None for a bundle without tokenizer.json (id-only use)."""
        if not (bundle / TOKENIZER_FILE).is_file():
            return None
        return cls(bundle, bos_token_id, eos_token_id)

    @property
    def _chat_tokenizer(self) -> Any:
        """The tokenizer of rendered chat templates (control tokens become ids), made on first use."""
        with self._chat_lock:
            if self._chat is None:
                from gsm.tokenizer import load_tokenizer

                chat = load_tokenizer(self._bundle)
                chat.encode_special_tokens = False
                self._chat = chat
            return self._chat

    def encode(self, text: str) -> list[int]:
        """The text's pieces, after BOS unless tokenizer_config.json says add_bos_token: false."""
        ids = [int(t) for t in self.tokenizer.encode(text).ids]
        return [self.bos_token_id, *ids] if self.config.add_bos_token else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def has_chat_template(self) -> bool:
        return self.config.chat_template is not None

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if self.config.chat_template is None:
            raise ChatTemplateError(f"the bundle has no chat template ({TOKENIZER_CONFIG_FILE} without "
                                    "chat_template); use a prompt instead")
        if self._template is None:  # two threads may both compile it: harmless, same result
            self._template = compile_chat_template(self.config.chat_template)
        return render_chat(self._template, messages, self.config.special_tokens or {},
                           add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """The rendered template's ids; the template writes any BOS itself, none is added."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return [int(t) for t in self._chat_tokenizer.encode(text).ids]

    def last_message_start(self, messages: Sequence[Mapping[str, Any]], ids: Sequence[int]) -> int | None:
        """Where the last message starts in `ids` (encode_chat of `messages`): the length of the earlier messages'
        rendering where that is a prefix of `ids` (None where the template or the tokenizer join them otherwise)."""
        if len(messages) < 2:
            return None
        head = self.encode_chat(messages[:-1], add_generation_prompt=False)
        return len(head) if 0 < len(head) < len(ids) and list(ids[:len(head)]) == head else None

    def chat_stop_ids(self) -> list[int]:
        """EOS (the bundle's and tokenizer_config's) and the end-of-turn tokens the template writes."""
        stops = {self.eos_token_id}
        eos = (self.config.special_tokens or {}).get("eos_token")
        names = [eos] if eos else []
        names += [t for t in END_OF_TURN_TOKENS if t in (self.config.chat_template or "")]
        for name in names:
            i = self._chat_tokenizer.token_to_id(name)
            if i is not None:
                stops.add(int(i))
        return sorted(stops)


class Detokenizer:
    """Text of the tokens generated after a prompt, piece by piece (see the module doc)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int]) -> None:
        self._decode = decode
        self.ids = [int(t) for t in prompt]
        self._start = 0  # window start: a clean cut (the whole prompt at first)
        self._read = len(self.ids)  # ids before this have had their text emitted
        self.text = ""  # everything emitted so far

    def add(self, token: int) -> str:
        """The text `token` completes (may be "" while a character is incomplete)."""
        self.ids.append(int(token))
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back, replacement characters included."""
        return self._emit(final=True) if self._read < len(self.ids) else ""

    def _emit(self, *, final: bool) -> str:
        before = self._decode(self.ids[self._start:self._read])
        after = self._decode(self.ids[self._start:])
        if not final and after.endswith(REPLACEMENT):
            return ""  # an incomplete UTF-8 character, most likely: wait for its other bytes
        delta = after[len(before):]
        if delta.strip(" "):  # text of ids[read:] starts a safe window: later decodes agree on it
            self._start = self._read
        self._read = len(self.ids)
        self.text += delta
        return delta
