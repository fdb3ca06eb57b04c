"""Device profiles: the facts the memory planner and the roofline estimate need, per target.

Why a table and not a query: the builder usually runs on a workstation for a Jetson it cannot
see, so the target's numbers must be known offline. Every number cites its public source.

Sources (cited by key in the table):
- [agx-ds]  NVIDIA Jetson AGX Orin Series Data Sheet (DS-10662-001) and the "Jetson AGX Orin"
            product page, nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/:
            AGX Orin 64GB: 2048 CUDA cores, 64 GB 256-bit LPDDR5, 204.8 GB/s;
            AGX Orin 32GB: 1792 CUDA cores, 32 GB 256-bit LPDDR5, 204.8 GB/s.
- [nx-ds]   NVIDIA Jetson Orin NX Series Data Sheet (DS-10712-001): Orin NX 16GB / 8GB,
            128-bit LPDDR5, 102.4 GB/s.
- [nano-ds] NVIDIA Jetson Orin Nano Series Data Sheet (DS-11105-001): Orin Nano 8GB 128-bit
            LPDDR5 68 GB/s, Orin Nano 4GB 64-bit LPDDR5 34 GB/s (JetPack 6.1+ "Super" mode raises
            the 8GB to 102 GB/s; we plan with the data-sheet figure, the conservative one).
- [cuda-cc] CUDA C Programming Guide, "Compute Capabilities" table / developer.nvidia.com/cuda-gpus:
            Orin (Ampere iGPU) 8.7, A10 8.6, L4 and RTX 4090 (Ada) 8.9, H100 and H200 (Hopper) 9.0.
- [fp8]     NVIDIA Transformer Engine / TensorRT docs: FP8 tensor cores exist on Ada (SM 8.9) and
            Hopper (SM 9.0) only; Ampere, including Orin, has none (INT8 is Orin's KV precision).
- [jp6]     JetPack 6.2 release notes (developer.nvidia.com/embedded/jetpack-sdk-62): L4T 36.4.3,
            CUDA 12.6, TensorRT 10.3; JetPack 7.2 (Orin support announced for JetPack 7.x) ships
            CUDA 13.2 (numbers as given in our issue 3).
- [a10]     NVIDIA A10 Tensor Core GPU data sheet: 24 GB GDDR6, 600 GB/s.
- [l4]      NVIDIA L4 Tensor Core GPU data sheet: 24 GB GDDR6, 300 GB/s.
- [4090]    GeForce RTX 4090 specifications (nvidia.com): 24 GB GDDR6X, 384-bit, 21 Gbps = 1008 GB/s.
- [h100]    NVIDIA H100 Tensor Core GPU data sheet: H100 SXM 80 GB HBM3, 3.35 TB/s.
- [h200]    NVIDIA H200 Tensor Core GPU product page: 141 GB HBM3e, 4.8 TB/s.

Memory usable by the app (`usable_bytes`) is OUR estimate, not a vendor number, and says so:
Jetson shares its DRAM between the OS, the CPU side of the app and the GPU, so we subtract an
OS + CUDA/TensorRT runtime reserve (headless L4T idles at ~0.8–1.2 GB; CUDA context + TensorRT
libraries ~0.5–0.8 GB; the small boards leave the desktop off). Discrete GPUs lose the CUDA
context and the driver's reserve (~0.5–1 GB, what nvidia-smi shows as used on an idle board).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GB = 10**9  # vendors quote memory sizes and bandwidth in decimal or binary units; see each row
GIB = 2**30


class UnknownDeviceError(ValueError):
    """--device names no known profile."""


@dataclass(frozen=True)
class DeviceProfile:
    """One target device. Sizes in bytes, bandwidth in bytes/s."""

    name: str
    description: str
    kind: str  # "jetson" | "dgpu"
    sm: str  # compute capability "major.minor"
    memory_bytes: int  # total DRAM (Jetson: shared CPU/GPU) or GPU memory
    bandwidth_bytes_s: float  # peak DRAM bandwidth, data sheet
    reserve_bytes: int  # our estimate of what the OS / CUDA context / TensorRT libraries take
    tensorrt: str  # expected TensorRT on the target
    cuda: str  # expected CUDA on the target
    fp8: bool  # FP8 tensor cores (KV/weights could use FP8); False on Ampere incl. Orin
    sources: tuple[str, ...]

    @property
    def usable_bytes(self) -> int:
        """Memory the app may plan for (an estimate: total minus `reserve_bytes`)."""
        return self.memory_bytes - self.reserve_bytes

    @property
    def kv_low_precision(self) -> str:
        """The lowest KV precision with hardware support: INT8 everywhere, FP8 where it exists."""
        return "fp8" if self.fp8 else "int8"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["sources"] = list(self.sources)
        d["usable_bytes"] = self.usable_bytes
        return d


_JP6 = {"tensorrt": "10.3 (JetPack 6.2); JetPack 7.2: CUDA 13.2", "cuda": "12.6"}
_DGPU = {"tensorrt": ">=10.0", "cuda": ">=12.0"}

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    # Jetson Orin: LPDDR5 sizes are binary (64 GB module = 64 GiB of DRAM), bandwidth decimal.
    DeviceProfile("orin-agx-64", "Jetson AGX Orin 64GB", "jetson", "8.7", 64 * GIB, 204.8 * GB,
                  4 * GIB, fp8=False, sources=("agx-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    DeviceProfile("orin-agx-32", "Jetson AGX Orin 32GB", "jetson", "8.7", 32 * GIB, 204.8 * GB,
                  3 * GIB, fp8=False, sources=("agx-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    DeviceProfile("orin-nx-16", "Jetson Orin NX 16GB", "jetson", "8.7", 16 * GIB, 102.4 * GB,
                  2 * GIB, fp8=False, sources=("nx-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    DeviceProfile("orin-nx-8", "Jetson Orin NX 8GB", "jetson", "8.7", 8 * GIB, 102.4 * GB,
                  int(1.5 * GIB), fp8=False, sources=("nx-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    DeviceProfile("orin-nano-8", "Jetson Orin Nano 8GB", "jetson", "8.7", 8 * GIB, 68 * GB,
                  int(1.5 * GIB), fp8=False, sources=("nano-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    DeviceProfile("orin-nano-4", "Jetson Orin Nano 4GB", "jetson", "8.7", 4 * GIB, 34 * GB,
                  int(1.25 * GIB), fp8=False, sources=("nano-ds", "cuda-cc", "fp8", "jp6"), **_JP6),
    # Discrete GPUs: memory in GiB as the boards carry it (nvidia-smi shows e.g. 23028 MiB for 24 GB).
    DeviceProfile("a10", "NVIDIA A10 24GB", "dgpu", "8.6", 24 * GIB, 600 * GB, GIB, fp8=False,
                  sources=("a10", "cuda-cc", "fp8"), **_DGPU),
    DeviceProfile("l4", "NVIDIA L4 24GB", "dgpu", "8.9", 24 * GIB, 300 * GB, GIB, fp8=True,
                  sources=("l4", "cuda-cc", "fp8"), **_DGPU),
    DeviceProfile("rtx4090", "GeForce RTX 4090 24GB", "dgpu", "8.9", 24 * GIB, 1008 * GB, GIB,
                  fp8=True, sources=("4090", "cuda-cc", "fp8"), **_DGPU),
    DeviceProfile("h100", "NVIDIA H100 SXM 80GB", "dgpu", "9.0", 80 * GIB, 3350 * GB, GIB, fp8=True,
                  sources=("h100", "cuda-cc", "fp8"), **_DGPU),
    DeviceProfile("h200", "NVIDIA H200 141GB", "dgpu", "9.0", 141 * GB, 4800 * GB, GIB, fp8=True,
                  sources=("h200", "cuda-cc", "fp8"), **_DGPU),
)}

ALIASES = {"orin": "orin-agx-64"}


def device_names() -> list[str]:
    """Every accepted --device value except `auto`: profile names, then aliases."""
    return list(PROFILES) + list(ALIASES)


def get_profile(name: str) -> DeviceProfile:
    """Profile by name or alias (case-insensitive); UnknownDeviceError lists the choices."""
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return PROFILES[key]
    except KeyError:
        raise UnknownDeviceError(f"unknown device {name!r}; choose one of "
                                 f"{', '.join(device_names())} or 'auto'") from None
