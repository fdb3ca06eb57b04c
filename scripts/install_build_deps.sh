#!/usr/bin/env bash
# What `pip install -e ".[test]"` needs from outside PyPI to build every library the tests run:
#   - TBB (Debian's libtbb-dev), for the HIP CPU Runtime build of the CUDA kernels
#     (libgsm_plugins_cuda_emulated.so, what `GSM_CUDA=emulated pytest tests/gpu` runs);
#   - ONNX Runtime's C API headers (scripts/fetch_ort_headers.sh), for the CPU custom op libgsm_ort_ops.so.
# Idempotent; installs with apt-get only what is missing (as root, or through sudo). Exit 1 when TBB cannot be
# had, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! dpkg-query -W -f='${Status}' libtbb-dev 2>/dev/null | grep -q "install ok installed"; then
  SUDO=()
  [ "$(id -u)" -ne 0 ] && SUDO=(sudo)
  echo "installing libtbb-dev (TBB, for the emulated CUDA kernels)"
  if ! { "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq libtbb-dev >/dev/null; }; then
    echo "error: could not install libtbb-dev (apt-get install -y libtbb-dev); the emulated CUDA kernels need it" >&2
    exit 1
  fi
fi
echo "TBB present: libtbb-dev $(dpkg-query -W -f='${Version}' libtbb-dev)"
# Optional, as before: without the headers pip skips libgsm_ort_ops.so and its tests skip (the runtime runs the
# standard-op graph); TBB is not optional, `GSM_CUDA=emulated pytest tests/gpu` fails without the emulated kernels.
bash scripts/fetch_ort_headers.sh || echo "warning: no ONNX Runtime headers: the fused-attention graph's tests will skip"
