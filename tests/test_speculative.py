"""Speculative decoding (runtime/speculative.py, Runtime.verify_batch, CachedSequence.keep):

- a verification's logits row j is bit for bit the one-token step's after token j, and its query_mass row j the
  step's attn_mass (both networks of the onnxruntime backend, and the plugin graph on the reference backend: the
  plugins' C++ reference behind ONNX's evaluator), and keeping n of its tokens leaves the sequence as n one-token
  steps would (hotness from each query's own mass, tiers after the re-tier pass the steps reach, the cache's rows),
  with the rejected drafts forgotten; on a model that re-tiers every 8 steps;
- greedy and seeded sampled generation give the same tokens with drafting on and off (alone and batched);
- prompt lookup proposes what a brute-force search of the history finds; the adaptive rule drafts nothing when
  drafts do not pay and never more than the room;
- the acceptance rule for a drafter with a distribution of its own samples the target distribution (chi-square on
  a small vocabulary), and a wrong rule fails the same test.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import retiering_copy
from hypothesis import given, settings
from hypothesis import strategies as st

from builder.build import BuildConfig, build
from gsm.synth import synth_checkpoint
from runtime.speculative import DraftLength, NgramDrafts, SpeculativeConfig, accept_draft, expected_tokens

N_MAX, MAX_INPUT = 448, 16


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    ckpt = retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=4), root / "retier")
    out = root / "bundle"
    # the plugin graph (reference backend): max_top_k = max-seq, so it takes the engine's dense probe calls too, and
    # float32 activations, so a last-bit difference of a verified row's attention is not rounded away by a cast
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, max_seq=N_MAX, max_input=MAX_INPUT, max_batch=4,
                      max_top_k=N_MAX, trt_precision="fp32"))
    return out


@pytest.fixture(scope="module", params=["cpu", "portable", "reference"])
def rt(bundle, request):
    """Both networks of the onnxruntime backend verify drafts (model.cpu.onnx's custom op, the standard-op graph), and
    the reference backend's plugin graph (GsmSparseAttention's query_mass)."""
    import runtime
    from runtime.ref_backend import reference_usable

    if request.param == "reference":
        if not reference_usable()[0]:
            pytest.skip(f"reference backend: {reference_usable()[1]}")
        r = runtime.load(bundle, "reference")
    else:
        r = runtime.load(bundle, "onnxruntime", threads=1, graph=request.param)
        assert r.backend.graph == request.param
    assert r.capabilities.verify_rows == MAX_INPUT
    return r


def _prompt(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def _steps(rt, prompt, tokens):
    """One-token steps of `tokens` after the prompt: each step's logits, then the sequence's state."""
    seq = rt.new_sequence()
    seq.prefill(prompt)
    rows = [seq.decode(t) for t in tokens]
    state = (seq.state.hotness.copy(), seq.state.tier.copy(), seq.state.decode_steps, seq.retier_passes)
    return np.stack(rows), seq, state


@pytest.mark.parametrize("past,fed,kept", [(40, 6, 6), (40, 6, 2), (150, 8, 1), (150, 5, 5), (300, 8, 4)])
def test_a_verification_is_the_one_token_steps_bit_for_bit(rt, past, fed, kept):
    prompt = _prompt(past)
    seq = rt.new_sequence()
    seq.prefill(prompt)
    true = [int(t) for t in np.random.default_rng(past).integers(3, 300, 12)]
    want, ref, ref_state = _steps(rt, prompt, true[:kept])
    ref.close()
    drafts = true[1:fed]
    if kept < fed:  # a wrong draft right after the kept ones: the call still reads and writes it
        drafts[kept - 1] = (drafts[kept - 1] + 1) % 300
    room = seq.draft_room
    rows = seq.verify([true[0], *drafts][:room + 1])
    n = min(kept, len(rows))
    assert np.array_equal(rows[:n], want[:n]), "a verified row differs from the one-token step's logits"
    seq.keep(n)
    if n == kept:
        hot, tier, steps, passes = ref_state
        assert np.array_equal(seq.state.hotness, hot) and np.array_equal(seq.state.tier, tier)
        assert seq.state.decode_steps == steps and seq.retier_passes == passes
    # after the rollback the sequence goes on as the one-token path does (rows written again, nothing stale)
    more = [int(t) for t in np.random.default_rng(past + 1).integers(3, 300, 10)]
    want2, ref2, _ = _steps(rt, prompt, true[:n] + more)
    ref2.close()
    got2 = np.stack([seq.decode(t) for t in more])
    assert np.array_equal(got2, want2[n:])
    seq.close()


class Masses:
    """Wraps backend.forward to record each call's attention masses: a step's attn_mass, a verification's query_mass."""

    def __init__(self, rt):
        self.rt, self.inner, self.calls = rt, rt.backend.forward, []

    def __enter__(self):
        def forward(*a, **kw):
            out = self.inner(*a, **kw)
            self.calls.append(out)
            return out

        self.rt.backend.forward = forward
        return self

    def __exit__(self, *exc):
        self.rt.backend.forward = self.inner


