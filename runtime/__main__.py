"""`python -m runtime generate BUNDLE --prompt TEXT | --ids 1,2,3 | --chat TEXT` — prints tokens as they come.
`python -m runtime serve BUNDLE [--host 127.0.0.1] [--port 8000]` — OpenAI-compatible HTTP server (docs/serving.md).
`python -m runtime verify BUNDLE [--backend auto|tensorrt|onnxruntime|reference]` — the bundle's golden probe through a
backend, a verdict table, exit 0 pass / 1 fail (docs/verify.md).
`python -m runtime patch BUNDLE --patch PATCH.json [--out DIR]` — change the bundle's run-time knobs (window, budget,
re-tier period, tier policy, fallback thresholds) without a rebuild (docs/serving.md "Changing knobs").

Exit codes (gsm.cli_support.run_main, as every command): 0 ok, 2 bad usage or bad input (one `error:` line
naming the flag or file), 1 a failure while working (a backend that cannot start here, the serve extra not
installed), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gsm.atomic import OutputExistsError
from gsm.cli_support import CommandFailed, int_at_least, run_main
from runtime.cli_args import PROG, add_backend_arguments, backend_label, flag_of, load_runtime, one_line
from runtime.loader import BACKENDS
from runtime.ort_backend import GRAPHS
from runtime.speculative import SPECULATIVE_MODES


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _checked(parse: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse type: parse, then the runtime's own range check (one wording for CLI and API)."""
    from runtime.sampling import RequestError

    def convert(text: str) -> Any:
        try:
            return check(parse(text))
        except RequestError as e:
            raise argparse.ArgumentTypeError(e.detail) from None

    return convert


def _id_list(text: str, *, allow_empty: bool) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if items == [""]:
        if allow_empty:
            return []
        raise argparse.ArgumentTypeError("expected comma-separated token ids such as 1,415,1781, got nothing")
    ids = []
    for i, t in enumerate(items):
        try:
            v = int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"position {i} is {t!r}, not an integer token id "
                                             "(expected comma-separated ids such as 1,415,1781)") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"id {v} (position {i}) is negative; token ids are >= 0")
        ids.append(v)
    return ids


