"""The runtime: a loaded bundle, sequences over it, sampling and generation.

The runtime owns what the graphs do not decide (docs/engine_io.md section 2, "Ownership"): the
cache buffers, the hotness EMA from `attn_mass`, the decode step count and the re-tier passes at the
end of every prefill call and after every `quantization_adaptation_rate`-th decode step, which it
applies through the backend's demotion graph. The call order equals gsm.golden's `prefill` /
`decode`, so a portable bundle reproduces GoldenModel in deployed mode.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bundle import verify_bundle
from runtime.ort_backend import OrtBackend, StepOutput
from runtime.policy import SequenceState, TierPolicy, retier

BACKENDS = ("auto", "onnxruntime", "tensorrt", "reference")


class ContextFullError(RuntimeError):
    """The sequence would grow past the bundle's max-seq."""


@dataclass
class Token:
    id: int
    text: str  # the text this token adds to the decoded output (may be "" inside a UTF-8 sequence)


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (a stop id) | "length" (max_new_tokens) | "context" (max-seq reached)


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


@dataclass
class Sampler:
    """temperature 0 is greedy (argmax, first index on ties); otherwise top-k, then top-p, then draw."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # smallest prefix reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))


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
        w = self.cfg["sparse_window"] if sparse_window is None else sparse_window
        if not 1 <= w <= self.cfg["max_sparse_window"]:
            raise ValueError(f"sparse_window {w} outside 1..{self.cfg['max_sparse_window']} (max_sparse_window)")
        self.sparse_window = w
        self._tok = None

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            from gsm.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.bundle)
        return self._tok

    def new_sequence(self) -> Sequence_:
        return Sequence_(self)

    def encode(self, text: str) -> list[int]:
        """BOS + the text's pieces (the tokenizer adds no special tokens itself)."""
        return [int(self.cfg["bos_token_id"])] + list(self.tokenizer.encode(text).ids)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_ids: Sequence[int] | None = None) -> Iterator[Token]:
        """Yield generated tokens as they come; stop ids end the stream and are not yielded."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        stops = {int(self.cfg["eos_token_id"])} if stop_ids is None else {int(s) for s in stop_ids}
        sample = Sampler(temperature, top_k, top_p, seed)
        seq = self.new_sequence()
        logits = seq.prefill(ids)
        out: list[int] = []
        text_so_far = ""
        self.finish_reason = "length"
        for _ in range(max_new_tokens):
            tok = sample(logits)
            if tok in stops:
                self.finish_reason = "stop"
                return
            out.append(tok)
            text = self._decode(out)
            yield Token(tok, text[len(text_so_far):] if text is not None else "")
            text_so_far = text or ""
            if len(out) == max_new_tokens:
                return
            if seq.length >= self.n_max:
                self.finish_reason = "context"
                return
            logits = seq.decode(tok)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> Generation:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        new = [t.id for t in self.stream(ids, max_new_tokens, **kw)]
        return Generation(ids, new, self._decode(new), self.finish_reason)

    def _decode(self, ids: list[int]) -> str | None:
        if not (self.bundle / "tokenizer.json").is_file():
            return None
        return self.tokenizer.decode(ids)


def load(bundle: str | Path, backend: str = "auto", *, threads: int = 0, sparse_window: int | None = None) -> Runtime:
    """Verify the bundle's hashes, then open it with `backend`.

    auto: TensorRT when the bundle has an engine.plan and TensorRT imports, else ONNX Runtime.
    reference: the TensorRT graph (model.onnx) with the plugins' C++ CPU reference; slow, for checks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    root = Path(bundle)
    manifest = verify_bundle(root)
    cfg = json.loads((root / "bundle.json").read_text(encoding="utf-8"))
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
    return Runtime(root, manifest, be, sparse_window=sparse_window)
