"""Write a Triton model repository over gsm-edge bundles: one model per bundle.

    REPO/
      manifest.json              hashes of every file (gsm.atomic), written last: the repository is atomic
      NAME/config.pbtxt          Python backend, decoupled, the generate extension's tensors, instance group
      NAME/1/model.py            a shim: the Python environment of the writer, then runtime.triton.model
      NAME/1/bundle/             with --copy: the bundle itself (else config.pbtxt names its path)

The bundle is verified by its own manifest when the model loads (runtime.load), wherever it lives, and refused
where its recorded golden check (report.json, `builder engine`) failed on the model's backend, unless the repository
was written with --allow-failed-verify; the checks recorded when the repository was written are its config's
`golden_check` parameter (GET /v2/models/NAME/config).

Run-time knobs: the config's `gsm_config_patch` parameter, a JSON Patch (RFC 6902, gsm.bundle_knobs paths) the model
applies to the bundle's knobs when it loads (Engine.patch). `--config-patch` writes it, checked here against the
bundle's limits first; a load with a config override (Triton's repository API) changes it: a model reload.
"""

from __future__ import annotations

import json
import shutil
import site
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gsm.atomic import atomic_output_dir
from gsm.bundle_format import BundleConfig
from gsm.bundle_knobs import KnobError, RunKnobs, patch_knobs
from runtime.verdict import ALLOW_FAILED_VERIFY, recorded_verdicts, refuse_failed, verdict_status

KINDS = ("cpu", "gpu")
ALLOW_PARAM, VERIFY_PARAM = "allow_failed_verify", "golden_check"  # config.pbtxt parameters (runtime.triton.model)
PATCH_PARAM = "gsm_config_patch"  # config.pbtxt parameter: a JSON Patch of the bundle's knobs, applied at load
DRAFT_PARAM = "draft_bundle"  # config.pbtxt parameter: the draft bundle's absolute path (absent: prompt lookup)
# the generate extension's inputs (`/v2/models/NAME/generate` maps JSON fields onto them by name): name,
# Triton type, dims; all optional but text_input
INPUTS = (
    ("text_input", "TYPE_STRING", "[ 1 ]"),
    ("max_tokens", "TYPE_INT32", "[ 1 ]"),
    ("temperature", "TYPE_FP32", "[ 1 ]"),
    ("top_p", "TYPE_FP32", "[ 1 ]"),
    ("top_k", "TYPE_INT32", "[ 1 ]"),
    ("seed", "TYPE_INT64", "[ 1 ]"),
    ("stream", "TYPE_BOOL", "[ 1 ]"),
    ("stop", "TYPE_STRING", "[ -1 ]"),
    ("speculative", "TYPE_STRING", "[ 1 ]"),
)
OUTPUTS = (("text_output", "TYPE_STRING", "[ 1 ]"), ("finish_reason", "TYPE_STRING", "[ 1 ]"),
           ("completion_tokens", "TYPE_INT32", "[ 1 ]"))
SHIM = '''"""Triton's Python backend entry point for gsm-edge (written by `python -m runtime triton`)."""

import json
import os
import pathlib
import site
import sys

# the Python environment that wrote this repository: its site directories (.pth files processed, as at
# interpreter start-up) and the gsm-edge source root, ahead of whatever the backend stub starts with
_ENV = json.loads((pathlib.Path(__file__).parent / "python_env.json").read_text())
os.environ.update(_ENV["environ"])
_before = list(sys.path)
for _d in _ENV["site"]:
    site.addsitedir(_d)  # appends, and runs the directory's .pth files (an editable install's finder)
_added = [p for p in sys.path if p not in _before]
sys.path[:] = _ENV["path"] + _added + [p for p in _before if p not in _ENV["path"]]  # ahead of the stub's own

from runtime.triton.model import TritonPythonModel  # noqa: E402,F401
'''


@dataclass(frozen=True)
class TritonModelSpec:
    """One model of the repository."""

    bundle: Path
    name: str | None = None  # default: the bundle directory's name, as `runtime serve` names its model
    instances: int = 1  # instance_group count: each instance is a process with its own engine and cache rows
    kind: str = "cpu"  # KIND_CPU | KIND_GPU (the engine picks its backend: runtime.load "auto")
    copy: bool = False  # carry the bundle inside the repository instead of naming its path
    backend: str = "auto"  # runtime.load's backend
    max_queue: int = 64  # requests waiting in the engine before Triton gets an error back
    speculative: str = "auto"  # runtime.load's: drafting on ("auto") or off; a request's `speculative` input overrides
    draft_bundle: Path | None = None  # runtime.load's: a bundle whose greedy tokens are the drafts (its path as given)
    python_env: Path | None = None  # the virtual environment the model imports from (default: the writer's)
    allow_failed_verify: bool = False  # load even where the bundle's recorded golden check failed on the backend
    # a JSON Patch (RFC 6902) of the bundle's run-time knobs, as JSON text: the PATCH_PARAM parameter (None: none)
    config_patch: str | None = None

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {list(KINDS)}, got {self.kind!r}")

    @property
    def model_name(self) -> str:
        return self.name or Path(self.bundle).resolve().name


