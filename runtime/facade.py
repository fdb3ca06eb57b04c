"""`Runtime`: the object users call. A verified bundle with a backend (runtime.loader.load opens one): text in and
out, requests checked and run (`request`, `stream`, `generate`, `chat*`, `generate_batch`), and the step API a
scheduler drives, which it hands to its step worker (runtime.step_worker)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gsm.bundle_format import BundleConfig
from gsm.bundle_knobs import RunKnobs
from runtime.backend import Backend, Capabilities, StepOutput
from runtime.draft_model import DraftModel
from runtime.policy import TierPolicy
from runtime.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, PrefixCache
from runtime.request_options import RequestOptions
from runtime.request_state import Generation, RequestState, TokenConstraint
from runtime.sampling import RequestError
from runtime.sequence import CachedSequence, Scorer, check_sparse_top_k, check_sparse_window, tier_policy
from runtime.speculative import SpeculativeConfig, check_speculative
from runtime.step_worker import StepWorker
from runtime.text import TextCodec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from runtime.constrained import GrammarCache
    from runtime.request import TokenStream

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]

WARM_PLACEHOLDER = "."  # the user turn warm_prefix renders after the messages: only where it starts counts


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
        self._grammars: GrammarCache | None = None  # made by the first structured request
        self._grammars_lock = threading.Lock()
        # requests draft unless told not to (load(speculative=...), a request's own speculative=), where the backend
        # can verify drafts (Capabilities.verify_rows)
        self.speculative = dataclasses.replace(speculative or SpeculativeConfig(),
                                               row_cost=self.capabilities.verify_row_cost)
        # chat prompts' prefixes (runtime.prefix_cache); 0 bytes: none kept (the breaks stay: the same tokens)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self.worker = StepWorker(cfg, backend, self.prefixes)
        self.draft: DraftModel | None = None  # a draft bundle drafting for requests (attach_draft)

    def attach_draft(self, draft: Runtime) -> None:
        """Requests draft with `draft`'s greedy tokens (runtime.draft_model) where prompt lookup finds none; their
        adaptive rule counts what a guess costs (DraftModel.cost). DraftBundleError where its tokenizer is not this
        bundle's."""
        self.draft = DraftModel.attach(self, draft)

    # -- knobs ----------------------------------------------------------------------------------------------------
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
        """The default selection budget of new sequences (CachedSequence.sparse_top_k overrides it per sequence)."""
        return self.cfg.sparse_top_k if self.knobs.sparse_top_k is None else self.knobs.sparse_top_k

    def set_knobs(self, knobs: RunKnobs) -> None:
        """The knobs of sequences made from now on (gsm.bundle_knobs; checked against the bundle's limits). Sequences
        made before keep theirs."""
        self.cfg.knob_limits.check(knobs, top_k_cap=self.capabilities.max_top_k)
        self.knobs = knobs

    # -- the step API: one backend call for several sequences (runtime.step_worker) -------------------------------
    def new_sequence(self, knobs: RunKnobs | None = None) -> CachedSequence:
        """A sequence with `knobs` (None: the runtime's now)."""
        return self.worker.new_sequence(self.knobs if knobs is None else knobs)

    @property
    def can_probe(self) -> bool:
        """Whether decode_batch(probe=...) can measure the mask hit rate on this backend (StepWorker.can_probe)."""
        return self.worker.can_probe

    def forward_batch(self, seqs: Sequence[CachedSequence], chunks: Sequence[Sequence[int]], *,
                      probes: bool = False) -> StepOutput:
        """StepWorker.forward_batch: one call, sequence b adding chunks[b]."""
        return self.worker.forward_batch(seqs, chunks, probes=probes)

    def prefill_batch(self, seqs: Sequence[CachedSequence], prompts: Sequence[Sequence[int]],
                      scorers: Sequence[Scorer | None] | None = None,
                      breaks: Sequence[int | None] | None = None) -> np.ndarray:
        """StepWorker.prefill_batch: each sequence's prompt in chunks; last-position logits [B, V]."""
        return self.worker.prefill_batch(seqs, prompts, scorers, breaks)

    def decode_batch(self, seqs: Sequence[CachedSequence], tokens: Sequence[int],
                     probe: Sequence[bool] | None = None, *, selections: bool = False) -> np.ndarray:
        """StepWorker.decode_batch: one decode step of each sequence; logits [B, V]."""
        return self.worker.decode_batch(seqs, tokens, probe, selections=selections)

    def verify_batch(self, seqs: Sequence[CachedSequence], chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """StepWorker.verify_batch: each sequence's next token and drafts in one call; `keep(n)` settles each."""
        return self.worker.verify_batch(seqs, chunks)

    def prefill_call(self, seq: CachedSequence, tokens: Sequence[int], *, selections: bool = False) -> StepOutput:
        """StepWorker.prefill_call: one prefill call of exactly `tokens` and its re-tier pass."""
        return self.worker.prefill_call(seq, tokens, selections=selections)

    def call_draft_room(self, seqs: Sequence[CachedSequence]) -> int:
        """StepWorker.call_draft_room: drafts any sequence may carry in one call with `seqs`."""
        return self.worker.call_draft_room(seqs)

    def chunk_tokens(self, past: int) -> int:
        """StepWorker.chunk_tokens: tokens of a prefill call."""
        return self.worker.chunk_tokens(past)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 64,
                       options: RequestOptions | None = None, **keywords: Any) -> list[Generation]:
        """Several requests decoded together, one backend call per step for all unfinished ones; each
        result equals `generate` of that prompt alone (same sampling parameters for all). More prompts than
        the plan's resident rows run in groups of that many."""
        reqs = [self.request(p, max_new_tokens, options, **keywords) for p in prompts]  # every input checked first
        group = min(self.capabilities.max_resident, self.capabilities.max_per_call)
        for i in range(0, len(reqs), group):
            self._run_together(reqs[i:i + group])
        return [r.result() for r in reqs]

    def _run_together(self, reqs: Sequence[RequestState]) -> None:
        live = [r for r in reqs if r.start()]
        seqs = {id(r): self.new_sequence() for r in live}
        logits = self.prefill_batch([seqs[id(r)] for r in live], [r.prefill_ids for r in live],
                                    [r.prompt_scorer for r in live], [r.prompt_break for r in live]) if live else []
        for r, lg in zip(live, logits):
            r.accept(lg, seqs[id(r)].length)
        while True:
            for r in live:
                r.finish_forced(seqs[id(r)].length)
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

    # -- text -----------------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` of the bundle."""
        return self._need_codec().tokenizer

    def _need_codec(self) -> TextCodec:
        if self.codec is None:
            raise RequestError("prompt", f"{self.bundle} has no tokenizer.json: give token ids instead of text")
        return self.codec

    def encode(self, text: str) -> list[int]:
        """BOS + the text's pieces; no BOS when tokenizer_config.json has add_bos_token: false."""
        return self._need_codec().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_codec().decode(ids)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    @property
    def has_chat_template(self) -> bool:
        return self.codec is not None and self.codec.has_chat_template

    def chat_ids(self, messages: Messages) -> list[int]:
        """The messages rendered by the bundle's chat template (with the generation prompt), as ids."""
        return self._need_codec().encode_chat(messages)

    # -- requests -------------------------------------------------------------------------------------------------
    def request(self, prompt: Prompt, max_new_tokens: int = 64, options: RequestOptions | None = None,
                **keywords: Any) -> RequestState:
        """A checked request, not yet run (`stream`, `generate_batch` and the Engine drive it). Inputs are
        checked here, before any model work: a RequestError (ValueError) names the parameter. `options` and
        `keywords` (the fields of runtime.RequestOptions, over `options`): sampling (temperature, top_k, top_p,
        seed), penalties, stop_ids, stop, logprobs, response_format, fit_context, prompt_logprobs, speculative."""
        opts = RequestOptions.of(options, **keywords)  # the sampling fields are checked first
        return RequestState(self, self._prompt_ids(prompt), max_new_tokens, opts,
                            constraint=self._constraint(opts.response_format),
                            speculative=self._speculation(opts.speculative),
                            drafter=self.draft)

    def _speculation(self, mode: str | None) -> SpeculativeConfig | None:
        """A request's drafting: the runtime's config in the request's mode; None where it is off or the backend
        cannot verify."""
        cfg = self.speculative if check_speculative(mode) is None else dataclasses.replace(self.speculative, mode=mode)
        return cfg if cfg.on and self.capabilities.verify_rows > 1 else None

    def _constraint(self, fmt: Mapping[str, Any] | None) -> TokenConstraint | None:
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

    def stream(self, prompt: Prompt, max_new_tokens: int = 64, options: RequestOptions | None = None,
               **keywords: Any) -> TokenStream:
        """A request: iterate it for tokens as they come (stop ids end it and are not yielded); after
        that its `ids`, `text` and `finish_reason` hold the outcome. Options and checks as `request`."""
        from runtime.request import TokenStream  # at call time: request code builds on this module, not under it

        return TokenStream(self, self.request(prompt, max_new_tokens, options, **keywords))

    def generate(self, prompt: Prompt, max_new_tokens: int = 64, options: RequestOptions | None = None,
                 **keywords: Any) -> Generation:
        """The whole generation at once; `text` is what follows the prompt (leading space kept)."""
        return self.stream(prompt, max_new_tokens, options, **keywords).collect()

    def chat_request(self, messages: Messages, max_new_tokens: int = 64, options: RequestOptions | None = None,
                     **keywords: Any) -> RequestState:
        """`request` on the rendered messages, stopping at EOS and the template's end-of-turn token (unless the
        options name stop_ids); its prefill breaks where the last message starts (the earlier messages' state is
        kept for the next prompt that starts with them: runtime.prefix_cache)."""
        codec = self._need_codec()
        if "stop_ids" not in keywords and (options is None or options.stop_ids is None):
            keywords["stop_ids"] = codec.chat_stop_ids()
        ids = self.chat_ids(messages)
        req = self.request(ids, max_new_tokens, options, **keywords)
        req.prompt_break = codec.last_message_start(messages, ids)
        return req

    def warm_prefix(self, messages: Messages, options: RequestOptions | None = None, **keywords: Any) -> int:
        """Puts the state `messages` leave (a system prompt and worked examples every later prompt starts with) in the
        prefix cache before the first request, so the first chat prompt starting with them finds it as later ones
        do. It runs a chat request of `messages` and one placeholder user turn through the path every chat request
        takes, so the prefix is the one that request's break keeps (its tokens, its knobs' key); a draft bundle's
        runtime keeps it too. Returns how many tokens are kept; 0 where none can be (no prefix cache, a selection
        budget of the request's own, a template that joins the last message to the earlier ones)."""
        from runtime.request import TokenStream

        if self.prefixes.capacity == 0 or not messages:
            return 0
        req = self.chat_request([*messages, {"role": "user", "content": WARM_PLACEHOLDER}], 1, options, **keywords)
        TokenStream(self, req).collect()
        if self.draft is not None:  # its drafts start from the same prefix
            self.draft.runtime.warm_prefix(messages)
        head = req.prompt_break
        return head if head is not None and self.prefixes.holds(req.prompt_ids[:head]) else 0

    def warm_format(self, response_format: Mapping[str, Any]) -> None:
        """Compiles a structured output's format before the first request that asks for it, with the grammar engine's
        view of the tokenizer (made once per runtime: ~0.2 s for SmolLM2's 49K tokens), which that request would
        pay otherwise: an app whose requests share one schema calls it at start, as it warms their prefix. A
        malformed format raises the RequestError a request of it would."""
        self._constraint(response_format)

    def chat_stream(self, messages: Messages, max_new_tokens: int = 64, options: RequestOptions | None = None,
                    **keywords: Any) -> TokenStream:
        """`stream` on the rendered messages, stopping at EOS and the template's end-of-turn token."""
        from runtime.request import TokenStream

        return TokenStream(self, self.chat_request(messages, max_new_tokens, options, **keywords))

    def chat(self, messages: Messages, max_new_tokens: int = 64, options: RequestOptions | None = None,
             **keywords: Any) -> Generation:
        """The assistant's answer to `messages` ([{"role": "user", "content": "..."}, ...])."""
        return self.chat_stream(messages, max_new_tokens, options, **keywords).collect()
