"""A draft bundle: another gsm-edge bundle with the target's tokenizer drafting greedy tokens on its own cache rows.

`DraftModel` holds the draft bundle's runtime and what a guess costs, in one-token steps of the target: the seconds a
call of the draft takes as requests run (an exponential average over proposals, the prompt's prefill left out; before
the first, a draft step measured at load) over a target step measured at load. As requests run is what counts: the
two models' calls alternate, and where each one's ONNX Runtime threads spin on after its call they slow the other's
(runtime.load therefore stops both sessions' spinning between runs: SessionTuning.spin_between_runs). After RETRY
proposals the rule declined, the figure moves halfway back to the draft step at load, so that a slow spell does not
stop drafting for good. The adaptive rule (runtime.speculative.DraftLength) weighs the cost against the acceptance.

`ModelDrafts` is one request's drafter (runtime.speculative.Drafter): a sequence of the draft bundle that follows the
request's tokens. A proposal first feeds the draft the tokens it has not seen (the prompt as a prefill, later the
accepted tokens as one verification-sized call), then decodes k - 1 guesses, marking the sequence before each; the
tokens the request accepts consume those guesses, and the first that differs rewinds the draft sequence to the mark
before it (CachedSequence.rewind: the state copied, the rows forgotten), so the draft's cache holds exactly the
request's tokens, as if it had decoded them one at a time. A guess is never fed across a re-tier pass (a pass
re-encodes earlier rows and cannot be undone): the proposal stops there.

The draft is greedy, so its q is a point mass on each guess, and the request's acceptance (RequestState.
accept_verified) is the speculative-sampling rule exactly, as for prompt lookup: the same tokens as without drafting,
greedy or seeded. A request that finds no free row in the draft bundle's memory plan (its --max-batch) does not
draft; neither does one whose history has reached the draft's max-seq.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtime.backend import CacheFullError
from runtime.sequence import CachedSequence, SequenceMark

TOKENIZER_FILE = "tokenizer.json"
COST_PROMPT = 24  # tokens prefilled before the steps step_seconds times
COST_STEPS = 8  # timed one-token steps per runtime (the median counts)
RETRY = 16  # declined proposals after which the cost moves halfway back to the draft step measured at load


class Runtime(Protocol):
    """What a draft and its target are here (runtime.facade.Runtime, which builds on this module)."""

    bundle: Path
    manifest: dict[str, Any]
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    n_max: int

    def new_sequence(self) -> CachedSequence: ...

    def warm_prefix(self, messages: Any) -> int: ...


class DraftBundleError(ValueError):
    """The draft bundle cannot draft for the target: not a bundle (or a file fails its hash), or another tokenizer."""


def check_draft_pair(target: Runtime, draft: Runtime) -> None:
    """The draft must speak the target's tokens: the same vocabulary size, BOS / EOS ids and tokenizer.json bytes
    (the manifests' hashes), else DraftBundleError naming the draft bundle and the field."""
    tokenizers = (rt.manifest["files"].get(TOKENIZER_FILE) for rt in (target, draft))
    fields = (("vocab_size", target.vocab_size, draft.vocab_size),
              ("bos_token_id", target.bos_token_id, draft.bos_token_id),
              ("eos_token_id", target.eos_token_id, draft.eos_token_id),
              (TOKENIZER_FILE, *tokenizers))
    for name, want, got in fields:
        if want != got:
            raise DraftBundleError(f"draft bundle {draft.bundle}: {name} is {got!r}, the target {target.bundle} has "
                                   f"{want!r}; a draft bundle needs the target's tokenizer (build it from a checkpoint "
                                   "of the same model family)")


def step_seconds(target: Runtime, draft: Runtime) -> tuple[float, float]:
    """A one-token step's seconds on the target and on the draft: the median of COST_STEPS steps each after a short
    prompt (the same tokens), on one sequence of each runtime (given back after)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, target.vocab_size, COST_PROMPT).tolist()
    steps = rng.integers(0, target.vocab_size, COST_STEPS + 2).tolist()

    def median_step(rt: Runtime) -> float:
        seq = rt.new_sequence()
        try:
            seq.prefill(prompt)
            times = []
            for t in steps:
                t0 = time.perf_counter()
                seq.decode(t)
                times.append(time.perf_counter() - t0)
            return float(np.median(times[2:]))  # the first steps warm the sessions' buffers
        finally:
            seq.close()

    return median_step(target), median_step(draft)


@dataclass
class DraftModel:
    """A draft bundle attached to a target runtime: `drafts()` makes each request's drafter; `cost` is what a guess
    costs in target steps."""

    runtime: Runtime
    target_step_s: float  # a target step, measured at load
    draft_step_s: float  # a draft step, measured at load
    memory: float = 0.8  # weight of the previous average at each proposal

    def __post_init__(self) -> None:
        self.call_s = self.draft_step_s  # seconds a draft call takes as requests run (exponential average)
        self.declined = 0

    @classmethod
    def attach(cls, target: Runtime, draft: Runtime) -> DraftModel:
        check_draft_pair(target, draft)
        return cls(draft, *step_seconds(target, draft))

    @property
    def cost(self) -> float:
        return self.call_s / self.target_step_s

    def record(self, seconds: float, calls: int) -> None:
        """A proposal made `calls` calls of the draft (catching up, then one a guess after the first) in `seconds`."""
        if calls > 0:
            self.call_s = self.memory * self.call_s + (1 - self.memory) * seconds / calls

    def decline(self) -> None:
        """The adaptive rule drafted nothing at a request's step."""
        self.declined += 1
        if self.declined % RETRY == 0:
            self.call_s = 0.5 * (self.call_s + self.draft_step_s)

    def drafts(self, prompt: Sequence[int], output: Sequence[int] = (), prompt_break: int | None = None) -> ModelDrafts:
        return ModelDrafts(self, prompt, output, prompt_break)


class ModelDrafts:
    """One request's drafts from the draft bundle (the module's docstring). Its sequence is taken at the first
    proposal and given back by `close` (or when garbage-collected)."""

    def __init__(self, model: DraftModel, prompt: Sequence[int], output: Sequence[int] = (),
                 prompt_break: int | None = None) -> None:
        self.model = model
        self.runtime = model.runtime
        self.tokens: list[int] = [int(t) for t in (*prompt, *output)]
        self.prompt_length = len(prompt)  # prefilled as the request's prompt was: the same calls, the same re-tiers
        self.prompt_break = prompt_break
        self.seq: CachedSequence | None = None
        self.unavailable = False  # no free row in the draft's plan, or its max-seq reached: no more drafts
        # guesses fed to the draft, each with the mark before it and the draft's logits there (the guess their argmax)
        self.ahead: list[tuple[int, SequenceMark, np.ndarray]] = []
        self.logits: np.ndarray | None = None  # the draft's logits after its sequence's last position

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            t = int(t)
            if self.ahead:
                if self.ahead[0][0] == t:
                    self.ahead.pop(0)  # the draft has it already
                else:
                    self._rewind()
            self.tokens.append(t)

    def _rewind(self) -> None:
        """Back to the mark before the first guess still ahead."""
        assert self.seq is not None
        _, mark, self.logits = self.ahead[0]
        self.seq.rewind(mark)
        self.ahead.clear()

    def close(self) -> None:
        if self.seq is not None:
            self.seq.close()
            self.seq = None
        self.unavailable = True

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` greedy tokens of the draft after the request's tokens."""
        if limit <= 0 or self.unavailable:
            return []
        t0 = time.perf_counter()
        if self.ahead:  # guesses past a shorter verification (the engine cuts a batch's drafts to one length)
            self._rewind()
        seq = self._sequence()
        limit = min(limit, self.runtime.n_max - len(self.tokens) + 1)  # the history and limit - 1 guesses fit
        if seq is None or limit <= 0:
            self.unavailable = True
            return []
        if seq.length == 0:  # the prompt, in the request's prefill calls (the same re-tier passes)
            self.logits = seq.prefill(self.tokens[:self.prompt_length], break_at=self.prompt_break)
            t0 = time.perf_counter()  # once a request: not a guess's cost
        calls = 0
        if seq.length < len(self.tokens):
            self.logits, calls = self._feed(self.tokens[seq.length:])
        assert self.logits is not None
        out = [int(np.argmax(self.logits))]
        while len(out) < limit and seq.steps_to_retier > 1:
            self.ahead.append((out[-1], seq.mark(), self.logits))
            self.logits = seq.decode(out[-1])
            calls += 1
            out.append(int(np.argmax(self.logits)))
        self.model.record(time.perf_counter() - t0, calls)
        return out

    def _sequence(self) -> CachedSequence | None:
        if self.seq is None:
            try:
                self.seq = self.runtime.new_sequence()
            except CacheFullError:
                return None
        return self.seq

    def _feed(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """The draft's logits after `tokens` (at least one) follow its sequence, in calls of as many tokens as a
        verification may carry (one-token steps where none may), each kept whole; and how many calls it made."""
        seq = self.seq
        assert seq is not None and tokens
        calls = 0
        while True:
            calls += 1
            n = min(len(tokens), seq.draft_room + 1)
            if n == 1:
                logits = seq.decode(tokens[0])
            else:
                logits = seq.verify(tokens[:n])[-1]
                seq.keep(n)
            tokens = tokens[n:]
            if not tokens:
                return logits, calls
