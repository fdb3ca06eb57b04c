"""TensorRT backend (placeholder until the full backend lands): availability check only."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def trt_usable(bundle: Path) -> tuple[bool, str]:
    """(True, "") when the bundle has engine.plan and TensorRT imports; else (False, why not)."""
    if not (bundle / "engine.plan").is_file():
        return False, "the bundle has no engine.plan (build it on the target: python -m builder engine BUNDLE)"
    try:
        import tensorrt  # noqa: F401
    except ImportError as e:
        return False, f"TensorRT is not installed ({e})"
    return True, ""


class TrtBackend:
    def __init__(self, bundle: Path, cfg: dict[str, Any]) -> None:
        ok, why = trt_usable(bundle)
        if not ok:
            raise RuntimeError(f"backend 'tensorrt' unavailable: {why}")
        raise NotImplementedError("TensorRT backend: see runtime/trt_backend.py")
