"""The TensorRT path without TensorRT: model.onnx with GSM plugin nodes, run by ONNX's reference
evaluator with each GSM node executed by the plugins' C++ CPU reference (runtime backend "reference"),
driving the engine's int32 byte pools, slot tables and demotion lists.

- fp32 activations (`trt_precision="fp32"`): equals GoldenModel deployed to float32 summation order:
  logits <= 1e-3, greedy tokens and tiers identical for 64 steps (the plugin-node wiring, attributes,
  pool layout, slot allocation and demotion are all exercised: re-tier every 8 steps).
- fp16 activations (what engines run): logits within 2 % of their scale of the portable fp32 graph,
  teacher forced (greedy argmax may flip at fp16 near-ties, so tokens are not compared).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import int4_copy, retiering_copy

from builder.build import BuildConfig, build
from gsm.golden.model import GoldenModel
from gsm.synth import synth_checkpoint
from runtime.ref_backend import reference_usable

ok, why = reference_usable()
pytestmark = pytest.mark.skipif(not ok, reason=f"plugin CPU reference not available: {why}")
N_MAX, PROMPT_LEN, STEPS = 128, 40, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    base = synth_checkpoint("tiny", root / "tiny", seed=5)
    return retiering_copy(base, root / "retier")


@pytest.fixture(scope="module")
def ckpt_int4(tmp_path_factory):
    """Re-tiering into all four tiers: the pools' INT4 region, INT4 rows in wider regions, INT4 demotion lists."""
    root = tmp_path_factory.mktemp("ck4")
    return int4_copy(synth_checkpoint("tiny", root / "tiny", seed=5), root / "int4")


@pytest.mark.parametrize("which", ["ckpt", "ckpt_int4"])
def test_plugin_path_fp32_reproduces_golden(which, request, tmp_path):
    import runtime

    ckpt = request.getfixturevalue(which)
    out = tmp_path / "b32"
    # INT4: a longer plan with short prefill calls, so the pools have an INT4 region for the demoted rows to move to
    size = {"max_seq": 256, "max_input": PROMPT_LEN} if which == "ckpt_int4" else {"max_seq": N_MAX}
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, trt_precision="fp32", max_batch=2, **size))
    rt = runtime.load(out, backend="reference")
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    # default --max-top-k: the model's sparse_top_k; a larger run-time budget is refused, naming the flag
    assert rt.backend.max_top_k == golden.p.sparse_top_k == json.loads((out / "bundle.json").read_text())["max_top_k"]
    wide = rt.new_sequence()
    wide.sparse_top_k = golden.p.sparse_top_k + 1
    with pytest.raises(runtime.RequestError, match=f"--max-top-k {golden.p.sparse_top_k + 1}"):
        wide.prefill([5, 6])
    assert wide.length == 0
    prompt = np.random.default_rng(2).integers(3, 259, PROMPT_LEN).tolist()
    gcache, seq = golden.new_cache(), rt.new_sequence()
    with torch.no_grad():
        g_logits = golden.prefill(gcache, prompt).logits[-1].numpy()
    logits = seq.prefill(prompt)
    worst, tiers = float(np.abs(logits - g_logits).max()), set()
    for step in range(STEPS):
        tok = int(np.argmax(g_logits))
        assert int(np.argmax(logits)) == tok, f"greedy tokens diverge at step {step}"
        with torch.no_grad():
            g_logits = golden.decode(gcache, tok).logits[-1].numpy()
        logits = seq.decode(tok)
        worst = max(worst, float(np.abs(logits - g_logits).max()))
        assert np.array_equal(seq.state.tier, gcache.tier.numpy()), f"tiers differ after step {step}"
        tiers |= set(seq.state.tier.tolist())
    assert worst <= 1e-3, worst
    assert tiers == ({0, 1, 2, 3} if which == "ckpt_int4" else {0, 1, 2})
    if which == "ckpt_int4":  # the plan gave the pools an INT4 region, and demoted rows moved into it
        c16, c12, c8, c4 = json.loads((out / "bundle.json").read_text())["pool_rows"].values()
        assert c4 > 0 and any(int(e) & 0xFFFFFF >= c16 + c12 + c8 for e in seq.cache.slots.entries[: seq.length])
    # dequantised latents read back through the slot table equal the golden's cache
    quant = {l: t for l, t in _quant_tables(out).items()}
    for l, c in gcache.layers.items():
        ck, cv = rt.backend.latents(seq.cache, l, quant[l])
        n = seq.length
        assert np.abs(ck[:n] - c.ck.numpy()).max() <= 1e-2 * np.abs(c.ck.numpy()).max()


