"""Opening a bundle: `load()` verifies it and opens the backend its name picks from one registry.

`BACKEND_OPENERS` is the table of backends, name -> how to open one over a verified bundle; each opener imports its
backend's module when it is called, so TensorRT is imported only where it is chosen (or where `auto` asks whether it
is usable). `auto` takes the first of `AUTO_CHOICES` whose check passes on the bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gsm.bundle_format import BundleConfig
from runtime.backend import Backend
from runtime.bundle import BundleError, open_bundle
from runtime.draft_model import DraftBundleError
from runtime.facade import Runtime
from runtime.host_memory import trim_heap
from runtime.ort_backend import GRAPHS
from runtime.prefix_cache import DEFAULT_PREFIX_CACHE_MIB
from runtime.sampling import RequestError
from runtime.sequence import check_sparse_top_k, check_sparse_window
from runtime.speculative import SpeculativeConfig, check_speculative


@dataclass(frozen=True)
class BackendOptions:
    """What `load` hands a backend's opener: ONNX Runtime's session tuning (the other backends take none)."""

    threads: int = 0  # intra-op threads; 0: ONNX Runtime's default
    spinning: bool = True  # intra-op workers busy-wait between operators
    graph: str = "auto"  # "cpu" | "portable" | "auto" (runtime.ort_backend.GRAPHS)
    spin_between_runs: bool = True  # off for a draft bundle and its target (runtime.ort_backend.SessionTuning)


Opener = Callable[[Path, BundleConfig, BackendOptions], Backend]


def open_onnxruntime(root: Path, cfg: BundleConfig, options: BackendOptions) -> Backend:
    from runtime.ort_backend import OrtBackend, SessionTuning

    return OrtBackend(root, cfg, tuning=SessionTuning(threads=options.threads, spinning=options.spinning,
                                                      graph=options.graph,
                                                      spin_between_runs=options.spin_between_runs))


def open_tensorrt(root: Path, cfg: BundleConfig, options: BackendOptions) -> Backend:
    from runtime.trt_backend import TrtBackend

    return TrtBackend(root, cfg)


def open_reference(root: Path, cfg: BundleConfig, options: BackendOptions) -> Backend:
    """The TensorRT graph (model.onnx) on the plugins' C++ CPU reference (tests, debugging)."""
    from runtime.ref_backend import RefBackend

    return RefBackend(root, cfg)


# name -> how to open it (the order is the one the CLI's --backend choices and the error messages list)
BACKEND_OPENERS: dict[str, Opener] = {"onnxruntime": open_onnxruntime, "tensorrt": open_tensorrt,
                                      "reference": open_reference}
BACKENDS = ("auto", *BACKEND_OPENERS)


def tensorrt_usable(root: Path) -> bool:
    from runtime.trt_backend import trt_usable

    return trt_usable(root)[0]


def anywhere(root: Path) -> bool:
    return True


# `auto`: the first backend whose check passes on the bundle (TensorRT where the bundle has an engine and TensorRT
# imports, else ONNX Runtime)
AUTO_CHOICES: tuple[tuple[str, Callable[[Path], bool]], ...] = (("tensorrt", tensorrt_usable),
                                                                ("onnxruntime", anywhere))


def backend_name(backend: str, root: Path) -> str:
    """The registry's name for `backend` on this bundle (`auto` resolved)."""
    if backend != "auto":
        return backend
    return next(name for name, usable in AUTO_CHOICES if usable(root))


def open_backend(backend: str, root: Path, cfg: BundleConfig, options: BackendOptions) -> Backend:
    """The backend `backend` names (or `auto` picks) over a verified bundle."""
    return BACKEND_OPENERS[backend_name(backend, root)](root, cfg, options)


def open_draft(bundle: str | Path, backend: str, options: BackendOptions, prefix_cache_mib: float) -> Runtime:
    """A draft bundle (runtime.draft_model), verified and opened as its target is, drafting nothing itself; one that
    is no bundle or fails its hashes is a DraftBundleError, so the caller can name the draft as the culprit."""
    root = Path(bundle)
    try:
        manifest, cfg = open_bundle(root)
    except BundleError as e:
        raise DraftBundleError(str(e)) from None
    return Runtime(root, manifest, cfg, open_backend(backend, root, cfg, options), sparse_window=None,
                   speculative=SpeculativeConfig("off"), prefix_cache_bytes=int(prefix_cache_mib * (1 << 20)))


