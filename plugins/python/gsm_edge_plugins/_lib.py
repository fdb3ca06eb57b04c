"""Locating and loading the shared libraries that plugins/CMakeLists.txt installs into this package."""

from __future__ import annotations

import ctypes
import os
from importlib import metadata
from pathlib import Path

REF_LIB = "libgsm_plugins_ref.so"
CUDA_LIB = "libgsm_plugins_cuda.so"
CUDA_EMULATED_LIB = "libgsm_plugins_cuda_emulated.so"  # the same kernels on the HIP CPU Runtime
TRT_LIB = "libgsm_trt_plugins.so"
ORT_OPS_LIB = "libgsm_ort_ops.so"


def _candidates(name: str) -> list[Path]:
    """Where `name` may be: $GSM_EDGE_PLUGINS_DIR, beside this file, or wherever the installed
    distribution recorded it (editable installs keep the package source in the repository while
    CMake's outputs live in site-packages)."""
    out: list[Path] = []
    env = os.environ.get("GSM_EDGE_PLUGINS_DIR")
    if env:
        out.append(Path(env) / name)
    out.append(Path(__file__).resolve().parent / name)
    try:
        files = metadata.files("gsm-edge") or []
    except metadata.PackageNotFoundError:
        files = []
    out += [Path(str(f.locate())) for f in files if f.name == name]
    return out


def find_library(name: str) -> Path | None:
    """Path of an installed plugin library, or None when it was not built."""
    for p in _candidates(name):
        if p.is_file():
            return p
    return None


def load(name: str) -> ctypes.CDLL | None:
    path = find_library(name)
    return ctypes.CDLL(str(path)) if path is not None else None
