"""The runtime: a loaded bundle, sequences over it, sampling and generation.

The runtime owns what the graphs do not decide (docs/engine_io.md section 2, "Ownership"): the
cache buffers, the hotness EMA from `attn_mass`, the decode step count and the re-tier passes at the
end of every prefill call and after every `quantization_adaptation_rate`-th decode step, which it
applies through the backend's demotion graph. The call order equals gsm.golden's `prefill` /
`decode`, so a portable bundle reproduces GoldenModel in deployed mode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bundle import BundleError, verify_bundle
from runtime.ort_backend import OrtBackend, StepOutput
from runtime.policy import SequenceState, TierPolicy, retier
from runtime.request import Generation, Token, TokenStream
from runtime.sampling import RequestError, Sampler, SamplingParams
from runtime.text import TextCodec

__all__ = ["BACKENDS", "ContextFullError", "Generation", "Runtime", "Sampler", "Sequence_", "Token", "TokenStream",
           "load"]

BACKENDS = ("auto", "onnxruntime", "tensorrt", "reference")


class ContextFullError(RuntimeError):
    """The sequence would grow past the bundle's max-seq."""


class Sequence_:
    """One sequence's cache and tier state; use Runtime.new_sequence()."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.cache = rt.backend.new_cache(1)
        self.state = SequenceState()
        self.last: StepOutput | None = None

    @property
    def length(self) -> int:
        return self.state.length

    def _forward(self, ids: Sequence[int]) -> StepOutput:
        rt = self.rt
        n0 = self.state.length
        if n0 + len(ids) > rt.n_max:
            raise ContextFullError(f"sequence of {n0 + len(ids)} positions exceeds the bundle's max-seq "
                                   f"{rt.n_max} (rebuild with a larger --max-seq)")
        self.state.add_positions(list(ids))
        out = rt.backend.forward(self.cache, np.asarray([ids], np.int64), np.array([n0], np.int32),
                                 np.array([len(ids)], np.int32), rt.sparse_window)
        self.state.update_hotness(out.attn_mass[0], rt.policy.hotness_decay)
        self.last = out
        return out

    def _retier(self) -> None:
        new_tier = retier(self.state, self.rt.policy, self.rt.n_max)
        if new_tier is not None:
            self.rt.backend.demote(self.cache, new_tier[None])

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Prompt (or more of it), in chunks of at most max-input tokens, each followed by a re-tier
        pass as golden `prefill` does; returns the last position's logits [V]."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        if self.state.length + len(ids) > self.rt.n_max:  # the whole prompt, not the chunk, before any work
            raise ContextFullError(f"{self.state.length} positions + a prompt of {len(ids)} tokens exceed the "
                                   f"bundle's max-seq {self.rt.n_max} (rebuild with a larger --max-seq)")
        step = self.rt.max_input
        for i in range(0, len(ids), step):
            out = self._forward(ids[i:i + step])
            self._retier()
        return out.logits[0, -1]

    def decode(self, token: int) -> np.ndarray:
        """One decode step; re-tier after every `rate`-th step. Returns logits [V]."""
        out = self._forward([int(token)])
        self.state.decode_steps += 1
        if self.state.decode_steps % self.rt.policy.rate == 0:
            self._retier()
        return out.logits[0, -1]


def check_sparse_window(w: int | None, cfg: Mapping[str, Any]) -> int:
    """The run-time window: the model's by default, else 1..max_sparse_window of the bundle."""
    if w is None:
        return int(cfg["sparse_window"])
    hi = int(cfg["max_sparse_window"])
    if isinstance(w, bool) or int(w) != w or not 1 <= w <= hi:
        raise RequestError("sparse_window", f"must be an integer in 1..{hi} (the bundle's max_sparse_window), got {w}")
    return int(w)


