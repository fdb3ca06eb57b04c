"""The runtime: a loaded bundle, sequences over it, sampling and generation.

The runtime owns what the graphs do not decide (docs/engine_io.md section 2, "Ownership"): the
cache buffers, the hotness EMA from `attn_mass`, the decode step count and the re-tier passes at the
end of every prefill call and after every `quantization_adaptation_rate`-th decode step, which it
applies through the backend's demotion graph. The call order equals gsm.golden's `prefill` /
`decode`, so a portable bundle reproduces GoldenModel in deployed mode.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gsm.bundle_format import BundleConfig
from gsm.bundle_knobs import RunKnobs
from runtime.backend import Backend, Capabilities, StepOutput
from runtime.bundle import open_bundle
from runtime.host_memory import trim_heap
from runtime.ort_backend import GRAPHS, OrtBackend, SessionTuning
from runtime.policy import SequenceState, TierPolicy, retier
from runtime.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, Prefix, PrefixCache
from runtime.request_state import Generation, RequestState, Token
from runtime.sampling import RequestError, Sampler, SamplingParams
from runtime.speculative import SpeculativeConfig, check_speculative
from runtime.text import TextCodec

if TYPE_CHECKING:
    from runtime.request import TokenStream

__all__ = ["BACKENDS", "ContextFullError", "Generation", "RequestState", "Runtime", "Sampler", "Sequence_", "Token",
           "load"]

BACKENDS = ("auto", "onnxruntime", "tensorrt", "reference")
PREFILL_ALIGN = 64  # a bounded prefill call's tokens: a multiple of this (Runtime.chunk_tokens)


def prefill_chunk(max_input: int, past: int, call_positions: int) -> int:
    """Tokens of a prefill call after `past` positions: max-input, or where a backend bounds a call's tokens x
    positions (call_positions > 0) the largest multiple of PREFILL_ALIGN whose tokens x (past + max-input) fits,
    never fewer than PREFILL_ALIGN (nor more than max-input)."""
    if call_positions <= 0:
        return max_input
    fit = call_positions // (past + max_input) // PREFILL_ALIGN * PREFILL_ALIGN
    return max(min(PREFILL_ALIGN, max_input), min(max_input, fit))


class ContextFullError(RuntimeError):
    """The sequence would grow past the bundle's max-seq."""


