#!/usr/bin/env bash
# ISA check of the ONNX Runtime CPU op's kernels (plugins/ortCpu), a developer check on an x86-64 machine:
#   1. builds plugins/ortCpu/test/cachedAttentionCheck.cpp (the op's raw-pointer API on fixed pseudo-random inputs,
#      no ONNX Runtime) for x86-64 (baseline + AVX2/FMA/F16C chosen by cpuid) and, cross-compiled, for aarch64
#      (the NEON kernels of the Jetson Orin), -O3 with the per-file flags of plugins/CMakeLists.txt,
#   2. runs it three ways: x86 AVX2 kernels, x86 baseline kernels (GSM_ORT_KERNELS=baseline) and aarch64 under
#      qemu-aarch64,
#   3. compares the baseline and aarch64 outputs with the AVX2 ones (plugins/ortCpu/test/compare_outputs.py):
#      `selected` identical, float outputs within 1e-5 of each tensor's max |value|; prints the worst deviations;
#   4. builds plugins/ortCpu/test/quantMatMulCheck.cpp (GsmQuantMatMul, five grids and shapes) the same two ways and
#      requires the same output bits from every x86 kernel (GSM_ORT_QMM_KERNEL) and the aarch64 build.
# Needs: g++ (x86-64 host), aarch64-linux-gnu-g++ with its sysroot (Debian: g++-aarch64-linux-gnu), qemu-aarch64
# (Debian: qemu-user), python3 with numpy. Exit: 0 agree, 1 a mismatch or a build failure, 2 skipped (a tool
# missing, not an x86-64 AVX2 host).
# Env: GSM_ORTCPU_SRC  the ortCpu source folder (default plugins/ortCpu; point it at a perturbed scratch copy to see
#                      the check fail), GSM_ISA_CHECK_DIR  where the builds and outputs go (default a temp dir),
#      AARCH64_SYSROOT  (default /usr/aarch64-linux-gnu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=${GSM_ORTCPU_SRC:-$ROOT/plugins/ortCpu}
HARNESS=$ROOT/plugins/ortCpu/test/cachedAttentionCheck.cpp
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
CXX_HOST=${CXX:-g++}
CXX_ARM=aarch64-linux-gnu-g++

skip() {
  echo "check_ortcpu_aarch64: skipped: $*" >&2
  exit 2
}
[ "$(uname -m)" = x86_64 ] || skip "the AVX2 reference needs an x86-64 host (this is $(uname -m))"
grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo \
  || skip "this CPU lacks AVX2/FMA/F16C (no AVX2 kernels to compare with)"
for tool in "$CXX_HOST" "$CXX_ARM" qemu-aarch64 python3; do
  command -v "$tool" >/dev/null || skip "$tool not found on PATH (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)"
done
[ -d "$SYSROOT/lib" ] || skip "no aarch64 sysroot at $SYSROOT (set AARCH64_SYSROOT)"
python3 -c "import numpy" 2>/dev/null || skip "python3 has no numpy"

if [ -n "${GSM_ISA_CHECK_DIR:-}" ]; then
  OUT=$GSM_ISA_CHECK_DIR
else
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/ortcpu-isa.XXXXXX")
  trap 'rm -rf "$OUT"' EXIT
fi
mkdir -p "$OUT/x86_64" "$OUT/aarch64"

# plugins/CMakeLists.txt (gsm_ort_ops, Release): -O3 -fno-fast-math on everything; the kernels may contract to FMA,
# the orchestration may not; the AVX2 copy of the kernels gets -mavx2 -mfma -mf16c. -DNDEBUG -fPIC as CMake adds.
COMMON=(-std=c++17 -O3 -DNDEBUG -fPIC -Wall -Wextra -fno-fast-math)
ORCH=(-ffp-contract=off)
KERN=(-ffp-contract=fast -Wno-psabi)
AVX2=(-mavx2 -mfma -mf16c)

# the ops' files reach plugins/common (gsm_math.h, gsm_layout.h) as ../../common/: from a scratch copy of this folder
# elsewhere that path is found through an include folder two levels below plugins/
INC=(-I"$SRC" -I"$ROOT/plugins/ortCpu/common")

build() { # build CXX DIR [avx2]
  local cxx=$1 dir=$2
  "$cxx" "${COMMON[@]}" "${ORCH[@]}" "${INC[@]}" -c "$SRC/GsmCachedAttention/gsmCachedAttention.cpp" -o "$dir/attention.o"
  "$cxx" "${COMMON[@]}" "${ORCH[@]}" "${INC[@]}" -c "$SRC/GsmPoolAttention/gsmPoolRows.cpp" -o "$dir/poolrows.o"
  "$cxx" "${COMMON[@]}" "${KERN[@]}" -c "$SRC/kernels/gsmOrtKernelsGeneric.cpp" -o "$dir/generic.o"
  local objs=("$dir/attention.o" "$dir/poolrows.o" "$dir/generic.o")
  if [ "${3:-}" = avx2 ]; then
    "$cxx" "${COMMON[@]}" "${KERN[@]}" "${AVX2[@]}" -c "$SRC/kernels/gsmOrtKernelsAvx2.cpp" -o "$dir/avx2.o"
    objs+=("$dir/avx2.o")
  fi
  "$cxx" "${COMMON[@]}" "${ORCH[@]}" "${INC[@]}" -c "$HARNESS" -o "$dir/check.o"
  "$cxx" "${objs[@]}" "$dir/check.o" -o "$dir/cachedAttentionCheck"
}