class Runtime:
    """A verified bundle with a backend; `generate` / `stream` for text or ids."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], backend: Any, *, sparse_window: int | None) -> None:
        self.bundle = bundle
        self.manifest = manifest
        self.cfg = json.loads((bundle / "bundle.json").read_text(encoding="utf-8"))
        self.backend = backend
        self.n_max = int(self.cfg["n_max"])
        self.max_input = int(self.cfg["max_input"])
        q = self.cfg["kv_quantization"]
        self.policy = TierPolicy(sink_tokens=self.cfg["sink_tokens"], fp16_window=q["fp16_window"],
                                 tier_fractions=tuple(q["tier_fractions"]), hotness_decay=q["hotness_decay"],
                                 rate=self.cfg["quantization_adaptation_rate"],
                                 hot_token_ids=frozenset(q.get("hot_token_ids", [])))
        self.sparse_window = check_sparse_window(sparse_window, self.cfg)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.bos_token_id = int(self.cfg["bos_token_id"])
        self.eos_token_id = int(self.cfg["eos_token_id"])
        self.codec = TextCodec.load(bundle, self.bos_token_id, self.eos_token_id)  # None: ids only

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` of the bundle."""
        return self._need_codec().tokenizer

    def _need_codec(self) -> TextCodec:
        if self.codec is None:
            raise RequestError("prompt", f"{self.bundle} has no tokenizer.json: give token ids instead of text")
        return self.codec

    def new_sequence(self) -> Sequence_:
        return Sequence_(self)

    def encode(self, text: str) -> list[int]:
        """BOS + the text's pieces; no BOS when tokenizer_config.json has add_bos_token: false."""
        return self._need_codec().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_codec().decode(ids)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_ids: Sequence[int] | None = None) -> TokenStream:
        """A request: iterate it for tokens as they come (stop ids end it and are not yielded); after
        that its `ids`, `text` and `finish_reason` hold the outcome. Inputs are checked here, before any
        model work: a RequestError (ValueError) names the parameter."""
        return TokenStream(self, self._prompt_ids(prompt), max_new_tokens,
                           SamplingParams(temperature, top_k, top_p, seed), stop_ids)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> Generation:
        """The whole generation at once; `text` is what follows the prompt (leading space kept)."""
        return self.stream(prompt, max_new_tokens, **kw).collect()

    @property
    def has_chat_template(self) -> bool:
        return self.codec is not None and self.codec.has_chat_template

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The messages rendered by the bundle's chat template (with the generation prompt), as ids."""
        return self._need_codec().encode_chat(messages)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, **kw: Any) -> TokenStream:
        """`stream` on the rendered messages, stopping at EOS and the template's end-of-turn token."""
        kw.setdefault("stop_ids", self._need_codec().chat_stop_ids())
        return self.stream(self.chat_ids(messages), max_new_tokens, **kw)

    def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, **kw: Any) -> Generation:
        """The assistant's answer to `messages` ([{"role": "user", "content": "..."}, ...])."""
        return self.chat_stream(messages, max_new_tokens, **kw).collect()


def load(bundle: str | Path, backend: str = "auto", *, threads: int = 0, sparse_window: int | None = None) -> Runtime:
    """Verify the bundle's hashes, then open it with `backend`.

    auto: TensorRT when the bundle has an engine.plan and TensorRT imports, else ONNX Runtime.
    reference: the TensorRT graph (model.onnx) with the plugins' C++ CPU reference; slow, for checks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    root = Path(bundle)
    manifest = verify_bundle(root)
    try:
        cfg = json.loads((root / "bundle.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{root / 'bundle.json'}: not readable JSON ({e})") from None
    try:
        check_sparse_window(sparse_window, cfg)  # before any graph is opened
    except KeyError as e:
        raise BundleError(f"{root / 'bundle.json'}: no {e} field (rebuild the bundle)") from None
    if isinstance(threads, bool) or int(threads) != threads or threads < 0:
        raise RequestError("threads", f"must be an integer >= 0 (0: ONNX Runtime's default), got {threads}")
    if backend == "auto":
        from runtime.trt_backend import trt_usable

        backend = "tensorrt" if trt_usable(root)[0] else "onnxruntime"
    if backend == "tensorrt":
        from runtime.trt_backend import TrtBackend

        be: Any = TrtBackend(root, cfg)
    elif backend == "reference":  # the TensorRT graph on the plugins' CPU reference (tests, debugging)
        from runtime.ref_backend import RefBackend

        be = RefBackend(root, cfg)
    else:
        be = OrtBackend(root, cfg, threads=threads)
    try:
        return Runtime(root, manifest, be, sparse_window=sparse_window)
    except KeyError as e:
        raise BundleError(f"{root / 'bundle.json'}: no {e} field (rebuild the bundle)") from None
