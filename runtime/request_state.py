"""One request's state: its checked inputs, sampler, detokeniser, ids and finish logic.

Every driver (`TokenStream`, `Runtime.generate_batch`, `Engine`) runs the model and hands the logits here;
this object alone decides the next token and when the request ends, so the three cannot disagree. It
knows nothing of sequences or backends: the driver passes the sequence's length with the logits.

Per step, in this order: the constraint's token mask (structured output), the penalties, the sampler; then
stop ids (not emitted), the token, the constraint's end, stop strings (the text is cut before one and
nothing after it is emitted; while streaming, an end of the text that may still become one is held back),
max_new_tokens, the context end. Log-probabilities, when asked, are the model's (the logits as the graph
returned them, before mask, penalties and temperature: what vLLM returns by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.request_options import RequestOptions
from runtime.sampling import RequestError, Sampler, SamplingParams, apply_penalties
from runtime.speculative import Drafter, DraftLength, NgramDrafts, SpeculativeConfig
from runtime.stop_strings import check_stop, find_stop, held_back
from runtime.text import Detokenizer, TextCodec

# Ends after which bytes the detokeniser holds back are dropped, not flushed into `text`: the request was
# abandoned (cancelled) or broke (error). Every other end (stop, length, context, deadline) keeps them.
ABANDONED_ENDS = ("cancelled", "error")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class Token:
    id: int
    text: str  # the text this token releases (may be "" inside a UTF-8 sequence or while it may start a stop)
    logprob: float | None = None  # the model's log-probability of this token (when logprobs were asked)
    top_logprobs: list[tuple[int, float]] | None = None  # the `logprobs` most likely (id, logprob), best first


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]
    text: str | None  # what follows the prompt's text (leading space kept); None without a tokenizer
    finish_reason: str  # "stop" (a stop id / string, grammar end) | "length" (max_new_tokens) | "context" (max-seq)
    tokens: list[Token] | None = None  # every generated token with its log-probabilities (when asked)


class DrafterSource(Protocol):
    """What makes a request's drafter at its first proposal (runtime.draft_model.DraftModel)."""

    @property
    def cost(self) -> float:
        """A drafted token's cost in one-token steps of the target."""
        ...

    def drafts(self, prompt: Sequence[int], output: Sequence[int], prompt_break: int | None) -> Drafter: ...

    def decline(self) -> None:
        """The adaptive rule drafted nothing at a step."""
        ...


class TokenConstraint(Protocol):
    """Structured output for one request (runtime.constrained): which tokens may come next."""

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar accepts next."""
        ...

    def advance(self, token: int) -> None:
        """The sampled token (one `allowed` permitted)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar has ended: nothing may follow."""
        ...

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (no state change)."""
        ...

    def only_token(self) -> int | None:
        """The next token when the grammar allows exactly one, else None (no state change)."""
        ...

    def forced_end(self, limit: int) -> list[int]:
        """The tokens that end the grammar within `limit`, each the only one its step allows; else [] (no state
        change)."""
        ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def check_logprobs(n: int | None) -> int | None:
    if n is not None and (isinstance(n, bool) or int(n) != n or not 0 <= n <= MAX_TOP_LOGPROBS):
        raise RequestError("logprobs", f"must be an integer in 0..{MAX_TOP_LOGPROBS} (how many alternatives per "
                                       f"token; 0: the chosen token's only), got {n!r}")
    return None if n is None else int(n)


class ModelLimits(Protocol):
    """What a request is checked against (a `Runtime` has these)."""

    vocab_size: int
    n_max: int
    eos_token_id: int
    codec: TextCodec | None
    logits_all: bool  # the graph returns every position's logits (bundle built with --logits all)


