"""The TensorRT step: model.onnx (GSM plugin nodes) -> engine.plan, on a machine that has TensorRT + a GPU.

Written against the TensorRT 10 Python API and never faked: where `import tensorrt` fails or no
GPU is visible, `tensorrt_status` says why and the build records that the engine is to be built on
the target (`python -m builder engine BUNDLE`). Steps: load the GSM plugin library (its IPluginV3
creators register themselves), parse model.onnx into a *strongly typed* network (TensorRT 11 drops
weak typing; the graph's types are explicit), two optimisation profiles (prefill/chunk: S in
1..max_input; decode: S = 1), workspace limit from the plan, a timing cache persisted per GPU
architecture, then serialize.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path
from typing import Any

from builder.bundle import BUNDLE_FILE, ENGINE_FILE, add_file_to_bundle, read_bundle_manifest
from builder.graphs import MODEL_TRT
from builder.plan import WORKSPACE_BYTES, MemoryPlan

PLUGIN_LIB_ENV = "GSM_PLUGIN_LIB"
PLUGIN_LIB_NAMES = ("libgsm_plugins.so", "gsm_plugins.dll")
TIMING_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gsm-edge"


class EngineUnavailable(RuntimeError):
    """TensorRT, a GPU or the plugin library is missing: the engine must be built elsewhere."""


def tensorrt_status() -> tuple[bool, str]:
    """(True, version) when TensorRT imports and a CUDA GPU is visible, else (False, why not)."""
    try:
        import tensorrt as trt
    except ImportError as e:
        return False, f"TensorRT is not installed here (import tensorrt: {e})"
    if shutil.which("nvidia-smi") is None and not Path("/etc/nv_tegra_release").exists():
        return False, f"TensorRT {trt.__version__} is installed but no NVIDIA GPU is visible"
    return True, f"TensorRT {trt.__version__}"


def find_plugin_library() -> Path:
    env = os.environ.get(PLUGIN_LIB_ENV)
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parents[1]
    for d in (here / "gsm_edge_plugins", here / "build" / "plugins", here / "build"):
        candidates += [d / n for n in PLUGIN_LIB_NAMES]
    for c in candidates:
        if c.is_file():
            return c
    raise EngineUnavailable(f"GSM plugin library not found (set {PLUGIN_LIB_ENV}, or build plugins/: "
                            f"looked at {', '.join(str(c) for c in candidates)})")


def _input_shapes(runtime_cfg: dict[str, Any], s: tuple[int, int, int], b: tuple[int, int, int]) -> dict[str, Any]:
    """min/opt/max shapes of the dynamic inputs for one optimisation profile."""
    shapes: dict[str, Any] = {"input_ids": [(bb, ss) for bb, ss in zip(b, s)],
                              "past_lengths": [(bb,) for bb in b], "new_lengths": [(bb,) for bb in b],
                              "sparse_window": [(1,)] * 3, "kv_slots": [(bb, runtime_cfg["n_max"]) for bb in b]}
    return shapes


def build_engine(bundle_dir: Path, plan: MemoryPlan, profile: Any, out_path: Path) -> dict[str, Any]:
    """Build and serialize the engine to out_path; returns the manifest's `engine` record."""
    ok, why = tensorrt_status()
    if not ok:
        raise EngineUnavailable(why)
    import tensorrt as trt

    lib = find_plugin_library()
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # registers the GSM IPluginV3 creators
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(bundle_dir / MODEL_TRT)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {MODEL_TRT}: {errs}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    rcfg = json.loads((bundle_dir / BUNDLE_FILE).read_text())
    B, T = rcfg["max_batch"], rcfg["max_input"]
    for s_range in ((1, max(1, T // 2), T), (1, 1, 1)):  # prefill / chunk, then decode
        prof = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            t = network.get_input(i)
            shapes = _input_shapes(rcfg, s_range, (1, B, B)).get(t.name)
            if shapes is None:  # caches: static except the batch
                dims = list(t.shape)
                shapes = [tuple([bb] + dims[1:]) for bb in (1, B, B)]
            prof.set_shape(t.name, *shapes)
        config.add_optimization_profile(prof)
    TIMING_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cache_file = TIMING_CACHE_DIR / f"timing-sm{profile.sm.replace('.', '')}-trt{trt.__version__}.cache"
    cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see the log above)")
    out_path.write_bytes(bytes(serialized))
    cache_file.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"status": "built", "file": ENGINE_FILE, "tensorrt": trt.__version__, "plugin_library": lib.name,
            "timing_cache": str(cache_file), "profiles": ["prefill", "decode"]}


def engine_command(bundle: Path) -> dict[str, Any]:
    """`python -m builder engine BUNDLE`: build engine.plan into an existing bundle on the target."""
    from runtime.bundle import verify_bundle

    from jetson import get_profile

    verify_bundle(bundle)
    manifest = read_bundle_manifest(bundle)
    profile = get_profile(manifest["device"]["name"])
    plan_json = json.loads((bundle / "plan.json").read_text())
    plan = _plan_from_json(plan_json)
    tmp = bundle.parent / f".{bundle.name}.{ENGINE_FILE}.tmp"
    try:
        record = build_engine(bundle, plan, profile, tmp)
        add_file_to_bundle(bundle, tmp, ENGINE_FILE, {"engine": record})
    finally:
        tmp.unlink(missing_ok=True)
    return record


def _plan_from_json(d: dict[str, Any]) -> MemoryPlan:
    from builder.plan import PoolRows

    fields = {k: v for k, v in d.items() if k in MemoryPlan.__dataclass_fields__}
    fields["pool_rows"] = PoolRows(**d["pool_rows"])
    return MemoryPlan(**fields)
