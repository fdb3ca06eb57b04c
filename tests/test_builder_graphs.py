"""Structure of the two network variants (docs/engine_io.md): same interface, one GSM plugin node per
portable subgraph, standard ops only in the portable graph, one shared weight file."""

from __future__ import annotations

import onnx
import pytest

from builder.build import BuildConfig, build
from builder.graph_trt import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION
from gsm import checkpoint
from gsm.synth import synth_checkpoint

N_MAX = 64


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("g")
    ck = synth_checkpoint("tiny", root / "tiny")
    out = root / "bundle"
    build(BuildConfig(device="orin", checkpoint=ck, output=out, max_seq=N_MAX))
    return out, checkpoint.load_config(ck)


def load(path):
    return onnx.load(str(path), load_external_data=False)


def io(values):
    return {v.name: (v.type.tensor_type.elem_type,
                     [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values}


def cache_map(cfg, *, read=False):
    """TensorRT-variant cache tensor -> the portable tensors that stand for it (engine_io section 5).

    The portable graph returns only the new rows, so the pool *after* the update (`kv_pool_out.{l}`,
    `index_keys_out.{l}`) is, where a node reads it (`read`), the cache input plus the new rows."""
    m = {"kv_slots": {"cache_rows"}}
    # the portable graph also caches the K rows every layer makes from a pool's latents (its own
    # for an owning layer, the source's for a sharing one); the plugins rebuild them from the pool. The new
    # K rows are made by the reading layer's attention subgraph (see NEW_K_ROWS)
    readers = {l: {l} | {i for i, s in cfg.gsm.kv_sharing.items() if s == l} for l in cfg.owning_layers}
    for l in cfg.owning_layers:
        m[f"kv_pool.{l}"] = {f"latent_k.{l}", f"latent_v.{l}"} | {f"k_rows.{i}" for i in readers[l]}
        m[f"kv_pool_out.{l}"] = {f"new_latent_k.{l}", f"new_latent_v.{l}"}
        m[f"index_keys_out.{l}"] = {f"new_index_keys.{l}"}
        if read:
            m[f"kv_pool_out.{l}"] |= m[f"kv_pool.{l}"]
            m[f"index_keys_out.{l}"] |= {f"index_keys.{l}"}
    return m


def test_same_interface(bundle):
    out, cfg = bundle
    trt, port = load(out / "model.onnx"), load(out / "model.portable.onnx")
    ti, pi = io(trt.graph.input), io(port.graph.input)
    to, po = io(trt.graph.output), io(port.graph.output)
    cmap = cache_map(cfg)
    for name in ("input_ids", "past_lengths", "new_lengths", "sparse_window", "sparse_top_k", "cache_rows",
                 "logit_rows"):
        assert ti[name] == pi[name]
    assert to["logits"] == po["logits"]
    # attention mass: the TensorRT engine covers N_max positions, the portable graph L = max(past) + S
    assert to["attn_mass"] == (onnx.TensorProto.FLOAT, ["B", N_MAX]) and po["attn_mass"] == (onnx.TensorProto.FLOAT,
                                                                                            ["B", "L"])
    dI = cfg.gsm.indexer_dim
    assert pi["cache_rows"] == (onnx.TensorProto.INT32, ["B"])
    for l in cfg.owning_layers:
        assert ti[f"index_keys.{l}"] == (onnx.TensorProto.FLOAT16, ["R", N_MAX, dI])  # every cache row
        assert ti[f"kv_pool.{l}"][1][0] == to[f"kv_pool_out.{l}"][1][0] == "R"
        assert pi[f"index_keys.{l}"] == (onnx.TensorProto.FLOAT16, ["R", N_MAX, dI])  # one row per live sequence
        assert po[f"new_index_keys.{l}"] == (onnx.TensorProto.FLOAT16, ["B", "S", dI])  # the new rows only
        for kind in ("k", "v"):
            assert pi[f"latent_{kind}.{l}"][1][:2] == ["R", N_MAX]
            assert po[f"new_latent_{kind}.{l}"][1][:2] == ["B", "S"]
    mapped_in = set().union(*(cmap.get(n, {n}) for n in ti))
    mapped_out = set().union(*(cmap.get(n, {n}) for n in to))
    mapped_out |= {f"new_k_rows.{i}" for i in range(cfg.num_hidden_layers)}
    # each logit row's own attention mass (speculative verification), over N_max positions as attn_mass
    assert po["query_mass"] == (onnx.TensorProto.FLOAT, ["B", "J", "L"])
    assert to["query_mass"] == (onnx.TensorProto.FLOAT, ["B", "J", N_MAX])
    for i in range(cfg.num_hidden_layers):  # every layer's K rows, cached and new
        assert pi[f"k_rows.{i}"] == (onnx.TensorProto.FLOAT, ["R", N_MAX, cfg.kv_dim])
        assert po[f"new_k_rows.{i}"] == (onnx.TensorProto.FLOAT, ["B", "S", cfg.kv_dim])
    assert mapped_in == set(pi) and mapped_out == set(po)


def _subgraph(nodes, prefix):
    sub = [n for n in nodes if n.name.startswith(prefix + "/")]
    produced = {o for n in sub for o in n.output}
    consumed = {i for n in sub for i in n.input if i}
    return sub, consumed - produced, produced


def test_every_gsm_node_is_one_portable_subgraph(bundle):
    out, cfg = bundle
    trt, port = load(out / "model.onnx"), load(out / "model.portable.onnx")
    cmap, read_map = cache_map(cfg), cache_map(cfg, read=True)
    inits = {i.name for i in port.graph.initializer}
    gsm_nodes = [n for n in trt.graph.node if n.domain == DOMAIN]
    expected = 2 * len(cfg.owning_layers) + len(cfg.sharing_layers)
    assert len(gsm_nodes) == expected
    consumers_outside: dict[str, set[str]] = {}
    for n in port.graph.node:
        for i in n.input:
            consumers_outside.setdefault(i, set()).add(n.name.split("/")[0])
    graph_outputs = {o.name for o in port.graph.output}
    # per-call geometry shared by every layer (scope `call`): functions of the input shape, the past /
    # new lengths, cache_rows, the window and the per-sequence budget only, which every GSM node
    # reads (q's shape gives B, S)
    call = {o for n in port.graph.node if n.name.startswith("call/") for o in n.output}
    call_in = {i for n in port.graph.node if n.name.startswith("call/") for i in n.input} - call
    assert call_in - inits - {"rope_cos", "rope_sin"} <= {"input_ids", "past_lengths", "new_lengths", "cache_rows",
                                                          "sparse_window", "sparse_top_k", "gsm.rope_cos",
                                                          "gsm.rope_sin"}
    for node in gsm_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_version"] == PLUGIN_VERSION.encode()
        assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
        scope = node.name.split("/")[0]
        assert scope.endswith("." + node.op_type)
        sub, ext_in, produced = _subgraph(port.graph.node, scope)
        assert sub, f"no portable subgraph for {node.name}"
        assert all(n.domain in ("", "ai.onnx") for n in sub)
        # inputs: everything the subgraph reads from outside is an input of the plugin node (mapped)
        node_in = set().union(*(read_map.get(i, {i}) for i in node.input))
        assert ext_in - inits - call <= node_in, f"{scope} reads {sorted(ext_in - inits - call - node_in)}"
        # outputs: the subgraph produces every node output (mapped), and nothing else leaves it
        # (an owning layer's `selected` is only read when a sharing layer uses that source)
        leaving = {t for t in produced if t in graph_outputs or consumers_outside.get(t, set()) - {scope}}
        node_out = set().union(*(cmap.get(o, {o}) for o in node.output))
        if node.op_type == "GsmSparseAttention":  # its layer's new K rows, an output of the portable graph
            node_out.add("new_k_rows." + scope.split(".")[0][1:])
        assert leaving <= node_out <= produced, f"{scope}: leaving {sorted(leaving)}, node outputs {sorted(node_out)}"
        # connected: a single weakly connected component through its internal tensors (the update
        # only rounds the three kinds of new row, one independent chain each, the runtime writes them)
        if node.op_type != "GsmKVCacheUpdate":
            assert _connected(sub), f"{scope} is not one connected subgraph"
        else:
            # (the FP16 round trip of each latent is two Casts, the keys' one; the last Cast names the output)
            assert len(sub) == 5 and all(n.op_type == "Cast" for n in sub)


def _connected(nodes):
    prod = {o: i for i, n in enumerate(nodes) for o in n.output}
    adj = {i: set() for i in range(len(nodes))}
    for i, n in enumerate(nodes):
        for t in n.input:
            if t in prod:
                adj[i].add(prod[t])
                adj[prod[t]].add(i)
    seen, todo = {0}, [0]
    while todo:
        for j in adj[todo.pop()] - seen:
            seen.add(j)
            todo.append(j)
    return len(seen) == len(nodes)


def test_standard_ops_only_and_shared_weights(bundle):
    out, _ = bundle
    graphs = {f: load(out / f) for f in ("model.onnx", "model.portable.onnx", "gsm_demote.onnx",
                                          "gsm_demote.portable.onnx")}
    for f in ("model.portable.onnx", "gsm_demote.portable.onnx"):
        assert {n.domain for n in graphs[f].graph.node} <= {""}, f
        onnx.checker.check_model(str(out / f))
    for f in ("model.onnx", "gsm_demote.onnx"):
        assert {n.domain for n in graphs[f].graph.node} <= {"", DOMAIN}
    refs: dict[str, tuple] = {}
    for m in graphs.values():
        for t in m.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in t.external_data}
                assert ext["location"] == "weights.bin"
                key = (ext["offset"], ext["length"])
                assert refs.setdefault(t.name, key) == key, f"{t.name} stored twice"
    def stored(m):
        return {t.name for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}

    port, trt = stored(graphs["model.portable.onnx"]), stored(graphs["model.onnx"])
    assert port <= trt  # every stored weight the portable graph reads, the TensorRT one reads too
    assert trt - port == {n for n in trt if n.startswith("gsm.layers.")}  # + quant tables (plugin nodes only)
