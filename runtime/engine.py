"""Engine: many requests over one Runtime, with continuous batching on one scheduler thread.

    eng = Engine(runtime.load(bundle)).start()              # warm-up runs here, not in the first request
    h = eng.submit("Once upon a time", max_new_tokens=32, temperature=0.0, deadline_s=5)
    for tok in h:                                            # or: async for tok in h.aiter()
        print(tok.text, end="")
    print(h.finish_reason)                                   # stop | length | context | cancelled | deadline | error
    eng.close()

One thread owns the runtime. Each iteration it admits waiting requests, first come first served, while the
memory plan has a free cache row for them (`runtime.admission`: `max_running`, at most the backend's
`capabilities.max_resident`; new requests join between decode steps), drops cancelled and expired ones,
asks the `stepper` for one forward call per running sequence (the prompt's prefill for a request that just
joined, else one decode step), hands each request's logits to its own `RequestState` (sampler, stop ids,
length and context ends: the object `TokenStream` and `generate_batch` drive too), and retires the finished
ones (their rows free for the next in the queue). `SequentialStepper` makes one backend call per sequence; on
a backend that takes several per call (`capabilities.max_per_call`) `BatchedStepper` makes one call for the
whole list (the scheduler only hands it `Work` items and takes logits back).
Requests are checked by the Runtime's own `request` / `chat_request` (same RequestError messages) and
their sequences are never shared, so greedy outputs equal the same requests run alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gsm.bundle_knobs import KV_NOISE_AUTO, RunKnobs, parse_fraction, parse_noise, patch_knobs
from gsm.tiers import FP16, NAMES, fractions4
from runtime.admission import KVBudget
from runtime.backend import CacheFullError
from runtime.facade import Runtime
from runtime.request_options import RequestOptions
from runtime.request_state import RequestFields, RequestState, Token
from runtime.sampling import RequestError
from runtime.scheduled_sequence import ScheduledSequence
from runtime.sequence import CachedSequence
from runtime.speculative import expected_tokens

log = logging.getLogger("runtime.engine")

FINISH_REASONS = ("stop", "length", "context", "cancelled", "deadline", "error")
FROM_BUNDLE = "bundle"  # EngineConfig.max_kv_noise: the bundle's run_time (None there means off)
KV_NOISE_FLOOR = 0.05  # the GSM deployment description's threshold
KV_NOISE_MARGIN = 2.0  # a pass may add up to this many times the error calibration measured for its tier


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its limit; `retry_after_s` estimates when to try again."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        super().__init__(f"the request queue is full ({limit} waiting); retry in about {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class EngineClosedError(RuntimeError):
    """submit() after close()."""


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits. max_running 0: the bundle's max_batch, or `interleave` sequences when the
    bundle was built for batch 1 (their steps are then interleaved, one call each). Either is clamped to the
    cache rows the backend holds (the memory plan's max_batch): a bundle built for batch 1 runs one request
    at a time, the rest wait in the queue."""

    max_running: int = 0
    interleave: int = 8
    max_queue: int = 64
    default_deadline_s: float | None = None  # per request, from submission; None: no limit
    warmup: bool = True
    # Fallback policies of the sequences (docs/serving.md "Fallback policies"; thresholds of the GSM
    # deployment description), in place of the bundle's run_time (gsm.bundle_knobs.RunTime; None / FROM_BUNDLE:
    # the bundle's). The hit rate needs the dense attention of the step: probed on a sequence's decode steps 1,
    # 1 + n, 1 + 2n, ... (n = hit_rate_every; 0: never probed, no hit-rate fallback).
    min_hit_rate: float | None = None  # a probed hit rate below this -> dense attention for that sequence; 0: off
    hit_rate_every: int | None = None
    # KV noise of a re-tier pass above this -> cache refreshed; None: off; KV_NOISE_AUTO: from the bundle's tiers
    max_kv_noise: float | str | None = FROM_BUNDLE

    def __post_init__(self) -> None:
        for name in ("max_running", "interleave", "max_queue", "hit_rate_every"):
            v, lo = getattr(self, name), 0 if name in ("max_running", "hit_rate_every") else 1
            if v is None and name == "hit_rate_every":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"EngineConfig.{name}: expected an integer >= {lo}, got {v!r}")
        if self.default_deadline_s is not None and not self.default_deadline_s > 0:
            raise ValueError(f"EngineConfig.default_deadline_s: expected a number > 0 or None, "
                             f"got {self.default_deadline_s!r}")
        if self.min_hit_rate is not None:  # the ranges of the bundle's run_time (KnobError is a ValueError)
            parse_fraction("EngineConfig.min_hit_rate", self.min_hit_rate)
        if self.max_kv_noise != FROM_BUNDLE:
            parse_noise("EngineConfig.max_kv_noise", self.max_kv_noise)

    def knobs(self, base: RunKnobs) -> RunKnobs:
        """`base` (the runtime's knobs) with the thresholds this config sets in place of the bundle's."""
        k = base.with_run_time(min_hit_rate=self.min_hit_rate, hit_rate_every=self.hit_rate_every)
        if self.max_kv_noise == FROM_BUNDLE:
            return k
        return dataclasses.replace(k, run_time=dataclasses.replace(k.run_time, max_kv_noise=self.max_kv_noise))