def _same_bits(mass: np.ndarray, want: np.ndarray) -> bool:
    """Equal float32 bits over the shorter length (a graph's masses cover the call's positions or N_max), zeros past."""
    n = min(len(mass), len(want))
    rest = mass[n:] if len(mass) > n else want[n:]
    return np.array_equal(mass[:n].view(np.uint32), want[:n].view(np.uint32)) and not rest.any()


@pytest.mark.parametrize("past", [40, 150])
def test_a_verifications_query_masses_are_the_steps_attention_masses(rt, past):
    """Row j of a verification: the logits and the query's own attention mass (query_mass, summed over heads and
    owning layers) of the one-token step after token j, bit for bit."""
    prompt, toks = _prompt(past), [int(t) for t in np.random.default_rng(past + 7).integers(3, 300, 6)]
    seq = rt.new_sequence()
    seq.prefill(prompt)
    with Masses(rt) as steps:
        want = [seq.decode(t) for t in toks]
    seq.close()
    seq = rt.new_sequence()
    seq.prefill(prompt)
    with Masses(rt) as ver:
        rows = seq.verify(toks)
    out = ver.calls[0]
    assert out.query_mass.shape[:2] == (1, len(toks))
    for j in range(len(toks)):
        assert np.array_equal(rows[j].view(np.uint32), want[j].view(np.uint32)), f"logits of row {j}"
        assert _same_bits(out.query_mass[0, j], steps.calls[j].attn_mass[0]), f"query_mass of row {j}"
    seq.keep(len(toks))
    seq.close()


def test_a_verification_stops_at_the_re_tier_pass(rt):
    """A call never carries tokens past the next re-tier pass: the tokens after it read the re-encoded rows."""
    seq = rt.new_sequence()
    seq.prefill(_prompt(100))
    rate = rt.policy.rate
    for _ in range(rate - 3 - seq.state.decode_steps % rate):
        seq.decode(7)
    assert seq.draft_room == 2  # 3 steps to the pass: the next token and 2 drafts
    with pytest.raises(ValueError, match="takes 1..3 now"):
        seq.verify([7, 8, 9, 10])
    seq.verify([7, 8, 9])
    passes = seq.retier_passes
    seq.keep(3)
    assert seq.retier_passes == passes + 1 and seq.draft_room == min(rt.capabilities.verify_rows, rate) - 1
    seq.close()


def _looping_prompt() -> list[int]:
    return [5, 17, 42, 9, 77, 13] * 6 + [5, 17]


def test_greedy_generation_is_the_same_with_drafting_on_and_off(rt):
    from runtime.request import TokenStream

    drafted = accepted = 0
    for p in (_looping_prompt(), _prompt(60, 8) * 2, _prompt(9, 1)):
        off = rt.generate(p, 40, stop_ids=[], speculative="off")
        req = rt.request(p, 40, stop_ids=[], speculative="auto")
        on = TokenStream(rt, req).collect()
        assert on.ids == off.ids and on.finish_reason == off.finish_reason
        drafted += req.draft_length.drafted
        accepted += req.draft_length.accepted
    assert drafted > 0 and accepted > 0, "the prompts were chosen so that lookup drafts and some are kept"


class _Oracle:
    """Drafts that are the tokens a run without drafting produced, every `wrong`-th one changed: the tiny random
    model's sampled text has no repeats for lookup to find, so this is how sampled requests get drafts kept."""

    def __init__(self, target: list[int], wrong: int) -> None:
        self.target, self.wrong, self.seen = target, wrong, 0

    def extend(self, tokens) -> None:
        self.seen += len(tokens)

    def close(self) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        out = self.target[self.seen:self.seen + limit]
        return [(t + 1) % 300 if (self.seen + i) % self.wrong == 0 else t for i, t in enumerate(out)]


