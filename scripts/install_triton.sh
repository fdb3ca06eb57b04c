#!/usr/bin/env bash
# Triton Inference Server for this machine's tests and own use, beside the venv rather than in it:
#   - nvidia-pytriton ships the real `tritonserver`, its Python backend and a backend stub per Python version;
#   - tritonclient is the client library (HTTP and gRPC);
#   - a virtual environment for the models (below).
# Both go with --no-deps into one directory (default ~/.cache/gsm-edge/triton, or $GSM_TRITON_DIST): their pins
# (numpy < 2 for nvidia-pytriton, protobuf < 7 for tritonclient's grpc extra) would downgrade what gsm-edge runs
# on, and neither needs them to start the server or to call it (tritonclient's generated protobuf code loads on
# protobuf 7; its other dependencies are the `triton` extra: pip install -e ".[triton]").
# runtime/triton/launch.py and the tests find it there. Idempotent.
set -euo pipefail
DEST="${GSM_TRITON_DIST:-${GSM_EDGE_CACHE:-$HOME/.cache/gsm-edge}/triton}"
PY="${PYTHON:-python3}"
if [ -x "$DEST/pytriton/tritonserver/bin/tritonserver" ] && [ -d "$DEST/tritonclient" ] && [ -x "$DEST/env/bin/python" ]; then
  # an environment made before a runtime dependency was added gets it (the model's gsm_config_patch needs jsonpatch)
  if ! "$DEST/env/bin/python" -c "import jsonpatch" 2>/dev/null; then
    "$DEST/env/bin/python" -m pip install -q "jsonpatch>=1.33"
  fi
  echo "Triton present: $DEST"
  exit 0
fi
mkdir -p "$DEST"
"$PY" -m pip install -q --no-deps --target "$DEST" "nvidia-pytriton==0.7.0" "tritonclient==2.73.0"
# The models' Python environment (runtime triton --python-env DEST/env): Triton 2.51's backend stub is built
# against numpy 1 (a numpy 2 array reaches it with the wrong layout), so the runtime's dependencies again, at
# numpy < 2; gsm-edge itself comes from the source tree (the repository's shim puts it on the path).
"$PY" -m venv "$DEST/env"
"$DEST/env/bin/python" -m pip install -q "numpy<2" onnxruntime tokenizers "jinja2>=3.1.6" "jsonpatch>=1.33" llguidance
echo "Triton installed: $DEST (models' environment: $DEST/env)"
