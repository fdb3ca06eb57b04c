"""A selection budget that grows with the context (gsm_config `sparse_top_k_divisor`, docs/decisions.md "A budget
that grows with the context"): the query at position t picks max(top_k, (t + 1) // d) by the indexer.

- the format: a table or model without growth writes no divisor (checksums unchanged); a growing table
  round-trips; a negative divisor is one ConfigError naming the field;
- the golden: each query's selected count is min(t + 1, sinks + w + max(k, (t + 1) // d)), counted here from the
  rule, not from the golden's code; a prompt prefilled in one call selects exactly as token-by-token decode;
- every engine the CPU can run (ONNX Runtime on model.portable.onnx and model.cpu.onnx, the plugin graph on the
  reference backend) equals the golden on a tiny model with two growing layers and a streaming one, with
  run-time budgets 0, 3, each layer's own, dense and a switch to dense (tests/test_runtime_topk.drive_budgets:
  a budget is the floor the growth starts from); the 40-token prefill straddles the point where growth starts;
- the build plans max_top_k for the last position's budget; the remote code (transformers, no gsm) selects alike;
- the converter's growth leaves streaming layers alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import need_ort_ops_library, tiny_selection_case
from test_runtime_topk import N_MAX, drive_budgets

from builder.build import BuildConfig, build
from gsm.config import ConfigError, GSMParams, LayerSelection
from gsm.convert.budget import with_growth
from gsm.golden.model import GoldenModel

# tiny: owning layers 0, 1, 2 (layer 3 shares layer 1); 1 sink. Layer 0 streams; layer 1 grows from 3 by 1/4 of
# the context (past t + 1 = 12), layer 2 from 4 by 1/3 (past t + 1 = 12 as well, faster after)
TABLE = {0: (12, 0), 1: (2, 3, 4), 2: (3, 4, 3)}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_selection_case(tmp_path_factory.mktemp("grow"), TABLE, N_MAX)


@pytest.fixture(scope="module")
def ckpt(case):
    return case[0]


@pytest.fixture(scope="module")
def bundle(case):
    return case[1]


def rule(t: int, sinks: int, w: int, k: int, d: int) -> int:
    """Spec 4.1 with growth, as docs/decisions.md states it: rows the query at position t selects."""
    return min(t + 1, sinks + w + (max(k, (t + 1) // d) if d else k))


def test_format_round_trips_and_a_fixed_budget_writes_no_divisor():
    fixed = GSMParams(layer_selection={0: LayerSelection(40, 0), 2: LayerSelection(3, 100)})
    d = fixed.to_json()
    assert "sparse_top_k_divisor" not in d and all("sparse_top_k_divisor" not in e
                                                   for e in d["layer_selection"].values())
    grow = GSMParams(sparse_top_k_divisor=16, layer_selection={0: LayerSelection(40, 0), 2: LayerSelection(3, 100, 8)})
    g = json.loads(json.dumps(grow.to_json()))
    assert g["sparse_top_k_divisor"] == 16
    assert g["layer_selection"]["2"] == {"sparse_window": 3, "sparse_top_k": 100, "sparse_top_k_divisor": 8}
    assert GSMParams.from_json(g) == grow
    assert [grow.selection_of(2).top_k_at(t) for t in (0, 798, 799, 807, 808, 8191)] == [100, 100, 100, 101, 101, 1024]
    assert grow.max_top_k_to(8192) == 1024 and grow.max_top_k_to(512) == 100 and fixed.max_top_k_to(64) == 64
    # the uniform fields grow too (a layer without an entry): 8192 // 16 = 512
    assert grow.selection_of(1).top_k_at(8191) == 512 and grow.for_layer(1).selection_is_dense(64 + 3 + 1)


@pytest.mark.parametrize("where, words", [
    ({"layer_selection": {"0": {"sparse_window": 4, "sparse_top_k": 2, "sparse_top_k_divisor": -1}}},
     "layer_selection[0]: sparse_window must be >= 1, sparse_top_k and sparse_top_k_divisor >= 0"),
    ({"sparse_top_k_divisor": -2}, "gsm_config.sparse_top_k_divisor must be >= 0"),
])
def test_a_negative_divisor_is_one_config_error(where, words):
    d = {**GSMParams(kv_sharing={3: 1}).to_json(), **where}
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        GSMParams.from_json(d)


def test_golden_counts_follow_the_rule_and_prefill_selects_as_decode(ckpt):
    g = GoldenModel.from_checkpoint(ckpt, mode="exact")
    p = g.cfg.gsm
    ids = np.random.default_rng(1).integers(3, 259, 60).tolist()
    with torch.no_grad():
        whole = g.forward(g.new_cache(), ids, trace=True)
        cache = g.new_cache()
        steps = [g.forward(cache, [t], trace=True) for t in ids]
    grew = 0
    for l in g.cfg.owning_layers:
        w, k, d = (TABLE[l] + (0,))[:3]
        sel = whole.trace.selected[l].numpy()  # [T, T]
        for t in range(len(ids)):
            assert sel[t].sum() == rule(t, p.sink_tokens, w, k, d), f"layer {l}, row {t}"
            assert np.array_equal(sel[t, :t + 1], steps[t].trace.selected[l].numpy()[0, :t + 1]), f"layer {l}, {t}"
            grew += d > 0 and (t + 1) // d > k and sel[t].sum() < t + 1
    assert grew > 40  # the growth is exercised past the dense threshold, not only in dense rows
    assert float((whole.logits[-1] - steps[-1].logits[-1]).abs().max()) <= 1e-4


def test_plan_covers_the_last_positions_budget(ckpt, tmp_path):
    from builder.build import BuildError
    from gsm.bundle_format import BundleConfig

    build(BuildConfig(device="orin", checkpoint=ckpt, output=tmp_path / "b", max_seq=N_MAX))
    cfg = BundleConfig.load(tmp_path / "b")
    assert cfg.layer_selection == {0: (12, 0), 1: (2, 3, 4), 2: (3, 4, 3)}
    assert [cfg.top_k_divisor_of(l) for l in cfg.owning_layers] == [0, 4, 3]
    assert cfg.max_top_k == N_MAX // 3  # layer 2's top-k at position N_MAX - 1 (its floor is 4, the model's 8)
    with pytest.raises(BuildError, match="--max-top-k must be in \\[42 "):
        build(BuildConfig(device="orin", checkpoint=ckpt, output=tmp_path / "c", max_seq=N_MAX, max_top_k=41))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("backend, graph", [("onnxruntime", "portable"), ("onnxruntime", "cpu"), ("reference", "auto")])
def test_engines_equal_golden_with_a_growing_budget(ckpt, bundle, backend, graph):
    import runtime

    if graph == "cpu":
        need_ort_ops_library()
    rt = runtime.load(bundle, backend=backend, graph=graph, **({"threads": 1} if backend == "onnxruntime" else {}))
    base = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    seqs = drive_budgets(rt, base, seed=8, steps=6, dense_at=3)
    assert all(s.length // 3 > 4 for s in seqs[:3])  # the last checks ran where layer 2 had grown


def test_remote_code_selects_alike(ckpt, tmp_path):
    """transformers' remote code (no gsm package) against the golden on the growing checkpoint."""
    from test_remote_code import SUBPROCESS, loadable

    d = loadable(ckpt, tmp_path / "growing")
    prompt = np.random.default_rng(4).integers(3, 259, 50).tolist()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", SUBPROCESS, str(d), json.dumps(prompt), "8"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    g = GoldenModel.from_checkpoint(d, mode="exact")
    ref = g.forward(g.new_cache(), prompt).logits
    assert float((torch.tensor(json.loads(r.stdout)["logits"]) - ref).abs().max()) <= 1e-4
    # the same prompt with the growth removed selects fewer rows: the comparison can tell them apart
    fixed = GoldenModel(g.w, mode="exact", params=GSMParams.from_json({**g.p.to_json(), "layer_selection": {
        str(l): {"sparse_window": e[0], "sparse_top_k": e[1]} for l, e in TABLE.items()}}))
    assert float((fixed.forward(fixed.new_cache(), prompt).logits - ref).abs().max()) > 1e-3


