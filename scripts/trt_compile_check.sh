#!/usr/bin/env bash
# Compile check of the TensorRT IPluginV3 wrappers (plugins/**) against a directory of TensorRT
# headers, without libnvinfer: nothing is linked. Every wrapper translation unit is compiled
#   - with g++ (-std=c++17 -fsyntax-only -Wall -Wextra), and
#   - with nvcc as CUDA (-x cu -c to a throw-away object) for each SM in GSM_CHECK_ARCHS,
# the registration TU in both modes (REGISTER_TENSORRT_PLUGIN, and -DGSM_EXPORT_GET_CREATORS=1).
# The CUDA kernel sources (no TensorRT headers) are also compiled with nvcc unless
# GSM_CHECK_KERNELS=0. A step passes when it exits 0 and prints no warning.
#
# Usage:
#   TRT_INCLUDE=/path/to/TensorRT/include scripts/trt_compile_check.sh
# Optional: CXX (g++), NVCC (nvcc on PATH, else /usr/local/bin/nvcc, else /usr/local/cuda/bin/nvcc),
#   CUDA_INCLUDE (the toolkit's include/, found next to nvcc), GSM_CHECK_ARCHS ("87 90"),
#   GSM_CHECK_KERNELS (1).
# Exit status: 0 when every step passed, 1 when one failed, 2 on a usage/setup error.
# Not run in CI: TensorRT headers are not available there.
set -u
cd "$(dirname "$0")/.."

if [[ -z "${TRT_INCLUDE:-}" || ! -f "${TRT_INCLUDE}/NvInferRuntime.h" || ! -f "${TRT_INCLUDE}/NvInferVersion.h" ]]; then
  echo "usage: TRT_INCLUDE=/path/to/TensorRT/include $0   (needs NvInferRuntime.h and NvInferVersion.h there)" >&2
  exit 2
fi
CXX=${CXX:-g++}
if [[ -z "${NVCC:-}" ]]; then
  NVCC=$(command -v nvcc || true)
  for c in /usr/local/bin/nvcc /usr/local/cuda/bin/nvcc; do
    [[ -z "$NVCC" && -x "$c" ]] && NVCC=$c
  done
fi
if [[ -z "$NVCC" ]]; then
  echo "trt_compile_check: nvcc not found (set NVCC=...)" >&2
  exit 2
fi
if [[ -z "${CUDA_INCLUDE:-}" ]]; then
  nvcc_real=$(readlink -f "$NVCC")
  for c in "$(dirname "$nvcc_real")/../include" /usr/local/cuda/include; do
    if [[ -z "${CUDA_INCLUDE:-}" && -f "$c/cuda_runtime_api.h" ]]; then CUDA_INCLUDE=$(cd "$c" && pwd); fi
  done
fi
if [[ -z "${CUDA_INCLUDE:-}" || ! -f "$CUDA_INCLUDE/cuda_runtime_api.h" ]]; then
  echo "trt_compile_check: CUDA headers not found (set CUDA_INCLUDE=...)" >&2
  exit 2
fi
ARCHS=${GSM_CHECK_ARCHS:-87 90}
KERNELS=${GSM_CHECK_KERNELS:-1}

TRT_VERSION=$(printf '#include <NvInferVersion.h>\nNV_TENSORRT_MAJOR.NV_TENSORRT_MINOR.NV_TENSORRT_PATCH.NV_TENSORRT_BUILD\n' \
  | "$CXX" -E -P -x c++ -I"$TRT_INCLUDE" - 2>/dev/null | tail -n 1 | tr -d ' ')
echo "TensorRT headers : $TRT_INCLUDE (NvInferVersion.h: ${TRT_VERSION:-unknown})"
echo "g++              : $("$CXX" --version | head -n 1)"
echo "nvcc             : $("$NVCC" --version | tail -n 2 | head -n 1)  (CUDA headers $CUDA_INCLUDE)"
echo "SMs              : $ARCHS"

# Wrapper translation units (the TensorRT library target's sources, plugins/CMakeLists.txt).
TRT_TUS=(
  plugins/common/gsmPluginCommon.cpp
  plugins/common/gsmPluginRegistration.cpp
  plugins/gsmKVCache/gsmKVCachePlugin.cpp
  plugins/gsmSparseAttention/gsmSparseAttentionPlugin.cpp
)
KERNEL_TUS=(
  plugins/gsmKVCache/gsmKVCacheKernels.cu
  plugins/gsmSparseAttention/gsmSparseAttentionKernels.cu
  plugins/common/gsmCudaCapi.cu
)

# Host flags of the numerics contract (docs/engine_io.md section 6), as in plugins/CMakeLists.txt.
HOST_FLAGS=(-ffp-contract=off -fno-fast-math -Wall -Wextra)
INCLUDES=(-isystem "$TRT_INCLUDE" -isystem "$CUDA_INCLUDE" -Iplugins/common)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trt_compile_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

declare -a RESULTS=()
FAILED=0

# step <label> <command...>: run, keep the log, pass = exit 0 and no "warning" in the output.
step() {
  local label=$1
  shift
  local log="$WORK/log.txt"
  "$@" >"$log" 2>&1
  local rc=$?
  if [[ $rc -eq 0 ]] && ! grep -qi 'warning' "$log"; then
    RESULTS+=("PASS  $label")
  else
    local why="exit $rc"
    [[ $rc -eq 0 ]] && why="warnings"
    RESULTS+=("FAIL  $label ($why)")
    FAILED=1
    echo "---- FAIL: $label ($why)"
    echo "     $*"
    sed 's/^/     | /' "$log" | head -n 60
  fi
}

variants() { # <tu>: the -D sets to compile it with ("" = none)
  if [[ $1 == *gsmPluginRegistration.cpp ]]; then
    printf '%s\n' "" "-DGSM_EXPORT_GET_CREATORS=1"
  else
    printf '%s\n' ""
  fi
}

for tu in "${TRT_TUS[@]}"; do
  while IFS= read -r defs; do
    tag=${defs:+ $defs}
    # shellcheck disable=SC2086  # $defs is empty or one flag
    step "g++   $tu$tag" "$CXX" -std=c++17 -fsyntax-only "${HOST_FLAGS[@]}" $defs "${INCLUDES[@]}" "$tu"
    for sm in $ARCHS; do
      # shellcheck disable=SC2086
      step "nvcc  sm_$sm $tu$tag" "$NVCC" -std=c++17 -x cu -arch="sm_$sm" -c -o "$WORK/tu.o" \
        -Xcompiler="$(IFS=,; echo "${HOST_FLAGS[*]}")" --expt-relaxed-constexpr $defs "${INCLUDES[@]}" "$tu"
    done
  done < <(variants "$tu")
done

if [[ "$KERNELS" != 0 ]]; then
  for tu in "${KERNEL_TUS[@]}"; do
    for sm in $ARCHS; do
      step "nvcc  sm_$sm $tu" "$NVCC" -std=c++17 -arch="sm_$sm" -c -o "$WORK/k.o" \
        -Xcompiler="$(IFS=,; echo "${HOST_FLAGS[*]}")" --expt-relaxed-constexpr -Iplugins/common "$tu"
    done
  done
fi

echo
echo "== summary (TensorRT ${TRT_VERSION:-unknown} headers)"
printf '%s\n' "${RESULTS[@]}"
npass=$(printf '%s\n' "${RESULTS[@]}" | grep -c '^PASS')
echo "$npass/${#RESULTS[@]} passed"
exit "$FAILED"