def load(bundle: str | Path, backend: str = "auto", *, threads: int = 0, sparse_window: int | None = None,
         sparse_top_k: int | None = None, spinning: bool = True, graph: str = "auto",
         speculative: str = "auto", prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
         draft_bundle: str | Path | None = None) -> Runtime:
    """Verify the bundle's hashes, then open it with `backend`.

    sparse_top_k: the default selection budget (spec 4.1) of every sequence, 0..max-seq (a value
    >= the context is dense attention); None: the checkpoint's. Not the sampling top_k of `generate`.
    spinning: ONNX Runtime's intra-op threads busy-wait between operators (onnxruntime backend, threads
    != 1), as ONNX Runtime, llama.cpp and GenAI do by default: a decode step hands work to the threads
    hundreds of times, and a parked thread takes tens of microseconds to wake each time. False gives the
    cores back between operators, for a board that shares them with other work (docs/runtime.md, "ONNX
    Runtime session").
    graph (onnxruntime backend): "cpu" runs model.cpu.onnx, the attention as one custom op per owning layer
    (libgsm_ort_ops.so; RuntimeError where it is not built); "portable" the standard-op graph; "auto" the
    first where it is usable. `Runtime.backend.graph` says which one runs.

    speculative: "auto" drafts tokens from each request's own prompt and output and verifies them several per call
    (runtime.speculative; same tokens as without, greedy or seeded), where the backend can ("off": one token a call);
    a request's own `speculative=` overrides it.
    draft_bundle: another bundle with this one's tokenizer (a smaller model, or this model with INT4 weights) whose
    greedy tokens are the drafts where prompt lookup finds none (runtime.draft_model), opened with the same backend and
    options on rows of its own memory plan (its --max-batch bounds the requests that draft at once).
    prefix_cache_mib: the memory kept for chat prompts' prefixes (the messages before the last one: a system prompt,
    worked examples, the history), so that the next prompt starting with them prefills its last message only
    (runtime.prefix_cache; 0: none kept, the same tokens either way).

    auto: TensorRT when the bundle has an engine.plan and TensorRT imports, else ONNX Runtime.
    reference: the TensorRT graph (model.onnx) with the plugins' C++ CPU reference; slow, for checks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    root = Path(bundle)
    manifest, cfg = open_bundle(root)
    check_sparse_window(sparse_window, cfg)  # before any graph is opened
    if sparse_top_k is not None:
        check_sparse_top_k(sparse_top_k, cfg.n_max)
    spec = SpeculativeConfig(check_speculative(speculative, "speculative") or "auto")
    if isinstance(prefix_cache_mib, bool) or not isinstance(prefix_cache_mib, (int, float)) or not (
            0 <= prefix_cache_mib < float("inf")):
        raise RequestError("prefix_cache_mib", f"must be a number >= 0 (MiB), got {prefix_cache_mib!r}")
    if isinstance(threads, bool) or int(threads) != threads or threads < 0:
        raise RequestError("threads", f"must be an integer >= 0 (0: ONNX Runtime's default), got {threads}")
    options = BackendOptions(threads=threads, spinning=bool(spinning), graph=graph,
                             spin_between_runs=draft_bundle is None)
    be = open_backend(backend, root, cfg, options)
    rt = Runtime(root, manifest, cfg, be, sparse_window=sparse_window, sparse_top_k=sparse_top_k, speculative=spec,
                 prefix_cache_bytes=int(prefix_cache_mib * (1 << 20)))
    if draft_bundle is not None:
        rt.attach_draft(open_draft(draft_bundle, backend, options, prefix_cache_mib))
    trim_heap()  # what loading parsed and dropped (the tokenizer's JSON: ~16 MiB on SmolLM2) goes back
    return rt
