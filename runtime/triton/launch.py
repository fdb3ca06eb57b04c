"""Start the real `tritonserver` that the nvidia-pytriton package ships (the `triton` extra), on a repository.

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
        try:
            import pytriton
        except ImportError as e:
            raise TritonUnavailable(f"tritonserver needs nvidia-pytriton: pip install 'gsm-edge[triton]' "
                                    f"({e})") from None
        root = Path(pytriton.__file__).parent / "tritonserver"
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        d = cls(root / "bin" / "tritonserver", root / "backends",
                root / "python_backend_stubs" / version / "triton_python_backend_stub",
                root.parent.parent / "nvidia_pytriton.libs")
        for p in (d.server, d.backends, d.stub):
            if not p.exists():
                raise TritonUnavailable(f"nvidia-pytriton is installed but {p} is missing (Python {version})")
        return d


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
