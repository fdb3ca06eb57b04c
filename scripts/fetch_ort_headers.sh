#!/usr/bin/env bash
# ONNX Runtime's C API headers, for the CPU custom-op library (plugins/ortCpu, libgsm_ort_ops.so).
#
# The onnxruntime wheel ships the runtime but not its headers, and only PyPI, Debian and npm are
# reachable from our machines, so the headers come from Debian's libonnxruntime-dev package
# (MIT-licensed upstream headers), checked against its SHA-256 and unpacked into
#   ${GSM_EDGE_CACHE:-~/.cache/gsm-edge}/onnxruntime/include
# where plugins/CMakeLists.txt looks for them (or pass -DGSM_ORT_INCLUDE_DIR=/path, or set
# ONNXRUNTIME_INCLUDE_DIR). The library asks ONNX Runtime for C API version 17 (ORT 1.17, the
# first with KernelContext_ParallelFor), so headers of any later release serve as well.
# Usage: bash scripts/fetch_ort_headers.sh      (idempotent; exit 1 with a message when unreachable)
set -euo pipefail
CACHE="${GSM_EDGE_CACHE:-$HOME/.cache/gsm-edge}"
DEST="$CACHE/onnxruntime"
if [ -f "$DEST/include/onnxruntime_c_api.h" ]; then
  echo "ONNX Runtime headers present: $DEST/include"
  exit 0
fi
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# pinned: Debian trixie's package (its pool file and hash); when the pool moves on, the current
# trixie (then sid) package is looked up in the signed Packages index and checked against the hash there
DEB="pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
SHA="14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fetch() { curl -fsSL --retry 2 --max-time 120 -o "$2" "$1"; }
if ! fetch "$MIRROR/$DEB" "$TMP/ort.deb" || [ "$(sha256sum "$TMP/ort.deb" | cut -d' ' -f1)" != "$SHA" ]; then
  for suite in trixie sid; do
    if fetch "$MIRROR/dists/$suite/main/binary-amd64/Packages.xz" "$TMP/Packages.xz"; then
      entry="$(xz -dc "$TMP/Packages.xz" | awk '/^Package: libonnxruntime-dev$/,/^$/')"
      DEB="$(printf '%s\n' "$entry" | sed -n 's/^Filename: //p')"
      SHA="$(printf '%s\n' "$entry" | sed -n 's/^SHA256: //p')"
      if [ -n "$DEB" ] && fetch "$MIRROR/$DEB" "$TMP/ort.deb" \
          && [ "$(sha256sum "$TMP/ort.deb" | cut -d' ' -f1)" = "$SHA" ]; then
        break
      fi
    fi
    DEB=""
  done
  if [ -z "$DEB" ]; then
    echo "error: could not download libonnxruntime-dev from $MIRROR (the CPU custom-op library will not be built)" >&2
    exit 1
  fi
fi
mkdir -p "$TMP/x"
if command -v dpkg-deb >/dev/null; then
  dpkg-deb -x "$TMP/ort.deb" "$TMP/x"
else  # a .deb is an ar archive holding data.tar.*
  (cd "$TMP" && ar x ort.deb && tar -xf data.tar.* -C x)
fi
mkdir -p "$DEST"
rm -rf "$DEST/include.tmp"
cp -r "$TMP/x/usr/include/onnxruntime" "$DEST/include.tmp"
cp "$TMP/x/usr/share/doc/libonnxruntime-dev/copyright" "$DEST/include.tmp/COPYRIGHT.debian" 2>/dev/null || true
mv "$DEST/include.tmp" "$DEST/include"
echo "ONNX Runtime headers ($(basename "$DEB")): $DEST/include"
