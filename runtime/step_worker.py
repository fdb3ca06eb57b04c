"""The step worker: one backend call for several sequences, the batched step API a scheduler drives.

`StepWorker` makes sequences (runtime.sequence.CachedSequence) over its backend and runs their calls: a forward call
of a chunk per sequence, prompts in chunks with a re-tier pass after each (and the prefix cache at a chat prompt's
last message), decode steps with the re-tier pass every `rate`-th step and the hit-rate probe's dense shadow call,
and speculative verifications. The call order equals gsm.golden's `prefill` / `decode`, so a portable bundle
reproduces GoldenModel in deployed mode. `Runtime` (runtime.facade) hands its step API here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gsm.bundle_format import BundleConfig
from gsm.bundle_knobs import RunKnobs
from runtime.backend import Backend, Capabilities, StepOutput
from runtime.prefix_cache import PrefixCache
from runtime.sequence import CachedSequence, PendingVerification, Scorer

PREFILL_ALIGN = 64  # a bounded prefill call's tokens: a multiple of this (StepWorker.chunk_tokens)


class ContextFullError(RuntimeError):
    """The sequence would grow past the bundle's max-seq."""


def prefill_chunk(max_input: int, past: int, call_positions: int) -> int:
    """Tokens of a prefill call after `past` positions: max-input, or where a backend bounds a call's tokens x
    positions (call_positions > 0) the largest multiple of PREFILL_ALIGN whose tokens x (past + max-input) fits,
    never fewer than PREFILL_ALIGN (nor more than max-input)."""
    if call_positions <= 0:
        return max_input
    fit = call_positions // (past + max_input) // PREFILL_ALIGN * PREFILL_ALIGN
    return max(min(PREFILL_ALIGN, max_input), min(max_input, fit))


def hit_rate(dense_mass: np.ndarray, selected: np.ndarray) -> float:
    """Spec 4.3 for one query: the dense attention mass (summed over heads, one query) that falls on the
    selected positions, over the whole mass (= the number of heads up to rounding): the mean over heads
    of the dense softmax probability of Sel(t)."""
    m = np.asarray(dense_mass, np.float64)
    picks = np.asarray(selected)
    return float(m[picks[picks >= 0]].sum() / m.sum())


