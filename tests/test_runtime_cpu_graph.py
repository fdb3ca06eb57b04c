"""The fused-attention network `model.cpu.onnx` (docs/engine_io.md 5.1: one `GsmPoolAttention` custom op per
owning layer and one `GsmPoolSharedAttention` per sharing layer over the plugins' pools, plugins/ortCpu) against the
standard-op network `model.portable.onnx` of the same bundle.

The portable graph is the reference here (it is the one the golden tests pin down, tests/test_runtime_golden.py
also runs the cpu graph against the golden model): several sequences of different lengths, chunked prefill,
per-sequence budgets (0, small, dense) and re-tier passes give the same greedy tokens, tiers and selections
and logits to float32 summation order, on 1 and 2 threads. Tests needing the op library skip when it was not
built (it needs ONNX Runtime's C API headers: scripts/fetch_ort_headers.sh; CI builds it).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import half_grid_copy, int4_copy, need_ort_ops_library, retiering_copy
from runtime_bundles import ROOT, run_module

from builder.build import BuildConfig, build
from gsm.synth import synth_checkpoint

N_MAX, MAX_INPUT = 192, 16


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A checkpoint whose U lie on the FP16 grid, as the converter writes them (so model.cpu.onnx reads float16
    U; the quantised bundles below keep the synthetic checkpoint's float32 U)."""
    root = tmp_path_factory.mktemp("cpu_graph")
    ck = half_grid_copy(retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=5), root / "retier"),
                        root / "grid")
    out = root / "bundle"
    build(BuildConfig(device="orin", checkpoint=ck, output=out, max_seq=N_MAX, max_input=MAX_INPUT, debug_outputs=True,
                      max_batch=4))  # the four budgets in one batch
    return out


@pytest.fixture(scope="module")
def quantised_bundles(tmp_path_factory):
    """Bundles whose GSM side is one quantised projection (so model.cpu.onnx scales, splits and rounds it in one
    GsmSideSplit node): INT8 weights with INT8 indexer keys, INT4 weights with FP16 keys. Exact matmuls, so the two
    graphs differ only in float32 summation order (INT8 activations would turn that into rounding flips)."""
    root = tmp_path_factory.mktemp("cpu_graph_q")
    base = synth_checkpoint("tiny", root / "tiny", seed=5)
    out = {}
    for name, ck, weights in (("int8-keys8", int4_copy(base, root / "k8"), "int8"),
                              ("int4-keys16", retiering_copy(base, root / "retier"), "int4")):
        out[name] = root / name
        build(BuildConfig(device="orin", checkpoint=ck, output=out[name], max_seq=N_MAX, max_input=MAX_INPUT,
                          debug_outputs=True, max_batch=4, weights=weights, gsm_weights="int8",
                          matmul_accuracy="exact"))
    return out


def run(rt, prompts, budgets, steps):
    """Prefill the prompts together, then `steps` greedy decode steps of all of them in one call each;
    per step: logits, tokens, tiers and selections of every sequence."""
    seqs = [rt.new_sequence() for _ in prompts]
    for s, k in zip(seqs, budgets):
        s.sparse_top_k = k
    logits = rt.prefill_batch(seqs, prompts)
    trace = []
    for _ in range(steps):
        tokens = [int(np.argmax(lg)) for lg in logits]
        logits = rt.decode_batch(seqs, tokens)
        trace.append({"logits": [lg.copy() for lg in logits], "tokens": tokens,
                      "tiers": [s.state.tier.copy() for s in seqs],
                      "selected": [{l: v.copy() for l, v in s.last.selected.items()} for s in seqs]})
    return trace