echo "== build ($SRC -> $OUT)"
start=$(date +%s)
build "$CXX_HOST" "$OUT/x86_64" avx2 &
build "$CXX_ARM" "$OUT/aarch64" &
wait -n && wait -n || { echo "check_ortcpu_aarch64: error: a build failed" >&2; exit 1; }
echo "built in $(( $(date +%s) - start )) s ($("$CXX_HOST" --version | head -1); $("$CXX_ARM" --version | head -1))"

echo "== run"
env -u GSM_ORT_KERNELS "$OUT/x86_64/cachedAttentionCheck" "$OUT/avx2.bin"
GSM_ORT_KERNELS=baseline "$OUT/x86_64/cachedAttentionCheck" "$OUT/x86_baseline.bin"
qemu-aarch64 -L "$SYSROOT" "$OUT/aarch64/cachedAttentionCheck" "$OUT/aarch64.bin"

# the runs must really have used the kernels they stand for (else the comparison is vacuous)
kernels() { sed -n '2s/^kernels //p' "$1"; }
[ "$(kernels "$OUT/avx2.bin")" = "avx2+fma+f16c" ] || { echo "error: the x86 run did not use the AVX2 kernels" >&2; exit 1; }
[ "$(kernels "$OUT/x86_baseline.bin")" = generic ] || { echo "error: GSM_ORT_KERNELS=baseline was ignored" >&2; exit 1; }

echo "== compare with the AVX2 kernels"
python3 "$ROOT/plugins/ortCpu/test/compare_outputs.py" "$OUT/avx2.bin" "$OUT/x86_baseline.bin" "$OUT/aarch64.bin"

# GsmQuantMatMul (plugins/ortCpu/test/quantMatMulCheck.cpp): its kernels promise the same bits, not merely close
# ones, so every x86 kernel and the aarch64 build (the generic kernel) must print the same hashes
echo "== GsmQuantMatMul: every kernel, the same bits"
QMM=$ROOT/plugins/ortCpu/test/quantMatMulCheck.cpp
"$CXX_HOST" "${COMMON[@]}" "${ORCH[@]}" "${INC[@]}" "$SRC/GsmQuantMatMul/gsmQuantMatMul.cpp" "$QMM" -o "$OUT/x86_64/quantMatMulCheck"
"$CXX_ARM" "${COMMON[@]}" "${ORCH[@]}" "${INC[@]}" "$SRC/GsmQuantMatMul/gsmQuantMatMul.cpp" "$QMM" -o "$OUT/aarch64/quantMatMulCheck"
env -u GSM_ORT_QMM_KERNEL "$OUT/x86_64/quantMatMulCheck" > "$OUT/qmm_best.txt"
GSM_ORT_QMM_KERNEL=avx2 "$OUT/x86_64/quantMatMulCheck" > "$OUT/qmm_avx2.txt"
GSM_ORT_QMM_KERNEL=generic "$OUT/x86_64/quantMatMulCheck" > "$OUT/qmm_generic.txt"
qemu-aarch64 -L "$SYSROOT" "$OUT/aarch64/quantMatMulCheck" > "$OUT/qmm_aarch64.txt"
for f in qmm_best qmm_avx2 qmm_generic qmm_aarch64; do echo "$f: $(head -1 "$OUT/$f.txt")"; done
[ "$(head -1 "$OUT/qmm_generic.txt")" = "kernel generic" ] || { echo "error: GSM_ORT_QMM_KERNEL=generic was ignored" >&2; exit 1; }
for f in qmm_avx2 qmm_generic qmm_aarch64; do
  if ! diff <(tail -n +2 "$OUT/qmm_best.txt") <(tail -n +2 "$OUT/$f.txt") > /dev/null; then
    echo "check_ortcpu_aarch64: error: GsmQuantMatMul $f differs from $(head -1 "$OUT/qmm_best.txt"):" >&2
    diff <(tail -n +2 "$OUT/qmm_best.txt") <(tail -n +2 "$OUT/$f.txt") >&2 || true
    exit 1
  fi
done
echo "ok: GsmQuantMatMul's kernels give the same bits ($(tail -n +2 "$OUT/qmm_best.txt" | wc -l) cases)"
