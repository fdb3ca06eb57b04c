"""TensorRT backend: runs only where TensorRT, a GPU and the GSM plugin library exist."""

from __future__ import annotations

import numpy as np
import pytest

from builder.trt_engine import tensorrt_status

ok, why = tensorrt_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"TensorRT backend not testable here: {why}")


def test_tensorrt_matches_portable(tmp_path):
    import runtime
    from builder.build import BuildConfig, build
    from builder.trt_engine import engine_command
    from gsm.synth import synth_checkpoint

    ck = synth_checkpoint("tiny", tmp_path / "tiny")
    out = tmp_path / "b"
    build(BuildConfig(device="auto", checkpoint=ck, output=out, max_seq=128))
    if not (out / "engine.plan").exists():
        engine_command(out)
    ort = runtime.load(out, "onnxruntime", threads=1)
    trt = runtime.load(out, "tensorrt")
    prompt = list(range(3, 43))
    a, b = ort.new_sequence(), trt.new_sequence()
    la, lb = a.prefill(prompt), b.prefill(prompt)
    for _ in range(16):
        # FP16 activations in the engine: compare the distributions, not the bits
        assert np.abs(la - lb).max() <= 5e-2 * np.abs(la).max()
        tok = int(np.argmax(la))
        la, lb = a.decode(tok), b.decode(tok)
