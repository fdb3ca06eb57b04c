"""Is the CUDA device code of the kernels the same as at another revision? (nvcc only, no GPU, no cuobjdump)

Compiles each kernel source (plugins/*/*Kernels.cu) of the working tree and of REV to a cubin per SM and compares
the kernels' machine code: the ELF `.text.<kernel>` sections, byte for byte. Section names carry a hash nvcc derives
from the translation unit (`..._cu_1a2b3c4d...`), which any host-code edit changes; it is normalised away, so a host
launcher change shows as "identical" and any change of a kernel's instructions as "DIFFERENT".

Usage: python scripts/compare_cubins.py REV [--archs 87,90]     (after pip install -e .; exit 1 when any kernel differs)
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from gsm_edge_plugins.launch_limits import KERNEL_SOURCES  # under plugins/

ROOT = Path(__file__).resolve().parents[1]
NVCC_FLAGS = ("-std=c++17", "-Xcompiler=-ffp-contract=off", "--expt-relaxed-constexpr")  # as plugins/CMakeLists.txt
_TU_HASH = re.compile(r"(_cu_|_GLOBAL__N__)[0-9a-f]{8}")


def text_sections(cubin: bytes) -> dict[str, bytes]:
    """`.text.*` sections of an ELF64 little-endian file, names with the translation-unit hash normalised."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]

    def name(off: int) -> str:
        end = cubin.index(b"\0", strtab + off)
        return cubin[strtab + off:end].decode()

    out = {}
    for h in headers:
        n = name(h[0])
        if n.startswith(".text.") and h[1] != 8:  # 8: SHT_NOBITS
            out[_TU_HASH.sub(r"\1H", n)] = cubin[h[4]:h[4] + h[5]]
    return out


def cubin_of(tree: Path, source: str, arch: str, out: Path) -> bytes:
    subprocess.run(["nvcc", *NVCC_FLAGS, f"-arch=sm_{arch}", "-cubin", f"-I{tree / 'plugins/common'}",
                    str(tree / "plugins" / source), "-o", str(out)], check=True)
    return out.read_bytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="git revision to compare the working tree with")
    ap.add_argument("--archs", default="87,90", help="SMs (default 87,90: Jetson Orin, H100/H200)")
    args = ap.parse_args()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "plugins"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        for source in KERNEL_SOURCES:
            for arch in args.archs.split(","):
                old = text_sections(cubin_of(base, source, arch, Path(tmp) / "old.cubin"))
                new = text_sections(cubin_of(ROOT, source, arch, Path(tmp) / "new.cubin"))
                changed = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
                size = sum(len(v) for v in new.values())
                verdict = "identical" if not changed else f"DIFFERENT: {', '.join(changed)}"
                print(f"sm_{arch} plugins/{source}: {len(new)} kernels, {size} B of code, {verdict}")
                differ |= bool(changed)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
