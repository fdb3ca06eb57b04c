"""Start the real `tritonserver` that the nvidia-pytriton package ships (scripts/install_triton.sh), on a
repository.

The package holds the server, its Python backend and one backend stub per Python version; the stub of this
interpreter's version goes into a backends directory of our own (as pytriton does), and the stub loads the
libpython of this interpreter (LD_LIBRARY_PATH), so models run on the Python that wrote the repository.
On a Jetson or a GPU server Triton comes with its container instead: point it at the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path


class TritonUnavailable(RuntimeError):
    """No tritonserver here; the message says why and what to install."""


@dataclass(frozen=True)
class TritonDist:
    server: Path  # bin/tritonserver
    backends: Path  # backends/ (python/, ...)
    stub: Path  # triton_python_backend_stub for this Python version
    libs: Path  # the wheel's bundled shared libraries

    @classmethod
    def find(cls) -> TritonDist:
        """nvidia-pytriton's files in dist_dir() (scripts/install_triton.sh), else where Python finds the
        package; located, not imported (its Python side is not needed to start the server)."""
        import importlib.util

        pkg = dist_dir() / "pytriton"
        if not pkg.is_dir():
            spec = importlib.util.find_spec("pytriton")
            if spec is None or not spec.submodule_search_locations:
                raise TritonUnavailable(f"no tritonserver: nvidia-pytriton is not in {dist_dir()} nor installed "
                                        "(run scripts/install_triton.sh)")
            pkg = Path(list(spec.submodule_search_locations)[0])
        root = pkg / "tritonserver"
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        d = cls(root / "bin" / "tritonserver", root / "backends",
                root / "python_backend_stubs" / version / "triton_python_backend_stub",
                pkg.parent / "nvidia_pytriton.libs")
        for p in (d.server, d.backends, d.stub):
            if not p.exists():
                raise TritonUnavailable(f"nvidia-pytriton is installed but {p} is missing (Python {version})")
        return d


def dist_dir() -> Path:
    """Where scripts/install_triton.sh puts nvidia-pytriton and tritonclient ($GSM_TRITON_DIST)."""
    env = os.environ.get("GSM_TRITON_DIST")
    if env:
        return Path(env)
    return Path(os.environ.get("GSM_EDGE_CACHE", Path.home() / ".cache" / "gsm-edge")) / "triton"


def model_env() -> Path | None:
    """The models' Python environment scripts/install_triton.sh makes (numpy < 2 for Triton 2.51's stub)."""
    env = dist_dir() / "env"
    return env if (env / "bin" / "python").exists() else None


def client_path() -> None:
    """Make tritonclient importable from dist_dir() when it is not installed (tests, bench)."""
    import importlib.util

    if importlib.util.find_spec("tritonclient") is None and (dist_dir() / "tritonclient").is_dir():
        sys.path.append(str(dist_dir()))


def prepare_backends(dist: TritonDist, work: Path) -> Path:
    """A backends directory with this Python's stub in backends/python/ (Triton looks for it there)."""
    target = work / "backends"
    if not target.exists():
        shutil.copytree(dist.backends, target)
        shutil.copy2(dist.stub, target / "python" / "triton_python_backend_stub")
    return target


def server_env(dist: TritonDist) -> dict[str, str]:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [str(dist.libs), libdir] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


def start(repository: Path, work: Path, *, http_port: int, grpc_port: int, metrics_port: int,
          explicit: bool = False, log: Path | None = None) -> subprocess.Popen:
    """tritonserver on 127.0.0.1 only (HTTP, gRPC, metrics); `explicit`: models loaded through the client's model
    control (load / unload) instead of all at start."""
    dist = TritonDist.find()
    backends = prepare_backends(dist, work)
    argv = [str(dist.server), f"--model-repository={repository}", f"--backend-directory={backends}",
            "--http-address=127.0.0.1", f"--http-port={http_port}", "--grpc-address=127.0.0.1",
            f"--grpc-port={grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
            "--allow-metrics=true", "--allow-cpu-metrics=false", "--allow-gpu-metrics=false", "--log-verbose=0",
            f"--model-control-mode={'explicit' if explicit else 'none'}", "--exit-timeout-secs=10"]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the process owns it)
    return subprocess.Popen(argv, env=server_env(dist), stdout=out, stderr=subprocess.STDOUT, cwd=work)
