"""The TensorRT step: model.onnx (GSM plugin nodes) -> engine.plan, on a machine that has TensorRT + a GPU.

Written against the TensorRT 10 Python API and never faked: where `import tensorrt` fails or no
GPU is visible, `tensorrt_status` says why and the build records that the engine is to be built on
the target (`python -m builder engine BUNDLE`). Steps: load the GSM plugin library (its IPluginV3
creators register themselves), parse model.onnx into a *strongly typed* network (TensorRT 11 drops
weak typing; the graph's types are explicit), two optimisation profiles (prefill/chunk: S in
1..max_input; decode: S = 1), workspace limit from the plan, a timing cache persisted per GPU
architecture, then serialize. `builder engine` then runs the bundle's golden probe through the new engine
(runtime.verify, the check `runtime verify` makes) before installing it: TensorRT builds our plugins for the first
time on the target, where no golden model can run (docs/verify.md).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.bundle import add_file_to_bundle, read_bundle_manifest, write_json
from builder.plan import WORKSPACE_BYTES, MemoryPlan
from gsm import graph_io as io
from gsm.bundle_format import FILES, VERIFY_ROWS, BundleConfig
from gsm.probe_format import read_probe

PLUGIN_LIB_ENV = "GSM_PLUGIN_LIB"
PLUGIN_LIB_NAMES = ("libgsm_trt_plugins.so", "gsm_trt_plugins.dll")
TENSORRT = "tensorrt"  # the backend name the verdict is recorded under (runtime.loader BACKENDS)
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
    """GSM_PLUGIN_LIB, else the library the plugins package installed (gsm_edge_plugins), else a build dir."""
    env = os.environ.get(PLUGIN_LIB_ENV)
    candidates = [Path(env)] if env else []
    try:
        from gsm_edge_plugins import trt_plugin_library

        lib = trt_plugin_library()
        if lib is not None:
            candidates.append(Path(lib))
    except ImportError:
        pass
    here = Path(__file__).resolve().parents[1]
    for d in (here / "gsm_edge_plugins", here / "build" / "plugins", here / "build"):
        candidates += [d / n for n in PLUGIN_LIB_NAMES]
    for c in candidates:
        if c.is_file():
            return c
    raise EngineUnavailable(f"GSM plugin library not found (set {PLUGIN_LIB_ENV}, or build plugins/: "
                            f"looked at {', '.join(str(c) for c in candidates)})")


def _input_shapes(cfg: BundleConfig, s: tuple[int, int, int], b: tuple[int, int, int]) -> dict[str, Any]:
    """min/opt/max shapes of the dynamic inputs for one optimisation profile."""
    per_sequence = [(bb,) for bb in b]
    shapes: dict[str, Any] = {io.INPUT_IDS.name: [(bb, ss) for bb, ss in zip(b, s)],
                              io.PAST_LENGTHS.name: per_sequence, io.NEW_LENGTHS.name: per_sequence,
                              io.SPARSE_TOP_K.name: per_sequence, io.CACHE_ROWS.name: per_sequence,
                              io.SPARSE_WINDOW.name: [(1,)] * 3, io.KV_SLOTS.name: [(bb, cfg.n_max) for bb in b],
                              # a prefill's one row, a verification's up to VERIFY_ROWS (speculative decoding)
                              io.LOGIT_ROWS.name: [(bb, j) for bb, j in zip(b, (1, 1, min(VERIFY_ROWS, max(s))))]}
    return shapes


def _parse(trt: Any, builder: Any, logger: Any, path: Path) -> Any:
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {path.name}: {errs}")
    return network, parser


def _serialize(trt: Any, builder: Any, network: Any, config: Any, out: Path) -> None:
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {out.name} (see the log above)")
    out.write_bytes(bytes(serialized))


def build_engine(bundle_dir: Path, plan: MemoryPlan, profile: Any, out_path: Path,
                 demote_out: Path | None = None) -> dict[str, Any]:
    """Build and serialize engine.plan (and demote.plan beside it); returns the manifest's `engine` record."""
    ok, why = tensorrt_status()
    if not ok:
        raise EngineUnavailable(why)
    import tensorrt as trt

    lib = find_plugin_library()
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # registers the GSM IPluginV3 creators
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    rcfg = BundleConfig.load(bundle_dir)
    B, T, N = rcfg.max_batch, rcfg.max_input, rcfg.n_max
    TIMING_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cache_file = TIMING_CACHE_DIR / f"timing-sm{profile.sm.replace('.', '')}-trt{trt.__version__}.cache"
    timing = None

    def config_for() -> Any:
        nonlocal timing
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        if timing is None:
            timing = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
        config.set_timing_cache(timing, ignore_mismatch=False)
        return config

    network, _parser = _parse(trt, builder, logger, bundle_dir / FILES.model_trt)
    config = config_for()
    for s_range in ((1, max(1, T // 2), T), (1, 1, 1)):  # profile 0: prefill / chunk; 1: decode
        prof = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            t = network.get_input(i)
            shapes = _input_shapes(rcfg, s_range, (1, B, B)).get(t.name)
            if shapes is None:  # the pools: every cache row, always bound whole ([R, ...], R = max_batch)
                shapes = [tuple([B] + list(t.shape)[1:])] * 3
            prof.set_shape(t.name, *shapes)
        config.add_optimization_profile(prof)
    _serialize(trt, builder, network, config, out_path)

    demote_out = demote_out or out_path.with_name(FILES.demote_engine)
    network, _parser = _parse(trt, builder, logger, bundle_dir / FILES.demote_trt)
    config = config_for()
    prof = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.name == io.DEMOTE_LIST.name:
            prof.set_shape(t.name, (1, 3), (max(1, N // 4), 3), (B * N, 3))
        else:  # the pools, whole: demote_list entries name their rows
            prof.set_shape(t.name, *[tuple([B] + list(t.shape)[1:])] * 3)
    config.add_optimization_profile(prof)
    _serialize(trt, builder, network, config, demote_out)
    cache_file.write_bytes(bytes(timing.serialize()))
    return {"status": "built", "file": FILES.engine, "demote_file": FILES.demote_engine, "tensorrt": trt.__version__,
            "plugin_library": lib.name, "plugin_library_path": str(lib), "timing_cache": str(cache_file),
            "profiles": ["prefill", "decode"]}


FAILED_SUFFIX = ".failed-engine"  # beside the bundle: where an engine that fails the golden check is kept
VERDICT_FILE = "verdict.json"


@dataclass(frozen=True)
class EngineOutcome:
    """What `builder engine` did: the engine record, its golden check, and where a failing engine was kept aside
    (None: installed in the bundle)."""

    record: dict[str, Any]
    verdict: Any  # runtime.verdict.Verdict
    kept_aside: Path | None = None


def engine_command(bundle: Path, *, keep_failing: bool = False) -> EngineOutcome:
    """`python -m builder engine BUNDLE`: build engine.plan on the target, run the bundle's golden probe through it
    (runtime verify's check), record the verdict in the bundle's report, and install the engine only where it passed
    (or `keep_failing`); a failing one is kept aside in BUNDLE.failed-engine/."""
    from jetson import get_profile
    from runtime.bundle import verify_bundle

    verify_bundle(bundle)
    read_probe(bundle / FILES.probe)  # an engine is never installed unchecked: a bundle without its probe is rebuilt
    manifest = read_bundle_manifest(bundle)
    profile = get_profile(manifest["device"]["name"])
    plan = _plan_from_json(json.loads((bundle / FILES.plan).read_text()))
    tmp = bundle.parent / f".{bundle.name}.{FILES.engine}.tmp"
    tmp_demote = bundle.parent / f".{bundle.name}.{FILES.demote_engine}.tmp"
    try:
        record = build_engine(bundle, plan, profile, tmp, tmp_demote)
        verdict = check_engine(bundle, tmp, tmp_demote, record["plugin_library_path"])
        return settle_engine(bundle, tmp, tmp_demote, record, verdict, keep_failing=keep_failing)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_demote.unlink(missing_ok=True)


def check_engine(bundle: Path, engine: Path, demote: Path, plugin_library: str) -> Any:
    """The golden probe through a candidate engine (runtime.verify), before it is installed."""
    from gsm.bundle_format import BundleConfig
    from runtime.trt_backend import EnginePlans, TrtBackend, gpu_name
    from runtime.verify import judge_backend

    backend = TrtBackend(bundle, BundleConfig.load(bundle), EnginePlans(engine, demote, plugin_library))
    return judge_backend(bundle, backend, device=gpu_name())


def settle_engine(bundle: Path, engine: Path, demote: Path, record: dict[str, Any], verdict: Any, *,
                  keep_failing: bool) -> EngineOutcome:
    """Record the verdict in the bundle's report (report.json `verify.tensorrt`, re-hashed in the manifest), then
    install the engine where it passed or `keep_failing`, else move it aside to BUNDLE.failed-engine/ with the verdict
    (a directory gsm-edge wrote: replaced by the next failing build)."""
    from gsm.atomic import atomic_output_dir
    from runtime.verdict import VERIFY_KEY

    verdict_json = verdict.to_json()
    record = {**record, VERIFY_KEY: {"status": verdict_json["status"], "failed": [c.name for c in verdict.failed]}}
    report = json.loads((bundle / FILES.report).read_text(encoding="utf-8"))
    report.setdefault(VERIFY_KEY, {})[TENSORRT] = verdict_json
    tmp_report = bundle.parent / f".{bundle.name}.{FILES.report}.tmp"
    write_json(tmp_report, report)
    if verdict.passed or keep_failing:
        add_file_to_bundle(bundle, demote, FILES.demote_engine, {})
        add_file_to_bundle(bundle, engine, FILES.engine, {"engine": record})
        add_file_to_bundle(bundle, tmp_report, FILES.report, {})
        return EngineOutcome(record, verdict)
    aside = bundle.parent / f"{bundle.name}{FAILED_SUFFIX}"
    with atomic_output_dir(aside, overwrite=True) as out:
        shutil.move(engine, out / FILES.engine)
        shutil.move(demote, out / FILES.demote_engine)
        write_json(out / VERDICT_FILE, {**verdict_json, "engine": record})
    add_file_to_bundle(bundle, tmp_report, FILES.report, {})
    return EngineOutcome(record, verdict, aside)


def _plan_from_json(d: dict[str, Any]) -> MemoryPlan:
    from builder.plan import PoolRows

    fields = {k: v for k, v in d.items() if k in MemoryPlan.__dataclass_fields__}
    fields["pool_rows"] = PoolRows(**d["pool_rows"])
    return MemoryPlan(**fields)
