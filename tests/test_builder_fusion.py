"""Layer-stack fusions (docs/runtime.md "Layer-stack fusions"): after ONNX Runtime's own optimisation the
portable graph has one SimplifiedLayerNormalization per RMSNorm and four Gemm per layer (an owning layer's
q + GSM-side projections as one, gate + up as one, o, down); the fused weights are the checkpoint tensors
row-concatenated, streamed; quantised projections stay separate; the logits still match the golden."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from test_runtime_golden import LOGIT_TOL, check_selection

from builder.build import BuildConfig, build
from builder.network import FUSED, GSM_SIDE, NetSpec, Network
from builder.onnx_util import GraphBuilder, WeightStore
from gsm import checkpoint, names
from gsm.golden.model import GoldenModel
from gsm.synth import synth_checkpoint

N_MAX = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuse")
    ck = synth_checkpoint("tiny", root / "tiny", seed=3)
    out = root / "bundle"
    build(BuildConfig(device="orin", checkpoint=ck, output=out, max_seq=N_MAX, debug_outputs=True))
    return ck, out


def optimised(model_path, tmp_path):
    """The graph as ONNX Runtime runs it: ORT_ENABLE_ALL on the CPU provider, saved and read back."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.bin")
    ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    return onnx.load(so.optimized_model_filepath, load_external_data=False)


def per_layer(model, op_type):
    """op_type nodes of the layer scopes `L{i}/...` (the GSM subgraphs `L{i}.Gsm...` excluded), by layer."""
    c = collections.Counter()
    for n in model.graph.node:
        scope = n.name.split("/")[0]
        if n.op_type == op_type and scope.startswith("L") and scope[1:].isdigit():
            c[int(scope[1:])] += 1
    return c


def test_optimised_portable_graph_fuses_norms_and_projections(tiny, tmp_path):
    ck, out = tiny
    cfg = checkpoint.load_config(ck)
    m = optimised(out / "model.portable.onnx", tmp_path)
    ops = collections.Counter(n.op_type for n in m.graph.node)
    # two RMSNorms per layer and the final one, each a single kernel; nothing of the unfused form left
    assert ops["SimplifiedLayerNormalization"] == 2 * cfg.num_hidden_layers + 1
    assert ops["ReduceMean"] == 0 and ops["Sqrt"] == 0
    # owning: in_proj (q + 5 GSM-side), o, gate_up, down; sharing: q, o, gate_up, down (the unfused graph
    # had 10 and 5); plus the untied LM head
    assert cfg.owning_layers and cfg.sharing_layers
    assert per_layer(m, "Gemm") == dict.fromkeys(range(cfg.num_hidden_layers), 4)
    assert ops["Gemm"] == 4 * cfg.num_hidden_layers + (0 if cfg.tie_word_embeddings else 1)
    # the whole layer outside the attention, by hand: the two norms, Gemm (+ the residual as its C input,
    # no Add), the latent-scale Mul and SwiGLU's product, Reshape to [B, S, w] and back from the attention,
    # Split of the fused outputs, silu as QuickGelu (shape tensors are made once per width: left out)
    owning = {"SimplifiedLayerNormalization": 2, "Gemm": 4, "Mul": 2, "Reshape": 2, "Split": 2, "QuickGelu": 1}
    sharing = {**owning, "Mul": 1, "Split": 1}
    for i in range(cfg.num_hidden_layers):
        got = collections.Counter(n.op_type for n in m.graph.node if n.name.startswith(f"L{i}/"))
        got.pop("Concat", None)
        assert got == (owning if cfg.is_owning(i) else sharing), (i, got)
    gemm_b = {n.input[1] for n in m.graph.node if n.op_type == "Gemm"}
    for i in range(cfg.num_hidden_layers):
        assert FUSED["gate_up"].format(i=i) in gemm_b
        assert (FUSED["in_proj"].format(i=i) in gemm_b) == cfg.is_owning(i)