@pytest.mark.parametrize("kw", [{"temperature": 0.9, "seed": 11},
                                {"temperature": 0.7, "top_p": 0.9, "seed": 2, "repetition_penalty": 1.1}])
def test_seeded_sampling_is_the_same_with_drafting_on_and_off(rt, kw):
    """Row j is sampled only after rows 0..j-1 matched their drafts, from the request's own sampler: the draws are
    the ones one-token steps make, so a seeded request gives the same tokens."""
    from runtime.request import TokenStream

    p = _prompt(30, 5)
    off = rt.generate(p, 48, stop_ids=[], speculative="off", **kw)
    req = rt.request(p, 48, stop_ids=[], speculative="auto", **kw)
    req.drafts = _Oracle(off.ids, wrong=7)
    on = TokenStream(rt, req).collect()
    assert on.ids == off.ids
    assert req.draft_length.accepted > 10 and req.draft_length.drafted > req.draft_length.accepted


def test_batched_generation_with_drafting_equals_each_alone(rt):
    prompts = [_looping_prompt(), _prompt(30, 4) * 3, _prompt(5, 9), _prompt(70, 2)]
    alone = [rt.generate(p, 30, stop_ids=[], speculative="off").ids for p in prompts]
    together = rt.generate_batch(prompts, 30, stop_ids=[], speculative="auto")
    assert [g.ids for g in together] == alone


def test_a_request_override_and_the_load_option(bundle, rt):
    import runtime
    from runtime.sampling import RequestError

    assert rt.request([1, 2], 4).drafts is not None and rt.request([1, 2], 4, speculative="off").drafts is None
    off = runtime.load(bundle, "onnxruntime", threads=1, speculative="off")
    assert off.request([1, 2], 4).drafts is None and off.request([1, 2], 4, speculative="auto").drafts is not None
    with pytest.raises(RequestError, match="speculative: must be one of auto, off, got 'on'"):
        rt.request([1, 2], 4, speculative="on")
    with pytest.raises(RequestError, match="speculative"):
        runtime.load(bundle, "onnxruntime", speculative="yes")


def _brute_lookup(history: list[int], limit: int, cfg: SpeculativeConfig) -> list[int]:
    for n in range(cfg.ngram_max, cfg.ngram_min - 1, -1):
        if len(history) <= n - 1 or len(history) < n:
            continue
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # the latest earlier occurrence ending at `end`
            if history[end - n + 1:end + 1] == suffix:
                return history[end + 1:end + 1 + limit]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=60), st.integers(0, 6), st.integers(1, 3), st.integers(0, 3))
def test_prompt_lookup_proposes_what_a_search_of_the_history_finds(history, limit, lo, extra):
    cfg = SpeculativeConfig(ngram_min=lo, ngram_max=lo + extra)
    cut = len(history) // 2
    d = NgramDrafts(history[:cut], cfg)
    d.extend(history[cut:])  # indexed in two parts, as a prompt then the output
    assert d.propose(limit) == _brute_lookup(history, limit, cfg)