def config_pbtxt(spec: TritonModelSpec, cfg: BundleConfig, bundle_ref: str) -> str:
    """The model's config.pbtxt. Triton does not batch (max_batch_size 0): the engine inside batches
    continuously up to the plan's rows; Triton's queue in front of it is bounded by the engine's."""
    def tensor(name: str, dtype: str, dims: str, optional: bool) -> str:
        opt = "\n    optional: true" if optional else ""
        return f"  {{\n    name: \"{name}\"\n    data_type: {dtype}\n    dims: {dims}{opt}\n  }}"

    inputs = ",\n".join(tensor(n, t, d, n != "text_input") for n, t, d in INPUTS)
    outputs = ",\n".join(tensor(n, t, d, False) for n, t, d in OUTPUTS)
    params = {"bundle": bundle_ref, "backend": spec.backend, "max_queue": str(spec.max_queue),
              "speculative": spec.speculative,
              "max_running": str(cfg.max_batch), ALLOW_PARAM: "true" if spec.allow_failed_verify else "false",
              # the bundle's recorded golden checks when the repository was written (GET /v2/models/NAME/config);
              # the model reads them again when it loads
              VERIFY_PARAM: json.dumps({b: verdict_status(Path(spec.bundle), b)
                                        for b in recorded_verdicts(Path(spec.bundle))})}
    if spec.config_patch is not None:
        params[PATCH_PARAM] = spec.config_patch
    if spec.draft_bundle is not None:
        params[DRAFT_PARAM] = str(Path(spec.draft_bundle).resolve())
    parameters = "\n".join(f"parameters {{\n  key: \"{k}\"\n  value: {{ string_value: {json.dumps(v)} }}\n}}"
                           for k, v in params.items())
    return (f"name: \"{spec.model_name}\"\nbackend: \"python\"\nmax_batch_size: 0\n"
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: {spec.instances}\n    kind: KIND_{spec.kind.upper()}\n  }}\n]\n"
            f"{parameters}\n")


def check_config_patch(text: str, cfg: BundleConfig) -> RunKnobs:
    """The knobs `text` (a PATCH_PARAM value: a JSON Patch) makes of the bundle's; KnobError naming the path unless it
    parses, addresses knobs only and stays within the limits the bundle was built for (the largest budget every
    backend takes: the model checks it again against its own backend when it loads)."""
    try:
        ops = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise KnobError(f"{PATCH_PARAM}: not JSON ({e})") from None
    return patch_knobs(cfg.knobs, ops, cfg.knob_limits)


def python_env(env: Path | None = None) -> dict[str, Any]:
    """What the model's shim puts on sys.path: gsm-edge's source root (runtime, gsm, gsm_edge_plugins) and the
    site directories of `env` (a virtual environment holding the runtime's dependencies for the Python the
    Triton stub embeds; Triton 2.51's stub needs numpy < 2) or, by default, this interpreter's; and where the
    plugins' built libraries are (GSM_EDGE_PLUGINS_DIR), so the fused CPU graph runs there too."""
    import runtime

    root = Path(runtime.__file__).resolve().parents[1]
    path = [str(root), str(root / "plugins" / "python")]
    if env is None:
        sites = [d for d in (site.getsitepackages() + [site.getusersitepackages()]) if Path(d).is_dir()]
    else:
        sites = [str(d) for d in sorted(Path(env).glob("lib/python3*/site-packages"))]
        if not sites:
            raise ValueError(f"--python-env {env}: no lib/python3.*/site-packages (expected a virtual environment)")
    out: dict[str, Any] = {"site": sites, "path": path, "environ": {}}
    try:
        from gsm_edge_plugins import ort_ops_library
        from gsm_edge_plugins._lib import REF_LIB, find_library

        lib = ort_ops_library() or find_library(REF_LIB)
        if lib is not None:
            out["environ"]["GSM_EDGE_PLUGINS_DIR"] = str(Path(lib).resolve().parent)
    except ImportError:
        pass
    return out


def write_repository(specs: list[TritonModelSpec], out: Path, *, overwrite: bool = False) -> Path:
    """The repository at `out`, written atomically; every bundle is verified first (BundleError)."""
    from runtime.bundle import open_bundle

    names = [s.model_name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {names} (give --model-name for each bundle)")
    opened = [(s, open_bundle(Path(s.bundle))) for s in specs]  # (manifest, cfg): verified before any output
    for spec, (_manifest, cfg) in opened:
        if spec.config_patch is not None:
            try:
                check_config_patch(spec.config_patch, cfg)
            except KnobError as e:
                raise KnobError(f"model {spec.model_name}: {e}") from None
    for s in specs:  # a backend named outright is refused here already; "auto" resolves when the model loads
        if s.backend != "auto":
            refuse_failed(Path(s.bundle), s.backend, flag=ALLOW_FAILED_VERIFY, allow=s.allow_failed_verify)
    envs = {s.python_env for s in specs}
    env_files = {e: json.dumps(python_env(e), indent=2) + "\n" for e in envs}
    with atomic_output_dir(out, overwrite=overwrite,
                           manifest_extra={"triton_repository": {"models": names}}) as tmp:
        for spec, (_manifest, cfg) in opened:
            model = tmp / spec.model_name
            version = model / "1"
            version.mkdir(parents=True)
            if spec.copy:
                shutil.copytree(spec.bundle, version / "bundle")
                ref = "1/bundle"  # relative to the model directory
            else:
                ref = str(Path(spec.bundle).resolve())
            (model / "config.pbtxt").write_text(config_pbtxt(spec, cfg, ref))
            (version / "model.py").write_text(SHIM)
            (version / "python_env.json").write_text(env_files[spec.python_env])
    return out
