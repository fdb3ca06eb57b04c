"""The runtime on the lowest versions pyproject.toml admits: a virtual environment holding exactly the declared floors
of the runtime's dependencies (and of onnx, which the reference backend needs) runs a bundle on every CPU network and
gives the greedy tokens this environment gives.

Why: a floor nobody runs is a guess. Triton's Python-backend environments pin numpy < 2 (scripts/install_triton.sh),
JetPack 6 ships ONNX Runtime 1.17, and numpy 1.x differs where it matters here (ONNX's reference GatherElements calls
np.choose, which takes at most 32 choices on numpy 1.x and 64 on 2.x). The reference here is this environment's own
run of the same bundle: newer versions of the same libraries, an independent build of every dependency.

The floors' venv is made once per set of floors under ~/.cache/gsm-edge (pip from the package index, ~1 min) and the
package is imported from this checkout (PYTHONPATH) with this install's plugin libraries (GSM_EDGE_PLUGINS_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gsm-edge"
EXTRA_FOR_REFERENCE = "builder"  # onnx: the reference backend's evaluator
# one prefill call of more than 32 tokens: numpy 1.x's np.choose takes at most 32 choices (the head's row gather)
PROMPT_IDS = [1, 5, 9, 14, 3, 22, 7, 30, 11, 2, 17, 4] * 4
NEW_TOKENS = 40  # past the demo bundle's re-tier period and FP16 window, so demoted rows are read

RUN = r'''
import json, sys
import numpy, onnxruntime
import runtime
out = {"numpy": numpy.__version__, "onnxruntime": onnxruntime.__version__}
for backend, graph in (("onnxruntime", "cpu"), ("onnxruntime", "portable"), ("reference", "auto")):
    rt = runtime.load(sys.argv[1], backend, threads=1, graph=graph)
    out[f"{backend}/{graph}"] = rt.generate([int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])).ids
print(json.dumps(out))
'''


def floors() -> list[str]:
    """`name==version` of every runtime dependency and of onnx, at the lowest version pyproject.toml admits."""
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*meta["dependencies"], *(r for r in meta["optional-dependencies"][EXTRA_FOR_REFERENCE]
                                     if r.startswith("onnx"))]
    pins = []
    for r in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", r.replace(" ", ""))
        assert m, f"pyproject.toml: {r!r} states no floor (>=)"
        pins.append(f"{m.group(1)}=={m.group(2)}")
    return sorted(pins)


def floors_python(pins: list[str]) -> Path:
    key = hashlib.sha256(" ".join([sys.version.split()[0], *pins]).encode()).hexdigest()[:12]
    env = CACHE / f"floors-{key}"
    python = env / "bin" / "python"
    if not (env / "ok").is_file():
        venv.create(env, with_pip=True, clear=True)
        r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *pins], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"the floors {pins} could not be installed here: {r.stderr.strip()[-300:]}")
        (env / "ok").write_text(" ".join(pins))
    return python


def _run(python: str, bundle: Path, env: dict[str, str]) -> dict:
    r = subprocess.run([python, "-c", RUN, str(bundle), ",".join(map(str, PROMPT_IDS)), str(NEW_TOKENS)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from conftest import retiering_copy

    from builder.build import BuildConfig, build
    from gsm.synth import synth_checkpoint

    root = tmp_path_factory.mktemp("floors")
    ckpt = retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=3), root / "retier")
    build(BuildConfig(device="orin", checkpoint=ckpt, output=root / "bundle", max_seq=128))
    return root / "bundle"


def test_floors_are_declared_for_every_runtime_dependency():
    names = {p.split("==")[0].lower() for p in floors()}
    assert names == {"numpy", "onnxruntime", "tokenizers", "jinja2", "jsonpatch", "onnx"}


def test_runtime_on_the_declared_floors_gives_this_environments_tokens(bundle):
    from gsm_edge_plugins import ort_ops_library
    from gsm_edge_plugins._lib import REF_LIB, find_library

    ref_lib, ort_lib = find_library(REF_LIB), ort_ops_library()
    if ref_lib is None or ort_lib is None or ref_lib.parent != ort_lib.parent:
        pytest.skip("the plugin libraries are not built here (or not in one folder)")
    pins = floors()
    python = floors_python(pins)
    libs = ref_lib.parent
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    here = _run(sys.executable, bundle, base)
    there = _run(str(python), bundle, {**base, "GSM_EDGE_PLUGINS_DIR": str(libs),
                                       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "python")])})
    assert there["numpy"] == dict(p.split("==") for p in pins)["numpy"]
    assert there["onnxruntime"].startswith(dict(p.split("==") for p in pins)["onnxruntime"])
    for key in ("onnxruntime/cpu", "onnxruntime/portable", "reference/auto"):
        assert len(here[key]) == NEW_TOKENS
        assert there[key] == here[key], f"{key}: the floors' tokens differ from this environment's"
