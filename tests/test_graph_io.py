"""The graph interface table (gsm/graph_io.py) against what the builder writes and what docs/engine_io.md says.

Independent references: the ONNX files of a built bundle (read by the `onnx` package, not by the code that declares
the ports) and the interface table of docs/engine_io.md section 2. A port the builder stops emitting, a new input
not in the table, a dtype that drifts, or a doc row that names a port the table lacks each fail here.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from gsm import graph_io as io
from gsm.bundle_format import FILES

ROOT = Path(__file__).resolve().parents[1]
GRAPH_FILES = {io.TRT: FILES.model_trt, io.CPU: FILES.model_cpu, io.PORTABLE: FILES.model_portable,
               io.DEMOTE: FILES.demote_trt, io.DEMOTE_PORTABLE: FILES.demote_portable}


def _ports_of_file(path: Path) -> dict[tuple[str, str], tuple[str, int]]:
    """(direction, name template) -> (dtype, rank) of every input and output of an ONNX file, layer indices as {l}."""
    m = onnx.load(str(path), load_external_data=False)
    out = {}
    for direction, values in ((io.IN, m.graph.input), (io.OUT, m.graph.output)):
        for v in values:
            name = re.sub(r"\.\d+$", "." + io.LAYER, v.name)
            dtype = TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower()
            out.setdefault((direction, name), (dtype, len(v.type.tensor_type.shape.dim)))
    return out


@pytest.fixture(scope="module", params=["fp16", "int8"])
def bundle(request, tmp_path_factory):
    """The tiny model's bundle with its probe outputs: FP16 indexer keys, or (INT4 tables and INT8 key scales) INT8
    keys and an INT4 tier, the ports whose dtype or presence could follow the bundle."""
    from conftest import int4_copy

    from builder.build import BuildConfig, build
    from gsm.synth import synth_checkpoint

    root = tmp_path_factory.mktemp("io")
    ckpt = synth_checkpoint("tiny", root / "tiny", seed=3)
    if request.param == "int8":
        ckpt = int4_copy(ckpt, root / "int4")
    build(BuildConfig(device="orin", checkpoint=ckpt, output=root / "bundle", max_seq=64, debug_outputs=True,
                      index_keys=request.param))
    return root / "bundle"


@pytest.mark.parametrize("graph", sorted(GRAPH_FILES))
def test_every_network_carries_exactly_its_ports(bundle, graph):
    path = bundle / GRAPH_FILES[graph]
    if not path.is_file():
        pytest.skip(f"{path.name} not built here")
    found = _ports_of_file(path)
    declared = {(p.direction, p.name): p for p in io.ports_of(graph)}
    assert set(found) == set(declared), (f"{path.name}: not in the table {sorted(set(found) - set(declared))}, "
                                         f"declared but absent {sorted(set(declared) - set(found))}")
    for key, (dtype, rank) in found.items():
        port = declared[key]
        assert dtype in port.dtype.split("|"), f"{path.name} {key[1]}: {dtype}, the table says {port.dtype}"
        assert rank == len(port.shape), f"{path.name} {key[1]}: rank {rank}, the table says {port.shape}"


def test_engine_io_doc_names_the_table():
    """Every row of docs/engine_io.md section 2's table is a port of the plugin graph with the same direction and
    dtype, and every plugin-graph port has a row."""
    text = (ROOT / "docs" / "engine_io.md").read_text()
    section = text.split("## 2.")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([a-z_{}.]+)` \| (in|out) \| ([^|]+?) \|", section, re.M)
    assert rows, "no interface table found in docs/engine_io.md section 2"
    doc = {name: (direction, dtype) for name, direction, dtype in rows}
    trt = {p.name: p for p in io.PORTS if io.TRT in p.graphs or p is io.QUERY_MASS}
    assert set(doc) == set(trt), f"doc only {sorted(set(doc) - set(trt))}, table only {sorted(set(trt) - set(doc))}"
    for name, (direction, dtype) in doc.items():
        assert direction == trt[name].direction, name
        if dtype.startswith("as "):  # an aliased output: "as `kv_pool.{l}`"
            continue
        words = {"float32": "float"}
        doc_types = {words.get(w.strip(), w.strip()) for w in re.split(r",|\bor\b", dtype) if w.strip()}
        assert doc_types <= set(trt[name].dtype.split("|")), f"{name}: doc {doc_types}, table {trt[name].dtype}"


def test_builder_writes_the_plugin_version_the_plugins_register():
    """An engine or graph of another node form must fail to find its creator: the version the builder stamps on every
    GSM node is the one plugins/common/gsmPluginCommon.h registers."""
    from builder.graph_trt import PLUGIN_VERSION

    header = (ROOT / "plugins" / "common" / "gsmPluginCommon.h").read_text()
    registered = re.search(r'kPluginVersion = "([^"]+)"', header)
    assert registered and registered.group(1) == PLUGIN_VERSION
