"""Mutations of a built bundle that `runtime verify` must catch (tests/test_runtime_verify.py, docs/verify.md): each
changes what a backend computes and re-stamps the bundle's manifest, as a builder bug or a bad engine would leave a
bundle that passes its integrity check. Each works on a copy the caller made."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gsm import names
from gsm.atomic import MANIFEST_NAME, sha256_file
from gsm.bundle_format import FILES


def restamp(bundle: Path, name: str) -> None:
    """The manifest's hash of `name` made the file's own again."""
    path = bundle / MANIFEST_NAME
    m = json.loads(path.read_text())
    m["files"][name] = "sha256:" + sha256_file(bundle / name)
    path.write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def sparsest_layer(bundle: Path) -> int:
    """The owning layer with the smallest selection (window + top-k: the one whose attention the probe's length makes
    sparsest), among those no sharing layer reads (whose selection width no other node assumes)."""
    cfg = json.loads((bundle / FILES.config).read_text())
    sources = set(json.loads((bundle / "config.json").read_text())["gsm_config"]["kv_sharing"].values())
    own = {int(l): e for l, e in cfg["layer_selection"].items()}
    budget = {l: sum(own.get(l, (cfg["sparse_window"], cfg["sparse_top_k"]))[:2]) for l in cfg["owning_layers"]}
    free = [l for l in cfg["owning_layers"] if l not in sources] or cfg["owning_layers"]
    return int(min(free, key=lambda l: (budget[l], l)))


def perturb_weight(bundle: Path, factor: float = 1.05) -> str:
    """One float32 weight every graph reads (the post-attention norm of sparsest_layer, in weights.bin) scaled by
    `factor`; returns its name."""
    import onnx

    name = names.COMMON["post_norm"].format(i=sparsest_layer(bundle))
    model = onnx.load(str(bundle / FILES.model_portable), load_external_data=False)
    init = next(t for t in model.graph.initializer if t.name == name)
    where = {e.key: e.value for e in init.external_data}
    offset, length = int(where["offset"]), int(where["length"])
    with open(bundle / FILES.weights, "r+b") as f:
        f.seek(offset)
        w = np.frombuffer(f.read(length), np.float32) * np.float32(factor)
        f.seek(offset)
        f.write(w.astype(np.float32).tobytes())
    restamp(bundle, FILES.weights)
    return name


def wrong_attribute(bundle: Path, graph: str, attribute: str = "sink_tokens", value: int = 0) -> str:
    """sparsest_layer's attention node of `graph` (a bundle file name: model.cpu.onnx or model.onnx) given
    `attribute` = `value`; returns the node's name."""
    import onnx
    from onnx import helper

    path = bundle / graph
    model = onnx.load(str(path), load_external_data=False)
    owning = json.loads((bundle / FILES.config).read_text())["owning_layers"]

    def owning_attention(n: onnx.NodeProto) -> bool:  # in layer order, one per owning layer
        kind = {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("layer_kind", 0)
        return n.op_type in ("GsmPoolAttention", "GsmSparseAttention") and kind == 0

    node = [n for n in model.graph.node if owning_attention(n)][owning.index(sparsest_layer(bundle))]
    for a in node.attribute:
        if a.name == attribute:
            a.CopyFrom(helper.make_attribute(attribute, value))
    onnx.save(model, str(path))
    restamp(bundle, graph)
    return node.name
