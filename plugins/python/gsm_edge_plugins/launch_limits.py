"""Launch limits of the CUDA kernels, checked without a GPU (tests/test_cuda_launch_limits.py).

A launch beyond a limit of the SM (threads per block, gridDim.y, shared memory, registers) fails only on the device,
at run time, for the shapes that reach it. Three facts decide it, and this module holds them:
- the launches: the grid, block, dynamic shared memory and opt-in of every launch, from the launchers' own host
  function through the C API (`gsm_cuda_launch_geometry`; the emulated library has it and needs no GPU);
- the kernels' registers and static shared memory: ptxas' report (`nvcc --resource-usage`), per SM and per
  template instantiation;
- the limits of each SM (`SM_LIMITS`).
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gsm_edge_plugins._lib import CUDA_EMULATED_LIB, CUDA_LIB, find_library, load
from gsm_edge_plugins.ref import Dims, GsmDims

_c = ctypes


@dataclass(frozen=True)
class SmLimits:
    """Per-block limits of one compute capability.

    Source: CUDA C++ Programming Guide, "Compute Capabilities", Table "Technical Specifications per Compute
    Capability" (docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html): 8.7 and 9.0
    alike allow 1024 threads per block (block x, y <= 1024, z <= 64), grid x 2^31-1, grid y and z 65535, 48 KB of
    shared memory per block unless the kernel opts in, 64K 32-bit registers per block, 255 per thread; with the
    opt-in 163 KB per block on 8.7 and 227 KB on 9.0. Checked against NVIDIA's own encoding of that table, CCCL
    libcudacxx/include/cuda/__device/arch_traits.h: sm_87 and sm_90 "max_shared_memory_per_block_optin" = shared
    memory per SM (164 KiB / 228 KiB) - 1 KiB reserved per block = 166912 / 232448 bytes.
    """

    sm: str  # compute capability "major.minor", as jetson.profiles.DeviceProfile.sm
    smem_per_block_optin: int  # bytes, static + dynamic, after cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
    smem_per_block: int = 48 * 1024  # bytes, static + dynamic, without that opt-in
    max_threads_per_block: int = 1024
    max_block_dim: tuple[int, int, int] = (1024, 1024, 64)
    max_grid_dim: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    regs_per_thread: int = 255
    regs_per_block: int = 65536
    # Registers go to a block per warp, in units of 256 (the CUDA Occupancy Calculator's "register allocation unit
    # size", warp granularity on 8.x/9.0): a block can run out before regs/thread x threads reaches 65536.
    reg_alloc_unit: int = 256
    warp_size: int = 32

    @property
    def arch(self) -> str:
        """nvcc's name of the SM: sm_87."""
        return "sm_" + self.sm.replace(".", "")


SM_LIMITS: dict[str, SmLimits] = {s.sm: s for s in (
    SmLimits("8.7", smem_per_block_optin=163 * 1024),  # Jetson Orin
    SmLimits("9.0", smem_per_block_optin=227 * 1024),  # H100 / H200
)}


@dataclass(frozen=True)
class Launch:
    """One record of gsm_cuda_launch_geometry: `launches` launches of `kernel` with this geometry."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int
    opt_in: bool  # the launcher lifts MaxDynamicSharedMemorySize to dynamic_smem before launching
    launches: int

    @property
    def threads(self) -> int:
        return math.prod(self.block)

    def describe(self) -> str:
        return (f"grid {self.grid} block {self.block} dynamic smem {self.dynamic_smem} B"
                f"{' (opt-in)' if self.opt_in else ''} x{self.launches}")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas gave one kernel instantiation on one SM."""

    registers: int  # per thread
    static_smem: int  # bytes of __shared__ arrays


class _Record(_c.Structure):
    """Mirror of gsm::cuda::LaunchGeometry (plugins/common/gsm_launch_geometry.h), field for field."""

    _fields_ = [("kernel", _c.c_int32), ("optIn", _c.c_int32), ("grid", _c.c_int64 * 3),
                ("block", _c.c_int64 * 3), ("dynamicSmemBytes", _c.c_int64), ("launches", _c.c_int64)]