def build_parser() -> argparse.ArgumentParser:
    from runtime.sampling import check_seed, check_temperature, check_top_k, check_top_p

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a bundle")
    g.add_argument("bundle", type=Path)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (BOS is prepended unless tokenizer_config.json says not to)")
    src.add_argument("--ids", type=lambda t: _id_list(t, allow_empty=False),
                     help="comma-separated prompt token ids, used as given")
    src.add_argument("--chat", help="a user message, rendered with the bundle's chat template; prints the answer")
    g.add_argument("--max-new-tokens", type=int_at_least(0), default=64)
    g.add_argument("--temperature", type=_checked(_float, check_temperature), default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=_checked(_int, check_top_k), default=0, help="0: off")
    g.add_argument("--top-p", type=_checked(_float, check_top_p), default=1.0, help="in (0, 1]; 1: off")
    g.add_argument("--seed", type=_checked(_int, check_seed))
    g.add_argument("--stop-ids", type=lambda t: _id_list(t, allow_empty=True),
                   help="comma-separated ids that end generation (default: EOS; with --chat also the "
                        "end-of-turn token; \"\": none)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop string: the output ends before it (repeat for up to 4)")
    g.add_argument("--json-schema", type=Path, metavar="FILE",
                   help="constrain the output to this JSON schema (structured output; needs llguidance)")
    g.add_argument("--presence-penalty", type=_float, default=0.0, help="-2..2, OpenAI's (0: off)")
    g.add_argument("--frequency-penalty", type=_float, default=0.0, help="-2..2, OpenAI's (0: off)")
    g.add_argument("--repetition-penalty", type=_float, default=1.0, help="> 0, as vLLM and llama.cpp (1: off)")
    add_backend_arguments(g)
    g.add_argument("--sparse-window", type=int_at_least(1),
                   help="run-time window, 1..max_sparse_window (default: the model's)")
    g.add_argument("--sparse-top-k", type=int_at_least(0),
                   help="selection budget (spec 4.1 top-k), 0..max-seq; >= the context is dense attention "
                        "(default: the model's sparse_top_k; --top-k is the sampling top-k)")
    v = sub.add_parser("verify", help="run the bundle's golden probe through a backend and print the verdict")
    v.add_argument("bundle", type=Path)
    v.add_argument("--backend", choices=list(BACKENDS), default="auto")
    v.add_argument("--graph", choices=list(GRAPHS), default="auto", help="onnxruntime backend: which network runs "
                   "(as `generate --graph`)")
    v.add_argument("--threads", type=int_at_least(0), default=0, help="ONNX Runtime intra-op threads (0: its default)")
    v.add_argument("--sparse-top-k", type=int_at_least(0), help="run with this selection budget instead of the "
                   "model's (a dense one fails where the golden's selection is sparse)")
    v.add_argument("--json", action="store_true", help="print the verdict as JSON instead of the table")
    from runtime.serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    pa = sub.add_parser("patch", help="change a bundle's run-time knobs by a JSON Patch (RFC 6902), no rebuild")
    pa.add_argument("bundle", type=Path)
    pa.add_argument("--patch", type=Path, required=True, help="a JSON file: an array of RFC 6902 operations over "
                                                               "bundle.json's knob paths (docs/serving.md)")
    pa.add_argument("--out", type=Path, help="write the patched bundle here (default: in place)")
    pa.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    t = sub.add_parser("triton", help="write a Triton Inference Server model repository over bundles")
    t.add_argument("bundles", type=Path, nargs="+", metavar="BUNDLE")
    t.add_argument("--out", type=Path, required=True, help="the repository directory to write (atomically)")
    t.add_argument("--model-name", action="append", help="a model's name, once per bundle in order (default: the "
                                                          "bundle directory's name, as `runtime serve` names it)")
    t.add_argument("--instances", type=int_at_least(1), default=1,
                   help="instance_group count: processes per model, each with its own engine and cache rows")
    t.add_argument("--kind", choices=["cpu", "gpu"], default="cpu", help="instance_group kind")
    t.add_argument("--backend", choices=list(BACKENDS), default="auto", help="the gsm-edge backend each instance "
                                                                             "loads")
    t.add_argument("--speculative", choices=list(SPECULATIVE_MODES), default="auto",
                   help="each instance's drafting (a request's `speculative` input overrides it)")
    t.add_argument("--draft-bundle", type=Path, metavar="DRAFT",
                   help="every model drafts with this bundle's greedy tokens (runtime.load draft_bundle; its path is "
                        "named, not copied)")
    t.add_argument("--copy", action="store_true", help="carry the bundles inside the repository (default: "
                                                       "name their paths)")
    t.add_argument("--python-env", type=Path, help="a virtual environment with the runtime's dependencies for the "
                                                    "Python Triton's stub embeds (default: this one's)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing repository")
    t.add_argument("--allow-failed-verify", action="store_true",
                   help="load bundles whose recorded golden check (report.json, `builder engine`) failed on their "
                        "backend (refused otherwise, here or when Triton loads the model)")
    t.add_argument("--config-patch", type=Path, metavar="PATCH.json",
                   help="a JSON Patch (RFC 6902) of the bundles' run-time knobs, as `runtime patch --patch` takes, "
                        "that each model applies when it loads (config parameter gsm_config_patch; checked here "
                        "against each bundle's limits)")
    return p


def triton(args: argparse.Namespace) -> int:
    from gsm.bundle_knobs import KnobError
    from runtime.triton.repository import TritonModelSpec, write_repository

    names = args.model_name or []
    if names and len(names) != len(args.bundles):
        raise ValueError(f"argument --model-name: give one per bundle ({len(args.bundles)}), got {len(names)}")
    config_patch = None
    if args.config_patch is not None:
        from runtime.bundle_patch import read_patch

        try:
            config_patch = json.dumps(read_patch(args.config_patch))
        except KnobError as e:
            raise ValueError(f"argument --config-patch: {str(e).removeprefix('--patch ')}") from None
    specs = [TritonModelSpec(b, names[i] if names else None, args.instances, args.kind, args.copy, args.backend,
                             python_env=args.python_env, speculative=args.speculative, draft_bundle=args.draft_bundle,
                             allow_failed_verify=args.allow_failed_verify, config_patch=config_patch)
             for i, b in enumerate(args.bundles)]
    try:
        write_repository(specs, args.out, overwrite=args.overwrite)
    except OutputExistsError as e:
        raise ValueError(f"argument --out: {e} (give --overwrite to replace it)") from None
    except KnobError as e:  # the config patch, refused against a bundle's limits: nothing written
        raise ValueError(f"argument --config-patch: {e}") from None
    print(f"Triton repository {args.out}: {', '.join(s.model_name for s in specs)} "
          f"(tritonserver --model-repository {args.out})", file=sys.stderr)
    return 0