def kv_noise_limit(asked: float | str | None, tier_noise: Mapping[str, float],
                   tier_fractions: Sequence[float]) -> float | None:
    """The KV-noise fallback's threshold. A number or None (off) as asked; KV_NOISE_AUTO: the deployment description's
    KV_NOISE_FLOOR, or KV_NOISE_MARGIN times the error calibration measured for the narrowest tier the bundle's
    fractions use, whichever is larger. The fallback is there for scales that do not fit the data; a pass that
    demotes to INT4 adds ~0.1 by design (the INT4 grid's error on the calibration text), which a fixed 0.05 would
    take for a fault on every request."""
    if asked != KV_NOISE_AUTO:
        return asked  # type: ignore[return-value]
    used = [NAMES[t] for t, f in enumerate(fractions4(tier_fractions)) if t != FP16 and f > 0]
    expected = max((tier_noise.get(name, 0.0) for name in used), default=0.0)
    return max(KV_NOISE_FLOOR, KV_NOISE_MARGIN * expected)


@dataclass
class Work:
    """One forward call the stepper must make: the prompt (prefill) or one token (decode)."""

    seq: CachedSequence
    ids: list[int]
    prefill: bool
    probe: bool = False  # decode only: also measure the sparse mask hit rate of this step (seq.last_hit_rate)
    # prefill only: gets each chunk's logits (RequestState.score_prompt: echo with logprobs)
    scorer: Callable[[int, np.ndarray], None] | None = None
    drafts: list[int] = field(default_factory=list)  # decode only: tokens to verify after ids[0] (speculative)
    acceptance: float = 0.0  # the chance each draft is kept (RequestState.draft_acceptance)
    break_at: int | None = None  # prefill only: where the prompt's last message starts (RequestState.prompt_break)


class Stepper(Protocol):
    def new_sequence(self, knobs: RunKnobs | None = None) -> CachedSequence: ...

    def step(self, work: Sequence[Work]) -> list[np.ndarray | Exception]:
        """Last-position logits [V] per work item (a verification's: [1 + len(drafts), V], row j after token j), or
        the exception that item raised."""
        ...


