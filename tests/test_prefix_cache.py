"""Chat prompts' prefixes computed once (runtime/prefix_cache.py, plugin_cache.take_prefix / put_prefix):

- a chat request's prefill ends a call where its last message starts, so a prompt gives the same tokens whether its
  prefix was found in the cache or computed for it, and with the cache off (greedy and seeded; alone, batched and in
  the engine; both networks of the onnxruntime backend and the reference backend);
- a prefix put into a sequence leaves it as the sequence it was taken from: the next steps' logits equal bit for bit,
  in a cache row whose last sequence read other prompts (its row cache could hold K rows at the prefix's positions
  and slot entries: they are dropped);
- the cache keeps prefixes up to its bytes, least recently used out first; sequences with a budget of their own
  neither use nor fill it.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.prefix_cache import Prefix, PrefixCache

SYSTEM = {"role": "system", "content": "You are a careful inspector. Answer briefly."}
SHOTS = [{"role": "user", "content": "Part A-1 has a scratch."}, {"role": "assistant", "content": "Low severity."},
         {"role": "user", "content": "Part B-2 has a crack."}, {"role": "assistant", "content": "High severity."}]


def _chat(q: str) -> list[dict]:
    return [SYSTEM, *SHOTS, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory):
    """The demo model with a ChatML template, long enough for a system prompt and worked examples; max-input 16, so a
    prefix takes several calls before the break."""
    from runtime_bundles import SERVE_VOCAB, demo_and_chat_bundles

    return demo_and_chat_bundles(tmp_path_factory.mktemp("prefix"), max_seq=512, max_input=16, vocab=SERVE_VOCAB,
                                 max_batch=4)["chat"]


def _load(bundle, **kw):
    import runtime

    return runtime.load(bundle, kw.pop("backend", "onnxruntime"), threads=1, **kw)


@pytest.mark.parametrize("backend,graph", [("onnxruntime", "cpu"), ("onnxruntime", "portable"), ("reference", "auto")])
def test_a_prompt_gives_the_same_tokens_with_its_prefix_found_computed_or_not_kept(chat_bundle, backend, graph):
    warm = _load(chat_bundle, backend=backend, graph=graph, speculative="off")
    cold = _load(chat_bundle, backend=backend, graph=graph, speculative="off", prefix_cache_mib=0)
    for kw in ({}, {"temperature": 0.9, "seed": 5}):
        for q in ("Part C-3 has a dent.", "Part D-4 is discoloured.", "Part C-3 has a dent."):
            a = warm.chat(_chat(q), 12, **kw)
            b = cold.chat(_chat(q), 12, **kw)
            assert a.ids == b.ids, (backend, graph, q, kw)
    assert warm.prefixes.hits >= 4 and len(warm.prefixes) == 1 and cold.prefixes.hits == 0


def test_the_break_is_where_the_last_message_starts(chat_bundle):
    rt = _load(chat_bundle)
    req = rt.chat_request(_chat("Part C-3 has a dent."), 4)
    head = rt._need_codec().encode_chat(_chat("x")[:-1], add_generation_prompt=False)
    assert req.prompt_break == len(head) and req.prompt_ids[:len(head)] == head
    assert rt.chat_request([{"role": "user", "content": "hi"}], 4).prompt_break is None  # one message: no prefix
    assert rt.request([1, 2, 3], 4).prompt_break is None


def test_batched_and_engine_requests_share_a_prefix_and_equal_alone(chat_bundle):
    from runtime.engine import Engine, EngineConfig

    rt = _load(chat_bundle, speculative="off")
    cold = _load(chat_bundle, speculative="off", prefix_cache_mib=0)
    qs = [f"Part X-{i} has a mark." for i in range(6)]
    alone = [cold.chat(_chat(q), 10).ids for q in qs]
    reqs = [rt.chat_request(_chat(q), 10) for q in qs[:3]]
    rt._run_together(reqs)
    assert [r.ids for r in reqs] == alone[:3]
    with Engine(rt, EngineConfig(min_hit_rate=0, max_kv_noise=None)) as eng:
        got = [h.result(60).ids for h in [eng.submit_chat(_chat(q), 10) for q in qs]]
    assert got == alone and rt.prefixes.hits >= 5


@pytest.mark.parametrize("graph", ["cpu", "portable"])
def test_a_restored_prefix_continues_bit_for_bit_in_a_row_another_prompt_used(chat_bundle, graph):
    rt = _load(chat_bundle, graph=graph, prefix_cache_mib=0)
    ids = rt.chat_ids(_chat("Part C-3 has a dent."))
    L = rt.chat_request(_chat("Part C-3 has a dent."), 4).prompt_break
    src = rt.new_sequence()
    src.prefill(ids[:L])
    snap = src.snapshot()
    want = [src.prefill(ids[L:])] + [src.decode(t) for t in (5, 9, 17, 33)]
    src.close()
    other = rt.new_sequence()  # the same row, another prompt: its row cache names the same positions and entries
    other.prefill(list(reversed(ids)))
    for t in (7, 8, 9):
        other.decode(t)
    row = other.cache.row
    other.close()
    dst = rt.new_sequence()
    assert dst.cache.row == row
    dst.restore(snap)
    got = [dst.prefill(ids[L:])] + [dst.decode(t) for t in (5, 9, 17, 33)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert np.array_equal(dst.state.hotness, src.state.hotness) and np.array_equal(dst.state.tier, src.state.tier)


def test_a_sequence_with_its_own_budget_neither_uses_nor_fills_the_cache(chat_bundle):
    rt = _load(chat_bundle)
    seq = rt.new_sequence()
    seq.sparse_top_k = 3
    ids = rt.chat_ids(_chat("q"))
    L = rt.chat_request(_chat("q"), 4).prompt_break
    seq.prefill(ids, break_at=L)
    assert len(rt.prefixes) == 0 and rt.prefixes.misses == 0


class _Rows:
    def __init__(self, n: int) -> None:
        self.nbytes = n


def _prefix(tokens: tuple[int, ...], n: int) -> Prefix:
    from runtime.policy import SequenceState

    return Prefix(tokens, SequenceState(), _Rows(n))


def test_the_cache_keeps_prefixes_up_to_its_bytes_least_recently_used_out_first():
    c = PrefixCache(1000)
    assert c.put(_prefix((1,), 400)) and c.put(_prefix((2,), 400))
    assert c.get((None, (1,))) is not None  # (2,) is now the least recently used
    assert c.put(_prefix((3,), 400))
    assert c.get((None, (2,))) is None and c.get((None, (1,))) is not None and c.get((None, (3,))) is not None
    assert c.get(("other knobs", (1,))) is None  # the same tokens under other knobs are another prefix
    assert c.bytes == sum(p.nbytes for p in c._items.values()) <= 1000
    assert not c.put(_prefix((4,), 2000)) and len(c) == 2
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_a_warmed_prefix_is_found_by_the_first_request_and_changes_no_token(chat_bundle):
    """Runtime.warm_prefix keeps the state of the messages every prompt starts with before any request: the first
    chat request then finds it (a hit, nothing kept anew) and answers what a cache-less runtime answers; in the engine
    every request of a burst hits it. Nothing is kept where the cache is off or a prompt is one message."""
    from runtime.engine import Engine, EngineConfig

    cold = _load(chat_bundle, speculative="off", prefix_cache_mib=0)
    rt = _load(chat_bundle, speculative="off")
    head = rt._need_codec().encode_chat(_chat("x")[:-1], add_generation_prompt=False)
    assert rt.warm_prefix(_chat("x")[:-1]) == len(head) and len(rt.prefixes) == 1
    hits = rt.prefixes.hits
    assert rt.chat(_chat("Part C-3 has a dent."), 12).ids == cold.chat(_chat("Part C-3 has a dent."), 12).ids
    assert rt.prefixes.hits == hits + 1 and len(rt.prefixes) == 1
    eng_rt = _load(chat_bundle, speculative="off")
    eng_rt.warm_prefix([SYSTEM, *SHOTS])
    qs = [f"Part Y-{i} has a mark." for i in range(4)]
    with Engine(eng_rt, EngineConfig(min_hit_rate=0, max_kv_noise=None)) as eng:
        got = [h.result(60).ids for h in [eng.submit_chat(_chat(q), 8) for q in qs]]
    assert got == [cold.chat(_chat(q), 8).ids for q in qs] and eng_rt.prefixes.hits == 4
    assert cold.warm_prefix([SYSTEM, *SHOTS]) == 0
    assert rt.warm_prefix([]) == 0


def test_byte_runs_copy_the_bytes_of_every_span_in_order():
    """A prefix's row spans merged into runs move the same bytes, in the same order, as an index of every byte of
    every span (the spans of rows back to back in a region, a gap, a region of another width, one row alone)."""
    from runtime.plugin_cache import byte_runs

    pool = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    starts = np.array([0, 40, 80, 120, 400, 448, 496, 1000, 3000], np.int64)
    sizes = np.array([40, 40, 40, 40, 48, 48, 48, 24, 96], np.int64)
    every_byte = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, sizes)])
    run_starts, run_sizes = byte_runs(starts, sizes)
    assert run_starts.tolist() == [0, 400, 1000, 3000] and run_sizes.tolist() == [160, 144, 24, 96]
    got = np.concatenate([pool[a:a + n] for a, n in zip(run_starts, run_sizes)])
    assert np.array_equal(got, pool[every_byte])
    assert [x.size for x in byte_runs(starts[:0], sizes[:0])] == [0, 0]