def check_ids(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    """Token ids as ints inside the vocabulary; a RequestError naming the first bad one."""
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or int(t) != t:
            raise RequestError(field, f"id {t!r} (position {i}) is not an integer")
        if not 0 <= t < vocab_size:
            raise RequestError(field, f"id {int(t)} (position {i}) is outside the vocabulary 0..{vocab_size - 1}")
        out.append(int(t))
    return out


def check_max_new_tokens(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise RequestError("max_new_tokens", f"must be an integer >= 0, got {n!r}")
    return int(n)


class RequestState:
    """Checked on construction, before any model work (a RequestError names the parameter). A driver
    calls `start()`; if True it prefills `prompt_ids`, then alternates `accept(logits, length)` and a
    decode step of `next_token` until `finish_reason` is set."""

    def __init__(self, model: ModelLimits, prompt_ids: Sequence[int], max_new_tokens: int, options: RequestOptions, *,
                 constraint: TokenConstraint | None = None, speculative: SpeculativeConfig | None = None,
                 drafter: DrafterSource | None = None, prompt_break: int | None = None) -> None:
        """options: what the request asks (runtime.request_options); constraint: its response_format compiled
        (runtime.constrained); speculative: how it drafts (None: it does not); drafter: what makes its drafter at
        the first proposal (a draft bundle's: runtime.draft_model; None: prompt lookup); prompt_break: where a chat
        prompt's last message starts (its prefill ends a call there: runtime.prefix_cache)."""
        self.prompt_ids = check_ids(prompt_ids, model.vocab_size, "prompt")
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty: need at least one token")
        if len(self.prompt_ids) > model.n_max:
            raise RequestError("prompt", f"the prompt is {len(self.prompt_ids)} tokens, more than the bundle's max-seq "
                                         f"{model.n_max} (shorten it or rebuild with a larger --max-seq)")
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        if options.fit_context and len(self.prompt_ids) + self.max_new_tokens > model.n_max:
            raise RequestError("max_new_tokens", f"the prompt's {len(self.prompt_ids)} tokens + {self.max_new_tokens} "
                                                 f"new tokens = {len(self.prompt_ids) + self.max_new_tokens} exceed "
                                                 f"the bundle's max-seq {model.n_max}: ask for at most "
                                                 f"{max(0, model.n_max - len(self.prompt_ids))}")
        self.stop_ids = frozenset([model.eos_token_id] if options.stop_ids is None
                                  else check_ids(list(options.stop_ids), model.vocab_size, "stop_ids"))
        self.stop = check_stop(options.stop)
        if self.stop and model.codec is None:
            raise RequestError("stop", "stop strings need the bundle's tokenizer (tokenizer.json); give stop_ids")
        self.logprobs = check_logprobs(options.logprobs)
        if options.prompt_logprobs and not model.logits_all:
            raise RequestError("echo", "the prompt's log-probabilities need every position's logits: rebuild the "
                                       "bundle with `builder build --logits all` (this one returns the last "
                                       "position's)")
        # the prompt's tokens scored (echo with logprobs): the first has no logprob, token i by position i - 1
        self.prompt_tokens: list[Token] | None = None
        if options.prompt_logprobs:
            self.prompt_tokens = [Token(self.prompt_ids[0], "")]
        self.constraint = constraint
        self.params = params = options.sampling
        self.n_max, self.vocab_size = model.n_max, model.vocab_size
        self.ids: list[int] = []
        self.tokens: list[Token] | None = [] if self.logprobs is not None else None
        self.finish_reason: str | None = None
        self.detok = None if model.codec is None else Detokenizer(model.codec.decode, self.prompt_ids)
        self.sampler = Sampler.from_params(params)
        # prompt lookup over the request's tokens and its adaptive draft length (runtime.speculative); with a draft
        # bundle, its drafter (made at the first proposal by `drafter`) and the rule of its guesses; None: off
        on = speculative is not None and speculative.on
        self.drafts: Drafter | None = NgramDrafts(self.prompt_ids, speculative) if on else None
        self.draft_length = DraftLength(speculative) if on else None
        self._drafter = drafter if on else None
        self.model_drafts: Drafter | None = None
        self.model_length = DraftLength(speculative) if on and drafter is not None else None
        self._source: DraftLength | None = None  # the rule of the last proposal's drafter (None: forced tokens)
        # where a chat prompt's last message starts: its prefill ends a call there (runtime.prefix_cache)
        self.prompt_break = prompt_break
        self._emitted = 0  # characters of the detokenised text released in Token.text so far
        self._cut: int | None = None  # where a stop string began: the text ends there
        self._started = False
        self.lead_in: list[Token] = []  # taken by start() before any model call: a driver emits them first
        self.prefilled = False  # the first logits were accepted
        if params.penalised:
            self._counts = np.zeros(model.vocab_size, np.int32)
            self._seen = np.zeros(model.vocab_size, bool)
            self._seen[self.prompt_ids] = True

    @property
    def text(self) -> str | None:
        """Text after the prompt so far (all of it once finished, cut before a stop string); None without a
        tokenizer."""
        if self.detok is None:
            return None
        return self.detok.text if self._cut is None else self.detok.text[:self._cut]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_token(self) -> int:
        """The token the next decode step feeds (the last one accepted)."""
        return self.ids[-1]

    def start(self) -> bool:
        """Whether the model has anything to do; with max_new_tokens 0 the request ends here ("length"), unless
        its prompt is to be scored. Takes the lead-in first (`lead_in`); the prefill feeds `prefill_ids`."""
        if self._started:
            return not self.done
        self._started = True
        if self.max_new_tokens == 0 and not self.scores_prompt:  # scoring a prompt still runs it
            self.finish("length")
        elif self.constraint is not None and self.tokens is None and not self.scores_prompt:
            # what the grammar allows alone before any model output (a JSON schema's opening brace and first key):
            # any logits would pick it, so it is taken now and prefilled with the prompt; not when log-probabilities
            # are asked (they need each token's logits)
            while not self.done and len(self.prompt_ids) + len(self.ids) < self.n_max:
                tok = self.constraint.only_token()
                if tok is None:
                    break
                token = self._take_forced(tok, len(self.prompt_ids) + len(self.ids))
                if token is not None:
                    self.lead_in.append(token)
        return not self.done

    @property
    def prefill_ids(self) -> list[int]:
        """What the prefill feeds: the prompt, then the lead-in's tokens."""
        return self.prompt_ids + self.ids if self.ids else self.prompt_ids

    def accept(self, logits: np.ndarray, length: int) -> Token | None:
        """Sample from the logits after `length` positions; returns the token to emit (None for a stop id).
        Order of the checks: the module's docstring."""
        if self.max_new_tokens == 0:  # a scored prompt with nothing to generate (echo, max_tokens 0)
            self.finish("length")
            return None
        self.prefilled = True
        z = logits
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            if not allowed.any():  # cannot happen with a grammar that ends: end rather than emit garbage
                self.finish("stop")
                return None
            z = np.where(allowed, z, -np.inf)
        if self.params.penalised:
            z = apply_penalties(z, self.params, self._counts, self._seen)
        return self._emit(self.sampler(z), logits, length)

    def _take_forced(self, tok: int, length: int) -> Token | None:
        """`tok`, the only token the grammar allows, taken without logits; a sampling request's generator draws as
        a step's would (its mask allowing `tok` alone), so a seeded request's later tokens are drawn as without."""
        if self.sampler.temperature > 0:
            z = np.full(self.vocab_size, -np.inf)
            z[tok] = 0.0
            self.sampler(z)
        return self._emit(tok, None, length)

    def _emit(self, tok: int, logits: np.ndarray | None, length: int) -> Token | None:
        """The request takes token `tok` (sampled from `logits`, or the only one its grammar allows: logits None)
        after `length` positions; returns it to emit, None for a stop id."""
        if tok in self.stop_ids:
            self.finish("stop")
            return None
        token = Token(tok, "") if logits is None else self._scored(tok, logits)
        self.ids.append(tok)
        if self.drafts is not None:
            self.drafts.extend((tok,))
        if self.model_drafts is not None:
            self.model_drafts.extend((tok,))
        if self.params.penalised:
            self._counts[tok] += 1
            self._seen[tok] = True
        if self.constraint is not None:
            self.constraint.advance(tok)
        if self.detok is not None:
            self.detok.add(tok)
        end = ("stop" if self.constraint is not None and self.constraint.finished
               else "length" if len(self.ids) == self.max_new_tokens else "context" if length >= self.n_max else None)
        if end is not None and self.detok is not None:
            self.detok.flush()
        token.text = self._release(final=end is not None)
        if self._cut is not None:
            end = "stop"
        if end is not None:
            self.finish(end)
        if self.tokens is not None:
            self.tokens.append(token)
        return token

    def finish_forced(self, length: int) -> list[Token]:
        """Grammar fast-forward at a structured output's end: when the tokens the grammar forces from here end it,
        each the only token its step allows, they are taken without a model call (any logits would pick them) and
        the request ends; else nothing happens. Drafting requests only (off keeps one call a token) and not with
        log-probabilities. `length`: positions the sequence holds (the next token's is length + 1)."""
        if self.drafts is None or self.constraint is None or self.tokens is not None or self.done:
            return []
        out = []
        for j, tok in enumerate(self.constraint.forced_end(self.max_new_tokens - len(self.ids))):
            token = self._take_forced(tok, length + 1 + j)
            if token is not None:
                out.append(token)
            if self.done:
                break
        return out

    def propose(self, room: int) -> list[int]:
        """Drafts to verify after `next_token` (at most `room`; none when drafting is off or would not pay): the
        tokens a structured output's grammar forces where it forces some (grammar fast-forward), else prompt
        lookup's where it finds some, else the draft bundle's; each as many as its adaptive rule finds worth a call."""
        self._source = None
        if self.drafts is None or self.draft_length is None or room < 1:
            return []
        if self.constraint is not None:
            forced = self.constraint.forced(room)
            if forced:  # kept unless a stop ends the request: evidence for no rule
                return forced
        self._source = self.draft_length
        guess = self.drafts.propose(self.draft_length.length(room))
        if guess or self._drafter is None or self.model_length is None:
            return guess
        self._source = self.model_length
        k = self.model_length.length(room, self._drafter.cost)
        if k == 0:
            self._drafter.decline()
            return []
        if self.model_drafts is None:
            self.model_drafts = self._drafter.drafts(self.prompt_ids, self.ids, self.prompt_break)
        return self.model_drafts.propose(k)

    @property
    def draft_acceptance(self) -> float:
        """The chance each token of the last proposal is kept, as its adaptive rule estimates it (forced tokens: 1)."""
        return 1.0 if self._source is None else self._source.acceptance

    @property
    def draft_counts(self) -> tuple[int, int]:
        """Tokens drafted and kept so far, prompt lookup's and the draft bundle's (forced tokens not counted)."""
        rules = [r for r in (self.draft_length, self.model_length) if r is not None]
        return sum(r.drafted for r in rules), sum(r.accepted for r in rules)

    def accept_verified(self, logits: np.ndarray, drafts: Sequence[int], length: int) -> tuple[list[Token], int]:
        """A verification's logits [n, V] (n = 1 + len(drafts)) after `length` positions: row j is sampled as a
        one-token step's logits, and the next row only while each sample equals its draft (runtime.speculative: the
        speculative-sampling rule for a drafter certain of its token). Returns the tokens to emit and the rows used
        (the sequence keeps that many of the fed tokens)."""
        out: list[Token] = []
        used = 0
        for j in range(len(logits)):
            tok = self.accept(logits[j], length + j + 1)
            used = j + 1
            if tok is not None:
                out.append(tok)
            if self.done or j == len(drafts) or self.ids[-1] != drafts[j]:
                break
        if self._source is not None:
            self._source.record(len(drafts), used - 1)
        return out, used

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_tokens is not None

    @property
    def prompt_scorer(self) -> Callable[[int, np.ndarray], None] | None:
        """What a prefill hands each chunk's logits to (Runtime.prefill_batch scorers), None when not scoring."""
        return self.score_prompt if self.scores_prompt else None

    def score_prompt(self, start: int, logits: np.ndarray) -> None:
        """Prefill's logits [n, V] of prompt positions start..start+n-1: each scores the prompt token after it
        (the last position's scores the first generated token, in accept)."""
        assert self.prompt_tokens is not None
        for j, row in enumerate(logits):
            p = start + j + 1
            if p < len(self.prompt_ids):
                self.prompt_tokens.append(self._scored(self.prompt_ids[p], row, top=self.logprobs or 0))

    def _scored(self, tok: int, logits: np.ndarray, top: int | None = None) -> Token:
        n = self.logprobs if top is None else top
        if n is None:
            return Token(tok, "")
        lp = log_softmax(logits)
        best_n = None
        if n:
            best = np.argpartition(-lp, n - 1)[:n]
            best = best[np.argsort(-lp[best], kind="stable")]
            best_n = [(int(i), float(lp[i])) for i in best]
        return Token(tok, "", float(lp[tok]), best_n)

    def _release(self, *, final: bool) -> str:
        """The text that may be streamed now: up to a stop string (which ends the request), else all but an end
        that could still become one (all of it when the request ends)."""
        if self.detok is None:
            return ""
        text = self.detok.text
        if self.stop:
            hit = find_stop(text, self._emitted, self.stop)
            if hit is not None:
                self._cut = hit
                out, self._emitted = text[self._emitted:hit], hit
                return out
            if not final:
                keep = len(text) - held_back(text, self._emitted, self.stop)
                out, self._emitted = text[self._emitted:keep], keep
                return out
        out, self._emitted = text[self._emitted:], len(text)
        return out

    def finish(self, reason: str) -> None:
        """End the request: stop | length | context here; a driver adds cancelled | deadline | error."""
        if self.detok is not None and reason not in ABANDONED_ENDS:
            self.detok.flush()  # bytes held back before a stop id: no token left to carry them, .text has them
        for drafter in (self.drafts, self.model_drafts):
            if drafter is not None:
                drafter.close()
        self.finish_reason = reason

    def result(self) -> Generation:
        assert self.finish_reason is not None, "the request has not finished"
        return Generation(self.prompt_ids, list(self.ids), self.text, self.finish_reason,
                          None if self.tokens is None else list(self.tokens))


class RequestFields:
    """A driver's read-through view of its request (`self.state`): the state holds the only copy."""

    state: RequestState

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids

    @property
    def max_new_tokens(self) -> int:
        return self.state.max_new_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.state.stop_ids

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def ids(self) -> list[int]:
        return self.state.ids

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def text(self) -> str | None:
        """Text after the prompt so far (all of it once the request ended); None without a tokenizer."""
        return self.state.text

    @property
    def tokens(self) -> list[Token] | None:
        """The generated tokens with their log-probabilities, when the request asked for logprobs."""
        return self.state.tokens

    @property
    def prompt_tokens(self) -> list[Token] | None:
        """The prompt's tokens with their log-probabilities (the first has none), when asked (echo)."""
        return self.state.prompt_tokens
