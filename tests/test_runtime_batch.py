"""Batched decode and the cost of a step (docs/engine_io.md section 5; docs/runtime.md "Speed").

- several sequences of different lengths in one call (Runtime.prefill_batch / decode_batch, joining
  and leaving at different steps, re-tiering on their own schedules) give what each gives alone:
  logits to float32 summation order, identical greedy tokens, tiers and selections;
- Runtime.generate_batch equals generate of each prompt alone (greedy, sampled, stop ids);
- a decode step reads what the selection needs: in ONNX Runtime's profile of a step no operator
  produces a tensor as long as max-seq except the Reshape that views a cache buffer (it aliases it),
  and no output leaves the graph with more rows than the context.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import retiering_copy

from builder.build import BuildConfig, build
from gsm.synth import synth_checkpoint

N_MAX, MAX_INPUT = 448, 16  # 448: no other dimension of the tiny model is a multiple of it
MAX_BATCH = 4  # the memory plan's cache rows: the most sequences alive at once


@pytest.fixture(scope="module")
def retier_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_ck")
    return retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=4), root / "retier")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, retier_checkpoint):
    out = tmp_path_factory.mktemp("batch") / "bundle"
    build(BuildConfig(device="orin", checkpoint=retier_checkpoint, output=out, max_seq=N_MAX, max_input=MAX_INPUT,
                      debug_outputs=True, max_batch=MAX_BATCH))
    return out


def greedy_alone(rt, prompt, steps):
    seq = rt.new_sequence()
    logits, tokens, tiers, sels = [seq.prefill(prompt)], [], [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(seq.decode(tokens[-1]))
        tiers.append(seq.state.tier.copy())
        sels.append({l: v.copy() for l, v in seq.last.selected.items()})
    return logits, tokens, tiers, sels


def same_selection(a, b):
    """Equal selections; the width is the call's k (the batch's largest budget, capped by
    its context), so a sequence's rows may carry more -1 padding in a batch than alone."""
    w = max(a.shape[-1], b.shape[-1])
    pad = [(0, 0)] * (a.ndim - 1)
    return np.array_equal(np.pad(a, pad + [(0, w - a.shape[-1])], constant_values=-1),
                          np.pad(b, pad + [(0, w - b.shape[-1])], constant_values=-1))


def test_batched_decode_equals_each_alone(bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    rng = np.random.default_rng(0)
    # lengths: shorter and longer than max-input (chunked prefill), one of a single token
    prompts = [rng.integers(3, 259, n).tolist() for n in (5, 37, 1, 20)]
    start = [0, 0, 3, 7]  # decode step at which each sequence joins the batch (a scheduler's view)
    steps = 30
    alone = [greedy_alone(rt, p, steps) for p in prompts]

    seqs = [rt.new_sequence() for _ in prompts]
    logits = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    worst = 0.0
    for step in range(steps + max(start)):
        joining = [b for b, s in enumerate(start) if s == step]
        if joining:  # prefill the newcomers together, in one set of calls
            out = rt.prefill_batch([seqs[b] for b in joining], [prompts[b] for b in joining])
            for k, b in enumerate(joining):
                logits[b] = out[k]
                worst = max(worst, float(np.abs(out[k] - alone[b][0][0]).max()))
        live = [b for b, s in enumerate(start) if s <= step and len(tokens[b]) < steps]
        if not live:
            continue
        for b in live:
            tokens[b].append(int(np.argmax(logits[b])))
            assert tokens[b][-1] == alone[b][1][len(tokens[b]) - 1], f"sequence {b} diverges at {len(tokens[b])}"
        out = rt.decode_batch([seqs[b] for b in live], [tokens[b][-1] for b in live])
        for k, b in enumerate(live):
            i = len(tokens[b])
            logits[b] = out[k]
            worst = max(worst, float(np.abs(out[k] - alone[b][0][i]).max()))
            assert np.array_equal(seqs[b].state.tier, alone[b][2][i - 1]), f"tiers of sequence {b}, step {i}"
            for l, sel in alone[b][3][i - 1].items():
                assert same_selection(seqs[b].last.selected[l], sel), f"selection of sequence {b}, step {i}"
    assert all(len(t) == steps for t in tokens)
    assert worst <= 1e-4, worst
    assert {t for s in seqs for t in s.state.tier.tolist()} == {0, 1, 2}  # demoted rows were read


def test_generate_batch_equals_generate(bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 259, n).tolist() for n in (3, 30, 11)]
    for kw in ({}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}):
        alone = [rt.generate(p, 24, **kw) for p in prompts]
        stop = alone[1].ids[5]  # a stop id that ends one request early and others maybe not
        together = rt.generate_batch(prompts, 24, **kw)
        assert [(g.ids, g.finish_reason) for g in together] == [(g.ids, g.finish_reason) for g in alone]
        alone = [rt.generate(p, 24, stop_ids=[stop], **kw) for p in prompts]
        together = rt.generate_batch(prompts, 24, stop_ids=[stop], **kw)
        assert [(g.ids, g.finish_reason) for g in together] == [(g.ids, g.finish_reason) for g in alone]
        assert "stop" in {g.finish_reason for g in together}
    assert [g.ids for g in rt.generate_batch(prompts, 0)] == [[], [], []]


