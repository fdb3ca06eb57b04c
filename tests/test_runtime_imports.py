"""The runtime package's module-level imports form no cycle, and each module imports on its own.

The graph is read from the source (ast): the statements at module level, which run when a module loads,
and, for the typing graph, those in module-level `if TYPE_CHECKING:` blocks too (two modules naming each
other's types are still one knot). A function-level import runs later, when every module it needs is
complete, so it cannot make a load order fail; it is not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "runtime"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def module_imports(path: Path, *, typing: bool = False) -> set[str]:
    """The runtime modules `path` imports at load: `from runtime.x import y` (runtime.x.y when that is a
    module) and `import runtime.x`, at the top level of the file (typing: and in `if TYPE_CHECKING:`)."""
    out = set()
    body = ast.parse(path.read_text(), str(path)).body
    for node in [n for top in body for n in (top.body if typing and is_type_checking(top) else [top])]:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "runtime" or node.module.startswith("runtime.")):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            out.update(subs or [node.module])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("runtime."))
    return out & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path (first node repeated at the end), or None."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        colour[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if colour.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in colour and (c := visit(m)):
                return c
        path.pop()
        colour[n] = 2
        return None

    for n in sorted(graph):
        if n not in colour and (c := visit(n)):
            return c
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("typing", [False, True], ids=["load", "typing"])
def test_runtime_modules_import_no_cycle(typing):
    graph = {m: module_imports(p, typing=typing) for m, p in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
    # requests are built on the Runtime, not the other way round; the request state needs neither
    for below in ("runtime.facade", "runtime.step_worker", "runtime.sequence", "runtime.loader"):
        assert "runtime.request" not in module_imports(MODULES[below]), below
    assert not {"runtime.facade", "runtime.request", "runtime.engine"} & graph["runtime.request_state"]


@pytest.mark.parametrize("module", ["runtime.loader", "runtime.facade", "runtime.step_worker", "runtime.sequence",
                                    "runtime.scheduled_sequence", "runtime.request", "runtime.request_state",
                                    "runtime.engine"])
def test_module_imports_in_a_fresh_interpreter(module):
    """Imported first (the order a cycle would break on), not after the package has loaded everything."""
    r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
