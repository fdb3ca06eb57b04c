"""Run-time selection budget, hit-rate probe and KV noise of demotion (docs/engine_io.md, docs/runtime.md).

- per-sequence `top_k` in one batch: each sequence equals GoldenModel deployed with its own
  `sparse_top_k` (logits to float32 summation order, greedy tokens, selected positions, tiers), including
  0, the checkpoint's default, dense (`top_k = max-seq`: every causal position, the spec's dense case)
  and a switch to dense in the middle of a generation (`use_dense()`);
- the probe (`decode_batch(..., probe=[...])`): on the first owning layer the hit rate is spec 4.3 as the
  golden computes it; on every layer it equals the spec formula evaluated in numpy on the golden's dense
  shadow step (full causal attention from the same cache); a probe leaves the real step unchanged;
- `last_kv_noise` of a re-tier pass equals ||new - old||_F / ||old||_F computed in numpy on the golden's
  cache before and after the same pass;
- `--sparse-top-k` / `top_k` range errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import retiering_copy
from runtime_bundles import run_module

from builder.build import BuildConfig, build
from gsm.golden.model import GoldenModel
from gsm.synth import synth_checkpoint

N_MAX = 128
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("topk")
    return retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=3), root / "retier")


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "b"
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, max_seq=N_MAX, debug_outputs=True,
                      max_batch=8))  # five sequences in one batch
    return out


def golden_at(base: GoldenModel, top_k: int) -> GoldenModel:
    """The golden with every layer's sparse_top_k replaced, as a run-time budget does (same weights, tiers,
    calibration; a layer's own window stays)."""
    return GoldenModel(base.w, mode=base.mode, quant=base.quant, calibration=base.calib,
                       params=base.p.overridden(sparse_top_k=top_k))


def selection_mask(selected: np.ndarray, n: int) -> np.ndarray:
    """[S, k] positions (-1 padded) -> [S, n] bool."""
    mask = np.zeros((selected.shape[0], n), bool)
    for row, picks in zip(mask, selected):
        p = picks[picks >= 0]
        assert np.all(np.diff(p) > 0) and np.all(picks[len(p):] == -1)
        row[p] = True
    return mask


def check_step(seq, logits, g, gcache, what):
    assert float(np.abs(logits - g.logits[-1].numpy()).max()) <= LOGIT_TOL, what
    for l, sel in g.trace.selected.items():  # rows past the sequence's own chunk are batch padding
        got = seq.last.selected[l][0, :sel.shape[0]]
        assert np.array_equal(selection_mask(got, seq.length), sel.numpy()), f"{what}, layer {l}"
    assert np.array_equal(seq.state.tier, gcache.tier.numpy()), what