def test_model_cpu_onnx_has_one_node_per_owning_layer_attention(bundle):
    import onnx

    cfg = json.loads((bundle / "bundle.json").read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["graphs"]["cpu"] == "model.cpu.onnx"
    cpu = onnx.load(str(bundle / "model.cpu.onnx"), load_external_data=False)
    portable = onnx.load(str(bundle / "model.portable.onnx"), load_external_data=False)
    fused = [n for n in cpu.graph.node if n.op_type == "GsmPoolAttention"]
    shared = [n for n in cpu.graph.node if n.op_type == "GsmPoolSharedAttention"]
    assert len(fused) == len(cfg["owning_layers"])
    assert len(fused) + len(shared) == json.loads((bundle / "config.json").read_text())["num_hidden_layers"]
    assert {n.domain for n in fused + shared} == {"ai.gsm_edge.cpu"}
    # the plugin graph's cache (pools, slot table, keys) and a row cache per layer; no float32 buffers by position,
    # and nothing returned of the cache
    names = [i.name for i in cpu.graph.input]
    trt = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    pools = [i.name for i in trt.graph.input if i.name.startswith(("kv_pool.", "index_keys.")) or i.name == "kv_slots"]
    assert set(pools) <= set(names)
    assert not any(n.startswith(("latent_", "k_rows.", "v_rows.")) for n in names)
    layers = len(fused) + len(shared)
    assert {n for n in names if n.startswith("row_cache")} == {f"row_cache{t}.{i}" for i in range(layers)
                                                                for t in ("", "_tags")}
    assert not any(o.name.startswith("new_") for o in cpu.graph.output)
    # the point of the graph: an owning layer's ~90 standard operators become one
    per_layer_saved = (len(portable.graph.node) - len(cpu.graph.node)) / len(cfg["owning_layers"])
    assert per_layer_saved > 40, per_layer_saved


def test_quantised_gsm_side_is_one_node_per_owning_layer(quantised_bundles):
    import onnx

    for name, b in quantised_bundles.items():
        cfg = json.loads((b / "bundle.json").read_text())
        cpu = onnx.load(str(b / "model.cpu.onnx"), load_external_data=False).graph
        side = [n for n in cpu.node if n.op_type == "GsmSideSplit"]
        assert len(side) == len(cfg["owning_layers"]), name
        assert not any(n.op_type in ("Round", "Clip", "Cast") and ".GsmKVCacheUpdate" in n.name for n in cpu.node)
        keys = next(i for i in cpu.input if i.name == f"index_keys.{cfg['owning_layers'][0]}")
        want = onnx.TensorProto.INT32 if name.endswith("keys8") else onnx.TensorProto.FLOAT16  # codes in words
        assert keys.type.tensor_type.elem_type == want, name


def up_types(b) -> set[int]:
    """Element types of the U_k / U_v initializers the GsmPoolAttention nodes of b's model.cpu.onnx read."""
    import onnx

    g = onnx.load(str(b / "model.cpu.onnx"), load_external_data=False).graph
    types = {t.name: t.data_type for t in g.initializer}
    return {types[n.input[i]] for n in g.node if n.op_type == "GsmPoolAttention" for i in (12, 13)}


def test_u_on_the_fp16_grid_is_read_as_float16(bundle, quantised_bundles):
    """U on the FP16 grid: the op reads float16 copies (half the bytes, the same values); the portable graph keeps
    the float32 tensors; U off the grid (the synthetic checkpoint's) stays float32 in every graph."""
    import onnx

    assert up_types(bundle) == {onnx.TensorProto.FLOAT16}
    cpu = onnx.load(str(bundle / "model.cpu.onnx"), load_external_data=False).graph
    assert not any(t.name.endswith(("k_svd_U.weight", "v_svd_U.weight")) for t in cpu.initializer)  # no float32 U
    portable = onnx.load(str(bundle / "model.portable.onnx"), load_external_data=False).graph
    assert not any(t.name.endswith(".float16") for t in portable.initializer)
    for b in quantised_bundles.values():
        assert up_types(b) == {onnx.TensorProto.FLOAT}


def test_float16_u_gives_the_float32_bits(bundle, tmp_path, monkeypatch):
    """The same checkpoint built with the op reading float32 U gives the float16 bundle's logits bit for bit (the
    op widens each block of U exactly and sums it as the float32 one; tests/test_ort_ops.py checks the op alone)."""
    need_ort_ops_library()
    import onnx

    import runtime
    from builder.graph_cpu import CpuOps

    monkeypatch.setattr(CpuOps, "half_up", False)
    f32 = tmp_path / "f32"
    build(BuildConfig(device="orin",
                      checkpoint=json.loads((bundle / "manifest.json").read_text())["checkpoint"]["path"], output=f32,
                      max_seq=N_MAX, max_input=MAX_INPUT, debug_outputs=True, max_batch=4))
    assert up_types(f32) == {onnx.TensorProto.FLOAT}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 259, n).tolist() for n in (9, 40)]
    a = run(runtime.load(bundle, "onnxruntime", threads=2, graph="cpu"), prompts, [3, None], 12)
    b = run(runtime.load(f32, "onnxruntime", threads=2, graph="cpu"), prompts, [3, None], 12)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x["tokens"] == y["tokens"], i
        for s in range(len(prompts)):
            assert np.array_equal(x["logits"][s], y["logits"][s]), f"step {i}, sequence {s}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["fp16", "int8-keys8", "int4-keys16"])
