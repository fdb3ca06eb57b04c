"""`python -m runtime verify BUNDLE`: the bundle's golden probe (gsm.probe_format) through a backend, judged against
the golden's outputs (runtime.verdict; docs/verify.md). Torch-free: it runs where the engine runs.

Each probe record is replayed call for call as the golden made it (`Runtime.prefill_call` for each prefill chunk,
then one decode step per continuation token but the last, each fed the golden's token), so every stored output is
compared with the output of the same call; selections are read on the calls that hold a stored query row.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gsm.bundle_format import FILES
from gsm.bundle_knobs import knobs_of_document
from gsm.probe_format import FORMS, PROBE_KNOBS, GoldenProbe, ProbeError, ProbeRecord, read_probe
from runtime.sampling import RequestError
from runtime.tolerances import FP16, FP32, INT8_ACTIVATIONS, TOLERANCES
from runtime.verdict import Verdict
from runtime.verify_checks import PROBE_RUN, Check, checks

if TYPE_CHECKING:
    from runtime.backend import Backend
    from runtime.facade import Runtime

PLUGIN_BACKENDS = ("tensorrt", "reference")  # the ones that run model.onnx (the TensorRT weight form)


@dataclass(frozen=True)
class BackendRun:
    """What the backend gave on one probe record."""

    top1: np.ndarray  # [K] argmax of each call's last-row logits
    logits: np.ndarray  # [P, V] float32: the outputs the record stores logits of
    selected: np.ndarray  # bool [Ls, Q, N]: the stored (layer, query row) selections


def run_record(rt: Runtime, rec: ProbeRecord) -> BackendRun:
    """The record's calls on a fresh sequence of runtime `rt`."""
    rows = {int(r): q for q, r in enumerate(rec.sel_rows)}
    layers = [int(l) for l in rec.sel_layers]
    sel = np.zeros((len(layers), len(rows), rec.positions), bool)
    outputs: list[np.ndarray] = []
    seq = rt.new_sequence()
    pos = 0

    def take(selected: dict[int, np.ndarray] | None, n: int) -> None:
        for r in (r for r in range(pos, pos + n) if r in rows):
            for j, l in enumerate(layers):
                picks = selected[l][0, r - pos]
                sel[j, rows[r], picks[(picks >= 0) & (picks < rec.positions)]] = True

    try:
        for c in (int(c) for c in rec.calls):
            wanted = any(pos <= r < pos + c for r in rows)
            out = rt.prefill_call(seq, [int(t) for t in rec.ids[pos:pos + c]], selections=wanted)
            outputs.append(np.asarray(out.logits[0, -1], np.float32))
            if wanted:
                take(out.selected, c)
            pos += c
        for tok in (int(t) for t in rec.tokens[:-1]):
            wanted = pos in rows  # the other steps run as plain decode steps (a backend's fastest path)
            outputs.append(np.asarray(rt.decode_batch([seq], [tok], selections=wanted)[0], np.float32))
            if wanted:
                take(seq.last.selected, 1)
            pos += 1
    finally:
        seq.close()
    out = np.stack(outputs)
    return BackendRun(out.argmax(axis=1), out[rec.logit_outputs], sel)


def precision_of(backend: str, manifest: dict[str, Any], weights: dict[str, Any]) -> str:
    """The arithmetic a backend runs a bundle with: the plugin graph's activation type, or, on ONNX Runtime, INT8
    activation blocks where the bundle's quantised matmuls are `fast` (bundle.json weights.matmul_accuracy)."""
    if backend in PLUGIN_BACKENDS:
        return FP32 if manifest.get("trt_precision") == "fp32" else FP16
    return INT8_ACTIVATIONS if weights.get("matmul_accuracy") == "fast" else FP32


def form_of(backend: str) -> str:
    """The weight form a backend's graph holds (gsm.probe_format FORMS)."""
    return FORMS[1] if backend in PLUGIN_BACKENDS else FORMS[0]


