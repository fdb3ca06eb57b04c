"""`--device auto`: which profile is the machine we run on?

Order: a Jetson first (its /proc/device-tree/model names the module family, /proc/meminfo picks the
memory size, /etc/nv_tegra_release confirms L4T when the device tree is hidden, e.g. in a container),
then a discrete GPU through `nvidia-smi`. Every input is injectable so tests feed fake files and
fake nvidia-smi output instead of needing the hardware.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jetson.profiles import GIB, PROFILES, DeviceProfile

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
TEGRA_RELEASE = Path("/etc/nv_tegra_release")
MEMINFO = Path("/proc/meminfo")

# Jetson family -> profile names by memory size (GiB of DRAM on the module)
_JETSON_FAMILIES = {
    "agx": {64: "orin-agx-64", 32: "orin-agx-32"},
    "nx": {16: "orin-nx-16", 8: "orin-nx-8"},
    "nano": {8: "orin-nano-8", 4: "orin-nano-4"},
}
# nvidia-smi product name patterns -> profile (word-bounded: "A10" must not match "A100")
_DGPU_NAMES = [
    (re.compile(r"\bH200\b"), "h200"),
    (re.compile(r"\bH100\b"), "h100"),
    (re.compile(r"\bRTX 4090\b"), "rtx4090"),
    (re.compile(r"\bL4\b"), "l4"),
    (re.compile(r"\bA10\b"), "a10"),
]


class DetectionError(RuntimeError):
    """`--device auto` found no known device; the message says what was seen."""


@dataclass(frozen=True)
class Detection:
    profile: DeviceProfile
    evidence: str  # what we read, for the report


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace").replace("\x00", "").strip()
    except OSError:
        return None


def mem_total_bytes(meminfo: str) -> int | None:
    """MemTotal of /proc/meminfo text, in bytes."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.M)
    return int(m.group(1)) * 1024 if m else None


def _jetson_family(model: str) -> str | None:
    m = model.lower()
    if "orin" not in m:
        return None
    for fam in ("agx", "nx", "nano"):
        if re.search(rf"\b{fam}\b", m):
            return fam
    return None


def _nearest_size(fam: str, mem_bytes: int | None) -> str:
    """The family member whose DRAM size is nearest MemTotal (the kernel sees a bit less than the
    module's DRAM: carve-outs); the largest member when MemTotal is unknown."""
    sizes = _JETSON_FAMILIES[fam]
    if mem_bytes is None:
        return sizes[max(sizes)]
    return sizes[min(sizes, key=lambda g: abs(g * GIB - mem_bytes))]


def detect_jetson(model_text: str | None, tegra_release: str | None, meminfo: str | None) -> Detection | None:
    """A Jetson Orin profile from the device-tree model (and MemTotal), or None."""
    mem = mem_total_bytes(meminfo) if meminfo else None
    if model_text:
        fam = _jetson_family(model_text)
        if fam:
            name = _nearest_size(fam, mem)
            return Detection(PROFILES[name], f"/proc/device-tree/model {model_text!r}, "
                                             f"MemTotal {mem} bytes")
        if "jetson" in model_text.lower():
            raise DetectionError(f"this is a Jetson ({model_text!r}) but not an Orin we have a "
                                 "profile for; pass --device explicitly")
    if tegra_release:
        # L4T without a readable device tree (containers): pick the family by memory size alone,
        # the common case on each size: 64/32 GiB -> AGX, 16 -> NX, 8/4 -> Nano (NX 8GB would need --device)
        if mem is None:
            raise DetectionError(f"L4T found ({tegra_release.splitlines()[0]!r}) but neither "
                                 "/proc/device-tree/model nor /proc/meminfo is readable; pass --device")
        by_size = {64: "orin-agx-64", 32: "orin-agx-32", 16: "orin-nx-16", 8: "orin-nano-8",
                   4: "orin-nano-4"}
        g = min(by_size, key=lambda s: abs(s * GIB - mem))
        return Detection(PROFILES[by_size[g]], f"/etc/nv_tegra_release {tegra_release.splitlines()[0]!r}, "
                                               f"MemTotal {mem} bytes (family guessed from memory size)")
    return None


def nvidia_smi_query(run: Callable[[list[str]], str] | None = None) -> str | None:
    """Output of `nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader`,
    or None when nvidia-smi is absent or fails."""
    cmd = ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader"]
    if run is None:
        if shutil.which("nvidia-smi") is None:
            return None

        def run(c: list[str]) -> str:
            return subprocess.run(c, capture_output=True, text=True, check=True, timeout=20).stdout
    try:
        return run(cmd)
    except (OSError, subprocess.SubprocessError):
        return None


def detect_dgpu(smi_output: str | None) -> Detection | None:
    """Profile of the first GPU nvidia-smi lists; DetectionError for a GPU we have no profile for."""
    if not smi_output or not smi_output.strip():
        return None
    first = smi_output.strip().splitlines()[0]
    name = first.split(",")[0].strip()
    for pat, prof in _DGPU_NAMES:
        if pat.search(name):
            return Detection(PROFILES[prof], f"nvidia-smi: {first.strip()!r}")
    raise DetectionError(f"nvidia-smi reports {first.strip()!r}, which has no profile; "
                         f"pass --device with one of {', '.join(PROFILES)}")


def detect(*, device_tree_model: Path = DEVICE_TREE_MODEL, tegra_release: Path = TEGRA_RELEASE,
           meminfo: Path = MEMINFO, run: Callable[[list[str]], str] | None = None) -> Detection:
    """The profile of this machine, or DetectionError saying what was looked at."""
    j = detect_jetson(_read(device_tree_model), _read(tegra_release), _read(meminfo))
    if j is not None:
        return j
    d = detect_dgpu(nvidia_smi_query(run))
    if d is not None:
        return d
    raise DetectionError(f"--device auto found no Jetson ({device_tree_model}, {tegra_release}) and no "
                         "GPU (nvidia-smi absent or silent); pass --device, e.g. --device orin")
