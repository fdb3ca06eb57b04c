#!/usr/bin/env bash
# GPU check of the GSM plugins, one script, < 8 minutes on one GPU:
#   1. build the CPU reference and the CUDA kernels (sm_87, sm_90 and this GPU's SM),
#   2. run tests/gpu on the GPU (CUDA kernels vs the CPU reference; CI runs the same tests on the CPU-emulated
#      kernels) and the CPU reference tests,
#   3. where TensorRT is installed, the TensorRT backend against the backend contract
#      (tests/test_backend_contract.py; up to 7 more minutes),
#   4. where TensorRT is installed, the engine size of a tied model's INT8 embedding/head against its FP16
#      head (does TensorRT keep one quantised copy for the Gather and the MatMul? docs/weights.md),
#   5. where TensorRT is installed, the golden check of an engine: `builder engine` on an INT4 demo bundle checks the
#      plan it builds against the bundle's golden probe and prints the verdict table (docs/verify.md), then
#      `runtime verify --backend tensorrt` on the installed engine,
#   6. print decode-attention bandwidth (GB/s, % of peak) and the speed-up over dense PyTorch SDPA
#      at 4K and 32K context (tests/gpu/bench_decode.py).
# Needs: nvcc, cmake >= 3.18, python3 with numpy, torch (CUDA build) and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GSM_GPU_CHECK_BUILD:-$ROOT/build/gpu_check}

echo "== device"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
ARCHS=${GSM_CUDA_ARCHS:-$(printf '%s\n' 87 90 "$CAP" | sort -un | paste -sd ';')}
python3 - <<'PY'
import importlib.util, sys
missing = [m for m in ("numpy", "torch", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: python modules missing: {missing}")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch has no CUDA device")
PY

echo "== build (CMAKE_CUDA_ARCHITECTURES=$ARCHS)"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
start=$(date +%s)
# (the CPU-emulated kernels are CI's business, not this GPU's: not built here)
cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
  -DGSM_PLUGINS_EMULATED=OFF \
  | grep -A4 "gsm-edge plugins:"
cmake --build "$BUILD" -j "$(nproc)"
echo "build took $(( $(date +%s) - start )) s"

export GSM_EDGE_PLUGINS_DIR="$BUILD/plugins"
export GSM_CUDA=device  # tests/gpu on this GPU, never the emulated library
export PYTHONPATH="$ROOT/plugins/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

echo "== tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_plugins_cuda.py tests/test_plugins_cpu.py

echo "== backend contract (TensorRT)"
# The TensorRT backend against the one contract every backend meets (tests/test_backend_contract.py: CI runs it
# on onnxruntime and reference); it builds a demo bundle and its engine, so it needs TensorRT and the builder.
if python3 -c "import tensorrt, onnx, onnxruntime" 2>/dev/null; then
  export GSM_PLUGIN_LIB="$BUILD/plugins/libgsm_trt_plugins.so"
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_backend_contract.py -k tensorrt -rs
else
  echo "skipped: TensorRT (or onnx / onnxruntime) is not installed on this machine"
fi

echo "== quantised embedding and head (TensorRT)"
if python3 -c "import tensorrt, onnx" 2>/dev/null; then
  W=$(mktemp -d)
  python3 -m gsm synth --preset small --out "$W/ck" >/dev/null
  for h in int8 fp16; do
    python3 -m builder build --device orin --checkpoint "$W/ck" --output "$W/b$h" --max-seq 256 --weights int4 \
      --head-weights "$h" --json > "$W/r$h.json"
    if timeout 150 python3 -m builder engine "$W/b$h" > "$W/e$h.log" 2>&1; then
      echo "head $h: engine.plan $(stat -c %s "$W/b$h/engine.plan") bytes, plan weight_bytes" \
        "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['weights']['bytes'])" "$W/r$h.json")"
    else
      echo "head $h: engine build failed:"; tail -5 "$W/e$h.log"
    fi
  done
else
  echo "skipped: TensorRT is not installed on this machine"
fi

echo "== golden check (TensorRT)"
if python3 -c "import tensorrt, onnx, onnxruntime" 2>/dev/null; then
  export GSM_PLUGIN_LIB="$BUILD/plugins/libgsm_trt_plugins.so"
  W=$(mktemp -d)
  python3 -m builder build --device orin --output "$W/demo" --max-seq 512 --weights int4 >/dev/null
  if timeout 300 python3 -m builder engine "$W/demo"; then
    timeout 120 python3 -m runtime verify "$W/demo" --backend tensorrt || echo "runtime verify on the installed engine failed"
  else
    echo "golden check: the engine failed or did not build (kept aside in $W/demo.failed-engine if built)"
  fi
else
  echo "skipped: TensorRT (or onnx / onnxruntime) is not installed on this machine"
fi

echo "== decode attention"
timeout 150 python3 tests/gpu/bench_decode.py
