"""The runtime-only install is minimal: numpy, onnxruntime, tokenizers, jinja2, jsonpatch and nothing the
builder or converter need, and the runtime really runs with only those importable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DEPS = {"numpy", "onnxruntime", "tokenizers", "jinja2", "jsonpatch"}
# What the builder, the converter and the tests bring; a device may have none of it.
NOT_ON_A_DEVICE = ("torch", "onnx", "rich", "safetensors", "transformers", "sentencepiece", "gguf", "google.protobuf",
                   "scipy", "fastapi", "starlette", "uvicorn", "prometheus_client")


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def test_base_install_is_the_runtime_and_nothing_else():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in meta["dependencies"]}
    assert base == RUNTIME_DEPS
    extras = meta["optional-dependencies"]
    builder = {_name(r) for r in extras["builder"]}
    assert {"onnx", "safetensors", "rich"} <= builder
    assert "torch" in {_name(r) for r in extras["convert"]} and "gsm-edge[builder]" in extras["convert"]


BLOCKER = r'''
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or any(name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is not installed on this device (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
sys.argv = ["python -m runtime", *sys.argv[2:]]
from runtime.__main__ import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("LEAKED", leaked, file=sys.stderr)
sys.exit(code if not leaked else 99)
'''


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory) -> Path:
    from builder.build import BuildConfig, build

    out = tmp_path_factory.mktemp("b") / "demo"
    build(BuildConfig(device="orin", output=out, max_seq=64))
    return out


def test_runtime_generates_with_only_its_dependencies(demo_bundle, tmp_path):
    blocked = ",".join(NOT_ON_A_DEVICE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", BLOCKER, blocked, "generate", str(demo_bundle), "--prompt",
                        "Once upon a time", "--max-new-tokens", "8", "--threads", "1"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "LEAKED []" in r.stderr and "8 tokens" in r.stderr
    assert r.stdout.startswith("Once upon a time") and len(r.stdout.strip()) > len("Once upon a time")


def test_the_blocker_bites(demo_bundle, tmp_path):
    """The same harness fails when a blocked module is one the runtime needs (so the test above can fail)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", BLOCKER, "onnxruntime", "generate", str(demo_bundle), "--prompt",
                        "x", "--max-new-tokens", "2"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 1 and "onnxruntime" in r.stderr and "Traceback" not in r.stderr
