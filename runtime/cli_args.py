"""What `python -m runtime generate` and `python -m runtime serve` share on their command lines: the flags that
choose and tune the backend, opening the bundle with the error line each failure gets (gsm.cli_support.run_main
prints it), and the one-line name of what runs."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gsm.cli_support import CommandFailed, int_at_least
from runtime.backend import Backend
from runtime.facade import Runtime
from runtime.loader import BACKENDS
from runtime.ort_backend import GRAPHS
from runtime.prefix_cache import DEFAULT_PREFIX_CACHE_MIB
from runtime.speculative import SPECULATIVE_MODES

PROG = "python -m runtime"


def add_backend_arguments(p: argparse.ArgumentParser | Any) -> None:
    """--backend, --threads, --spinning, --graph, --prefix-cache-mib, --speculative, --draft-bundle (passed on to
    runtime.load)."""
    p.add_argument("--backend", choices=list(BACKENDS), default="auto")
    p.add_argument("--threads", type=int_at_least(0), default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--spinning", action=argparse.BooleanOptionalAction, default=True,
                   help="ONNX Runtime's threads busy-wait between operators (default on, as ONNX Runtime's and "
                        "llama.cpp's; --no-spinning gives the cores back between operators, for a board that "
                        "shares them with other work)")
    p.add_argument("--graph", choices=list(GRAPHS), default="auto",
                   help="onnxruntime backend: cpu = the fused-attention graph (custom op library), portable = "
                        "standard ops only, auto = cpu where its library is built")
    p.add_argument("--prefix-cache-mib", type=float, default=DEFAULT_PREFIX_CACHE_MIB,
                   help="memory kept for chat prompts' prefixes (the messages before the last one), so a prompt "
                        "starting with a kept one prefills its last message only (0: none kept)")
    p.add_argument("--speculative", choices=list(SPECULATIVE_MODES), default="auto",
                   help="auto: draft tokens from each request's prompt and output and verify several per call (the "
                        "same tokens as off, greedy or seeded; where the backend can verify); off: one token a call")
    p.add_argument("--draft-bundle", type=Path, metavar="DRAFT",
                   help="draft with this bundle's greedy tokens where prompt lookup finds none: a bundle with the same "
                        "tokenizer (a smaller model of the family, or this model with INT4 weights), on its own rows")


def backend_label(backend: Backend) -> str:
    """"onnxruntime (graph cpu)", "tensorrt": the backend, and for ONNX Runtime which network it runs (and why
    `auto` fell back to the portable one, if it did)."""
    graph, note = backend.capabilities.graph, backend.capabilities.graph_note
    return backend.name + (f" (graph {graph}{'; ' + note if note else ''})" if graph else "")


def one_line(text: object) -> str:
    """A message as the single error line (a bundle's integrity problems are listed one per line)."""
    return " ".join(str(text).split())


def flag_of(field: str, others: Mapping[str, str] | None = None) -> str:
    """The flag that sets a request field (RequestError.field): --field-name, unless `others` names another."""
    return (others or {}).get(field, "--" + field.replace("_", "-"))


def load_runtime(args: argparse.Namespace, **kw: Any) -> Runtime:
    """runtime.load with the command's flags; a refusal raises ValueError (exit 2) naming the flag or the bundle,
    a backend that cannot start here CommandFailed (exit 1)."""
    import runtime
    from runtime.draft_model import DraftBundleError

    try:
        return runtime.load(args.bundle, args.backend, threads=args.threads, spinning=args.spinning, graph=args.graph,
                            speculative=args.speculative, prefix_cache_mib=args.prefix_cache_mib,
                            draft_bundle=args.draft_bundle, **kw)
    except DraftBundleError as e:  # before ValueError: the draft's own problems name its flag
        raise ValueError(one_line(f"argument --draft-bundle: {e}")) from None
    except runtime.RequestError as e:
        raise ValueError(f"argument {flag_of(e.field)}: {e.detail}") from None
    except runtime.BundleError as e:
        raise ValueError(one_line(f"bundle {e}")) from None
    except ValueError as e:  # a chat template that does not compile, and other bad bundle contents
        raise ValueError(one_line(f"bundle {args.bundle}: {e}")) from None
    except RuntimeError as e:  # a backend that cannot start here (TensorRT missing, no model.cpu.onnx, ...)
        raise CommandFailed(one_line(e)) from None
    except ImportError as e:  # the backend's library is not installed on this machine
        raise CommandFailed(f"backend {args.backend}: {e} (the ONNX Runtime backend needs `pip install onnxruntime`; "
                            "TensorRT comes with JetPack)") from None
