"""Shared test fixtures: the real data of ../shared/data (tests skip when it is absent; CI has it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
STORIES = DATA / "stories260K.bin"
CALIB_TEXT = DATA / "tinystories_calib.txt"
EVAL_TEXT = DATA / "tinystories_eval.txt"
needs_data = pytest.mark.skipif(not STORIES.is_file(), reason=f"real data not found at {DATA}")


SMOLLM2_GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_LAYERS = 8  # of its 30: real weights and tokenizer at CI's cost (docs/verify.md "What CI verifies")
# `gsm convert` kept short: real fits on 4K calibration tokens, a fixed selection sparse at the probe's 256 tokens
# (sinks 1 + window 32 + top-k 32), no long fit or long-context check, one held-out window for the report
SMOLLM2_CONVERT = ("--layers", str(SMOLLM2_LAYERS), "--calib-tokens", "4096", "--eval-tokens", "256",
                   "--indexer-steps", "20", "--long-fit", "0", "--long-check", "", "--top-k", "32", "--window", "32")
# `calibration run` on 16 sequences, every KV tier in use (fixed fractions: no search)
SMOLLM2_CALIBRATE = ("--samples", "16", "--tier-fractions", "0.25,0.25,0.25,0.25", "--eval-samples", "0")


@pytest.fixture(scope="session")
def smollm2_small(tmp_path_factory):
    """A calibrated GSM checkpoint of SmolLM2-135M-Instruct's first SMOLLM2_LAYERS decoder layers, made once per
    session from ../shared/data's GGUF by the CLI (`gsm convert --layers`, then `calibration run`): the real
    tokenizer, embedding, head and the kept layers' real weights, about 40 s on 2 cores. A model cut so is no
    language model (its perplexity is astronomical), but every tensor a bundle of it holds has a real model's
    values. Deleted after the session."""
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"SmolLM2's GGUF not found at {SMOLLM2_GGUF}")
    root = tmp_path_factory.mktemp("smollm2-small")
    steps = [("gsm", "convert", "--from", "gguf", str(SMOLLM2_GGUF), "--calib-text", str(CALIB_TEXT),
              "--eval-text", str(EVAL_TEXT), "--out", str(root / "gsm"), *SMOLLM2_CONVERT),
             ("calibration", "run", "--checkpoint", str(root / "gsm"), "--data", str(CALIB_TEXT),
              "--out", str(root / "cal"), *SMOLLM2_CALIBRATE)]
    for step in steps:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", *step], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        print(f"smollm2_small: {' '.join(step[:2])} {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    yield root / "cal"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # 2-core machines: torch's own thread pool fights pytest and subprocesses for the cores
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def stories_src():
    if not STORIES.is_file():
        pytest.skip(f"real data not found at {DATA}")
    from gsm.sources.llama2c import read_llama2c

    return read_llama2c(STORIES)


@pytest.fixture(scope="session")
def stories_tok(stories_src):
    from gsm.tokenizer import tokenizer_from_json

    return tokenizer_from_json(stories_src.tokenizer_json)


@pytest.fixture(scope="session")
def stories_hf(stories_src):
    """transformers' LlamaForCausalLM holding the stories260K weights: the independent reference."""
    transformers = pytest.importorskip("transformers")
    from gsm.sources.hf import llama_config_dict

    cfg = transformers.LlamaConfig(**llama_config_dict(stories_src.config), attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict({n: stories_src.get(n) for n in stories_src.names}, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # lm_head is tied to the embedding
    return model


ORT_OPS_DOMAIN = "ai.gsm_edge.cpu"  # plugins/ortCpu's ops (builder/graph_cpu.py CPU_DOMAIN)
NO_ORT_OPS = ("libgsm_ort_ops.so not built (ONNX Runtime C API headers not found: run scripts/fetch_ort_headers.sh "
              "and rebuild the plugins)")


def ort_op_session(node, inputs: list, outputs: list, threads: int = 1):
    """An ONNX Runtime CPU session of one node of libgsm_ort_ops.so (value infos `inputs`, `outputs`)."""
    import onnxruntime as ort
    from gsm_edge_plugins import ort_ops_library
    from onnx import helper

    graph = helper.make_graph([node], node.op_type, inputs, outputs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ORT_OPS_DOMAIN, 1)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(ort_ops_library()))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def need_ort_ops_library() -> None:
    """Skip the calling test where libgsm_ort_ops.so (model.cpu.onnx's custom op) was not built."""
    from gsm_edge_plugins import ort_ops_library

    if ort_ops_library() is None:
        pytest.skip("libgsm_ort_ops.so not built (ONNX Runtime C API headers missing: run "
                    "scripts/fetch_ort_headers.sh, then pip install -e .)")


def retiering_copy(base: Path, out: Path, *, rate: int = 8, fp16_window: int = 8,
                   tier_fractions: tuple[float, ...] | None = None, calibration: bytes | None = None,
                   index_key_bits: int | None = None) -> Path:
    """A copy of checkpoint `base` that re-tiers every `rate` decode steps behind an `fp16_window`
    FP16 window, so that short golden-regression runs really read INT12/INT8 rows. Keeps the
    tokenizer and any calibration (or writes `calibration`, kv_calibration.safetensors bytes), and
    `tier_fractions` replaces the checkpoint's; config checksum and manifest are rewritten consistently."""
    import dataclasses

    from gsm import checkpoint

    cfg = checkpoint.load_config(base)
    cfg = cfg.replace(gsm=dataclasses.replace(cfg.gsm, quantization_adaptation_rate=rate))
    quant = checkpoint.load_quant(base).replace(fp16_window=fp16_window)
    if tier_fractions is not None:
        quant = quant.with_fractions(tier_fractions)
    if index_key_bits is not None:
        quant = quant.replace(index_key_bits=index_key_bits)
    return rewrite_checkpoint(base, out, cfg, quant, checkpoint.load_state_dict(base), calibration)


def rewrite_checkpoint(base: Path, out: Path, cfg, quant, state: dict, calibration: bytes | None = None) -> Path:
    """Checkpoint `out`: `base`'s tokenizer and calibration (or `calibration`, kv_calibration.safetensors bytes) with
    this config, quant_config and tensors; checksum and manifest written consistently."""
    from gsm import checkpoint

    tok = base / "tokenizer.json"
    calib = base / "kv_calibration.safetensors"
    if calibration is None and calib.is_file():
        calibration = calib.read_bytes()
    files = checkpoint.CheckpointFiles(tokenizer_json=tok.read_text() if tok.is_file() else None,
                                       extra={calib.name: calibration} if calibration is not None else {})
    return checkpoint.write_checkpoint_arrays(out, cfg, quant, state, files=files, progress=False)


def half_grid_copy(base: Path, out: Path) -> Path:
    """A copy of checkpoint `base` with every U_k / U_v rounded to the FP16 grid, as the converter writes them
    (decisions "U on the FP16 grid"); everything else as it was."""
    from gsm import checkpoint

    state = checkpoint.load_state_dict(base)
    state = {k: (v.astype(np.float16).astype(np.float32) if k.endswith(("k_svd_U.weight", "v_svd_U.weight"))
                 else v) for k, v in state.items()}
    return rewrite_checkpoint(base, out, checkpoint.load_config(base), checkpoint.load_quant(base), state)


INT4_FRACTIONS = (0.25, 0.125, 0.25, 0.375)


def int4_copy(base: Path, out: Path) -> Path:
    """retiering_copy of `base` in GSM_SPEC v2's formats: re-tier passes fill all four tiers, with fitted-looking INT4
    tables (the data-free INT8 scales, INT4 scales clipping at half the data-free range, non-zero compensation for
    both, so every operation of the INT8 and INT4 dequantisation is exercised), and INT8 indexer keys whose scales
    clip at ~3 standard deviations of the key (from the weights, as the data-free latent scales), so some codes
    saturate."""
    import torch
    from safetensors.numpy import save

    from gsm import checkpoint
    from gsm.golden.weights import GoldenWeights, KVCalibration, LatentScales

    w = GoldenWeights.from_tensors(checkpoint.load_config(base), checkpoint.load_state_dict(base))
    df = KVCalibration.data_free(w)
    g = torch.Generator().manual_seed(5)

    def jitter(scale: torch.Tensor) -> torch.Tensor:
        return (torch.rand(scale.shape, generator=g) - 0.5) * scale

    keys = {i: (3.0 * (w.owning(i).idx_k * w.layers[i].input_norm).norm(dim=1) / 127.0).float()
            for i in w.cfg.owning_layers}
    cal = KVCalibration({k: LatentScales(s.scale_int8, s.scale_int12, jitter(s.scale_int8), s.scale_int4 * 0.5,
                                         jitter(s.scale_int4 * 0.5)) for k, s in df.scales.items()}, calibrated=True,
                        index_key_scales=keys)
    return retiering_copy(base, out, tier_fractions=INT4_FRACTIONS, calibration=save(cal.to_tensors()),
                          index_key_bits=8)


def layer_selection_copy(base: Path, out: Path, table: dict[int, tuple[int, ...]]) -> Path:
    """A copy of checkpoint `base` whose owning layers select per `table` (layer -> (window, top_k) or
    (window, top_k, top_k divisor)), gsm_config layer_selection; weights, quantisation, tokenizer and
    calibration as they were."""
    import dataclasses

    from gsm import checkpoint
    from gsm.config import LayerSelection

    cfg = checkpoint.load_config(base)
    sel = {l: LayerSelection(*e) for l, e in table.items()}
    cfg = cfg.replace(gsm=dataclasses.replace(cfg.gsm, layer_selection=sel))
    return rewrite_checkpoint(base, out, cfg, checkpoint.load_quant(base), checkpoint.load_state_dict(base))


def tiny_selection_case(root: Path, table: dict[int, tuple[int, ...]], n_max: int) -> tuple[Path, Path]:
    """The selection tests' model: the synthetic tiny (owning layers 0, 1, 2; layer 3 shares layer 1), re-tiering
    often, selecting per `table` (layer_selection_copy), and its bundle of max-seq n_max with debug outputs, an
    fp32 plugin graph, 8 sequences and max_top_k n_max (the reference backend takes the dense budget).
    Returns (checkpoint, bundle)."""
    from builder.build import BuildConfig, build
    from gsm.synth import synth_checkpoint

    base = retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=3), root / "retier")
    ckpt = layer_selection_copy(base, root / "selecting", table)
    build(BuildConfig(device="orin", checkpoint=ckpt, output=root / "bundle", max_seq=n_max, trt_precision="fp32",
                      debug_outputs=True, max_top_k=n_max, max_batch=8))
    return ckpt, root / "bundle"


# the serving tests' bundles (tests/test_serve*.py): the demo model plain and with a ChatML template, 8 rows
@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from runtime_bundles import SERVE_MAX_INPUT, SERVE_MAX_SEQ, SERVE_VOCAB, demo_and_chat_bundles

    return demo_and_chat_bundles(tmp_path_factory.mktemp("serve"), max_seq=SERVE_MAX_SEQ, max_input=SERVE_MAX_INPUT,
                                 vocab=SERVE_VOCAB, max_batch=8)


@pytest.fixture(scope="module")
def rts(bundles):
    import runtime

    return {k: runtime.load(v, "onnxruntime", threads=1) for k, v in bundles.items()}