class GeometryLibrary:
    """gsm_cuda_launch_geometry of a CUDA-kernels library (host code only: no GPU needed)."""

    def __init__(self, name: str) -> None:
        lib = load(name)
        if lib is None:
            raise ImportError(f"{name} was not built/installed (pip install -e .)")
        self.name = name
        p, i32, i64 = _c.c_void_p, _c.c_int32, _c.c_int64
        dp = _c.POINTER(GsmDims)
        sig = {
            "gsm_cuda_last_error": (_c.c_char_p, []),
            "gsm_cuda_launch_record_bytes": (i32, []),
            "gsm_cuda_kernel_name": (_c.c_char_p, [i32]),
            "gsm_cuda_attention_workspace_bytes": (i64, [dp, i64]),
            "gsm_cuda_launch_geometry": (i32, [dp, i32, i32, i64, i32, p, i32]),
        }
        for fn_name, (res, args) in sig.items():
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = res, args
        found = lib.gsm_cuda_launch_record_bytes()
        if found != _c.sizeof(_Record):  # a library from other sources would write other records
            raise ImportError(f"{name} writes {found}-byte launch records, this binding reads {_c.sizeof(_Record)}: "
                              "rebuild it (pip install -e .)")
        self.lib = lib

    def kernel_names(self) -> list[str]:
        """Every kernel the launchers can launch, by record id."""
        out = []
        while (n := self.lib.gsm_cuda_kernel_name(len(out))) is not None:
            out.append(n.decode())
        return out

    def attention_workspace_bytes(self, dims: Dims, max_rows: int) -> int:
        """What the TensorRT plugin asks for at the profile's max rows (getWorkspaceSize)."""
        return int(self.lib.gsm_cuda_attention_workspace_bytes(_c.byref(dims.c()), max_rows))

    def launches(self, dims: Dims, batch: int, seq: int, workspace_bytes: int, demote_entries: int = 0
                 ) -> list[Launch]:
        """The launches of one layer's nodes for a call over batch x seq rows (and a demotion of demote_entries)."""
        dc = _c.byref(dims.c())
        args = (dc, batch, seq, workspace_bytes, demote_entries)
        n = self.lib.gsm_cuda_launch_geometry(*args, None, 0)
        if n < 0:
            raise ValueError(self.lib.gsm_cuda_last_error().decode())
        records = (_Record * n)()
        self.lib.gsm_cuda_launch_geometry(*args, records, n)
        return [Launch(self.lib.gsm_cuda_kernel_name(r.kernel).decode(), tuple(r.grid), tuple(r.block),
                       r.dynamicSmemBytes, bool(r.optIn), r.launches) for r in records]


def geometry_library() -> GeometryLibrary | None:
    """The emulated kernels' library; else libgsm_plugins_cuda.so (the same launchers: its geometry entry point
    makes no CUDA call, so it loads and answers without a GPU); None when neither was built."""
    for name in (CUDA_EMULATED_LIB, CUDA_LIB):
        if find_library(name) is not None:
            return GeometryLibrary(name)
    return None


# ---- ptxas' resource report -------------------------------------------------------------------------------------
KERNEL_SOURCES = ("gsmSparseAttention/gsmSparseAttentionKernels.cu", "gsmKVCache/gsmKVCacheKernels.cu")
# Itanium-mangled template arguments of the kernels' instantiations
_INSTANTIATIONS = {"IfE": "float", "I6__halfE": "__half"}
_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def nvcc() -> str | None:
    return shutil.which("nvcc")


def resource_usage_command(compiler: str, plugins: Path, source: str, archs: Iterable[str], out: Path) -> list[str]:
    """nvcc with the flags plugins/CMakeLists.txt gives the kernels (registers depend on them), every SM at once."""
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    return [compiler, "-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-ffp-contract=off", "--expt-relaxed-constexpr",
            f"-I{plugins / 'common'}", "--resource-usage", *gencode, "-c", str(plugins / source), "-o", str(out)]