class SequentialStepper:
    """One Runtime call per sequence. A batched decode API replaces this with one call for the batch."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def new_sequence(self, knobs: RunKnobs | None = None) -> CachedSequence:
        return self.rt.new_sequence(knobs)

    def step(self, work: Sequence[Work]) -> list[np.ndarray | Exception]:
        out: list[np.ndarray | Exception] = []
        for w in work:
            try:
                out.append(w.seq.prefill(w.ids, scorer=w.scorer, break_at=w.break_at) if w.prefill
                           else w.seq.verify([w.ids[0], *w.drafts]) if w.drafts
                           else w.seq.decode(w.ids[0], probe=w.probe))
            except Exception as e:  # one sequence's failure must not stop the others
                out.append(e)
        return out


class BatchedStepper:
    """All prefills in one `Runtime.prefill_batch` call and all decode steps in one `decode_batch` call
    (the runtime's batched step API), in groups of the backend's `max_per_call`. A call that raises fails
    every request in it: re-running them one by one could repeat positions a half-done call already added. The graphs
    take one selection window per call: sequences of different windows (requests admitted before and after a knob
    patch) go in calls of their own."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.per_call = rt.capabilities.max_per_call

    def new_sequence(self, knobs: RunKnobs | None = None) -> CachedSequence:
        return self.rt.new_sequence(knobs)

    def step(self, work: Sequence[Work]) -> list[np.ndarray | Exception]:
        out: list[np.ndarray | Exception] = [ValueError("not run")] * len(work)
        # one call of the verifications and, with them, the plain decode steps (a one-token verification each); a
        # probed step runs as a decode call of its own (its dense shadow call comes first)
        verify = any(w.drafts for w in work)
        kinds = {"prefill": [i for i, w in enumerate(work) if w.prefill],
                 "verify": [i for i, w in enumerate(work) if not w.prefill and verify and not w.probe],
                 "decode": [i for i, w in enumerate(work) if not w.prefill and (w.probe or not verify)]}
        calls = [(kind, part[g:g + self.per_call]) for kind, every in kinds.items()
                 for part in by_window(work, every) for g in range(0, len(part), self.per_call)]
        for kind, idx in calls:
            seqs = [work[i].seq for i in idx]
            try:
                if kind == "prefill":
                    res = self.rt.prefill_batch(seqs, [work[i].ids for i in idx], [work[i].scorer for i in idx],
                                                [work[i].break_at for i in idx])
                elif kind == "verify":
                    rows = self.rt.verify_batch(seqs, [[work[i].ids[0], *work[i].drafts] for i in idx])
                    for i, s in zip(idx, seqs):
                        if not work[i].drafts:  # a plain step: its one token stays, as decode_batch keeps it
                            s.keep(1)
                    res = [r if work[i].drafts else r[0] for i, r in zip(idx, rows)]
                else:
                    res = self.rt.decode_batch(seqs, [work[i].ids[0] for i in idx],
                                               probe=[work[i].probe for i in idx])
                for k, i in enumerate(idx):
                    out[i] = res[k]
            except Exception as e:
                for i in idx:
                    out[i] = e
        return out


def by_window(work: Sequence[Work], idx: Sequence[int]) -> list[list[int]]:
    """`idx` split by the window their sequences select with, in order of first appearance."""
    parts: dict[int, list[int]] = {}
    for i in idx:
        parts.setdefault(work[i].seq.window_input, []).append(i)
    return list(parts.values())


def default_stepper(rt: Runtime) -> Stepper:
    """One call for several sequences where the backend takes them, else one call per sequence."""
    return BatchedStepper(rt) if rt.capabilities.max_per_call > 1 else SequentialStepper(rt)


class Observer:
    """Hooks the scheduler thread calls (metrics, fallback policies); the default does nothing.
    They run on the scheduler thread: keep them short."""

    def on_submit(self, req: EngineRequest) -> None: ...

    def on_reject(self, reason: str) -> None: ...

    def on_first_token(self, req: EngineRequest) -> None: ...

    def on_finish(self, req: EngineRequest) -> None: ...

    def on_step(self, engine: Engine, running: Sequence[EngineRequest]) -> None: ...

    def on_hit_rate(self, req: EngineRequest, hit_rate: float) -> None:
        """A probed decode step's sparse mask hit rate (mean over owning layers)."""

    def on_kv_noise(self, req: EngineRequest, noise: float) -> None:
        """The KV noise a re-tier pass of the request's sequence added (docs/serving.md)."""

    def on_fallback(self, req: EngineRequest, policy: str, value: float) -> None:
        """A fallback policy was taken for the request: "hit_rate" (dense from here) or "kv_noise" (refreshed)."""

    def on_drafts(self, req: EngineRequest, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens kept `accepted` of them (speculative decoding)."""


_ids = itertools.count(1)


@dataclass
class EngineRequest(RequestFields):
    """A submitted request: iterate it (or `aiter()`) for tokens; `cancel()` ends it. After it ends:
    `ids`, `text`, `finish_reason` (and `error` when finish_reason is "error")."""

    state: RequestState  # inputs, sampler, detokeniser, ids and finish logic: the scheduler only drives it
    deadline: float | None  # time.monotonic() value
    # its knobs, its cache row while it runs and what the fallback policies and metrics read of it
    sequence: ScheduledSequence
    id: int = field(default_factory=lambda: next(_ids))
    error: BaseException | None = None
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_end: float | None = None
    _cancel: bool = False
    _events: list[Token] = field(default_factory=list)
    _done: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)

    @property
    def knobs(self) -> RunKnobs:
        """The engine's knobs when it was submitted (gsm.bundle_knobs), for its whole life."""
        return self.sequence.knobs

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Ask the scheduler to end this request (finish_reason "cancelled"); its cache is dropped."""
        self._cancel = True

    # -- producer side (scheduler thread) --
    def _push(self, tok: Token | None) -> None:
        with self._cond:
            if tok is None:
                self._done = True
            else:
                self._events.append(tok)
            self._cond.notify_all()
            wakers = list(self._wakers)
        for loop, ev in wakers:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    # -- consumer side --
    def __iter__(self) -> Iterator[Token]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events) and not self._done:
                    self._cond.wait()
                if i >= len(self._events):
                    return
                tok = self._events[i]
            i += 1
            yield tok

    async def aiter(self) -> AsyncIterator[Token]:
        """The tokens, for asyncio code: waits without blocking the event loop."""
        loop, ev = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._wakers.append((loop, ev))
        i = 0
        try:
            while True:
                ev.clear()  # before reading: a push after the read sets it again
                with self._cond:
                    new, done = self._events[i:], self._done
                for tok in new:
                    yield tok
                i += len(new)
                if done and not new:
                    return
                if not new:
                    await ev.wait()
        finally:
            with self._cond:
                self._wakers.remove((loop, ev))

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def result(self, timeout: float | None = None) -> EngineRequest:
        """Wait for the end; raises the error of a request that failed while running."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self


class Engine:
    """Thread-safe request queue and scheduler over one Runtime (see the module doc)."""

    def __init__(self, rt: Runtime, config: EngineConfig | None = None, *, stepper: Stepper | None = None,
                 observer: Observer | None = None) -> None:
        self.rt = rt
        self.config = config or EngineConfig()
        self.stepper = stepper or default_stepper(rt)
        self.observers: list[Observer] = [observer] if observer is not None else []
        self.budget = KVBudget.of(rt.capabilities, max_running=self.config.max_running,
                                  interleave=self.config.interleave, max_batch=rt.cfg.max_batch)
        self.max_running = self.budget.max_running
        (log.warning if self.budget.clamped else log.info)("%s", self.budget.describe())
        self.ready = threading.Event()  # set after warm-up
        self.warmup_s: float | None = None
        self.warmup_error: BaseException | None = None  # the engine refuses requests when warm-up failed
        self.steps = 0
        # the knobs new requests take (the runtime's, the thresholds this config sets); a request keeps the ones it
        # was submitted under (EngineRequest.knobs) whatever a patch changes later
        self.knobs = self.config.knobs(rt.knobs)
        self.config_generation = 0  # patches applied (PATCH /admin/config)
        run = self.knobs.run_time
        if not rt.can_probe and run.min_hit_rate > 0 and run.hit_rate_every > 0:
            log.warning("backend %s cannot measure the sparse mask hit rate (no shadow call): the hit-rate "
                        "fallback is off", rt.backend.name)
        self.fallbacks: dict[str, int] = {"hit_rate": 0, "kv_noise": 0}  # taken so far, by policy
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._step_time = 0.0  # EMA of one iteration, for Retry-After

    # -- public --
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gsm-engine", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; requests still queued or running end as "cancelled"."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> list[EngineRequest]:
        return list(self._running)

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, deadline_s: float | None = None,
               options: RequestOptions | None = None, **keywords: Any) -> EngineRequest:
        """Queue a completion; `options` and `keywords` are Runtime.request's (runtime.RequestOptions: sampling,
        penalties, stop ids and strings, logprobs, response_format, ...). Inputs are checked now (RequestError);
        QueueFullError when the queue is full."""
        return self._enqueue(self.rt.request(prompt, max_new_tokens, options, **keywords), deadline_s)

    def submit_chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, *,
                    deadline_s: float | None = None, options: RequestOptions | None = None,
                    **keywords: Any) -> EngineRequest:
        """Queue a chat turn: the bundle's chat template, stopping at EOS and its end-of-turn token."""
        return self._enqueue(self.rt.chat_request(messages, max_new_tokens, options, **keywords), deadline_s)

    # -- internals --
    def _enqueue(self, state: RequestState, deadline_s: float | None) -> EngineRequest:
        d = self.config.default_deadline_s if deadline_s is None else deadline_s
        if d is not None and not (isinstance(d, (int, float)) and d > 0):
            raise RequestError("deadline_s", f"must be a number > 0 (seconds), got {d!r}")
        req = EngineRequest(state=state, deadline=None, sequence=ScheduledSequence(self.knobs))
        if d is not None:
            req.deadline = req.t_submit + float(d)
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if len(self._waiting) >= self.config.max_queue:
                self._notify("on_reject", "queue_full")
                raise QueueFullError(self.config.max_queue, self.retry_after_s())
            self._waiting.append(req)
            self._notify("on_submit", req)
            self._cond.notify_all()
        return req

    def max_kv_noise(self, knobs: RunKnobs) -> float | None:
        """The KV-noise fallback's threshold for a request with these knobs (kv_noise_limit; None: off)."""
        return kv_noise_limit(knobs.run_time.max_kv_noise, self.rt.cfg.kv_tier_noise, knobs.tier_fractions)

    def patch(self, ops: Any) -> RunKnobs:
        """Apply a JSON Patch (RFC 6902, gsm.bundle_knobs paths) to the knobs of requests submitted from now on; the
        running and queued ones keep theirs. All or nothing: KnobError naming the path, and nothing changed."""
        with self._cond:
            new = patch_knobs(self.knobs, ops, self.rt.cfg.knob_limits,
                              top_k_cap=self.rt.capabilities.max_top_k)
            self.knobs = new
            self.config_generation += 1
            generation = self.config_generation
        log.info("config generation %d (%s): %s", generation, new.checksum, json.dumps(ops))
        return new

    def retry_after_s(self) -> float:
        """A guess at when a queue slot frees: the queue drained at the running cap, at least 1 s."""
        per_request = self._step_time * 64  # a typical request: a few dozen steps
        return max(1.0, len(self._waiting) / max(1, self.max_running) * per_request)

    def _notify(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            try:
                getattr(o, hook)(*args)
            except Exception:  # a metrics bug must not take the scheduler down
                log.exception("observer %s.%s failed", type(o).__name__, hook)

    def _warmup(self) -> None:
        """First calls of each graph shape (prefill chunk, single-token prefill, decode, probe) before serving."""
        t0 = time.monotonic()
        n = max(1, min(self.rt.max_input, self.rt.n_max - 3))
        seq = self.stepper.new_sequence(self.knobs)
        # the decode step is a probed one when probes are on: the dense shadow call's first run is here too
        for w in ([Work(seq, [self.rt.bos_token_id] * n, True)],
                  [Work(seq, [self.rt.bos_token_id], False, probe=self._probes(self.knobs))]):
            for r in self.stepper.step(w):
                if isinstance(r, Exception):
                    raise r
        seq.close()  # a bundle built for batch 1 has this one row
        one = self.stepper.new_sequence(self.knobs)
        for r in self.stepper.step([Work(one, [self.rt.bos_token_id], True)]):
            if isinstance(r, Exception):
                raise r
        one.close()
        self.warmup_s = time.monotonic() - t0
        log.info("warm-up took %.3f s", self.warmup_s)

    def _finish(self, req: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        req.state.finish(reason)
        req.error, req.t_end = error, time.monotonic()
        req.sequence.close()
        self._notify("on_finish", req)
        req._push(None)

    def _loop(self) -> None:
        try:
            if self.config.warmup:
                self._warmup()
        except Exception as e:
            log.error("warm-up failed: %s", e)
            log.debug("warm-up failure", exc_info=True)
            self.warmup_error = e
            with self._cond:
                self._closed = True
        self.ready.set()
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    self._cond.wait()
                if self._closed:
                    pending = list(self._waiting) + self._running
                    self._waiting.clear()
                    self._running = []
                    break
            t0 = time.monotonic()
            self._iteration()
            self._step_time = 0.9 * self._step_time + 0.1 * (time.monotonic() - t0)
        for req in pending:
            self._finish(req, "cancelled")

    def _iteration(self) -> None:
        now = time.monotonic()
        with self._cond:
            keep = deque()
            for req in self._waiting:  # cancelled or expired before they ever ran
                if req._cancel or (req.deadline is not None and now >= req.deadline):
                    self._finish(req, "cancelled" if req._cancel else "deadline")
                else:
                    keep.append(req)
            self._waiting = keep
            while self._waiting and len(self._running) < self.max_running:  # one row per running request
                req = self._waiting[0]
                if not req.state.start():  # max_new_tokens 0 (or a lead-in that ends it): no model work
                    self._waiting.popleft()
                    for tok in req.state.lead_in:
                        self._push(req, tok)
                    self._finish(req, req.state.finish_reason)
                    continue
                try:
                    req.sequence.open(self.stepper)
                except CacheFullError as e:  # rows held outside this engine (a Runtime used beside it)
                    if self._running:
                        break  # the head waits for a row one of these frees
                    self._waiting.popleft()
                    self._finish(req, "error", e)  # nothing here would ever free one
                    continue
                self._waiting.popleft()
                self._running.append(req)
        live = []
        for req in self._running:
            if req._cancel:
                self._finish(req, "cancelled")
            elif req.deadline is not None and now >= req.deadline:
                self._finish(req, "deadline")
            elif not req.state.prefilled:
                live.append(req)
            else:  # a structured output whose grammar forces its end needs no call (RequestState.finish_forced)
                for tok in req.state.finish_forced(req.sequence.running.length):
                    self._push(req, tok)
                if self._still_running(req):
                    live.append(req)
        work = [Work(r.sequence.running, r.state.prefill_ids, True, scorer=r.state.prompt_scorer,
                     break_at=r.state.prompt_break)
                if not r.state.prefilled
                else self._decode_work(r) for r in live]
        self._fit_drafts(work)
        constrained = [r.state.constraint for r in live if r.state.constraint is not None]
        masks = None
        if constrained:  # structured output: the masks are computed while the model runs
            from runtime.constrained import prefetch_masks

            masks = prefetch_masks(constrained)
        results = self.stepper.step(work) if work else []
        if masks is not None:
            masks.join()
        self.steps += 1
        still, refresh = [], []
        for req, w, res in zip(live, work, results):
            if isinstance(res, Exception):
                log.error("request %d failed: %s", req.id, res)
                self._finish(req, "error", res)
                continue
            if w.prefill:
                for tok in req.state.lead_in:  # with the first sampled token: the time to first token is the prefill's
                    self._push(req, tok)
            if w.drafts:
                self._accept_verified(req, w, res)
            elif not w.prefill:
                req.sequence.count_decode_steps(1)
            noise = req.sequence.new_kv_noise()
            if w.probe:
                self._judge_hit_rate(req)
            if self._still_running(req) if w.drafts else self._advance(req, res):
                still.append(req)
                if noise is not None and self._noisy(req, noise):
                    refresh.append(req)
        if refresh:
            failed = self._refresh(refresh)  # once: a condition of the comprehension would run it per request
            still = [r for r in still if r not in failed]
        with self._cond:
            self._running = still
        self._notify("on_step", self, still)

    def _decode_work(self, req: EngineRequest) -> Work:
        """A decode step, or a verification of the request's drafts where it has some (a probed step has none)."""
        seq = req.sequence
        probe = self._probes(seq.knobs) and seq.probe_due()
        drafts = [] if probe else req.state.propose(seq.running.draft_room)
        if probe:
            seq.schedule_probe()
        return Work(seq.running, [req.state.next_token], False, probe=probe, drafts=drafts,
                    acceptance=req.state.draft_acceptance if drafts else 0.0)

    def _fit_drafts(self, work: Sequence[Work]) -> None:
        """One call pads every sequence to its longest verification, so the call's draft length is chosen for the
        batch: the k (each item's drafts cut to it) whose expected tokens over all its sequences per cost (1 + c k,
        c a verified row's cost in a call of that many sequences: Capabilities.row_cost) is best; 0 makes it a plain
        decode call."""
        items = [w for w in work if not w.prefill and not w.probe]
        longest = max((len(w.drafts) for w in items), default=0)
        if longest == 0 or len(items) == 1:  # one sequence: its own rule chose already
            return
        longest = min(longest, self.rt.call_draft_room([w.seq for w in items]))
        cost = self.rt.capabilities.row_cost(len(items))
        best_k, best = 0, float(len(items))
        for k in range(1, max(0, longest) + 1):
            rate = sum(expected_tokens(w.acceptance, min(k, len(w.drafts))) for w in items) / (1 + cost * k)
            if rate > best * 1.0001:
                best_k, best = k, rate
        for w in items:
            w.drafts = w.drafts[:best_k]

    def _accept_verified(self, req: EngineRequest, w: Work, rows: np.ndarray) -> None:
        """A verification's logits rows to the request's state (runtime.speculative's rule), the sequence keeping
        the tokens it accepted (and running the re-tier pass they reach), the tokens pushed."""
        toks, used = req.state.accept_verified(rows, w.drafts, w.seq.length)
        w.seq.keep(used)
        req.sequence.count_decode_steps(used)
        self._notify("on_drafts", req, len(w.drafts), used - 1)
        for tok in toks:
            self._push(req, tok)

    # -- fallback policies (docs/serving.md) --
    def _probes(self, knobs: RunKnobs) -> bool:
        return self.rt.can_probe and knobs.run_time.hit_rate_every > 0

    def _judge_hit_rate(self, req: EngineRequest) -> None:
        seq = req.sequence
        hr = seq.take_hit_rate()
        if hr is None:
            return
        self._notify("on_hit_rate", req, hr)
        floor = seq.knobs.run_time.min_hit_rate
        if hr < floor:
            seq.switch_to_dense()
            self.fallbacks["hit_rate"] += 1
            log.warning("request %d: sparse mask hit rate %.3f < %.3f at position %d: dense attention over its "
                        "cache from here", req.id, hr, floor, seq.running.length)
            self._notify("on_fallback", req, "hit_rate", hr)

    def _noisy(self, req: EngineRequest, noise: float) -> bool:
        seq = req.sequence
        seq.kv_noise = float(noise)
        self._notify("on_kv_noise", req, seq.kv_noise)
        limit = self.max_kv_noise(seq.knobs)
        if limit is None or not noise > limit or seq.refreshes:
            return False  # a refreshed cache stays FP16: it is never re-encoded again
        log.warning("request %d: KV noise %.4f > %.4f after a re-tier pass: refreshing its cache at FP16 from "
                    "%d tokens", req.id, noise, limit, seq.running.length)
        return True

    def _refresh(self, reqs: Sequence[EngineRequest]) -> list[EngineRequest]:
        """A fresh cache per request: the prompt and the tokens generated so far (all but the sampled next
        token, which the next decode step feeds as before) prefilled with no re-tier pass, so every row is
        FP16 and stays so. The sampler is untouched: the same sampling stream goes on. Returns the
        requests that failed (finished with "error")."""
        # one by one, the old row first: the plan may have no spare one, and the fresh prefill recomputes everything
        fresh = [req.sequence.reopen_fp16(self.stepper) for req in reqs]
        results = self.stepper.step([Work(s, r.prompt_ids + r.ids[:-1], True) for s, r in zip(fresh, reqs)])
        failed = []
        for req, res in zip(reqs, results):
            if isinstance(res, Exception):
                log.error("request %d: cache refresh failed: %s", req.id, res)
                self._finish(req, "error", res)  # its fresh row given back
                failed.append(req)
                continue
            req.sequence.refreshed()
            self.fallbacks["kv_noise"] += 1
            self._notify("on_fallback", req, "kv_noise", req.sequence.kv_noise)
        return failed

    def _advance(self, req: EngineRequest, logits: np.ndarray) -> bool:
        """Hand the logits to the request's state (its sampler and finish checks); False when it ends here."""
        tok = req.state.accept(logits, req.sequence.running.length)
        if tok is not None:
            self._push(req, tok)
        return self._still_running(req)

    def _push(self, req: EngineRequest, tok: Token) -> None:
        if req.t_first is None:
            req.t_first = time.monotonic()
            self._notify("on_first_token", req)
        req._push(tok)

    def _still_running(self, req: EngineRequest) -> bool:
        """False (and the request finished) when its state has ended."""
        if req.state.done:
            self._finish(req, req.state.finish_reason)
            return False
        return True
