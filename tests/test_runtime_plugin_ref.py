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

import numpy as np
import pytest
import torch
from conftest import retiering_copy

from builder.build import build
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


def test_plugin_path_fp32_reproduces_golden(ckpt, tmp_path):
    import runtime

    out = tmp_path / "b32"
    build(device="orin", checkpoint_dir=ckpt, output=out, max_seq=N_MAX, trt_precision="fp32")
    rt = runtime.load(out, backend="reference")
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
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
    assert tiers == {0, 1, 2}
    # dequantised latents read back through the slot table equal the golden's cache
    quant = {l: t for l, t in _quant_tables(out).items()}
    for l, c in gcache.layers.items():
        ck, cv = rt.backend.latents(seq.cache, l, quant[l])
        n = seq.length
        assert np.abs(ck[0, :n] - c.ck.numpy()).max() <= 1e-2 * np.abs(c.ck.numpy()).max()


def _quant_tables(bundle):
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(bundle / "model.onnx"))
    return {int(t.name.split(".")[2]): numpy_helper.to_array(t) for t in m.graph.initializer
            if t.name.startswith("gsm.layers.") and t.name.endswith(".quant")}


def test_plugin_path_fp16_close_to_portable(ckpt, tmp_path):
    import runtime

    out = tmp_path / "b16"
    build(device="orin", checkpoint_dir=ckpt, output=out, max_seq=N_MAX)
    port, ref = runtime.load(out, "onnxruntime", threads=1), runtime.load(out, "reference")
    a, b = port.new_sequence(), ref.new_sequence()
    prompt = np.random.default_rng(3).integers(3, 259, PROMPT_LEN).tolist()
    la, lb = a.prefill(prompt), b.prefill(prompt)
    for _ in range(24):
        assert np.abs(la - lb).max() <= 2e-2 * np.abs(la).max()
        tok = int(np.argmax(la))
        la, lb = a.decode(tok), b.decode(tok)


def test_reference_kv_noise_and_fixed_budget(ckpt, tmp_path):
    """KV noise of the end-of-prefill pass equals ||new - old|| / ||old|| on the golden's cache (numpy);
    the plugins select with their build-time top_k, so the runtime refuses another budget there."""
    from test_runtime_topk import noise_of_pass

    import runtime

    out = tmp_path / "b32"
    build(device="orin", checkpoint_dir=ckpt, output=out, max_seq=N_MAX, trt_precision="fp32")
    rt = runtime.load(out, backend="reference")
    golden = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    gcache, seq = golden.new_cache(), rt.new_sequence()
    prompt = np.random.default_rng(4).integers(3, 259, PROMPT_LEN).tolist()
    with torch.no_grad():
        golden.forward(gcache, prompt)
        expected = noise_of_pass(gcache, lambda: golden._maybe_retier(gcache))
    seq.prefill(prompt)
    assert expected is not None and abs(seq.last_kv_noise - expected) <= 1e-4 * expected
    with pytest.raises(runtime.RequestError, match="build-time budget"):
        seq.use_dense()
        seq.decode(3)
    with pytest.raises(runtime.RequestError, match="build-time budget"):
        runtime.load(out, backend="reference", top_k=3)