def start_resource_usage(compiler: str, plugins: Path, archs: Iterable[str], workdir: Path) -> list[subprocess.Popen]:
    """One nvcc per kernel source of the plugins/ tree `plugins`, side by side (ptxas reports on stderr)."""
    archs = list(archs)
    return [subprocess.Popen(resource_usage_command(compiler, plugins, src, archs, workdir / f"{i}.o"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, src in enumerate(KERNEL_SOURCES)]


def demangled_kernel(mangled: str, kernels: Iterable[str]) -> tuple[str, str] | None:
    """(kernel, instantiation: float | __half | "") of a mangled entry name; None when it is none of `kernels`."""
    for k in kernels:
        at = mangled.find(f"{len(k)}{k}")
        if at >= 0:
            rest = mangled[at + len(str(len(k))) + len(k):]
            inst = next((v for m, v in _INSTANTIATIONS.items() if rest.startswith(m)), "")
            return k, inst
    return None


def parse_resource_usage(text: str) -> dict[tuple[str, str], KernelResources]:
    """{(arch, mangled entry): resources} from ptxas' "Compiling entry function" / "Used N registers" lines."""
    out: dict[tuple[str, str], KernelResources] = {}
    entry: tuple[str, str] | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            entry = (m.group(2), m.group(1))
        elif (m := _USED.search(line)) and entry is not None:
            s = _SMEM.search(line)
            out[entry] = KernelResources(int(m.group(1)), int(s.group(1)) if s else 0)
            entry = None
    return out


def by_kernel(usage: dict[tuple[str, str], KernelResources], kernels: Iterable[str]
              ) -> dict[tuple[str, str, str], KernelResources]:
    """{(arch, kernel, instantiation): resources}; KeyError naming an entry that is none of `kernels` (a kernel the
    geometry records do not know would go unchecked)."""
    kernels = list(kernels)
    out = {}
    for (arch, mangled), res in usage.items():
        k = demangled_kernel(mangled, kernels)
        if k is None:
            raise KeyError(f"ptxas compiled {mangled} for {arch}, which is none of the launch records' kernels "
                           f"{kernels}: add it to plugins/common/gsm_launch_geometry.h")
        out[(arch, *k)] = res
    return out


# ---- the check ----------------------------------------------------------------------------------------------------
def allocated_registers(registers: int, threads: int, limits: SmLimits) -> int:
    """Registers a block of `threads` takes: per warp, rounded up to the allocation unit."""
    per_warp = math.ceil(registers * limits.warp_size / limits.reg_alloc_unit) * limits.reg_alloc_unit
    return per_warp * math.ceil(threads / limits.warp_size)


def limit_violations(launch: Launch, res: KernelResources, limits: SmLimits) -> list[str]:
    """Each limit of `limits` the launch exceeds, as "what: value > limit" (empty when it fits)."""
    out = []
    t = launch.threads
    if t > limits.max_threads_per_block:
        out.append(f"threads per block {t} > {limits.max_threads_per_block}")
    for axis, n, top in zip("xyz", launch.block, limits.max_block_dim):
        if not 1 <= n <= top:
            out.append(f"blockDim.{axis} {n} outside 1..{top}")
    if t % limits.warp_size:  # the kernels' full-mask __shfl_*_sync need whole warps
        out.append(f"threads per block {t} not a multiple of the warp ({limits.warp_size})")
    for axis, n, top in zip("xyz", launch.grid, limits.max_grid_dim):
        if not 1 <= n <= top:
            out.append(f"gridDim.{axis} {n} outside 1..{top}")
    smem = res.static_smem + launch.dynamic_smem
    if smem > limits.smem_per_block and not launch.opt_in:
        out.append(f"shared memory {smem} B (static {res.static_smem} + dynamic {launch.dynamic_smem}) > "
                   f"{limits.smem_per_block} B without the cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opt-in, "
                   "which the launcher does not do")
    if smem > limits.smem_per_block_optin:
        out.append(f"shared memory {smem} B (static {res.static_smem} + dynamic {launch.dynamic_smem}) > "
                   f"{limits.smem_per_block_optin} B per block even with the opt-in")
    if res.registers > limits.regs_per_thread:
        out.append(f"registers per thread {res.registers} > {limits.regs_per_thread}")
    regs = allocated_registers(res.registers, t, limits)
    if regs > limits.regs_per_block:
        out.append(f"registers per block {regs} ({res.registers} x {t} threads, allocated per warp) > "
                   f"{limits.regs_per_block}")
    return out