def test_rows_are_reused_and_never_grown_past_the_plan(bundle):
    import runtime
    from runtime.backend import CacheFullError

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    seqs = [rt.new_sequence() for _ in range(MAX_BATCH)]
    assert len({s.cache.row for s in seqs}) == MAX_BATCH
    with pytest.raises(CacheFullError, match=f"all {MAX_BATCH} cache rows.*max_batch {MAX_BATCH}.*--max-batch"):
        rt.new_sequence()  # one more than the plan: refused, not a larger buffer
    assert {b.shape[0] for b in rt.backend.buffers.values()} == {MAX_BATCH}
    ref_seq = seqs.pop()
    ref = ref_seq.prefill([5, 6, 7])
    row = seqs[0].cache.row
    del seqs[0]  # its row goes back to the free list and is handed out again
    again = rt.new_sequence()
    assert again.cache.row == row
    assert np.array_equal(again.prefill([5, 6, 7]), ref)  # stale rows of the previous owner are never read
    assert {b.shape[0] for b in rt.backend.buffers.values()} == {MAX_BATCH}


def test_decode_step_reads_no_max_seq_sized_tensor(bundle, tmp_path):
    """ONNX Runtime's own profile of a decode step: every operator output of max-seq rows is the
    Reshape viewing a bound cache buffer; the rest follows the context (here 21 positions)."""
    import onnxruntime as ort

    import runtime
    from runtime.ort_backend import SessionTuning, session_options

    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph="portable")  # its buffers, the graph's own
    be = rt.backend
    so = session_options(SessionTuning(threads=1))
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    be.session = ort.InferenceSession(str(bundle / "model.portable.onnx"), so)
    be.binding = be.session.io_binding()
    for name, buf in be.buffers.items():
        be.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buf))
    seq = rt.new_sequence()
    seq.prefill(list(range(3, 23)))
    assert seq.last.attn_mass.shape == (1, 20)
    seq.decode(5)
    assert seq.last.attn_mass.shape == (1, 21)
    events = json.loads(open(be.session.end_profiling()).read())
    nodes = [e["args"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert nodes
    big = [a for a in nodes
           if any(d % N_MAX == 0 for o in a.get("output_type_shape", []) for v in o.values() for d in v if d)]
    assert big, "the cache views should show up"
    assert {a["op_name"] for a in big} == {"Reshape"}, sorted({a["op_name"] for a in big})
    for a in big:  # each views a cache buffer [R, N_max, width] as [R * N_max, width]
        (shape,) = a["input_type_shape"][0].values()
        assert len(shape) == 3 and shape[1] == N_MAX, a["input_type_shape"]


def test_decode_fast_path_equals_the_general_one(bundle, retier_checkpoint, tmp_path):
    """Without probes or debug outputs a decode call (S = 1) writes its fixed-shape outputs into arrays bound once
    per batch size (runtime/ort_backend.py `_run_decode`); a debug bundle of the same checkpoint takes the general
    path (every output allocated per call). Same logits bit for bit over steps with re-tier passes, a batch that
    grows (a new binding), a probed step in between (the general path, then the fast one again), and logits kept
    from earlier steps unchanged by later ones (no aliasing of the bound arrays)."""
    import runtime

    lean = tmp_path / "lean"
    cfg = json.loads((bundle / "bundle.json").read_text())
    build(BuildConfig(device="orin", checkpoint=retier_checkpoint, output=lean, max_seq=N_MAX, max_input=MAX_INPUT,
                      max_batch=MAX_BATCH))
    assert not json.loads((lean / "bundle.json").read_text())["debug_outputs"] and cfg["debug_outputs"]
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 259, n).tolist() for n in (5, 12, 3)]

    def trace(path):
        rt = runtime.load(path, backend="onnxruntime", threads=1)
        seqs = [rt.new_sequence() for _ in prompts]
        kept = list(rt.prefill_batch(seqs[:2], prompts[:2]))
        live = seqs[:2]
        for step in range(20):
            if step == 6:  # a third sequence joins: B 2 -> 3
                kept.append(rt.prefill_batch([seqs[2]], [prompts[2]])[0])
                live = seqs
            tokens = [int(np.argmax(lg)) for lg in kept[-len(live):]]
            out = rt.decode_batch(live, tokens, probe=[step == 10] * len(live))
            kept.extend(out)  # not copied: later steps must not change them
        return kept, [s.state.tier.copy() for s in seqs], rt.backend._decode_key is not None

    fast, fast_tiers, took_fast = trace(lean)
    slow, slow_tiers, took_fast_debug = trace(bundle)
    assert took_fast and not took_fast_debug
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert np.array_equal(a, b), f"logits {i} differ"
    assert all(np.array_equal(a, b) for a, b in zip(fast_tiers, slow_tiers))
    assert {t for tiers in fast_tiers for t in tiers.tolist()} >= {0, 1}  # re-tier passes ran