def test_fused_weights_are_the_checkpoint_rows(tiny):
    ck, out = tiny
    cfg = checkpoint.load_config(ck)
    sd = checkpoint.load_state_dict(ck)
    m = onnx.load(str(out / "model.portable.onnx"))  # external data from weights.bin
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for i in range(cfg.num_hidden_layers):
        def ln(k, i=i):
            return sd[names.layer_name(k, i)]

        np.testing.assert_array_equal(inits[FUSED["gate_up"].format(i=i)], np.concatenate([ln("gate_proj"),
                                                                                          ln("up_proj")]))
        if cfg.is_owning(i):
            want = np.concatenate([ln(k) for k in GSM_SIDE] + [ln("q_proj")])
            np.testing.assert_array_equal(inits[FUSED["in_proj"].format(i=i)], want)
            n_idx = cfg.gsm.indexer_dim * (1 + cfg.gsm.indexer_heads) + cfg.gsm.indexer_heads
            np.testing.assert_array_equal(inits[FUSED["in_scale"].format(i=i)],
                                          np.concatenate([ln("k_S"), ln("v_S"), np.ones(n_idx, np.float32)]))


def test_fused_graph_matches_golden(tiny):
    """Prefill + 16 greedy steps of the fused portable graph against the golden model (deployed mode),
    with the golden regression's tolerance and exact selections."""
    import runtime

    ck, out = tiny
    rt = runtime.load(out, backend="onnxruntime", threads=1)
    golden = GoldenModel.from_checkpoint(ck, mode="deployed")
    prompt = np.random.default_rng(7).integers(3, 259, 40).tolist()
    gcache, seq = golden.new_cache(), rt.new_sequence()
    with torch.no_grad():
        g = golden.prefill(gcache, prompt, trace=True)
    logits = seq.prefill(prompt)
    check_selection(seq, g.trace, len(prompt))
    worst = float(np.abs(logits - g.logits[-1].numpy()).max())
    for _ in range(16):
        tok = int(torch.argmax(g.logits[-1]))
        assert int(np.argmax(logits)) == tok
        with torch.no_grad():
            g = golden.decode(gcache, tok, trace=True)
        logits = seq.decode(tok)
        check_selection(seq, g.trace, seq.length)
        worst = max(worst, float(np.abs(logits - g.logits[-1].numpy()).max()))
    assert worst <= max(LOGIT_TOL, 1e-4 * float(np.abs(g.logits[-1].numpy()).max())), worst


def test_tensorrt_fp16_graph_keeps_q_in_fp16_and_gsm_side_in_fp32(tiny):
    """model.onnx (FP16 activations) reads the same stored in_proj: q's rows are split off it and cast to
    FP16 for an FP16 Gemm, the GSM-side rows stay float32 and are scaled after their Gemm."""
    ck, out = tiny
    cfg = checkpoint.load_config(ck)
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    prod = {o: n for n in m.graph.node for o in n.output}

    def src(t, op, **attrs):
        n = prod[t]
        assert n.op_type == op, (t, n.op_type, op)
        for k, v in attrs.items():
            assert onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == k)) == v
        return n

    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    for i in cfg.owning_layers:
        gemm = src(src(src(f"L{i}.q", "Reshape").input[0], "Cast", to=f32).input[0], "Gemm")
        split = src(src(gemm.input[1], "Cast", to=f16).input[0], "Split", axis=0)
        assert split.input[0] == FUSED["in_proj"].format(i=i) and gemm.input[1] != split.output[0]
        mul = src(src(src(f"L{i}.latent_k_new", "Split").input[0], "Reshape").input[0], "Mul")
        assert mul.input[1] == FUSED["in_scale"].format(i=i)
        assert src(mul.input[0], "Gemm").input[1] == split.output[0]  # float32 rows, no Cast


