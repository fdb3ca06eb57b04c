"""gsm_edge_plugins: Python side of the C++/CUDA plugins in plugins/ (docs/engine_io.md).

- `gsm_edge_plugins.ref`: NumPy bindings of the C++ CPU reference (always built by `pip install .`).
- `gsm_edge_plugins.cuda`: torch.cuda bindings of the CUDA kernels (built when nvcc was found;
  usable on a machine with a GPU).
- `trt_plugin_library()`: path of libgsm_trt_plugins.so for TensorRT (built when TensorRT was found).
- `ort_ops_library()`: path of libgsm_ort_ops.so, ONNX Runtime CPU custom ops (domain "ai.gsm_edge.cpu"; built
  when the ONNX Runtime C API header was found).
"""

from __future__ import annotations

from pathlib import Path

from gsm_edge_plugins._lib import CUDA_LIB, ORT_OPS_LIB, REF_LIB, TRT_LIB, find_library

__all__ = ["reference_available", "cuda_library", "trt_plugin_library", "ort_ops_library", "ORT_OPS_LIB",
           "PLUGIN_NAMESPACE", "PLUGIN_VERSION",
           "ONNX_DOMAIN"]

# Names shared with the ONNX nodes and the TensorRT creators (docs/engine_io.md section 4).
ONNX_DOMAIN = "gsm.plugins"
PLUGIN_NAMESPACE = "gsm"
PLUGIN_VERSION = "1"


def reference_available() -> bool:
    """True when the CPU reference library was built and installed."""
    return find_library(REF_LIB) is not None


def cuda_library() -> Path | None:
    """libgsm_plugins_cuda.so, or None when nvcc was not found at build time."""
    return find_library(CUDA_LIB)


def trt_plugin_library() -> Path | None:
    """libgsm_trt_plugins.so to load into TensorRT's plugin registry, or None when not built."""
    return find_library(TRT_LIB)


def ort_ops_library() -> Path | None:
    """libgsm_ort_ops.so for `SessionOptions.register_custom_ops_library`, or None when not built."""
    return find_library(ORT_OPS_LIB)
