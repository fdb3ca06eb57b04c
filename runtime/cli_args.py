"""What `python -m runtime generate` and `python -m runtime serve` share on their command lines: the flags that
choose and tune the backend, and the one-line name of what runs."""

from __future__ import annotations

import argparse
from typing import Any

from gsm.cli_support import int_at_least
from runtime.model import BACKENDS
from runtime.ort_backend import GRAPHS


def add_backend_arguments(p: argparse.ArgumentParser | Any) -> None:
    """--backend, --threads, --spinning, --graph (passed on to runtime.load)."""
    p.add_argument("--backend", choices=list(BACKENDS), default="auto")
    p.add_argument("--threads", type=int_at_least(0), default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--spinning", action="store_true",
                   help="ONNX Runtime's threads busy-wait between operators (faster on a device that runs "
                        "nothing else)")
    p.add_argument("--graph", choices=list(GRAPHS), default="auto",
                   help="onnxruntime backend: cpu = the fused-attention graph (custom op library), portable = "
                        "standard ops only, auto = cpu where its library is built")


def backend_label(backend: Any) -> str:
    """"onnxruntime (graph cpu)", "tensorrt": the backend, and for ONNX Runtime which network it runs (and why
    `auto` fell back to the portable one, if it did)."""
    graph, note = getattr(backend, "graph", None), getattr(backend, "graph_note", "")
    return backend.name + (f" (graph {graph}{'; ' + note if note else ''})" if graph else "")