def test_quantised_projections_stay_separate(tiny, tmp_path):
    """INT8 q/o/down (and the untied LM head): MatMulNBits each; gate and up one MatMulNBits over their
    concatenation; the GSM-side projections of a fast build one INT8 MatMulNBits at group 32 over their
    concatenation (docs/weights.md "GSM-side projections"), so no float Gemm is left."""
    ck, _ = tiny
    cfg = checkpoint.load_config(ck)
    out = tmp_path / "int8"
    build(BuildConfig(device="orin", checkpoint=ck, output=out, max_seq=N_MAX, weights="int8"))
    m = optimised(out / "model.portable.onnx", tmp_path)
    nbits = collections.Counter(n.input[1] for n in m.graph.node if n.op_type == "MatMulNBits")
    assert set(nbits) == {names.layer_name(k, i) + ".nbits.qweight" for i in range(cfg.num_hidden_layers)
                          for k in ("q_proj", "o_proj", "down_proj")} | {
        FUSED["gate_up"].format(i=i) + ".nbits.qweight" for i in range(cfg.num_hidden_layers)} | {
        names.LM_HEAD + ".nbits.qweight"} | {FUSED["in_proj"].format(i=i) + ".nbits.qweight" for i in cfg.owning_layers}
    assert set(nbits.values()) == {1}
    assert per_layer(m, "Gemm") == {}
    assert per_layer(m, "Add") == dict.fromkeys(range(cfg.num_hidden_layers), 2)  # the residuals
    port = onnx.load(str(out / "model.portable.onnx"), load_external_data=False)
    stored = {t.name for t in port.graph.initializer}
    for i in cfg.owning_layers:
        assert FUSED["gate_up"].format(i=i) not in stored  # its codes only, not a float copy
        assert FUSED["in_proj"].format(i=i) not in stored


class _LoggingSource:
    """A TensorSource of 2-row chunks that records, as each chunk is produced, how far the weight file
    has been written (so a test sees whether earlier chunks were written before later ones were read)."""

    def __init__(self, arrays):
        self.arrays, self.log, self.store = arrays, [], None

    def shape(self, name):
        return self.arrays[name].shape

    def chunks(self, name):
        a = self.arrays[name]
        for r in range(0, a.shape[0], 2):
            self.log.append((name, r, self.store._f.tell()))
            yield a[r:r + 2].reshape(-1)


def test_fused_weight_is_streamed(tmp_path):
    """The concatenation reads its parts one chunk at a time, in order, each written before the next is read."""
    cfg = checkpoint.load_config(synth_checkpoint("tiny", tmp_path / "ck"))
    rng = np.random.default_rng(0)
    parts = {names.layer_name(k, 0): rng.standard_normal((6, 8)).astype(np.float32) for k in ("gate_proj", "up_proj")}
    src = _LoggingSource(dict(parts))
    store = src.store = WeightStore(tmp_path / "w.bin")
    g = GraphBuilder(store)
    net = Network(g, None, NetSpec(cfg, {}, 8), src, {}, onnx.TensorProto.FLOAT)
    name = net.rows("gate_up", 0, list(parts))
    assert name == FUSED["gate_up"].format(i=0)
    s, chunk = store.tensors[name], 2 * 8 * 4
    order = [(n, r) for n in parts for r in (0, 2, 4)]
    assert src.log == [(n, r, s.offset + k * chunk) for k, (n, r) in enumerate(order)]
    assert store.peak_tensor_bytes == chunk
    src.arrays[names.layer_name("q_proj", 1)] = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="differ in shape"):
        net.rows("gate_up", 1, [names.layer_name("gate_proj", 0), names.layer_name("q_proj", 1)])
    store.close()
    got = np.fromfile(tmp_path / "w.bin", "<f4", count=12 * 8, offset=s.offset).reshape(s.shape)
    np.testing.assert_array_equal(got, np.concatenate(list(parts.values())))