class Sequence_:
    """One sequence's cache and tier state; use Runtime.new_sequence(). Its place in the backend's
    buffers is given back when the sequence is garbage-collected (or by `close()`). It keeps the knobs it was made
    with (gsm.bundle_knobs: window and budget sent to the graphs, tier policy) whatever the runtime's change to.

    Monitoring: `sparse_top_k` is this sequence's selection budget (None: the runtime's default;
    `use_dense()` switches it to dense attention); after a probed decode step `last_hit_rate` /
    `last_hit_rates` hold the mask hit rate (docs/runtime.md "Probes"); after every re-tier pass
    `last_kv_noise` holds the relative error the pass's demotions added (None when it demoted nothing)."""

    def __init__(self, rt: Runtime, knobs: RunKnobs | None = None) -> None:
        self.rt = rt
        self.knobs = rt.knobs if knobs is None else knobs
        self.policy = tier_policy(rt.cfg, self.knobs)
        # what the graphs are sent when nobody chose: window 0 and budget -1, "each layer's own" (gsm_config
        # layer_selection; the model's window and top-k in a layer without one)
        self.window_input = self.knobs.sparse_window or 0
        self._default_budget = -1 if self.knobs.sparse_top_k is None else self.knobs.sparse_top_k
        self.cache = rt.backend.new_cache()
        self.state = SequenceState()
        self.last: StepOutput | None = None
        self._sparse_top_k: int | None = None
        self.last_hit_rate: float | None = None  # mean over owning layers, from the last probed step
        self.last_hit_rates: dict[int, float] | None = None  # owning layer -> hit rate, same step
        self.last_kv_noise: float | None = None  # from the last re-tier pass (None: it demoted nothing)
        self.retier_passes = 0  # re-tier passes run so far (tells a new last_kv_noise from an old one)
        self._fp16_only = False  # keep_fp16(): no re-tier passes (nothing demoted)
        self._verified: _Verified | None = None  # the last verify call's tokens and masses, until keep()
        self._finalizer = weakref.finalize(self, rt.backend.release, self.cache)

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def sparse_top_k(self) -> int | None:
        """Selection budget (spec 4.1 top-k) of this sequence's next calls; None: the runtime's default."""
        return self._sparse_top_k

    @sparse_top_k.setter
    def sparse_top_k(self, k: int | None) -> None:
        self._sparse_top_k = None if k is None else check_sparse_top_k(k, self.rt.n_max)

    @property
    def effective_sparse_top_k(self) -> int:
        if self._sparse_top_k is not None:
            return self._sparse_top_k
        return self.rt.cfg.sparse_top_k if self.knobs.sparse_top_k is None else self.knobs.sparse_top_k

    @property
    def budget_input(self) -> int:
        """The `sparse_top_k` the graphs are sent for this sequence (-1: each layer's own)."""
        return self._default_budget if self._sparse_top_k is None else self._sparse_top_k

    def use_dense(self) -> None:
        """Dense attention over the whole cache from the next call on (the spec's dense case: a budget of
        n_max covers every position), e.g. as a quality fallback; `sparse_top_k = None` goes back to sparse."""
        self._sparse_top_k = self.rt.n_max

    def keep_fp16(self) -> None:
        """No re-tier pass from now on: every row this sequence writes stays FP16 (the KV-noise fallback's
        refreshed cache, docs/serving.md). Rows already demoted stay as they are (demotion only)."""
        self._fp16_only = True

    def close(self) -> None:
        self._finalizer()

    def _retier(self) -> None:
        if self._fp16_only:
            return
        new_tier = retier(self.state, self.policy, self.state.length)
        self.retier_passes += 1
        self.last_kv_noise = None if new_tier is None else self.rt.backend.demote(self.cache, new_tier)

    def prefill(self, ids: Sequence[int], scorer: Callable[[int, np.ndarray], None] | None = None,
                break_at: int | None = None) -> np.ndarray:
        """Prompt (or more of it), in chunks of at most max-input tokens, each followed by a re-tier
        pass as golden `prefill` does; returns the last position's logits [V]. scorer, break_at: prefill_batch's."""
        return self.rt.prefill_batch([self], [ids], [scorer], [break_at])[0]

    def decode(self, token: int, *, probe: bool = False) -> np.ndarray:
        """One decode step; re-tier after every `rate`-th step. Returns logits [V]."""
        return self.rt.decode_batch([self], [token], probe=[probe])[0]

    def snapshot(self) -> Prefix:
        """This sequence's state and cache so far, copied (runtime.prefix_cache)."""
        return Prefix(tuple(self.state.tokens), copy.deepcopy(self.state),
                      self.rt.backend.take_prefix(self.cache, self.length), self.knobs)

    def restore(self, prefix: Prefix) -> None:
        """A fresh sequence made the one `prefix` was taken from."""
        if self.length:
            raise ValueError("restore() needs a fresh sequence")
        self.rt.backend.put_prefix(self.cache, prefix.rows)
        self.state = prefix.state_copy()

    @property
    def reuses_prefixes(self) -> bool:
        """Whether this sequence's prefill may use and fill the runtime's prefix cache: the runtime's selection
        budget, a cache that re-tiers (not a refreshed FP16 one), a backend that copies prefixes."""
        return (self._sparse_top_k is None and not self._fp16_only and self.rt.prefixes.capacity > 0
                and self.rt.capabilities.prefix_reuse)

    @property
    def draft_room(self) -> int:
        """Drafted tokens the next call may verify after the next token: within the backend's verification rows, the
        sequence's max-seq, and the decode steps left before the next re-tier pass (a pass falls between calls, as
        after one-token steps: the tokens after it read the re-encoded rows). 0: verification not possible."""
        cap = self.rt.capabilities.verify_rows
        if cap < 2:
            return 0
        to_retier = self.policy.rate - self.state.decode_steps % self.policy.rate
        return max(0, min(cap, to_retier, self.rt.n_max - self.length) - 1)

    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed the next token and drafts as one call; returns logits [n, V], row j what a one-token step after
        tokens[j] returns. Nothing is kept until `keep`."""
        return self.rt.verify_batch([self], [tokens])[0]

    def keep(self, n: int) -> None:
        """Keep the first n tokens of the last verify call (1..its length), as n one-token steps would have: positions,
        hotness from each token's own attention mass in order, decode steps and the re-tier pass they reach; the cache
        forgets the rest (rows, slots, row-cache entries: written again by the next call)."""
        v = self._verified
        if v is None or not 1 <= n <= len(v.tokens):
            raise ValueError(f"keep({n}): needs 1..{0 if v is None else len(v.tokens)} after a verify call")
        self._verified = None
        self.rt.backend.truncate(self.cache, self.length + n)
        for j in range(n):
            self.state.add_positions([v.tokens[j]])
            self.state.update_hotness(v.mass[j], self.policy.hotness_decay)
            self.state.decode_steps += 1
            if self.state.decode_steps % self.policy.rate == 0:
                self._retier()


@dataclass(frozen=True)
class _Verified:
    """What a verify call fed one sequence, until `Sequence_.keep` says how much of it stays."""

    tokens: list[int]
    mass: np.ndarray  # [n, L]: each token's query's own attention mass


def check_sparse_top_k(k: int, n_max: int) -> int:
    """A selection budget 0..n_max (n_max or anything >= the context: dense attention)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= n_max:
        raise RequestError("sparse_top_k", f"must be an integer in 0..{n_max} (the bundle's max-seq; a value >= "
                                           f"the context is dense attention), got {k!r}")
    return int(k)