def test_cpu_graph_equals_portable_graph(bundle, quantised_bundles, kind, threads):
    need_ort_ops_library()
    import runtime

    bundle = bundle if kind == "fp16" else quantised_bundles[kind]

    rng = np.random.default_rng(11)
    # lengths shorter and longer than max-input (chunked prefill: the op's S > 1 form), one single token;
    # budgets: none beyond sinks + window, small, the model's, dense (>= every context)
    prompts = [rng.integers(3, 259, n).tolist() for n in (9, 40, 1, 27)]
    budgets = [0, 3, None, N_MAX]
    ref = run(runtime.load(bundle, "onnxruntime", threads=1, graph="portable"), prompts, budgets, 24)
    rt = runtime.load(bundle, "onnxruntime", threads=threads, graph="cpu")
    assert rt.backend.graph == "cpu"
    got = run(rt, prompts, budgets, 24)
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a["tokens"] == b["tokens"], f"greedy tokens differ at step {i}"
        for s in range(len(prompts)):
            assert np.array_equal(a["tiers"][s], b["tiers"][s]), f"tiers of sequence {s}, step {i}"
            for l, sel in a["selected"][s].items():
                assert np.array_equal(sel, b["selected"][s][l]), f"selection of sequence {s}, layer {l}, step {i}"
            scale = float(np.abs(a["logits"][s]).max())
            worst = max(worst, float(np.abs(a["logits"][s] - b["logits"][s]).max()) / scale)
    # float32 summation order (FMA, the op's own loop order) compounded over 30 steps whose cache rows feed
    # back: 1.2e-5 of the logit scale measured; 1e-4 as tests/test_runtime_batch.py allows for batching
    assert worst <= 1e-4, worst
    assert {t for step in got for tiers in step["tiers"] for t in tiers.tolist()} >= {0, 1, 2}  # re-tiered rows read


def test_auto_takes_the_cpu_graph_and_portable_stays_selectable(bundle):
    need_ort_ops_library()
    import runtime

    assert runtime.load(bundle, "onnxruntime", threads=1).backend.graph == "cpu"
    assert runtime.load(bundle, "onnxruntime", threads=1, graph="portable").backend.graph == "portable"
    with pytest.raises(ValueError, match="graph must be one of"):
        runtime.load(bundle, "onnxruntime", graph="fused")


def test_a_bundle_without_the_cpu_graph_runs_portable_and_refuses_graph_cpu(bundle, tmp_path):
    import runtime
    from gsm.atomic import MANIFEST_NAME, write_manifest

    old = tmp_path / "old"  # a bundle as built before model.cpu.onnx existed
    shutil.copytree(bundle, old)
    (old / "model.cpu.onnx").unlink()
    meta = json.loads((old / MANIFEST_NAME).read_text())
    write_manifest(old, {k: v for k, v in meta.items() if k not in ("format", "version", "files")})
    assert runtime.load(old, "onnxruntime", threads=1).backend.graph == "portable"
    with pytest.raises(RuntimeError, match="model.cpu.onnx"):
        runtime.load(old, "onnxruntime", threads=1, graph="cpu")
    r = run_module("runtime", "generate", str(old), "--ids", "5,6,7", "--max-new-tokens", "2", "--graph", "cpu",
                   cwd=ROOT)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.cpu.onnx" in lines[0] and "error" in lines[0], r.stderr


def test_a_cpu_graph_without_the_pools_is_refused_with_the_rebuild_command(bundle, tmp_path):
    """A model.cpu.onnx of an older revision (its cache float32 buffers by position, here the portable graph's, which
    has the same inputs) is refused with one error naming the missing pool and the rebuild command, not run."""
    need_ort_ops_library()
    import runtime
    from gsm.atomic import MANIFEST_NAME, write_manifest
    from gsm.bundle_format import REBUILD, BundleError

    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    shutil.copyfile(old / "model.portable.onnx", old / "model.cpu.onnx")
    meta = json.loads((old / MANIFEST_NAME).read_text())
    write_manifest(old, {k: v for k, v in meta.items() if k not in ("format", "version", "files")})
    with pytest.raises(BundleError, match=r"model.cpu.onnx has no input kv_pool\.0: rebuild the bundle with") as e:
        runtime.load(old, "onnxruntime", threads=1, graph="cpu")
    assert REBUILD in str(e.value)


def test_auto_falls_back_to_portable_when_the_library_does_not_load(bundle, tmp_path, monkeypatch):
    """A library ONNX Runtime refuses (here a shared library without RegisterCustomOps, as an ONNX Runtime older
    than the op's C API 17 would refuse the real one): `auto` runs the portable graph and says why, `cpu` fails."""
    from gsm_edge_plugins._lib import ORT_OPS_LIB, REF_LIB, find_library

    import runtime

    ref = find_library(REF_LIB)
    if ref is None:
        pytest.skip("the plugins' CPU reference library is not built")
    libs = tmp_path / "libs"
    libs.mkdir()
    shutil.copy(ref, libs / ORT_OPS_LIB)
    monkeypatch.setenv("GSM_EDGE_PLUGINS_DIR", str(libs))
    rt = runtime.load(bundle, "onnxruntime", threads=1)
    assert rt.backend.graph == "portable" and "model.cpu.onnx did not load" in rt.backend.graph_note
    assert rt.new_sequence().prefill([5, 6, 7]).shape[-1] == rt.cfg.vocab_size
    with pytest.raises(RuntimeError, match="graph cpu: .*model.cpu.onnx does not load"):
        runtime.load(bundle, "onnxruntime", threads=1, graph="cpu")
