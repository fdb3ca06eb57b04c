"""The ONNX Runtime CPU op's kernels built for other ISAs (plugins/ortCpu): scripts/check_ortcpu_aarch64.sh runs the
x86 baseline kernels and the aarch64 (NEON, Jetson Orin) kernels under qemu on the same inputs as the AVX2 ones.

A developer check like scripts/gpu_check.sh: it skips where aarch64-linux-gnu-g++ or qemu-aarch64 is missing (CI).
The comparison tool itself is tested everywhere, on files written here, so that the check is known to be able to fail.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_ortcpu_aarch64.sh"
COMPARE = ROOT / "plugins" / "ortCpu" / "test" / "compare_outputs.py"


def test_aarch64_and_baseline_kernels_match_avx2(tmp_path: Path) -> None:
    missing = [t for t in ("aarch64-linux-gnu-g++", "qemu-aarch64", "g++") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not on PATH (a developer check: apt-get install g++-aarch64-linux-gnu "
                    "qemu-user)")
    if platform.machine() != "x86_64":
        pytest.skip("the AVX2 reference needs an x86-64 host")
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GSM_ISA_CHECK_DIR": str(tmp_path)})
    if res.returncode == 2:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok: all kernel builds agree" in res.stdout
    # GsmQuantMatMul: the AVX-512 VNNI (or AVX2), AVX2, generic and aarch64 builds print the same output hashes
    assert "ok: GsmQuantMatMul's kernels give the same bits (5 cases)" in res.stdout
    # both comparisons ran (not a vacuous pass)
    assert "generic (x86_baseline.bin) vs avx2+fma+f16c" in res.stdout
    assert "generic (aarch64.bin) vs avx2+fma+f16c" in res.stdout
    # the builds agree with each other; the float16 decoding of each must also be NumPy's (every finite float16;
    # the harness reads it back as relu(x) - relu(-x), so -0 comes back as +0)
    read_outputs = load_compare().read_outputs
    u = np.arange(1 << 16, dtype=np.uint32)
    halves = u[((u >> 10) & 0x1F) != 0x1F].astype(np.uint16)
    want = halves.view(np.float16).astype(np.float32) + np.float32(0.0)
    for name in ("avx2", "x86_baseline", "aarch64"):
        _, tensors = read_outputs(tmp_path / f"{name}.bin")
        for dI in (8, 12):
            got = tensors[f"half_decode/dI{dI}"].reshape(-1)[:len(halves)].view(np.float32)
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=f"{name} dI {dI}")


def load_compare():
    spec = importlib.util.spec_from_file_location("compare_outputs", COMPARE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_outputs(path: Path, kernels: str, tensors: dict[str, np.ndarray]) -> None:
    """The harness's file format (plugins/ortCpu/test/cachedAttentionCheck.cpp), written independently."""
    with open(path, "wb") as f:
        f.write(b"GSMCHK1\n" + f"kernels {kernels}\n".encode())
        for name, a in tensors.items():
            dt = "f4" if a.dtype == np.float32 else "i4"
            f.write(f"{name} {dt} {a.ndim} {' '.join(map(str, a.shape))}\n".encode())
            f.write(a.astype("<" + dt).tobytes())


def run_compare(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(COMPARE), *map(str, files)], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def reference(tmp_path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"c/attn_out": rng.standard_normal((2, 1, 12)).astype(np.float32),
            "c/selected": np.array([[[0, 3, 4, -1]], [[0, 1, 2, 5]]], np.int32),
            "c/attn_mass": np.abs(rng.standard_normal((2, 6))).astype(np.float32)}


def test_compare_accepts_rounding(tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    other = dict(reference)
    scale = float(np.abs(reference["c/attn_out"]).max())
    other["c/attn_out"] = (reference["c/attn_out"] + np.float32(5e-6 * scale)).astype(np.float32)
    write_outputs(tmp_path / "ref.bin", "avx2+fma+f16c", reference)
    write_outputs(tmp_path / "other.bin", "generic", other)
    res = run_compare(tmp_path / "ref.bin", tmp_path / "other.bin")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok: all kernel builds agree" in res.stdout


@pytest.mark.parametrize("change,message", [
    ("value", "c/attn_out: worst deviation"),
    ("selected", "c/selected: 1 entries differ, first at [0, 0, 2]: 5 vs reference 4"),
    ("missing", "c/attn_mass: only in the reference"),
])
def test_compare_fails_on_mismatch(tmp_path: Path, reference: dict[str, np.ndarray], change: str,
                                   message: str) -> None:
    other = dict(reference)
    if change == "value":  # 2e-5 of the tensor's max |value|: twice the tolerance
        a = reference["c/attn_out"].copy()
        a[1, 0, 7] += np.float32(2e-5 * float(np.abs(a).max()))
        other["c/attn_out"] = a
    elif change == "selected":
        s = reference["c/selected"].copy()
        s[0, 0, 2] = 5
        other["c/selected"] = s
    else:
        del other["c/attn_mass"]
    write_outputs(tmp_path / "ref.bin", "avx2+fma+f16c", reference)
    write_outputs(tmp_path / "other.bin", "generic", other)
    res = run_compare(tmp_path / "ref.bin", tmp_path / "other.bin")
    assert res.returncode == 1, res.stdout + res.stderr
    assert message in res.stdout
    assert "FAILED: the kernel builds disagree" in res.stdout


def test_compare_bad_file_is_usage_error(tmp_path: Path) -> None:
    (tmp_path / "junk.bin").write_bytes(b"not a check file\n")
    res = run_compare(tmp_path / "junk.bin", tmp_path / "junk.bin")
    assert res.returncode == 2
    assert res.stderr.startswith("error: ") and "junk.bin" in res.stderr