def test_the_adaptive_rule_drafts_only_where_it_pays():
    cfg = SpeculativeConfig(row_cost=0.12, max_draft=8)
    rule = DraftLength(cfg)
    assert 1 <= rule.length(room=8) <= 8 and rule.length(room=2) <= 2 and rule.length(room=0) == 0
    for _ in range(20):
        rule.record(4, 0)  # every draft rejected
    assert rule.length(room=8) == 0, "drafts that are never kept cost a row each: draft nothing"
    for _ in range(30):
        rule.record(8, 8)
    assert rule.length(room=8) == 8
    # the rule's own arithmetic: a draft of k pays when its expected tokens beat the call's cost
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test's p-value; for an even number of degrees of freedom 2m the survival function is
    exp(-x/2) * sum_{i<m} (x/2)^i / i! (no scipy needed)."""
    expected = probs * counts.sum()
    x = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    assert dof % 2 == 0
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(dof // 2))


def test_the_acceptance_rule_samples_the_target_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
    q = np.array([0.3, 0.1, 0.3, 0.1, 0.2])  # a draft distribution far from p
    n = 40_000

    def run(rule) -> np.ndarray:
        counts = np.zeros(len(p))
        for _ in range(n):
            draft = int(rng.choice(len(q), p=q))
            counts[rule(p, q, draft, rng)[1]] += 1
        return counts

    assert _chi_square_p(run(accept_draft), p) > 1e-3

    def wrong(p, q, draft, rng):  # a rejection resampled from p instead of the residual: biased towards q's picks
        if rng.random() < min(1.0, p[draft] / q[draft]):
            return True, draft
        return False, int(rng.choice(len(p), p=p))

    assert _chi_square_p(run(wrong), p) < 1e-6


@pytest.mark.parametrize("batched", [True, False])
def test_the_engine_with_drafting_gives_each_request_its_tokens_alone(rt, batched):
    """Continuous batching with verifications of different lengths (and plain steps) in one call, requests joining
    and leaving: each request's tokens are its tokens alone without drafting; the observer sees the drafts."""
    from runtime.engine import BatchedStepper, Engine, EngineConfig, Observer, SequentialStepper

    prompts = [_looping_prompt(), _prompt(30, 4) * 3, _prompt(5, 9), _prompt(70, 2), [9, 8, 7] * 10, _prompt(12, 3)]
    alone = [rt.generate(p, 24 + 4 * i, stop_ids=[], speculative="off").ids for i, p in enumerate(prompts)]

    class Drafts(Observer):
        drafted = accepted = 0

        def on_drafts(self, req, drafted, accepted):
            Drafts.drafted += drafted
            Drafts.accepted += accepted

    stepper = BatchedStepper(rt) if batched else SequentialStepper(rt)
    with Engine(rt, EngineConfig(max_running=4, min_hit_rate=0, max_kv_noise=None), stepper=stepper,
                observer=Drafts()) as eng:
        hs = [eng.submit(p, 24 + 4 * i, stop_ids=[], speculative="auto") for i, p in enumerate(prompts)]
        got = [h.result(60).ids for h in hs]
    assert got == alone
    assert Drafts.accepted > 0 and Drafts.drafted > Drafts.accepted


def _load_like(rt, bundle, **kw):
    """The bundle opened as `rt` is (its backend, its network)."""
    import runtime

    if rt.backend.name == "reference":
        return runtime.load(bundle, "reference", **kw)
    return runtime.load(bundle, "onnxruntime", threads=1, graph=rt.backend.graph, **kw)


@pytest.fixture
def self_drafted(rt, bundle, monkeypatch):
    """The bundle drafting for itself (runtime.draft_model) on the same backend: its guesses are the target's own greedy
    tokens wherever its cache holds exactly the request's tokens. Its measured cost (a whole step) would make the rule
    never draft, so the test sets it to 0, and rows nearly free, so that requests whose samples reject most guesses
    draft on."""
    import dataclasses

    from runtime.draft_model import DraftModel

    t = _load_like(rt, bundle, draft_bundle=bundle)
    assert t.draft is not None and 0.3 < t.draft.cost < 3, "a draft of the same bundle costs about one step"
    monkeypatch.setattr(DraftModel, "cost", property(lambda self: 0.0))
    t.speculative = dataclasses.replace(t.speculative, row_cost=1e-3)
    return t


def _guesses_against_rows(monkeypatch) -> list[tuple[int, int]]:
    """Wraps every request's accept_verified (for the rest of the test) to record, per verification row of the draft
    bundle's guesses, (the row's argmax, the guess the next row verifies): a draft bundle that is the target, in step
    with the request, guesses each row's argmax."""
    from runtime.request_state import RequestState

    pairs = []
    orig = RequestState.accept_verified

    def spy(self, logits, drafts, length):
        if self._source is not None and self._source is self.model_length:
            pairs.extend((int(np.argmax(logits[j])), int(d)) for j, d in enumerate(drafts))
        return orig(self, logits, drafts, length)

    monkeypatch.setattr(RequestState, "accept_verified", spy)
    return pairs


@pytest.mark.parametrize("kw", [{}, {"temperature": 1.0, "seed": 5}])
def test_a_draft_bundle_follows_the_request_through_its_rejections(self_drafted, kw, monkeypatch):
    """Greedy and sampled requests (whose samples reject many greedy guesses: each rejection rewinds the draft's
    sequence), over prompts that cross re-tier passes (every 8 steps): the same tokens as without drafting, and
    every guess the target's own argmax after the same tokens (the draft's cache holds exactly the request's)."""
    from runtime.request import TokenStream

    pairs = _guesses_against_rows(monkeypatch)
    drafted = 0
    for p in (_prompt(40, 6), _prompt(9, 1), _looping_prompt()):
        off = self_drafted.generate(p, 60, stop_ids=[], speculative="off", **kw)
        req = self_drafted.request(p, 60, stop_ids=[], speculative="auto", **kw)
        assert TokenStream(self_drafted, req).collect().ids == off.ids
        drafted += req.model_length.drafted
        assert req.model_drafts.seq is None, "the request's end gave its draft row back"
    assert drafted > 60 and len(pairs) == drafted
    assert [a for a, _ in pairs] == [d for _, d in pairs]