def hit_rate(dense_mass: np.ndarray, selected: np.ndarray) -> float:
    """Spec 4.3 for one query: the dense attention mass (summed over heads, one query) that falls on the
    selected positions, over the whole mass (= the number of heads up to rounding): the mean over heads
    of the dense softmax probability of Sel(t)."""
    m = np.asarray(dense_mass, np.float64)
    picks = np.asarray(selected)
    return float(m[picks[picks >= 0]].sum() / m.sum())


def tier_policy(cfg: BundleConfig, knobs: RunKnobs) -> TierPolicy:
    """The tier policy (runtime.policy) of a sequence with these knobs."""
    return TierPolicy(sink_tokens=cfg.sink_tokens, fp16_window=knobs.fp16_window, tier_fractions=knobs.tier_fractions,
                      hotness_decay=knobs.hotness_decay, rate=knobs.quantization_adaptation_rate,
                      hot_token_ids=frozenset(knobs.hot_token_ids))


def check_sparse_window(w: int | None, cfg: BundleConfig) -> int:
    """The run-time window: the model's by default, else 1..max_sparse_window of the bundle."""
    if w is None:
        return cfg.sparse_window
    hi = cfg.max_sparse_window
    if isinstance(w, bool) or int(w) != w or not 1 <= w <= hi:
        raise RequestError("sparse_window", f"must be an integer in 1..{hi} (the bundle's max_sparse_window), got {w}")
    return int(w)


