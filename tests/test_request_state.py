"""One request state, three drivers: `TokenStream` (generate / stream), `Runtime.generate_batch` and the
`Engine` (both steppers) give the same ids, text and finish reason for the same requests, and those
equal the model run by hand: `new_sequence().prefill/decode` with numpy argmax (greedy) or a `Sampler`
of the request's parameters, the finish checks written out in the documented order (stop id, then
max_new_tokens, then the context end). Exact equality: one backend (onnxruntime, one thread), and a
sequence computes the same logits alone or in a batch (tests/test_runtime_batch.py), so every token is
decided on the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_bundles import build_demo

MAX_SEQ, MAX_INPUT = 64, 16
NO_FALLBACKS = dict(min_hit_rate=0.0, max_kv_noise=None)  # sequences then run exactly as generate runs them


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import runtime

    # 4 cache rows: generate_batch and the engine run several of the requests in one call
    return runtime.load(build_demo(tmp_path_factory.mktemp("rs") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                                   max_batch=4), "onnxruntime", threads=1)


def by_hand(rt, prompt_ids, max_new_tokens, *, stop_ids, pick):
    """The generation loop written out on the low-level sequence API: (ids, finish_reason)."""
    ids: list[int] = []
    if max_new_tokens == 0:
        return ids, "length"
    seq = rt.new_sequence()
    logits = seq.prefill(prompt_ids)
    while True:
        tok = pick(logits)
        if tok in stop_ids:
            return ids, "stop"
        ids.append(tok)
        if len(ids) == max_new_tokens:
            return ids, "length"
        if seq.length >= MAX_SEQ:
            return ids, "context"
        logits = seq.decode(tok)


def greedy(logits):
    return int(np.argmax(logits))


def first_fresh_token(ids):
    """A token of the greedy run that did not occur before it (past position 0): a stop id that ends
    the run exactly there."""
    return next(t for i, t in enumerate(ids) if i > 0 and t not in ids[:i])


# (prompts, max_new_tokens, keywords): each case is one generate_batch call; stop_ids=[] where EOS would
# end a run early and hide the length / context ends
CASES = {
    "greedy": ([[1, 76, 111, 120], "Once upon a time", [1] + list(range(40, 60))], 20, dict(stop_ids=[])),
    "greedy-eos": (["The cat", [1, 200, 201]], 12, dict()),
    "seeded": ([[1, 40, 41], "The dog"], 16, dict(temperature=0.9, top_p=0.9, seed=3, stop_ids=[])),
    "seeded-top-k": ([[1, 200, 201]], 10, dict(temperature=1.2, top_k=20, seed=11, stop_ids=[])),
    "context": ([[5] * (MAX_SEQ - 2), [1, 5] * 25], 20, dict(stop_ids=[])),  # 62 + 3 and 50 + 15 reach max-seq
    "length-at-context": ([[5] * (MAX_SEQ - 2)], 3, dict(stop_ids=[])),  # both ends at once: "length" first
    "nothing": ([[1, 5]], 0, dict()),
}


@pytest.fixture(scope="module")
def cases(rt):
    """CASES plus a stop id case (the stop id taken from a hand-run greedy generation)."""
    out = dict(CASES)
    ids, _ = by_hand(rt, [1, 76, 111], 12, stop_ids=(), pick=greedy)
    out["stop-id"] = ([[1, 76, 111]], 12, dict(stop_ids=[first_fresh_token(ids)]))
    return out


def expected(rt, prompt, n, kw):
    """By hand; the text is what the tokenizer makes of prompt + ids after the prompt's own text."""
    import runtime

    p = rt.encode(prompt) if isinstance(prompt, str) else prompt
    stop = set(kw.get("stop_ids", [rt.eos_token_id]))
    pick = greedy if not kw.get("temperature") else runtime.Sampler(kw["temperature"], kw.get("top_k", 0),
                                                                    kw.get("top_p", 1.0), kw["seed"])
    ids, reason = by_hand(rt, p, n, stop_ids=stop, pick=pick)
    head, whole = rt.decode(p), rt.decode(p + ids)
    assert whole.startswith(head)
    return ids, whole[len(head):], reason


def outcome(g):
    return g.ids, g.text, g.finish_reason


def test_by_hand_reaches_every_end(rt, cases):
    """The cases cover what they are named for (else the comparisons below prove less than they say)."""
    reasons = {name: {expected(rt, p, n, kw)[2] for p in prompts} for name, (prompts, n, kw) in cases.items()}
    assert reasons["greedy"] == {"length"} and reasons["context"] == {"context"}
    assert reasons["length-at-context"] == {"length"}
    assert reasons["stop-id"] == {"stop"} and reasons["nothing"] == {"length"}


@pytest.mark.parametrize("name", [*CASES, "stop-id"])
def test_stream_and_generate_batch_equal_the_model_by_hand(rt, cases, name):
    prompts, n, kw = cases[name]
    want = [expected(rt, p, n, kw) for p in prompts]
    assert [outcome(rt.generate(p, n, **kw)) for p in prompts] == want
    assert [outcome(g) for g in rt.generate_batch(prompts, n, **kw)] == want
    for p, (ids, text, reason) in zip(prompts, want):
        s = rt.stream(p, n, **kw)
        toks = list(s)
        assert [t.id for t in toks] == ids and "".join(t.text for t in toks) == text == s.text
        assert s.finish_reason == reason


@pytest.mark.parametrize("batched", [False, True], ids=["sequential", "batched"])
def test_engine_equals_the_model_by_hand(rt, cases, batched):
    """Every case submitted at once (more requests than rows: they queue and join between steps)."""
    from runtime.engine import BatchedStepper, Engine, EngineConfig, SequentialStepper

    reqs = [(p, n, kw) for prompts, n, kw in cases.values() for p in prompts]
    stepper = BatchedStepper(rt) if batched else SequentialStepper(rt)
    with Engine(rt, EngineConfig(warmup=False, **NO_FALLBACKS), stepper=stepper) as eng:
        handles = [eng.submit(p, n, **kw) for p, n, kw in reqs]
        got = [h.result(120) for h in handles]
    for (p, n, kw), h in zip(reqs, got):
        ids, text, reason = expected(rt, p, n, kw)
        assert outcome(h) == (ids, text, reason), (p, n, kw)
        toks = list(h)
        assert [t.id for t in toks] == ids and "".join(t.text for t in toks) == text