def test_the_engine_drafts_with_a_draft_bundle_and_without_a_free_draft_row(self_drafted, monkeypatch):
    """Requests of the engine each draft on a row of the draft bundle and give their tokens alone; with every row of
    the draft's plan taken, a request drafts nothing and gives the same tokens."""
    from runtime.engine import Engine, EngineConfig

    prompts = [_looping_prompt(), _prompt(30, 4), _prompt(5, 9), _prompt(70, 2)]
    kws = [{}, {"temperature": 0.9, "seed": 1}, {}, {"temperature": 1.2, "seed": 8}]
    alone = [self_drafted.generate(p, 30, stop_ids=[], speculative="off", **kw).ids for p, kw in zip(prompts, kws)]
    pairs = _guesses_against_rows(monkeypatch)
    with Engine(self_drafted, EngineConfig(max_running=4, min_hit_rate=0, max_kv_noise=None)) as eng:
        got = [h.result(60).ids for h in [eng.submit(p, 30, stop_ids=[], speculative="auto", **kw)
                                           for p, kw in zip(prompts, kws)]]
    assert got == alone and pairs and [a for a, _ in pairs] == [d for _, d in pairs]
    draft = self_drafted.draft.runtime
    held = [draft.new_sequence() for _ in range(draft.capabilities.max_resident)]
    req = self_drafted.request(prompts[0], 30, stop_ids=[], speculative="auto")
    from runtime.request import TokenStream

    assert TokenStream(self_drafted, req).collect().ids == alone[0]
    assert req.model_drafts.unavailable and req.model_length.drafted == 0
    del held


def test_another_model_with_the_tokenizer_drafts_until_its_max_seq(bundle, demo, monkeypatch):
    """The demo model (other weights, the synthetic model's byte-level tokenizer, max-seq 128) drafting for the
    synthetic one: guesses often rejected, none past the draft's max-seq, the same tokens greedy and seeded."""
    import dataclasses

    import runtime
    from runtime.draft_model import DraftModel
    from runtime.request import TokenStream

    t = runtime.load(bundle, "onnxruntime", threads=1, draft_bundle=demo.bundle)
    monkeypatch.setattr(DraftModel, "cost", property(lambda self: 0.0))
    t.speculative = dataclasses.replace(t.speculative, row_cost=1e-3)
    for kw in ({}, {"temperature": 0.8, "seed": 2}):
        off = t.generate(_prompt(100, 7), 60, stop_ids=[], speculative="off", **kw)
        req = t.request(_prompt(100, 7), 60, stop_ids=[], speculative="auto", **kw)
        assert TokenStream(t, req).collect().ids == off.ids
        assert 0 < req.model_length.drafted and req.model_drafts.unavailable
        assert req.model_length.accepted < req.model_length.drafted