def generate(args: argparse.Namespace) -> int:
    import runtime

    source = "--prompt" if args.prompt is not None else "--ids" if args.ids is not None else "--chat"
    flags = {"prompt": source, "messages": source}
    rt = load_runtime(args, sparse_window=args.sparse_window, sparse_top_k=args.sparse_top_k)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              stop_ids=args.stop_ids, stop=args.stop, presence_penalty=args.presence_penalty,
              frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    flags["response_format"] = "--json-schema"
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(one_line(f"argument --json-schema: {args.json_schema}: {e}")) from None
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": args.json_schema.stem,
                                                                         "schema": schema}}
    try:
        if args.chat is not None:
            if not rt.has_chat_template:
                raise ValueError(f"argument --chat: bundle {args.bundle} has no chat template (no "
                                 "tokenizer_config.json with chat_template); use --prompt")
            stream = rt.chat_stream([{"role": "user", "content": args.chat}], args.max_new_tokens, **kw)
        else:
            stream = rt.stream(args.prompt if args.prompt is not None else args.ids, args.max_new_tokens, **kw)
    except runtime.RequestError as e:
        raise ValueError(one_line(f"argument {flag_of(e.field, flags)}: {e.detail}")) from None
    except runtime.ChatTemplateError as e:
        raise ValueError(one_line(f"argument --chat: {e}")) from None
    as_text = args.ids is None
    if (rt.manifest.get("checkpoint") or {}).get("demo"):
        print("note: this is the DEMO bundle: a seeded random model, so its text is random words "
              "(build a real checkpoint with --checkpoint)", file=sys.stderr)
    if args.prompt is not None:
        sys.stdout.write(args.prompt)
    t0, n, shown = time.perf_counter(), 0, 0
    try:
        for tok in stream:
            n += 1
            sys.stdout.write(tok.text if as_text else f"{tok.id} ")
            shown += len(tok.text)
            sys.stdout.flush()
    except runtime.ContextFullError as e:
        raise CommandFailed(one_line(e)) from None
    if as_text and stream.text:
        sys.stdout.write(stream.text[shown:])  # bytes held back before a stop id
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    rate = n / dt if dt > 0 and math.isfinite(n / dt) else 0.0
    print(f"[{n} tokens in {dt:.2f} s, {rate:.1f} tokens/s, backend {backend_label(rt.backend)}, "
          f"finish: {stream.finish_reason}]", file=sys.stderr)
    return 0


def verify(args: argparse.Namespace) -> int:
    """Exit 0 when the backend passes the golden check, 1 naming what failed."""
    import runtime
    from runtime.verify import verify as run_verify

    try:
        verdict = run_verify(args.bundle, args.backend, threads=args.threads, graph=args.graph,
                             sparse_top_k=args.sparse_top_k)
    except runtime.RequestError as e:
        raise ValueError(f"argument {flag_of(e.field)}: {e.detail}") from None
    except runtime.BundleError as e:
        raise ValueError(one_line(f"bundle {e}")) from None
    except RuntimeError as e:  # a backend that cannot start here
        raise CommandFailed(one_line(e)) from None
    except ImportError as e:
        raise CommandFailed(f"backend {args.backend}: {e}") from None
    print(json.dumps(verdict.to_json(), indent=2) if args.json else verdict.table())
    if not verdict.passed:
        raise CommandFailed(f"backend {verdict.backend} failed the golden check: {verdict.failure_line()}")
    return 0


def patch(args: argparse.Namespace) -> int:
    from runtime.bundle_patch import patch_bundle, read_patch

    try:
        r = patch_bundle(args.bundle, read_patch(args.patch), args.out, overwrite=args.overwrite)
    except OutputExistsError as e:
        raise ValueError(f"argument --out: {e} (give --overwrite to replace it)") from None
    print(f"patched {r.out}: {', '.join(r.changed)}; knobs {r.checksum} (manifest re-hashed)")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    if args.command == "serve":
        from runtime.serve.cli import serve

        return run_main(f"{PROG} serve", lambda: serve(args), extra="serve")
    if args.command == "triton":
        return run_main(f"{PROG} triton", lambda: triton(args))
    if args.command == "verify":
        return run_main(f"{PROG} verify", lambda: verify(args))
    if args.command == "patch":
        return run_main(f"{PROG} patch", lambda: patch(args))
    return run_main(f"{PROG} generate", lambda: generate(args))


if __name__ == "__main__":
    sys.exit(main())