class Runtime:
    """A verified bundle with a backend; `generate` / `stream` for text or ids."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], cfg: BundleConfig, backend: Backend, *,
                 sparse_window: int | None, sparse_top_k: int | None = None, knobs: RunKnobs | None = None,
                 speculative: SpeculativeConfig | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MIB << 20) -> None:
        self.bundle = bundle
        self.manifest = manifest
        self.cfg = cfg
        self.backend = backend
        self.capabilities: Capabilities = backend.capabilities
        self.n_max = cfg.n_max
        self.max_input = cfg.max_input
        # the knobs new sequences take (gsm.bundle_knobs): the bundle's run_time and tier policy (or `knobs`, e.g. the
        # golden probe's), the window and budget arguments in place of run_time's
        self.knobs = (cfg.knobs if knobs is None else knobs).with_run_time(
            sparse_window=None if sparse_window is None else check_sparse_window(sparse_window, cfg),
            sparse_top_k=None if sparse_top_k is None else check_sparse_top_k(sparse_top_k, self.n_max))
        cfg.knob_limits.check(self.knobs, top_k_cap=0)  # a budget above a plugin graph's: its backend's RequestError
        self.vocab_size = cfg.vocab_size
        self.logits_all = cfg.logits == "all"  # prefill returns every position's logits (prompt scoring)
        self.bos_token_id = cfg.bos_token_id
        self.eos_token_id = cfg.eos_token_id
        self.codec = TextCodec.load(bundle, self.bos_token_id, self.eos_token_id)  # None: ids only
        self._grammars: Any = None  # runtime.constrained.GrammarCache, made by the first structured request
        self._grammars_lock = threading.Lock()
        # requests draft unless told not to (load(speculative=...), a request's own speculative=), where the backend
        # can verify drafts (Capabilities.verify_rows)
        self.speculative = dataclasses.replace(speculative or SpeculativeConfig(),
                                               row_cost=self.capabilities.verify_row_cost)
        # chat prompts' prefixes (runtime.prefix_cache); 0 bytes: none kept (the breaks stay: the same tokens)
        self.prefixes = PrefixCache(prefix_cache_bytes)

    @property
    def policy(self) -> TierPolicy:
        """The tier policy of new sequences."""
        return tier_policy(self.cfg, self.knobs)

    @property
    def sparse_window(self) -> int:
        """The window new sequences select with in layers without their own (the model's unless chosen)."""
        return self.cfg.sparse_window if self.knobs.sparse_window is None else self.knobs.sparse_window

    @property
    def sparse_top_k(self) -> int:
        """The default selection budget of new sequences (Sequence_.sparse_top_k overrides it per sequence)."""
        return self.cfg.sparse_top_k if self.knobs.sparse_top_k is None else self.knobs.sparse_top_k

    def set_knobs(self, knobs: RunKnobs) -> None:
        """The knobs of sequences made from now on (gsm.bundle_knobs; checked against the bundle's limits). Sequences
        made before keep theirs."""
        self.cfg.knob_limits.check(knobs, top_k_cap=self.capabilities.max_top_k)
        self.knobs = knobs

    @property
    def can_probe(self) -> bool:
        """Whether decode_batch(probe=...) can measure the mask hit rate on this backend: it needs a shadow
        call that leaves every sequence's cached positions as they were (runtime.plugin_cache says why in-place
        pools allow it)."""
        return self.capabilities.hit_rate_probes

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` of the bundle."""
        return self._need_codec().tokenizer

    def _need_codec(self) -> TextCodec:
        if self.codec is None:
            raise RequestError("prompt", f"{self.bundle} has no tokenizer.json: give token ids instead of text")
        return self.codec

    def new_sequence(self, knobs: RunKnobs | None = None) -> Sequence_:
        """A sequence with `knobs` (None: the runtime's now)."""
        return Sequence_(self, knobs)

    # -- the step API: one backend call for several sequences (a scheduler drives these) -----------
    def forward_batch(self, seqs: Sequence[Sequence_], chunks: Sequence[Sequence[int]], *,
                      probes: bool = False) -> StepOutput:
        """One call: sequence b adds chunks[b] (1..max-input tokens) at its current length, selecting with
        its own budget (`Sequence_.sparse_top_k`). Updates each sequence's positions and hotness (no re-tier:
        prefill_batch / decode_batch do that). probes: also return each owning layer's selection and mass."""
        ids, past, new = self._call_inputs(seqs, chunks)
        out = self.backend.forward([s.cache for s in seqs], ids, past, new, seqs[0].window_input,
                                   self._budgets(seqs), probes=probes)
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            s.state.add_positions([int(t) for t in c])
            s.state.update_hotness(out.attn_mass[b], s.policy.hotness_decay)
            s.last = StepOutput(out.logits[b:b + 1], out.attn_mass[b:b + 1],
                                None if out.selected is None else {l: v[b:b + 1] for l, v in out.selected.items()})
        return out

    def _budgets(self, seqs: Sequence[Sequence_]) -> np.ndarray:
        return np.array([s.budget_input for s in seqs], np.int32)

    def _call_inputs(self, seqs: Sequence[Sequence_],
                     chunks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [B, S] (padding rows: any valid id), past and new lengths [B], after checking the call."""
        if not seqs or len(seqs) != len(chunks):
            raise ValueError("forward_batch needs one chunk of tokens per sequence, at least one sequence")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        if len({s.window_input for s in seqs}) > 1:  # the graphs take one window per call (graph_io sparse_window)
            raise ValueError(f"sequences of different windows {sorted({s.window_input for s in seqs})} in one call "
                             "(runtime.engine groups its calls by window)")
        if any(s._verified is not None for s in seqs):
            raise ValueError("a sequence's last verification is not settled: call keep(n) first")
        if len(seqs) > self.capabilities.max_per_call:
            raise ValueError(f"{len(seqs)} sequences in one call: backend {self.backend.name} takes at most "
                             f"{self.capabilities.max_per_call} (capabilities.max_per_call)")
        chunks = [[int(t) for t in c] for c in chunks]
        S = max(len(c) for c in chunks)
        if min(len(c) for c in chunks) < 1 or S > self.max_input:
            raise ValueError(f"each chunk needs 1..{self.max_input} tokens (max-input), got "
                             f"{[len(c) for c in chunks]}")
        past = np.array([s.length for s in seqs], np.int32)
        if int(past.max()) + S > self.n_max:
            raise ContextFullError(f"a call of {S} tokens after {int(past.max())} positions exceeds the bundle's "
                                   f"max-seq {self.n_max} (rebuild with a larger --max-seq)")
        ids = np.zeros((len(seqs), S), np.int64)
        for b, c in enumerate(chunks):
            ids[b, :len(c)] = c
        return ids, past, np.array([len(c) for c in chunks], np.int32)

    def prefill_batch(self, seqs: Sequence[Sequence_], prompts: Sequence[Sequence[int]],
                      scorers: Sequence[Callable[[int, np.ndarray], None] | None] | None = None,
                      breaks: Sequence[int | None] | None = None) -> np.ndarray:
        """Each sequence's prompt, in rounds of at most max-input tokens per sequence (fewer late in a long
        prompt where the backend bounds a call's working memory: chunk_tokens), each call followed by a re-tier
        pass of every sequence in it.
        Returns each sequence's last-position logits [B, V]. scorers[b] (a bundle built with --logits all):
        called with (first position, logits [n, V]) of every chunk of sequence b (prompt log-probabilities).
        breaks[b]: a call of a fresh sequence b ends there (RequestState.prompt_break: where a chat prompt's last
        message starts), and the state those tokens leave is found in, or kept in, the prefix cache
        (runtime.prefix_cache)."""
        prompts = [[int(t) for t in p] for p in prompts]
        if len(prompts) != len(seqs):
            raise ValueError("prefill_batch needs one prompt per sequence")
        for s, p in zip(seqs, prompts):
            if not p:
                raise ValueError("prefill needs at least one token")
            if s.length + len(p) > self.n_max:  # the whole prompt, not the chunk, before any work
                raise ContextFullError(f"{s.length} positions + a prompt of {len(p)} tokens exceed the "
                                       f"bundle's max-seq {self.n_max} (rebuild with a larger --max-seq)")
        out = np.zeros((len(seqs), self.vocab_size), np.float32)
        done = [0] * len(prompts)
        cut = [None] * len(prompts) if breaks is None else [
            k if k is not None and seqs[b].length == 0 and 0 < k < len(prompts[b]) else None
            for b, k in enumerate(breaks)]
        keep = [False] * len(prompts)  # the prefix to put into the cache once its calls are done
        for b, k in enumerate(cut):
            if k is not None and seqs[b].reuses_prefixes and (scorers is None or scorers[b] is None):
                hit = self.prefixes.get((seqs[b].knobs, tuple(prompts[b][:k])))
                if hit is not None:
                    seqs[b].restore(hit)
                    done[b] = k
                else:
                    keep[b] = True
        while True:
            part = [b for b, p in enumerate(prompts) if done[b] < len(p)]
            if not part:
                break
            step = self.chunk_tokens(max(seqs[b].length for b in part), len(part))
            ends = [len(prompts[b]) if cut[b] is None or done[b] >= cut[b] else cut[b] for b in part]
            chunks = [prompts[b][done[b]:min(done[b] + step, end)] for b, end in zip(part, ends)]
            res = self.forward_batch([seqs[b] for b in part], chunks)
            last = res.logits.shape[1] > 1  # logits=all: [B, S, V]; pick each sequence's last new row
            for k, b in enumerate(part):
                n = len(chunks[k])
                out[b] = res.logits[k, n - 1 if last else -1]
                if scorers is not None and scorers[b] is not None:
                    if not last:
                        raise ValueError("prompt scoring needs a bundle built with --logits all")
                    scorers[b](done[b], res.logits[k, :n])
                done[b] += n
                seqs[b]._retier()
                if keep[b] and done[b] == cut[b]:
                    self.prefixes.put(seqs[b].snapshot())
        return out

    def verify_batch(self, seqs: Sequence[Sequence_], chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One call: sequence b feeds chunks[b] (its next token, then 0..draft_room drafts); returns its logits
        [len(chunks[b]), V], row j bit for bit what a one-token step after chunks[b][j] returns. Each sequence then
        needs `keep(n)`: until then its state is as before the call."""
        cap = self.capabilities.verify_rows
        if cap < 1:
            raise RuntimeError(f"backend {self.backend.name} cannot verify drafts (its graph returns no query_mass)")
        for s, c in zip(seqs, chunks):
            if not 1 <= len(c) <= s.draft_room + 1:
                raise ValueError(f"a verification of {len(c)} tokens: this sequence takes 1..{s.draft_room + 1} now")
        ids, past, new = self._call_inputs(seqs, chunks)
        J = int(new.max())
        rows = np.minimum(np.arange(J, dtype=np.int32)[None, :], (new - 1)[:, None]).astype(np.int32)
        out = self.backend.forward([s.cache for s in seqs], ids, past, new, seqs[0].window_input,
                                   self._budgets(seqs), rows=rows)
        res = []
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            n = len(c)
            s._verified = _Verified([int(t) for t in c], out.query_mass[b, :n])
            res.append(out.logits[b, :n])
        return res

    def call_draft_room(self, seqs: Sequence[Sequence_]) -> int:
        """Drafts any sequence may carry in one call with `seqs`: the call gives every sequence as many positions as
        its longest verification, so the one nearest max-seq bounds them all (each within its own draft_room too)."""
        return min(self.n_max - s.length for s in seqs) - 1

    def chunk_tokens(self, past: int, sequences: int = 1) -> int:
        """Tokens per sequence of a prefill call of `sequences` sequences after at most `past` positions
        (prefill_chunk with this backend's bound, shared among the call's sequences)."""
        return prefill_chunk(self.max_input, past, self.backend.capabilities.call_positions // max(1, sequences))

    def prefill_call(self, seq: Sequence_, tokens: Sequence[int], *, selections: bool = False) -> StepOutput:
        """One prefill call of exactly `tokens` (1..max-input, never split) and the re-tier pass that ends it, as each
        call of prefill_batch makes them: for a caller that fixes the calls itself (runtime.verify replays the golden
        probe's). selections: the output holds each owning layer's selected positions too."""
        out = self.forward_batch([seq], [tokens], probes=selections)
        seq._retier()
        return out

    def decode_batch(self, seqs: Sequence[Sequence_], tokens: Sequence[int],
                     probe: Sequence[bool] | None = None, *, selections: bool = False) -> np.ndarray:
        """One decode step of each sequence in one call; each re-tiers after its own every `rate`-th
        step, as alone. Returns logits [B, V]. selections: each sequence's `last` holds the step's selected positions
        too (StepOutput.selected; runtime.verify).

        probe[b]: measure sequence b's mask hit rate at this step (spec 4.3): a dense shadow call of the
        probed sequences first (nothing of it is kept but each owning layer's attention mass), then the
        real call, whose selection Sel(t) is scored against that dense mass; sets `last_hit_rate(s)`."""
        probe = [False] * len(seqs) if probe is None else [bool(p) for p in probe]
        if len(probe) != len(seqs):
            raise ValueError("decode_batch: probe needs one flag per sequence")
        probed = [b for b, p in enumerate(probe) if p]
        dense = None
        if probed:
            pseqs = [seqs[b] for b in probed]
            ids, past, new = self._call_inputs(pseqs, [[int(tokens[b])] for b in probed])
            dense = self.backend.forward([s.cache for s in pseqs], ids, past, new, pseqs[0].window_input,
                                         np.full(len(pseqs), self.n_max, np.int32),
                                         probes=True, commit=False)
        res = self.forward_batch(seqs, [[int(t)] for t in tokens], probes=bool(probed) or selections)
        for k, b in enumerate(probed):
            rates = {l: hit_rate(dense.layer_mass[l][k], res.selected[l][b, 0]) for l in res.selected}
            seqs[b].last_hit_rates = rates
            seqs[b].last_hit_rate = float(np.mean(list(rates.values())))
        for s in seqs:
            s.state.decode_steps += 1
            if s.state.decode_steps % s.policy.rate == 0:
                s._retier()
        return res.logits[:, -1]

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64,
                       **kw: Any) -> list[Generation]:
        """Several requests decoded together, one backend call per step for all unfinished ones; each
        result equals `generate` of that prompt alone (same sampling parameters for all). More prompts than
        the plan's resident rows run in groups of that many."""
        reqs = [self.request(p, max_new_tokens, **kw) for p in prompts]  # every input checked first
        group = min(self.capabilities.max_resident, self.capabilities.max_per_call)
        for i in range(0, len(reqs), group):
            self._run_together(reqs[i:i + group])
        return [r.result() for r in reqs]

    def _run_together(self, reqs: Sequence[RequestState]) -> None:
        live = [r for r in reqs if r.start()]
        seqs = {id(r): self.new_sequence() for r in live}
        logits = self.prefill_batch([seqs[id(r)] for r in live], [r.prompt_ids for r in live],
                                    [r.prompt_scorer for r in live], [r.prompt_break for r in live]) if live else []
        for r, lg in zip(live, logits):
            r.accept(lg, seqs[id(r)].length)
        while True:
            for r in [r for r in live if r.done]:
                seqs.pop(id(r)).close()
            live = [r for r in live if not r.done]
            if not live:
                return
            run = [seqs[id(r)] for r in live]
            room = self.call_draft_room(run)
            drafts = [r.propose(min(s.draft_room, room)) for r, s in zip(live, run)]
            if not any(drafts):
                for r, s, lg in zip(live, run, self.decode_batch(run, [r.next_token for r in live])):
                    r.accept(lg, s.length)
                continue
            lengths = [s.length for s in run]  # one call: each sequence its next token and its drafts, if any
            rows = self.verify_batch(run, [[r.next_token, *d] for r, d in zip(live, drafts)])
            for r, s, d, lg, n in zip(live, run, drafts, rows, lengths):
                s.keep(r.accept_verified(lg, d, n)[1])

    def encode(self, text: str) -> list[int]:
        """BOS + the text's pieces; no BOS when tokenizer_config.json has add_bos_token: false."""
        return self._need_codec().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_codec().decode(ids)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def request(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                stop_ids: Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                logprobs: int | None = None, response_format: Mapping[str, Any] | None = None,
                fit_context: bool = False, prompt_logprobs: bool = False,
                speculative: str | None = None) -> RequestState:
        """A checked request, not yet run (`stream`, `generate_batch` and the Engine drive it). Inputs are
        checked here, before any model work: a RequestError (ValueError) names the parameter. top_k is
        sampling's top-k (0: off), not the selection budget (`Sequence_.sparse_top_k`). stop: up to 4 strings
        that end the output (not included); logprobs: None, or how many alternatives each Token carries (0: the
        chosen token's log-probability only); response_format: structured output (runtime.constrained);
        fit_context: refuse a prompt + max_new_tokens beyond max-seq (the server, for an explicit max_tokens)
        instead of ending at the context ("context"); prompt_logprobs: score the prompt's tokens too
        (`RequestState.prompt_tokens`; echo with logprobs, a bundle built with --logits all); speculative: "auto" |
        "off" for this request (None: the runtime's, `load(speculative=...)`)."""
        params = SamplingParams(temperature, top_k, top_p, seed, presence_penalty, frequency_penalty,
                                repetition_penalty)
        return RequestState(self, self._prompt_ids(prompt), max_new_tokens, params, stop_ids, stop=stop,
                            logprobs=logprobs, constraint=self._constraint(response_format), fit_context=fit_context,
                            prompt_logprobs=prompt_logprobs, speculative=self._speculation(speculative))

    def _speculation(self, mode: str | None) -> SpeculativeConfig | None:
        """A request's drafting: the runtime's config in the request's mode; None where it is off or the backend
        cannot verify."""
        cfg = self.speculative if check_speculative(mode) is None else dataclasses.replace(self.speculative, mode=mode)
        return cfg if cfg.on and self.capabilities.verify_rows > 1 else None

    def _constraint(self, fmt: Mapping[str, Any] | None) -> Any:
        if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
            return None
        from runtime.constrained import GrammarCache, grammar_of

        if self.codec is None:
            grammar_of(fmt)  # a malformed format is named first
            raise RequestError("response_format", f"{self.bundle} has no tokenizer.json: structured output needs it")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCache((self.bundle / "tokenizer.json").read_text(encoding="utf-8"),
                                              self.vocab_size, self.eos_token_id)
        return self._grammars.constraint(fmt)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> TokenStream:
        """A request: iterate it for tokens as they come (stop ids end it and are not yielded); after
        that its `ids`, `text` and `finish_reason` hold the outcome. Keywords and checks as `request`."""
        from runtime.request import TokenStream  # at call time: request code builds on this module, not under it

        return TokenStream(self, self.request(prompt, max_new_tokens, **kw))

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> Generation:
        """The whole generation at once; `text` is what follows the prompt (leading space kept)."""
        return self.stream(prompt, max_new_tokens, **kw).collect()

    @property
    def has_chat_template(self) -> bool:
        return self.codec is not None and self.codec.has_chat_template

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The messages rendered by the bundle's chat template (with the generation prompt), as ids."""
        return self._need_codec().encode_chat(messages)

    def chat_request(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, **kw: Any) -> RequestState:
        """`request` on the rendered messages, stopping at EOS and the template's end-of-turn token; its prefill
        breaks where the last message starts (the earlier messages' state is kept for the next prompt that starts
        with them: runtime.prefix_cache)."""
        codec = self._need_codec()
        kw.setdefault("stop_ids", codec.chat_stop_ids())
        ids = self.chat_ids(messages)
        req = self.request(ids, max_new_tokens, **kw)
        req.prompt_break = codec.last_message_start(messages, ids)
        return req

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, **kw: Any) -> TokenStream:
        """`stream` on the rendered messages, stopping at EOS and the template's end-of-turn token."""
        from runtime.request import TokenStream

        return TokenStream(self, self.chat_request(messages, max_new_tokens, **kw))

    def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, **kw: Any) -> Generation:
        """The assistant's answer to `messages` ([{"role": "user", "content": "..."}, ...])."""
        return self.chat_stream(messages, max_new_tokens, **kw).collect()


def load(bundle: str | Path, backend: str = "auto", *, threads: int = 0, sparse_window: int | None = None,
         sparse_top_k: int | None = None, spinning: bool = True, graph: str = "auto",
         speculative: str = "auto", prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB) -> Runtime:
    """Verify the bundle's hashes, then open it with `backend`.

    sparse_top_k: the default selection budget (spec 4.1) of every sequence, 0..max-seq (a value
    >= the context is dense attention); None: the checkpoint's. Not the sampling top_k of `generate`.
    spinning: ONNX Runtime's intra-op threads busy-wait between operators (onnxruntime backend, threads
    != 1), as ONNX Runtime, llama.cpp and GenAI do by default: a decode step hands work to the threads
    hundreds of times, and a parked thread takes tens of microseconds to wake each time. False gives the
    cores back between operators, for a board that shares them with other work (docs/runtime.md, "ONNX
    Runtime session").
    graph (onnxruntime backend): "cpu" runs model.cpu.onnx, the attention as one custom op per owning layer
    (libgsm_ort_ops.so; RuntimeError where it is not built); "portable" the standard-op graph; "auto" the
    first where it is usable. `Runtime.backend.graph` says which one runs.

    speculative: "auto" drafts tokens from each request's own prompt and output and verifies them several per call
    (runtime.speculative; same tokens as without, greedy or seeded), where the backend can ("off": one token a call);
    a request's own `speculative=` overrides it.
    prefix_cache_mib: the memory kept for chat prompts' prefixes (the messages before the last one: a system prompt,
    worked examples, the history), so that the next prompt starting with them prefills its last message only
    (runtime.prefix_cache; 0: none kept, the same tokens either way).

    auto: TensorRT when the bundle has an engine.plan and TensorRT imports, else ONNX Runtime.
    reference: the TensorRT graph (model.onnx) with the plugins' C++ CPU reference; slow, for checks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    root = Path(bundle)
    manifest, cfg = open_bundle(root)
    check_sparse_window(sparse_window, cfg)  # before any graph is opened
    if sparse_top_k is not None:
        check_sparse_top_k(sparse_top_k, cfg.n_max)
    spec = SpeculativeConfig(check_speculative(speculative, "speculative") or "auto")
    if isinstance(prefix_cache_mib, bool) or not isinstance(prefix_cache_mib, (int, float)) or not (
            0 <= prefix_cache_mib < float("inf")):
        raise RequestError("prefix_cache_mib", f"must be a number >= 0 (MiB), got {prefix_cache_mib!r}")
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
        be = OrtBackend(root, cfg, tuning=SessionTuning(threads=threads, spinning=bool(spinning), graph=graph))
    rt = Runtime(root, manifest, cfg, be, sparse_window=sparse_window, sparse_top_k=sparse_top_k, speculative=spec,
                 prefix_cache_bytes=int(prefix_cache_mib * (1 << 20)))
    trim_heap()  # what loading parsed and dropped (the tokenizer's JSON: ~16 MiB on SmolLM2) goes back
    return rt