def test_a_draft_bundle_with_another_tokenizer_is_refused(bundle, tmp_path):
    """A model of another vocabulary (the synthetic small preset, 1,024 tokens) is refused by runtime.load and the CLI,
    naming the draft bundle and the field; a directory that is no bundle is named with the flag."""
    import subprocess
    import sys

    import runtime
    from runtime.draft_model import DraftBundleError

    other = tmp_path / "small"
    build(BuildConfig(device="orin", checkpoint=synth_checkpoint("small", tmp_path / "ck", seed=1), output=other,
                      max_seq=64, max_input=16))
    with pytest.raises(DraftBundleError, match=f"draft bundle {other}: vocab_size is 1024, the target .* has 384"):
        runtime.load(bundle, "onnxruntime", threads=1, draft_bundle=other)
    for draft, want in ((other, "argument --draft-bundle: draft bundle"),
                        (tmp_path / "ck", "argument --draft-bundle: " + str(tmp_path / "ck") + ": a GSM checkpoint")):
        r = subprocess.run([sys.executable, "-m", "runtime", "generate", str(bundle), "--ids", "1,2,3",
                            "--draft-bundle", str(draft)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and want in r.stderr, r.stderr


def test_a_backend_that_cannot_verify_decodes_one_token_a_call(bundle):
    """A backend whose capabilities verify no drafts (a graph without query_mass): a request there drafts nothing, and
    gives the same tokens."""
    import dataclasses

    import runtime

    r = runtime.load(bundle, "onnxruntime", threads=1)
    r.capabilities = r.worker.capabilities = dataclasses.replace(r.capabilities, verify_rows=0)
    assert r.request([1, 2], 4).drafts is None
    p = _looping_prompt()
    assert r.generate(p, 6, stop_ids=[]).ids == runtime.load(bundle, "onnxruntime", threads=1).generate(
        p, 6, stop_ids=[], speculative="off").ids


SCHEMA = {"type": "object", "properties": {"part": {"type": "string", "maxLength": 12},
                                           "severity": {"enum": ["low", "medium", "high"]}},
          "required": ["part", "severity"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo bundle (a byte-level tokenizer, so structured output runs), built for 4 sequences."""
    pytest.importorskip("llguidance")
    from runtime_bundles import build_demo

    import runtime

    return runtime.load(build_demo(tmp_path_factory.mktemp("spec_demo") / "demo", max_seq=128, max_input=16,
                                   max_batch=4), "onnxruntime", threads=1)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.8, "seed": 3}])
def test_structured_output_drafts_the_grammars_forced_tokens(demo, kw):
    """A JSON schema forces its keys, quotes and separators: they are drafted (and kept: the mask allows nothing
    else), and the answer is the one without drafting."""
    from runtime.request import TokenStream

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    off = demo.generate("Report:", 60, response_format=fmt, speculative="off", **kw)
    req = demo.request("Report:", 60, response_format=fmt, speculative="auto", **kw)
    forced = []
    propose = req.propose

    def counting(room: int) -> list[int]:
        d = propose(room)
        if d and req._source is None:
            forced.append(len(d))
        return d

    req.propose = counting
    on = TokenStream(demo, req).collect()
    assert (on.ids, on.text, on.finish_reason) == (off.ids, off.text, off.finish_reason)
    assert sum(forced) >= 4, "the keys and separators of the schema are forced: drafted without a guess"


class _Counted:
    """A runtime's sequences with the tokens each call feeds recorded (prefill, decode, verify)."""

    def __init__(self, rt) -> None:
        self.rt, self.fed, self.seqs = rt, [], []

    def new_sequence(self):
        seq = self.rt.new_sequence()
        for name in ("prefill", "decode", "verify"):
            call = getattr(seq, name)

            def counted(ids, *a, _call=call, _name=name, **k):
                self.fed.append((_name, list(ids) if _name != "decode" else [ids]))
                return _call(ids, *a, **k)

            setattr(seq, name, counted)
        self.seqs.append(seq)
        return seq

    def close(self) -> None:
        for seq in self.seqs:  # each holds itself through its wrapped methods: release its row now
            seq.close()


def _allowed_walk(demo, fmt, pick):
    """Each step's allowed tokens (the mask unpacked) from the grammar's start, the walk going on with pick(step,
    allowed) until it returns None."""
    from runtime.constrained import unpack_mask

    demo.warm_format(fmt)
    c = demo._grammars.constraint(fmt)
    for step in range(10_000):
        c._lnp.fill_next_token_bitmask(c.matcher, c._bits, 0)
        tok = pick(step, np.flatnonzero(unpack_mask(c._bits[0], c.vocab_size)))
        if tok is None:
            return
        c.matcher.consume_token(int(tok))


def _lead_in(demo, fmt) -> list[int]:
    """The tokens a grammar allows one at a time from its start."""
    out: list[int] = []
    _allowed_walk(demo, fmt, lambda i, a: out.append(int(a[0])) or a[0] if a.size == 1 else None)
    return out


def _alone(demo, fmt, ids) -> list[bool]:
    """Whether each step of `ids` had its token as the only one allowed."""
    out: list[bool] = []
    _allowed_walk(demo, fmt, lambda i, a: out.append(a.size == 1) or ids[i] if i < len(ids) else None)
    return out


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_grammars_lead_in_is_prefilled_with_the_prompt(demo, mode):
    """The tokens a grammar allows alone before any output (a JSON schema's opening brace and first key) need no
    logits: they are fed with the prompt in its prefill, which is the only call before the first sampled token, and
    streamed with it. The answer is the one of a request that asks log-probabilities (each token then needs its
    logits: no lead-in), in every driver."""
    from runtime.engine import Engine, EngineConfig
    from runtime.request import TokenStream

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    lead = _lead_in(demo, fmt)
    assert demo.decode(lead) == '{"part":"', demo.decode(lead)  # the schema's compact start, one token a byte
    prompt = demo.encode("Report:")
    counted = _Counted(demo)
    req = demo.request(prompt, 40, response_format=fmt, speculative=mode)
    stream = TokenStream(counted, req)
    first = next(iter(stream))
    assert counted.fed == [("prefill", prompt + lead)]
    assert first.id == lead[0] and req.ids[:len(lead)] == lead
    got = stream.collect()
    counted.close()
    scored = demo.generate(prompt, 40, response_format=fmt, speculative=mode, logprobs=0)
    assert all(t.logprob is not None for t in scored.tokens)
    assert (got.ids, got.text, got.finish_reason) == (scored.ids, scored.text, scored.finish_reason)
    assert got.finish_reason == "stop" and json.loads(got.text)["severity"] in ("low", "medium", "high")
    assert [g.ids for g in demo.generate_batch([prompt, prompt], 40, response_format=fmt, speculative=mode)] == [
        got.ids] * 2
    with Engine(demo, EngineConfig(min_hit_rate=0.0, max_kv_noise=None)) as eng:
        r = eng.submit(prompt, 40, response_format=fmt, speculative=mode)
        assert [t.id for t in r] == got.ids


def test_drafting_ends_a_grammar_without_a_call_for_its_forced_end(demo):
    """With drafting on, the closing quote and brace the schema forces after its last value are taken without a
    model call: the sequence never feeds them, where drafting off feeds every token but the last. The answers
    agree."""
    from runtime.request import TokenStream

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    prompt = demo.encode("Report:")
    runs = {}
    for mode in ("off", "auto"):
        counted = _Counted(demo)
        g = TokenStream(counted, demo.request(prompt, 40, response_format=fmt, speculative=mode)).collect()
        runs[mode] = (g, counted.seqs[0].length)  # positions the sequence holds at the end
        counted.close()
    (off, off_held), (on, on_held) = runs["off"], runs["auto"]
    assert (on.ids, on.text, on.finish_reason) == (off.ids, off.text, off.finish_reason)
    assert off.finish_reason == "stop" and off.text.endswith('"}')
    alone = _alone(demo, fmt, off.ids)
    end = next(i for i in range(len(alone), 0, -1) if not alone[i - 1])  # the forced end: alone[end:]
    assert len(alone) - end >= 2  # '"' and '}' at least (one byte-token each)
    assert off_held == len(prompt) + len(off.ids) - 1  # every token but the last fed
    # with drafting, the token sampled before the forced end is not fed either; every other one is
    assert on_held == len(prompt) + end - 1
    # not with log-probabilities: each token then comes from its logits
    scored = demo.generate(prompt, 40, response_format=fmt, speculative="auto", logprobs=0)
    assert scored.ids == off.ids and all(t.logprob is not None for t in scored.tokens)


def test_the_engine_batch_with_structured_drafts_equals_alone(demo):
    from runtime.engine import Engine, EngineConfig

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    reqs = [dict(response_format=fmt), dict(), dict(response_format={"type": "json_object"}, temperature=0.9, seed=4),
            dict(response_format=fmt, temperature=1.1, seed=9), dict(stop=["e"])]
    alone = [demo.generate("Report:", 40, speculative="off", **kw) for kw in reqs]
    with Engine(demo, EngineConfig(min_hit_rate=0.0, max_kv_noise=None)) as eng:
        got = [r.result(60) for r in [eng.submit("Report:", 40, speculative="auto", **kw) for kw in reqs]]
    assert [(g.ids, g.text, g.finish_reason) for g in got] == [(a.ids, a.text, a.finish_reason) for a in alone]


def test_a_batched_call_drafts_what_pays_for_the_whole_batch(rt):
    """One call pads every sequence to its longest verification, so the engine picks the call's draft length by the
    batch's expected tokens per cost: one sure draft among eight plain steps is not worth eight padded rows, eight
    sure drafts are."""
    from runtime.engine import Engine, EngineConfig, Work

    if rt.backend.name == "reference":
        pytest.skip("the engine's arithmetic on the CPU graph's costs (the reference backend's cost the same batched)")
    eng = Engine(rt, EngineConfig(warmup=False))
    cost = rt.capabilities.row_cost(8)
    seq = SimpleNamespace(length=100)
    assert rt.capabilities.row_cost(1) == rt.capabilities.verify_row_cost < cost == rt.capabilities.row_cost(16)
    lone = [Work(seq, [1], False, drafts=[5, 6, 7, 8], acceptance=1.0)] + [Work(seq, [1], False) for _ in range(7)]
    eng._fit_drafts(lone)
    assert lone[0].drafts == []
    sure = [Work(seq, [1], False, drafts=[5, 6, 7, 8], acceptance=1.0) for _ in range(8)]
    eng._fit_drafts(sure)
    assert all(w.drafts == [5, 6, 7, 8] for w in sure) and 5 / (1 + 4 * cost) > 1
    mixed = [Work(seq, [1], False, drafts=[5, 6, 7, 8, 9, 10], acceptance=a) for a in (1.0, 0.8, 0.8, 0.3)]
    eng._fit_drafts(mixed)
    k = len(mixed[0].drafts)
    assert 0 < k < 6 and all(len(w.drafts) == k for w in mixed)
    # a sequence 3 positions from max-seq: the call's verification is at most 3 tokens for every sequence in it
    near = [Work(SimpleNamespace(length=N_MAX - 3), [1], False)] + [
        Work(seq, [1], False, drafts=[5, 6, 7, 8], acceptance=1.0) for _ in range(7)]
    eng._fit_drafts(near)
    assert max(len(w.drafts) for w in near) <= 2


def test_a_batch_with_a_sequence_at_its_context_end_still_verifies_within_it(rt):
    """One request reaches max-seq while another drafts at every step (an oracle's drafts): a call gives every sequence
    as many positions as the longest verification, so the drafts stay within the shortest room, and each answer
    equals the request alone (batched by generate_batch's driver and by the engine)."""
    from runtime.engine import Engine, EngineConfig

    near, loop = _prompt(N_MAX - 12, 6), _prompt(30, 4)
    alone = [rt.generate(p, n, stop_ids=[], speculative="off") for p, n in ((near, 20), (loop, 90))]
    assert alone[0].finish_reason == "context"
    reqs = [rt.request(near, 20, stop_ids=[]), rt.request(loop, 90, stop_ids=[])]
    reqs[1].drafts = _Oracle(alone[1].ids, wrong=3)
    rt._run_together(reqs)
    assert [r.ids for r in reqs] == [a.ids for a in alone] and reqs[1].draft_length.accepted > 0
    with Engine(rt, EngineConfig(min_hit_rate=0, max_kv_noise=None)) as eng:
        hs = [eng.submit(near, 20, stop_ids=[]), eng.submit(loop, 90, stop_ids=[])]
        hs[1].state.drafts = _Oracle(alone[1].ids, wrong=3)  # before its first decode step (after its prefill)
        got = [h.result(60) for h in hs]
    assert [(g.ids, g.finish_reason) for g in got] == [(a.ids, a.finish_reason) for a in alone]


def test_a_verification_must_be_settled_before_the_next_call(rt):
    seq = rt.new_sequence()
    seq.prefill(_prompt(20))
    seq.verify([5, 6, 7])
    with pytest.raises(ValueError, match="keep"):
        seq.decode(5)
    with pytest.raises(ValueError, match=r"keep\(4\): needs 1..3"):
        seq.keep(4)
    seq.keep(2)
    assert seq.length == 22
    with pytest.raises(ValueError, match="after a verify call"):
        seq.keep(1)
    seq.close()


def test_the_bench_lookup_ceiling_replays_drafts_against_the_tokens():
    """bench/speculative.py's prompt-lookup ceiling: text where no 2-gram repeats drafts nothing (1.0x); text that
    repeats its prompt keeps every draft, so once the rule drafts 8 a call makes 9 tokens for 1 + 8c steps: between
    2x and that limit, 3x at c = 0.25."""
    from bench.speculative import lookup_ceiling

    assert lookup_ceiling([[]], [list(range(100, 400))], 0.25) == 1.0
    prompt = list(range(1000, 1200))
    assert 2.0 < lookup_ceiling([prompt], [prompt], 0.25) <= 3.0