def cpu_words() -> str:
    """This machine's CPU, for the table: model name, cores, architecture."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or 'CPU'}, {os.cpu_count()} cores, {platform.machine()} {platform.system()}"


def backend_versions(backend: str) -> str:
    """The library versions a backend runs on."""
    if backend == "tensorrt":
        import tensorrt

        return f"TensorRT {tensorrt.__version__}"
    if backend == "reference":
        import onnx

        return f"plugins' C++ reference under onnx {onnx.__version__} (TensorRT not involved)"
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__}"


def probe_words(records: Sequence[ProbeRecord], golden: dict[str, Any]) -> str:
    cases = ", ".join(f"{r.case} {len(r.ids)} tokens in {len(r.calls)} call{'s' * (len(r.calls) > 1)} + "
                      f"{len(r.tokens)} greedy" for r in records)
    extra = []
    if "selection_density" in golden:
        extra.append(f"golden selects {golden['selection_density']:.0%} of positions")
    if "demoted_rows" in golden:
        extra.append(f"{golden['demoted_rows']} rows demoted")
    return cases + (f" ({'; '.join(extra)})" if extra else "")


def judge(rt: Runtime, probe: GoldenProbe, *, device: str | None = None, sparse_top_k: int | None = None) -> Verdict:
    """Run the probe on runtime `rt` and hold it to its precision's tolerance, with the knobs the golden ran with
    (a bundle patched since keeps its graphs: gsm.bundle_knobs). sparse_top_k: this budget instead."""
    from runtime.cli_args import backend_label

    if probe.vocab_size != rt.vocab_size:
        raise ProbeError(f"{rt.bundle / FILES.probe}: vocabulary {probe.vocab_size}, the bundle's is {rt.vocab_size}")
    rt.knobs = knobs_of_document(probe.golden[PROBE_KNOBS], rt.cfg.kv_quantization).with_run_time(
        sparse_top_k=sparse_top_k)
    name = rt.backend.name
    precision = precision_of(name, rt.manifest, rt.cfg.weights)
    tol = TOLERANCES[precision]
    records = probe.for_form(form_of(name))
    t0 = time.perf_counter()
    try:
        runs = [run_record(rt, r) for r in records]
        found = checks(records, [r.logits for r in runs], [r.top1 for r in runs], [r.selected for r in runs], tol)
    except RequestError:  # a flag out of the bundle's range (--sparse-top-k): the input's fault, not the engine's
        raise
    except Exception as e:  # an engine that cannot run the probe fails it (a bad plan, a wrong attribute, ...)
        found = (Check(PROBE_RUN, " ".join(f"{type(e).__name__}: {e}".split())[:300], "runs", False),)
    seconds = time.perf_counter() - t0
    return Verdict(str(rt.bundle), backend_label(rt.backend), backend_versions(name), device or cpu_words(),
                   precision, found, seconds, probe_words(records, probe.golden), tol.words())


def judge_backend(bundle: Path, backend: Backend, *, device: str | None = None) -> Verdict:
    """The probe on a backend object made by the caller over a verified bundle (`builder engine` checks the engine it
    has just built this way, before installing it); the backend is closed after."""
    from runtime.bundle import open_bundle
    from runtime.facade import Runtime
    from runtime.speculative import SpeculativeConfig

    manifest, cfg = open_bundle(bundle)
    try:
        rt = Runtime(Path(bundle), manifest, cfg, backend, sparse_window=None, speculative=SpeculativeConfig("off"),
                     prefix_cache_bytes=0)
        return judge(rt, read_probe(Path(bundle) / FILES.probe), device=device)
    finally:
        backend.close()


def verify(bundle: Path, backend: str = "auto", *, threads: int = 0, graph: str = "auto",
           sparse_top_k: int | None = None) -> Verdict:
    """`runtime.load` the bundle (its hashes checked) with `backend` and judge its probe. sparse_top_k: run with
    this selection budget instead of the model's (a dense budget fails where the golden's selection is sparse)."""
    import runtime

    bundle = Path(bundle)
    if bundle.is_dir() and not (bundle / FILES.probe).is_file():
        read_probe(bundle / FILES.probe)  # the missing file's error, before any backend starts
    rt = runtime.load(bundle, backend, threads=threads, graph=graph, sparse_top_k=sparse_top_k, speculative="off",
                      prefix_cache_mib=0)  # the budget's range checked here
    try:
        device = None
        if rt.backend.name == "tensorrt":
            from runtime.trt_backend import gpu_name

            device = gpu_name()
        return judge(rt, read_probe(bundle / FILES.probe), device=device, sparse_top_k=sparse_top_k)
    finally:
        rt.backend.close()
