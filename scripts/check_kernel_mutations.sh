#!/usr/bin/env bash
# Shows that the emulated CUDA-kernel tests bite. Each mutation below is a bug of the kind only a GPU would
# show (an off-by-one in the selection scan, a missing __syncthreads, a shuffle over the wrong width, ...). For
# each one: a scratch copy of plugins/ gets the change, libgsm_plugins_cuda_emulated.so is rebuilt from it, and
# `GSM_CUDA=emulated pytest tests/gpu` must FAIL on that library. The unmutated copy must pass (the control).
# Prints one line per mutation and exits 1 if any mutation survived (the tests passed on a broken kernel).
#
# Usage: bash scripts/check_kernel_mutations.sh    (after pip install -e ".[test]"; ~8 minutes on 2 cores)
# Needs g++ (C++17), TBB (libtbb-dev) and the HIP CPU Runtime (GSM_HIP_CPU_ROOT, default ../shared/tools/hip-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
HIP="${GSM_HIP_CPU_ROOT:-$ROOT/../shared/tools/hip-cpu}"
[ -f "$HIP/include/hip/hip_runtime.h" ] || { echo "error: HIP CPU Runtime not found under $HIP (set GSM_HIP_CPU_ROOT)" >&2; exit 2; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gsm-mutations.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
CXXFLAGS=(-std=c++17 -O2 -fPIC -ffp-contract=off -fno-fast-math -DGSM_HIP_CPU=1 '-DGSM_CUDA_ARCHS="emulated"'
  -Wno-unknown-pragmas -isystem "$HIP/include")
TUS=(gsmKVCache/gsmKVCacheKernels.cu gsmSparseAttention/gsmSparseAttentionKernels.cu common/gsmCudaCapi.cu)

# name | file under plugins/ | exact text | replacement (the text must occur exactly once)
MUTATIONS=(
  "selection scan off by one (inclusive lane test)|gsmSparseAttention/gsmSparseAttentionKernels.cu|__shfl_up_sync(0xFFFFFFFFu, x, o, 32);
        if (lane >= o)|__shfl_up_sync(0xFFFFFFFFu, x, o, 32);
        if (lane > o)"
  "missing __syncthreads after staging a latent row|gsmSparseAttention/gsmSparseAttentionKernels.cu|            c[i] = ok ? loadLatent(d, rowp, slotTier(entry), qv, i) : 0.f;
        }
        __syncthreads();|            c[i] = ok ? loadLatent(d, rowp, slotTier(entry), qv, i) : 0.f;
        }"
  "logit reduction shuffle over 16 lanes|gsmSparseAttention/gsmSparseAttentionKernels.cu|part += __shfl_xor_sync(0xFFFFFFFFu, part, o, 32);|part += __shfl_xor_sync(0xFFFFFFFFu, part, o, 16);"
  "missing __syncthreads after the radix histogram|gsmSparseAttention/gsmSparseAttentionKernels.cu|                            atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
                        }
                    }
                    __syncthreads();|                            atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
                        }
                    }"
  "tie compaction takes one equal key too many|gsmSparseAttention/gsmSparseAttentionKernels.cu|(eq && eqSeen + eqRank < needEq)|(eq && eqSeen + eqRank <= needEq)"
  "INT12 pair packing reads past an odd part|gsmKVCache/gsmKVCacheKernels.cu|2 * p + 1 < n ? quantize|2 * p + 1 <= n ? quantize"
  "attention reads pool row b, not cache_rows[b]|gsmSparseAttention/gsmSparseAttentionKernels.cu|a.pool + static_cast<int64_t>(a.rows.of(b)) * poolWords(d)|a.pool + static_cast<int64_t>(b) * poolWords(d)"
  "cache update writes pool row b, not cache_rows[b]|gsmKVCache/gsmKVCacheKernels.cu|seqPool(d, pool, cacheRow)|seqPool(d, pool, b)"
  "INT8 key store truncates instead of rounding and clamping|gsmKVCache/gsmKVCacheKernels.cu|reinterpret_cast<int8_t*>(kdst)[c] = keyCode(e);|reinterpret_cast<int8_t*>(kdst)[c] = static_cast<int8_t>(e);"
  "attention reads INT8 key codes as FP16|gsmSparseAttention/gsmSparseAttentionKernels.cu|bool const codes = int8Keys(d);|bool const codes = false;"
)

build() { # <plugins dir> <out dir>: the emulated library from that copy of the sources
  local src=$1 out=$2
  mkdir -p "$out"
  local objs=()
  for tu in "${TUS[@]}"; do
    local o="$out/$(basename "$tu" .cu).o"
    g++ "${CXXFLAGS[@]}" -I"$src/common" -x c++ -c "$src/$tu" -o "$o"
    objs+=("$o")
  done
  g++ -shared -o "$out/libgsm_plugins_cuda_emulated.so" "${objs[@]}" -ltbb -lpthread
}

run_tests() { # <lib dir>: 0 when tests/gpu passes on that library (a crash or a hang fails it too)
  GSM_CUDA=emulated GSM_EDGE_PLUGINS_DIR="$1" timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu \
    >"$1/pytest.log" 2>&1
}

cp -r plugins "$WORK/control"
build "$WORK/control" "$WORK/control-lib"
if ! run_tests "$WORK/control-lib"; then
  echo "control: tests/gpu FAILED on the unmutated kernels:"; tail -20 "$WORK/control-lib/pytest.log"; exit 1
fi
echo "control (unmutated): tests/gpu passed: $(tail -1 "$WORK/control-lib/pytest.log")"

survived=0
i=0
for m in "${MUTATIONS[@]}"; do
  i=$((i + 1))
  IFS='|' read -r -d '' name file old new < <(printf '%s\0' "$m") || true
  dir="$WORK/m$i"
  cp -r plugins "$dir"
  python3 - "$dir/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"mutation text occurs {text.count(old)} times in {path}, expected once")
open(path, "w").write(text.replace(old, new))
PY
  build "$dir" "$dir-lib"
  if run_tests "$dir-lib"; then
    echo "SURVIVED  $name: tests/gpu passed on the broken kernel"
    survived=1
  else
    if grep -q "Fatal Python error" "$dir-lib/pytest.log"; then
      first="the test process crashed ($(grep -m1 -o 'File ".*tests/gpu/[^"]*", line [0-9]* in [a-z_]*' "$dir-lib/pytest.log" || echo "no frame"))"
    else
      first=$(grep -m1 -E '^FAILED|^ERROR|Timeout' "$dir-lib/pytest.log" || tail -1 "$dir-lib/pytest.log")
    fi
    echo "killed    $name: $first"
  fi
done
exit "$survived"