def test_converter_growth_leaves_streaming_layers():
    p = GSMParams(sparse_top_k=300, layer_selection={0: LayerSelection(64, 0), 1: LayerSelection(32, 300)})
    q = with_growth(p, 16)
    assert q.selection_of(0) == LayerSelection(64, 0) and q.selection_of(1) == LayerSelection(32, 300, 16)
    assert q.sparse_top_k_divisor == 16 and with_growth(p, 0) == p
    assert q.mean_rows([0, 1], 8192) == (1 + 64 + 1 + 32 + 512) / 2


def test_a_wider_window_grows_its_top_k_less():
    """A layer whose window is wider than the model's (an indexer+w choice) gets the smallest divisor that keeps its
    rows at the model's context within a model-window layer's: its window took those rows from the top-k."""
    from gsm.convert.budget import wide_divisor

    p = GSMParams(sparse_window=32, max_sparse_window=32, sparse_top_k=300, layer_selection={
        1: LayerSelection(32, 300), 2: LayerSelection(256, 76), 3: LayerSelection(128, 40), 4: LayerSelection(1000, 8)})
    q = with_growth(p, 16, 8192)
    d = {i: q.selection_of(i).sparse_top_k_divisor for i in (1, 2, 3, 4)}
    assert d == {1: 16, 2: 29, 3: 20, 4: 0}
    for i in (2, 3):  # the smallest such divisor: one less would read more than the model-window layer
        extra = q.selection_of(i).sparse_window - 32
        assert 8192 // d[i] <= 8192 // 16 - extra < 8192 // (d[i] - 1)
        assert wide_divisor(16, extra, 8192) == d[i]
    rows = {i: q.mean_rows([i], 8192) for i in (1, 2, 3)}
    assert rows[1] == 1 + 32 + 512 and rows[2] <= rows[1] and rows[3] <= rows[1]
    assert q.mean_rows([4], 8192) == 1 + 1000 + 8  # the window takes the growth: a fixed top-k
    assert with_growth(p, 16) == replace(q, layer_selection={
        **q.layer_selection, 2: LayerSelection(256, 76, 16), 3: LayerSelection(128, 40, 16),
        4: LayerSelection(1000, 8, 16)})  # without the context: every indexer layer as before


def test_growth_fits_the_rows_at_the_models_context():
    """The converter's growth: the smallest divisor >= 16 whose mean rows at the model's context stay within 1/16 of
    dense; 16 itself when the table already fits (the default conversion's own table did: 508 rows at 8K)."""
    from gsm.convert.budget import fit_growth

    fits = GSMParams(sparse_window=32, max_sparse_window=32, sparse_top_k=300, layer_selection={
        0: LayerSelection(96, 0), 1: LayerSelection(32, 300)})
    assert fit_growth(fits, 16, 8192, [0, 1]) == with_growth(fits, 16, 8192)
    wide = GSMParams(sparse_window=32, max_sparse_window=32, sparse_top_k=300, layer_selection={
        0: LayerSelection(128, 32), 1: LayerSelection(32, 300), 2: LayerSelection(256, 160)})
    layers = [0, 1, 2]
    g = fit_growth(wide, 16, 8192, layers)
    d = g.sparse_top_k_divisor
    assert d > 16 and g == with_growth(wide, d, 8192)
    assert g.mean_rows(layers, 8192) <= 512 < with_growth(wide, d - 1, 8192).mean_rows(layers, 8192)
    assert fit_growth(wide, 0, 8192, layers) == wide