def _quant_tables(bundle):
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(bundle / "model.onnx"))
    return {int(t.name.split(".")[2]): numpy_helper.to_array(t) for t in m.graph.initializer
            if t.name.startswith("gsm.layers.") and t.name.endswith(".quant")}


def test_plugin_path_fp16_close_to_portable(ckpt, tmp_path):
    import runtime

    out = tmp_path / "b16"
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, max_seq=N_MAX))
    port, ref = runtime.load(out, "onnxruntime", threads=1), runtime.load(out, "reference")
    a, b = port.new_sequence(), ref.new_sequence()
    prompt = np.random.default_rng(3).integers(3, 259, PROMPT_LEN).tolist()
    la, lb = a.prefill(prompt), b.prefill(prompt)
    for _ in range(24):
        assert np.abs(la - lb).max() <= 2e-2 * np.abs(la).max()
        tok = int(np.argmax(la))
        la, lb = a.decode(tok), b.decode(tok)


def test_reference_kv_noise(ckpt, tmp_path):
    """KV noise of the end-of-prefill pass equals ||new - old|| / ||old|| on the golden's cache (numpy)."""
    from test_runtime_topk import noise_of_pass

    import runtime

    out = tmp_path / "b32"
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, max_seq=N_MAX, trt_precision="fp32", max_batch=2))
    rt = runtime.load(out, backend="reference")
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    gcache, seq = golden.new_cache(), rt.new_sequence()
    prompt = np.random.default_rng(4).integers(3, 259, PROMPT_LEN).tolist()
    with torch.no_grad():
        golden.forward(gcache, prompt)
        expected = noise_of_pass(gcache, lambda: golden._maybe_retier(gcache))
    seq.prefill(prompt)
    assert expected is not None and abs(seq.last_kv_noise - expected) <= 1e-4 * expected