class StepWorker:
    """The batched step API over one backend: sequences, and one call for several of them."""

    def __init__(self, cfg: BundleConfig, backend: Backend, prefixes: PrefixCache) -> None:
        self.cfg = cfg
        self.backend = backend
        self.capabilities: Capabilities = backend.capabilities
        self.n_max = cfg.n_max
        self.max_input = cfg.max_input
        self.vocab_size = cfg.vocab_size
        self.prefixes = prefixes  # chat prompts' prefixes (runtime.prefix_cache)

    def new_sequence(self, knobs: RunKnobs) -> CachedSequence:
        """A sequence with `knobs`, on a free row of the backend's memory plan (CacheFullError when none is)."""
        return CachedSequence(self, knobs)

    @property
    def can_probe(self) -> bool:
        """Whether decode_batch(probe=...) can measure the mask hit rate on this backend: it needs a shadow
        call that leaves every sequence's cached positions as they were (runtime.plugin_cache says why in-place
        pools allow it)."""
        return self.capabilities.hit_rate_probes

    def forward_batch(self, seqs: Sequence[CachedSequence], chunks: Sequence[Sequence[int]], *,
                      probes: bool = False) -> StepOutput:
        """One call: sequence b adds chunks[b] (1..max-input tokens) at its current length, selecting with
        its own budget (`CachedSequence.sparse_top_k`). Updates each sequence's positions and hotness (no re-tier:
        prefill_batch / decode_batch do that). probes: also return each owning layer's selection and mass."""
        ids, past, new = self._call_inputs(seqs, chunks)
        out = self.backend.forward([s.cache for s in seqs], ids, past, new, seqs[0].window_input,
                                   self._budgets(seqs), probes=probes)
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            s.add_call(c, out.attn_mass[b], StepOutput(
                out.logits[b:b + 1], out.attn_mass[b:b + 1],
                None if out.selected is None else {l: v[b:b + 1] for l, v in out.selected.items()}))
        return out

    def _budgets(self, seqs: Sequence[CachedSequence]) -> np.ndarray:
        return np.array([s.budget_input for s in seqs], np.int32)

    def _call_inputs(self, seqs: Sequence[CachedSequence],
                     chunks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [B, S] (padding rows: any valid id), past and new lengths [B], after checking the call."""
        if not seqs or len(seqs) != len(chunks):
            raise ValueError("forward_batch needs one chunk of tokens per sequence, at least one sequence")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        if len({s.window_input for s in seqs}) > 1:  # the graphs take one window per call (graph_io sparse_window)
            raise ValueError(f"sequences of different windows {sorted({s.window_input for s in seqs})} in one call "
                             "(runtime.engine groups its calls by window)")
        if any(s.pending is not None for s in seqs):
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

    def prefill_batch(self, seqs: Sequence[CachedSequence], prompts: Sequence[Sequence[int]],
                      scorers: Sequence[Scorer | None] | None = None,
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
        cut = [None] * len(prompts) if breaks is None else [
            k if k is not None and seqs[b].length == 0 and 0 < k < len(prompts[b]) else None
            for b, k in enumerate(breaks)]
        done, keep = self._reuse_prefixes(seqs, prompts, scorers, cut)
        while True:
            part = [b for b, p in enumerate(prompts) if done[b] < len(p)]
            if not part:
                break
            ends = {b: len(prompts[b]) if cut[b] is None or done[b] >= cut[b] else cut[b] for b in part}
            part, step = self._prefill_group(part, [seqs[b].length for b in part], [ends[b] - done[b] for b in part])
            chunks = [prompts[b][done[b]:min(done[b] + step, ends[b])] for b in part]
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
                seqs[b].retier()
                if keep[b] and done[b] == cut[b]:
                    self.prefixes.put(seqs[b].snapshot())
        return out

    def _reuse_prefixes(self, seqs: Sequence[CachedSequence], prompts: list[list[int]],
                        scorers: Sequence[Scorer | None] | None,
                        cut: list[int | None]) -> tuple[list[int], list[bool]]:
        """Each prompt's tokens already in its sequence from the prefix cache (a hit restores the state its break
        leaves), and whether to keep that prefix once its calls are done (a miss)."""
        done = [0] * len(prompts)
        keep = [False] * len(prompts)
        for b, k in enumerate(cut):
            if k is not None and seqs[b].reuses_prefixes and (scorers is None or scorers[b] is None):
                hit = self.prefixes.get((seqs[b].knobs.cache_key, tuple(prompts[b][:k])))
                if hit is not None:
                    seqs[b].restore(hit)
                    done[b] = k
                else:
                    keep[b] = True
        return done, keep

    def verify_batch(self, seqs: Sequence[CachedSequence], chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
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
            s.pending = PendingVerification([int(t) for t in c], out.query_mass[b, :n])
            res.append(out.logits[b, :n])
        return res

    def call_draft_room(self, seqs: Sequence[CachedSequence]) -> int:
        """Drafts any sequence may carry in one call with `seqs`: the call gives every sequence as many positions as
        its longest verification, so the one nearest max-seq bounds them all (each within its own draft_room too)."""
        return min(self.n_max - s.length for s in seqs) - 1

    def _prefill_group(self, part: list[int], past: list[int], left: list[int]) -> tuple[list[int], int]:
        """The sequences of one prefill call and their tokens each (the chunk the longest of them gets alone): the
        first of `part`, then each next while, where the backend bounds a call, the call stays within max-input tokens
        and the bound on its tokens x positions. A call's scratch follows its tokens and the distinct positions its
        queries pick, per sequence: 8 sequences of 4K sharing calls of 32 tokens each made a position's rows again in
        every call that picked it, and 4 sequences of 512 tokens in a call grew the heap (SmolLM2,
        bench/memory_breakdown.py --batch 8: peak 821 -> 754 MiB, prefill 110 -> 84 s). A sequence's chunks are then
        the ones it gets alone. past, left: each one's positions and prompt tokens still to run."""
        bound = self.backend.capabilities.call_positions
        n = 1
        while n < len(part):
            longest = max(past[:n + 1])
            step = self.chunk_tokens(longest)
            tokens = sum(min(step, t) for t in left[:n + 1])
            if bound > 0 and (tokens > self.max_input or tokens * (longest + self.max_input) > bound):
                break
            n += 1
        return part[:n], self.chunk_tokens(max(past[:n]))

    def chunk_tokens(self, past: int) -> int:
        """Tokens of a prefill call after at most `past` positions (prefill_chunk with this backend's bound)."""
        return prefill_chunk(self.max_input, past, self.backend.capabilities.call_positions)

    def prefill_call(self, seq: CachedSequence, tokens: Sequence[int], *, selections: bool = False) -> StepOutput:
        """One prefill call of exactly `tokens` (1..max-input, never split) and the re-tier pass that ends it, as each
        call of prefill_batch makes them: for a caller that fixes the calls itself (runtime.verify replays the golden
        probe's). selections: the output holds each owning layer's selected positions too."""
        out = self.forward_batch([seq], [tokens], probes=selections)
        seq.retier()
        return out

    def decode_batch(self, seqs: Sequence[CachedSequence], tokens: Sequence[int],
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
        dense: StepOutput | None = None
        if probed:
            pseqs = [seqs[b] for b in probed]
            ids, past, new = self._call_inputs(pseqs, [[int(tokens[b])] for b in probed])
            dense = self.backend.forward([s.cache for s in pseqs], ids, past, new, pseqs[0].window_input,
                                         np.full(len(pseqs), self.n_max, np.int32),
                                         probes=True, commit=False)
        res = self.forward_batch(seqs, [[int(t)] for t in tokens], probes=bool(probed) or selections)
        for k, b in enumerate(probed):
            seqs[b].record_hit_rates({l: hit_rate(dense.layer_mass[l][k], res.selected[l][b, 0])
                                      for l in res.selected})
        for s in seqs:
            s.count_decode_step()
        return res.logits[:, -1]
