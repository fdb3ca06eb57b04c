"""`python -m runtime generate BUNDLE --prompt TEXT` — prints tokens as they come."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a bundle")
    g.add_argument("bundle", type=Path)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (BOS is prepended)")
    src.add_argument("--ids", help="comma-separated prompt token ids, used as given")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop-ids", help="comma-separated ids that end generation (default: EOS)")
    g.add_argument("--backend", choices=["auto", "onnxruntime", "tensorrt", "reference"], default="auto")
    g.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    g.add_argument("--sparse-window", type=int, help="run-time window, 1..max_sparse_window (default: the model's)")
    args = p.parse_args(argv)

    import runtime

    try:
        rt = runtime.load(args.bundle, args.backend, threads=args.threads, sparse_window=args.sparse_window)
    except (runtime.BundleError, RuntimeError, ValueError) as e:
        print(f"runtime: {e}", file=sys.stderr)
        return 1
    prompt = args.prompt if args.prompt is not None else [int(t) for t in args.ids.split(",")]
    stops = None if args.stop_ids is None else [int(t) for t in args.stop_ids.split(",") if t]
    if args.prompt is not None:
        sys.stdout.write(args.prompt)
    t0, n = time.perf_counter(), 0
    for tok in rt.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_ids=stops):
        n += 1
        sys.stdout.write(tok.text if args.prompt is not None else f"{tok.id} ")
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    print(f"[{n} tokens in {dt:.2f} s, {n / dt if dt else 0:.1f} tokens/s, backend {rt.backend.name}, "
          f"finish: {rt.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