@pytest.fixture(scope="module")
def budget_bundle(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "b32"
    build(BuildConfig(device="orin", checkpoint=ckpt, output=out, max_seq=N_MAX, trt_precision="fp32",
                      debug_outputs=True, max_top_k=N_MAX, max_batch=8))  # the budgets' sequences in one batch
    return out


def test_reference_per_sequence_budgets_equal_golden_at_each_top_k(ckpt, budget_bundle):
    """Per-sequence budgets on the plugin path: one batch whose sequences select with budgets 0, 3, the
    checkpoint's, dense (max-seq) and one switched to dense mid-generation each equal GoldenModel
    deployed at that sparse_top_k (logits, selections, tiers: test_runtime_topk.check_step); the node's
    max_top_k is max-seq, so a probed step (dense shadow call) works and agrees with onnxruntime's."""
    from test_runtime_topk import drive_budgets

    import runtime

    rt = runtime.load(budget_bundle, backend="reference")
    assert rt.backend.max_top_k == N_MAX
    base = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    prompt = drive_budgets(rt, base, seed=8, steps=8, dense_at=3)[0].state.tokens[:40]  # its prompt
    # the hit-rate probe runs a dense shadow call first: the same rate as onnxruntime on the same sequence
    port = runtime.load(budget_bundle, backend="onnxruntime", threads=1)
    a, b = rt.new_sequence(), port.new_sequence()
    tok = int(np.argmax(a.prefill(prompt)))
    assert tok == int(np.argmax(b.prefill(prompt)))
    a.decode(tok, probe=True)
    b.decode(tok, probe=True)
    assert a.last_hit_rate is not None and 0 < a.last_hit_rate < 1
    assert abs(a.last_hit_rate - b.last_hit_rate) <= 1e-4
    for l, r in b.last_hit_rates.items():
        assert abs(a.last_hit_rates[l] - r) <= 1e-4


def test_reference_refuses_budget_above_max_top_k_before_any_change(budget_bundle):
    """A budget above the nodes' max_top_k (a smaller K_sel than max-seq) is refused with a RequestError
    naming sparse_top_k, and the sequence is left as it was (the CUDA kernel would clamp it silently)."""
    import runtime

    rt = runtime.load(budget_bundle, backend="reference")
    seq = rt.new_sequence()
    seq.prefill([5, 6, 7, 8])
    rt.backend.max_top_k = 6  # as a bundle built with max_top_k 6 would read it from its nodes
    seq.sparse_top_k = 7
    entries = seq.cache.slots.entries.copy()
    with pytest.raises(runtime.RequestError, match="sparse_top_k: 7 is above the bundle's max_top_k 6") as e:
        seq.decode(9)
    assert e.value.field == "sparse_top_k"
    assert seq.length == 4 and np.array_equal(seq.cache.slots.entries, entries)
    seq.sparse_top_k = 6
    seq.decode(9)
    assert seq.length == 5


def _one_attention_node(sc, divisor: int | None):
    """A graph of one owning GsmSparseAttention node (17 inputs, 4 outputs) over a plugin scenario, every row a logit
    row; divisor None: a node without the attribute sparse_top_k_divisor, as graphs written before it have."""
    from dataclasses import fields

    from onnx import TensorProto, helper

    names = ["q", "kv_pool", "kv_slots", "past_lengths", "new_lengths", "quant", "rope_cos", "rope_sin", "k_up",
             "v_up", "index_q", "index_w", "index_keys", "sparse_window", "sparse_top_k", "cache_rows", "logit_rows"]
    attrs = {f.name: int(getattr(sc.dims, f.name)) for f in fields(sc.dims) if f.name != "sparse_top_k_divisor"}
    if divisor is not None:
        attrs["sparse_top_k_divisor"] = divisor
    outs = ("attn_out", "selected", "attn_mass", "query_mass")
    node = helper.make_node("GsmSparseAttention", names, list(outs), domain="gsm.plugins", **attrs)
    graph = helper.make_graph([node], "one_attention", [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                                                         for n in names],
                              [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("gsm.plugins", 1)])
    feeds = dict(zip(names, [sc.q, sc.pool, sc.slots, sc.past, sc.new, sc.quant, sc.rope_cos, sc.rope_sin, sc.w0,
                             sc.w1, sc.index_q, sc.index_w, sc.index_keys, np.array([sc.window], np.int32),
                             sc.top_k, np.arange(len(sc.past), dtype=np.int32), sc.all_rows()]))
    return model, feeds


def test_reference_backend_node_reads_the_divisor_attribute():
    """The reference backend's GsmSparseAttention op takes the node's sparse_top_k_divisor into the plugin reference:
    the query at t selects max(sparse_top_k[b], (t + 1) // divisor) by score (counts worked out here), as the
    reference called directly; a node without the attribute selects the fixed per-sequence budget."""
    from gsm_edge_plugins.testing import make_scenario
    from onnx.reference import ReferenceEvaluator

    from runtime.ref_backend import _ops
    from runtime.ref_standard_ops import ProductRows

    sc = make_scenario(np.random.default_rng(21), num_heads=4, num_kv_heads=2, head_dim=8, rank_k=6, rank_v=5,
                       index_heads=2, index_dim=4, sink_tokens=1, top_k=32, max_sparse_window=4, window=2, n_max=96,
                       past=[70, 20], new=[4, 1], seq_top_k=[5, 5], sparse_top_k_divisor=6)
    counts = {}
    for divisor in (6, None):
        model, feeds = _one_attention_node(sc, divisor)
        out, sel, _mass, query_mass = ReferenceEvaluator(model, new_ops=_ops(ProductRows())).run(None, feeds)
        counts[divisor] = [(sel[b, :int(sc.new[b])] >= 0).sum(axis=-1).tolist() for b in range(2)]
        if divisor is not None:
            want = sc.call(logit_rows=sc.all_rows())
            assert np.array_equal(sel, want.selected)
            assert np.array_equal(out.view(np.uint32), want.out.view(np.uint32))
            assert np.array_equal(query_mass.view(np.uint32), want.query_mass.view(np.uint32))
    # t = 70..73: 71 // 6 = 11, then 12 from t = 71; t = 20: 21 // 6 = 3 < 5
    assert counts[6] == [[1 + 2 + 11] + [1 + 2 + 12] * 3, [1 + 2 + 5]]
    assert counts[None] == [[1 + 2 + 5] * 4, [1 + 2 + 5]]


@pytest.mark.parametrize("k, n", [(64, 344), (64, 192), (96, 64), (576, 1536), (1536, 576)])
def test_exact_products_give_a_row_the_same_bits_in_any_call(k, n):
    """runtime.ref_standard_ops computes a decode step's or a verification's products one row at a time, so a row's
    result is the same bits whatever the call holds (what a verification's rows being one-token steps rests on), on
    the BLAS at hand; numpy's own product of the same rows would not promise it (gemv for one row, gemm kernels
    chosen by size)."""
    from runtime.ref_standard_ops import rows_matmul

    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal((40, k), dtype=np.float32)
    for b in (w.T, np.ascontiguousarray(w.T)):  # Gemm's transB view, MatMul's weight
        alone = np.concatenate([rows_matmul(x[i:i + 1], b, True) for i in range(len(x))])
        for rows in (2, 3, 8, 16, 40):
            got = rows_matmul(x[:rows], b, True)
            assert np.array_equal(got.view(np.uint32), alone[:rows].view(np.uint32)), rows
        batched = rows_matmul(x[:32].reshape(4, 8, k), b, True).reshape(32, -1)  # [B, S, K] products
        assert np.array_equal(batched.view(np.uint32), alone[:32].view(np.uint32))
