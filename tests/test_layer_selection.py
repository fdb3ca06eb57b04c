"""Selection per layer (gsm_config `layer_selection`, docs/decisions.md "Selection per layer").

- the format: a v1 config (no table) writes no `layer_selection` and keeps its checksum; a table round-trips;
  a sharing layer or a bad window/top-k in it is one ConfigError naming the field;
- the golden: each owning layer selects sinks + its own window + its own top-k (a streaming layer, top-k 0, exactly
  sinks + window), counted here from the spec's rule, not from the golden's code; a sharing layer reuses its
  source's selection;
- every engine the CPU can run (ONNX Runtime on model.portable.onnx and on model.cpu.onnx, the plugin graph on the
  reference backend) equals the golden on a tiny model whose three owning layers select three ways (a streaming
  layer whose window is wider than max_sparse_window, a layer with its own window and top-k, one with the model's):
  logits, greedy tokens, selected positions and tiers at every step of one batch of sequences with run-time budgets
  0, 3, each layer's own, dense and a switch to dense (tests/test_runtime_topk.drive_budgets); and a run-time window
  overrides every layer's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import need_ort_ops_library, tiny_selection_case
from test_runtime_topk import N_MAX, drive_budgets

from gsm.config import ConfigError, GSMParams, LayerSelection, gsm_checksum
from gsm.golden.model import GoldenModel

# tiny: owning layers 0, 1, 2 (layer 3 shares layer 1); the model's window 3, max_sparse_window 8, top-k 8, 1 sink
TABLE = {0: (12, 0), 1: (2, 12)}  # layer 2: the model's (3, 8)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_selection_case(tmp_path_factory.mktemp("layersel"), TABLE, N_MAX)


@pytest.fixture(scope="module")
def ckpt(case):
    return case[0]


@pytest.fixture(scope="module")
def bundle(case):
    return case[1]


def test_v1_config_is_unchanged_and_a_table_round_trips():
    v1 = GSMParams()
    assert "layer_selection" not in v1.to_json()
    body = {k: v for k, v in v1.to_json().items() if k != "checksum"}
    assert v1.to_json()["checksum"] == gsm_checksum(body)
    p = GSMParams(layer_selection={0: LayerSelection(40, 0), 2: LayerSelection(3, 100)})
    d = json.loads(json.dumps(p.to_json()))
    assert d["layer_selection"] == {"0": {"sparse_window": 40, "sparse_top_k": 0},
                                    "2": {"sparse_window": 3, "sparse_top_k": 100}}
    q = GSMParams.from_json(d)
    assert q == p and q.selection_of(1) == LayerSelection(p.sparse_window, p.sparse_top_k)
    assert q.max_top_k_to(8192) == 100 and q.layer_max_window(0) == 40 and q.layer_max_window(2) == p.max_sparse_window


@pytest.mark.parametrize("table, words", [
    ({"3": {"sparse_window": 4, "sparse_top_k": 2}}, "layer 3 shares layer 1"),
    ({"0": {"sparse_window": 0, "sparse_top_k": 2}}, "layer_selection[0]: sparse_window must be >= 1"),
    ({"0": {"sparse_window": 4, "sparse_top_k": -1}}, "layer_selection[0]"),
    ({"0": {"sparse_window": 4}}, "gsm_config: malformed field"),
])
def test_a_bad_table_is_one_config_error(table, words):
    d = {**GSMParams(kv_sharing={3: 1}).to_json(), "layer_selection": table}
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        GSMParams.from_json(d)


def test_golden_selects_each_layers_own_budget(ckpt):
    """Selected rows per query, counted against spec 4.1 applied per layer: min(t + 1, sinks + w_l + k_l), the
    sinks and the layer's window always in, and a sharing layer's mask is its source's."""
    g = GoldenModel.from_checkpoint(ckpt, mode="exact")
    p = g.cfg.gsm
    ids = np.random.default_rng(1).integers(3, 259, 60).tolist()
    with torch.no_grad():
        tr = g.forward(g.new_cache(), ids, trace=True).trace
    T = len(ids)
    for l in g.cfg.owning_layers:
        w, k = TABLE.get(l, (p.sparse_window, p.sparse_top_k))
        sel = tr.selected[l].numpy()  # [T, T]
        for t in range(T):
            assert sel[t].sum() == min(t + 1, p.sink_tokens + w + k), f"layer {l}, row {t}"
            assert sel[t, :min(p.sink_tokens, t + 1)].all() and sel[t, max(0, t - w + 1):t + 1].all()
            assert not sel[t, t + 1:].any()
        if k == 0:  # streaming: nothing but sinks and window
            t = T - 1
            assert sel[t].nonzero()[0].tolist() == [*range(p.sink_tokens), *range(t - w + 1, t + 1)]
    # layer 3 attends over layer 1's selection (spec 4.2): its probabilities vanish exactly off that mask
    off = ~tr.selected[1]
    assert float(tr.probs[3][:, off].abs().max()) == 0.0


def test_bundle_states_the_table(bundle):
    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1)
    assert rt.cfg.layer_selection == TABLE and rt.cfg.graph_revision >= 7
    assert rt.cfg.selection_of(2) == (rt.cfg.sparse_window, rt.cfg.sparse_top_k)


@pytest.mark.parametrize("backend, graph", [("onnxruntime", "portable"), ("onnxruntime", "cpu"), ("reference", "auto")])
def test_engines_equal_golden_with_per_layer_selection(ckpt, bundle, backend, graph):
    import runtime

    if graph == "cpu":
        need_ort_ops_library()
    rt = runtime.load(bundle, backend=backend, graph=graph, **({"threads": 1} if backend == "onnxruntime" else {}))
    base = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    drive_budgets(rt, base, seed=8, steps=6, dense_at=3)


def test_a_run_time_window_overrides_every_layers(ckpt, bundle):
    from test_runtime_topk import check_step

    import runtime

    rt = runtime.load(bundle, backend="onnxruntime", threads=1, sparse_window=5)
    base = GoldenModel.from_checkpoint(ckpt, mode="deployed")
    golden = GoldenModel(base.w, mode="deployed", quant=base.quant, calibration=base.calib,
                         params=base.p.overridden(sparse_window=5))
    prompt = np.random.default_rng(2).integers(3, 259, 40).tolist()
    seq, gcache = rt.new_sequence(), golden.new_cache()
    logits = seq.prefill(prompt)
    with torch.no_grad():
        g = golden.prefill(gcache, prompt, trace=True)
    check_step(seq, logits, g, gcache, "prefill")
    for l in rt.cfg.owning_layers:  # window 5 everywhere, each layer's own top-k
        k = TABLE.get(l, (0, rt.cfg.sparse_top_k))[1]
        assert int((seq.last.selected[l][0, -1] >= 0).sum()) == rt.cfg.sink_tokens + 5 + k