def drive_budgets(rt, base, *, seed: int, steps: int, dense_at: int) -> list:
    """One batch of five sequences with budgets 0, 3, the bundle default, dense (N_MAX) and the default
    switched to dense (`use_dense()`) at decode step `dense_at`: every prefill and decode step of each
    equals GoldenModel deployed at that sparse_top_k (logits, selections, tiers: `check_step`), greedy.
    Returns the sequences; afterwards checks the selection sizes of the sparse and dense ones."""
    budgets = [0, 3, None, N_MAX, None]  # None: the bundle default (each layer's own)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 259, n).tolist() for n in (40, 25, 33, 12, 30)]
    seqs = [rt.new_sequence() for _ in budgets]
    goldens, caches, g_out = [], [], []
    for s, k, p in zip(seqs, budgets, prompts):
        s.sparse_top_k = k
        goldens.append(base if k is None else golden_at(base, k))
        caches.append(goldens[-1].new_cache())
        with torch.no_grad():
            g_out.append(goldens[-1].prefill(caches[-1], p, trace=True))
    logits = rt.prefill_batch(seqs, prompts)
    for b, s in enumerate(seqs):
        check_step(s, logits[b], g_out[b], caches[b], f"prefill of sequence {b}")
    for step in range(steps):
        if step == dense_at:
            seqs[4].use_dense()
            assert seqs[4].sparse_top_k == N_MAX
            goldens[4] = golden_at(base, N_MAX)  # same cache, dense from now on
        toks = [int(np.argmax(lg)) for lg in logits]
        assert toks == [int(torch.argmax(g.logits[-1])) for g in g_out], f"greedy tokens diverge at step {step}"
        with torch.no_grad():
            g_out = [g.decode(c, t, trace=True) for g, c, t in zip(goldens, caches, toks)]
        logits = rt.decode_batch(seqs, toks)
        for b, s in enumerate(seqs):
            check_step(s, logits[b], g_out[b], caches[b], f"sequence {b}, step {step}")
        for b in (3, 4) if step >= dense_at else (3,):  # dense: every position 0..t is selected
            for l in rt.cfg.owning_layers:
                assert selection_mask(seqs[b].last.selected[l][0], seqs[b].length).all()
    # sparse budgets select exactly sinks + window + top_k positions once the context is longer (each layer
    # its own window, and its own top-k unless the sequence has a budget; a growing layer's top-k is
    # max(that, (t + 1) // d) at the last position t)
    for l in rt.cfg.owning_layers:
        own_w, own_k = rt.cfg.selection_of(l)
        d = rt.cfg.top_k_divisor_of(l)
        w = own_w if rt.knobs.sparse_window is None else rt.sparse_window
        for b, k in ((0, 0), (1, 3), (2, own_k)):
            got = seqs[b].last.selected[l][0]
            grown = max(k, seqs[b].length // d) if d else k
            assert int((got >= 0).sum()) == rt.cfg.sink_tokens + w + grown, f"sequence {b}, layer {l}"
    return seqs


def test_per_sequence_top_k_in_one_batch_equals_golden_at_that_top_k(ckpt, bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    base = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    assert rt.sparse_top_k == base.p.sparse_top_k == 8
    drive_budgets(rt, base, seed=7, steps=20, dense_at=6)


def test_probe_hit_rate_is_spec_4_3(ckpt, bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    dense = golden_at(golden, N_MAX)
    prompt = np.random.default_rng(3).integers(3, 259, 37).tolist()
    seq, twin, other = rt.new_sequence(), rt.new_sequence(), rt.new_sequence()
    gcache = golden.new_cache()
    with torch.no_grad():
        g = golden.prefill(gcache, prompt)
    logits = seq.prefill(prompt)
    twin_logits = twin.prefill(prompt)
    other_logits = other.prefill(prompt[:20])
    first = rt.cfg.owning_layers[0]
    for step in range(10):
        tok = int(torch.argmax(g.logits[-1]))
        assert tok == int(np.argmax(logits))
        with torch.no_grad():
            shadow = dense.forward(copy.deepcopy(gcache), [tok], trace=True)  # full attention, same cache
            g = golden.decode(gcache, tok, trace=True)
        probe = step % 3 != 1
        out = rt.decode_batch([seq, other], [tok, int(np.argmax(other_logits))], probe=[probe, False])
        logits, other_logits = out[0], out[1]
        twin_logits = twin.decode(int(np.argmax(twin_logits)))
        assert np.array_equal(logits, twin_logits) or np.abs(logits - twin_logits).max() <= 1e-5  # unchanged
        assert other.last_hit_rate is None
        if not probe:
            continue
        assert seq.last_hit_rates.keys() == set(rt.cfg.owning_layers)
        # spec 4.3 as the golden measures it: on the first owning layer the shadow's query is the real one
        assert abs(seq.last_hit_rates[first] - float(g.trace.hit_rate[first][0])) <= 1e-5
        expected = {}
        for l in rt.cfg.owning_layers:
            p_dense = shadow.trace.probs[l].numpy()[:, 0]  # [nH, n]: full causal softmax of the dense step
            sel = g.trace.selected[l].numpy()[0]  # [n] bool: the real step's Sel(t)
            expected[l] = float((p_dense * sel[None]).sum(-1).mean())
            assert abs(seq.last_hit_rates[l] - expected[l]) <= 1e-5, (l, seq.last_hit_rates[l], expected[l])
        assert abs(seq.last_hit_rate - np.mean(list(expected.values()))) <= 1e-5
        assert 0 < seq.last_hit_rate < 1


def noise_of_pass(gcache, do_pass):
    """||new - old||_F / ||old||_F over the rows a golden re-tier pass changes (all layers, K and V)."""
    before_tier = gcache.tier.clone()
    before = {l: (c.ck.numpy().astype(np.float64).copy(), c.cv.numpy().astype(np.float64).copy())
              for l, c in gcache.layers.items()}
    do_pass()
    rows = np.nonzero((gcache.tier != before_tier).numpy())[0]
    if rows.size == 0:
        return None
    num = den = 0.0
    for l, c in gcache.layers.items():
        for old, new in zip(before[l], (c.ck.numpy(), c.cv.numpy())):
            num += float(((new[rows] - old[rows]) ** 2).sum())
            den += float((old[rows] ** 2).sum())
    return float(np.sqrt(num / den))


def test_kv_noise_of_demotion_matches_numpy(ckpt, bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    seq, gcache = rt.new_sequence(), golden.new_cache()
    short = rt.new_sequence()
    short.prefill([5, 6, 7])  # nothing outside the sinks and window: the pass demotes nothing
    assert short.retier_passes == 1 and short.last_kv_noise is None
    prompt = np.random.default_rng(5).integers(3, 259, 60).tolist()
    with torch.no_grad():
        golden.forward(gcache, prompt)
        expected = noise_of_pass(gcache, lambda: golden._maybe_retier(gcache))
    seq.prefill(prompt)
    assert expected is not None and 0 < expected < 0.1
    assert abs(seq.last_kv_noise - expected) <= 1e-4 * expected
    passes, checked = seq.retier_passes, 0
    for _ in range(16):  # decode passes every 8 steps re-encode a few more rows
        tok = int(np.argmax(seq.decode(3)))
        with torch.no_grad():
            golden.forward(gcache, [3])
            gcache.decode_steps += 1
            if gcache.decode_steps % golden.p.quantization_adaptation_rate == 0:
                expected = noise_of_pass(gcache, lambda: golden._maybe_retier(gcache))
                assert seq.retier_passes == passes + 1
                passes += 1
                if expected is None:
                    assert seq.last_kv_noise is None
                else:
                    assert abs(seq.last_kv_noise - expected) <= 1e-4 * expected
                    checked += 1
        del tok
    assert checked >= 1


def test_top_k_range_errors(bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    seq = rt.new_sequence()
    for bad in (-1, N_MAX + 1, True, 2.5, "3"):
        with pytest.raises(runtime.RequestError) as e:
            seq.sparse_top_k = bad
        assert e.value.field == "sparse_top_k"
    seq.sparse_top_k = 0
    seq.sparse_top_k = None
    assert seq.effective_sparse_top_k == rt.sparse_top_k
    with pytest.raises(runtime.RequestError):
        runtime.load(bundle, backend="onnxruntime", sparse_top_k=N_MAX + 1)
    assert runtime.load(bundle, backend="onnxruntime", sparse_top_k=N_MAX).sparse_top_k == N_MAX
    with pytest.raises(ValueError, match="one flag per sequence"):
        rt.decode_batch([seq], [1], probe=[True, False])


@pytest.mark.parametrize("value,expect", [("-1", "expected an integer >= 0"), ("x", "expected an integer >= 0"),
                                          (str(N_MAX + 1), f"must be an integer in 0..{N_MAX}")])
def test_cli_sparse_top_k_errors(bundle, tmp_path, value, expect):
    r = run_module("runtime", "generate", str(bundle), "--ids", "1,2,3", "--max-new-tokens", "2",
                   "--backend", "onnxruntime", "--sparse-top-k", value, cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert "error: argument --sparse-top-k: " + expect in lines[-1], r.stderr
    assert r.stdout == ""


def test_cli_sparse_top_k_dense_runs(bundle, tmp_path):
    r = run_module("runtime", "generate", str(bundle), "--ids", "1,2,3", "--max-new-tokens", "3",
                   "--backend", "onnxruntime", "--sparse-top-k", str(N_MAX), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3


def test_probe_outputs_add_no_node(bundle):
    """selected.{l} / attn_mass.{l} name tensors the graph computes anyway (no copy node): a call that does
    not bind them pays nothing for them."""
    import onnx

    m = onnx.load(str(bundle / "model.portable.onnx"), load_external_data=False)
    producer = {o: n.op_type for n in m.graph.node for o in n.output}
    names = {o.name for o in m.graph.output if o.name.startswith(("selected.", "attn_mass."))}
    assert len(names) == 2 * sum(i.name.startswith("latent_k.") for i in m.graph.input)  # two per owning layer
    assert {producer[n] for n in names} == {"Where", "ScatterElements"}
