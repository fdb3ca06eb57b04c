"""What a speculative verification costs on a real bundle: a call of n tokens (the next token and n - 1 drafts) against
a one-token step after the same context, and per verified row beyond the first, in one-token steps. These are the
figures behind the backend's `Capabilities.verify_row_cost` / `verify_row_cost_batch`, the price the adaptive draft
length (runtime.speculative.DraftLength) pays for each draft; the constants the backend declares are printed beside.

Each context is prefilled once (held-out TinyStories text); every call is then rewound (CachedSequence.mark /
rewind), so all calls of a context see the same cache. Calls of each size alternate within each repetition and the
median is kept. With --batch-bundle (a build with --max-batch 8), the same for 8 sequences at once: n tokens each
against their batched one-token step.

    python bench/verify_cost.py --bundle B [--contexts 256,1024,4096] [--rows 1,2,4,8] [--batch-bundle B8]
        [--batch-context 256] [--threads 2] [--reps 30]

Run it alone: another busy process changes every figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_speed import DATA, context_ids  # noqa: E402


def call_times(rt, seqs, ctx: list[int], rows: list[int], reps: int) -> dict[int, float]:
    """Median seconds of a call feeding n tokens to every sequence of `seqs` (n = 1: decode_batch, else verify_batch),
    each call rewound."""
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(reps):
        for n in rows:
            marks = [s.mark() for s in seqs]
            t0 = time.perf_counter()
            if n == 1:
                rt.decode_batch(seqs, [ctx[0]] * len(seqs))
            else:
                rt.verify_batch(seqs, [ctx[:n]] * len(seqs))
            times[n].append(time.perf_counter() - t0)
            for s, m in zip(seqs, marks):
                s.rewind(m)
    return {n: float(np.median(t)) for n, t in times.items()}


def report(label: str, t: dict[int, float]) -> list[float]:
    """Prints one table row per n; returns the per-row costs (n > 1)."""
    one, costs = t[1], []
    for n, s in t.items():
        ratio = s / one
        if n > 1:
            costs.append((ratio - 1) / (n - 1))
        print(f"| {label} | {n} | {s * 1e3:.2f} | {ratio:.2f} | {f'{costs[-1]:.2f}' if n > 1 else ''} |")
    return costs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--rows", default="1,2,4,8", help="tokens a call feeds each sequence (1 is the one-token step)")
    p.add_argument("--batch-bundle", type=Path, help="a build with --max-batch 8: 8 sequences a call as well")
    p.add_argument("--batch-context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--text", type=Path, default=DATA / "tinystories_eval.txt")
    a = p.parse_args()
    import runtime

    rows = sorted({1, *(int(x) for x in a.rows.split(","))})
    contexts = [int(x) for x in a.contexts.split(",") if x]
    rt = runtime.load(a.bundle, threads=a.threads)
    caps = rt.capabilities
    if max(rows) > caps.verify_rows:
        p.error(f"--rows: {a.bundle} verifies at most {caps.verify_rows} tokens a call")
    print(f"{a.bundle}, backend {rt.backend.name} ({caps.graph}), {a.threads} threads, median of {a.reps}")
    print("| context | tokens a call | ms | x one-token step | per verified row |")
    print("| --- | --- | --- | --- | --- |")
    single = []
    for c in contexts:
        ctx = context_ids(rt, a.text, c + max(rows))
        seq = rt.new_sequence()
        rt.prefill_batch([seq], [ctx[:c]])
        single += report(str(c), call_times(rt, [seq], ctx[c:], rows, a.reps))
        seq.close()
    print(f"one sequence: a verified row costs {min(single):.2f}-{max(single):.2f} of a step; the backend declares "
          f"verify_row_cost {caps.verify_row_cost}")
    if a.batch_bundle:
        del rt
        rt = runtime.load(a.batch_bundle, threads=a.threads)
        caps = rt.capabilities
        B = min(8, caps.max_per_call)
        seqs = [rt.new_sequence() for _ in range(B)]
        ctxs = [context_ids(rt, a.text, a.batch_context + max(rows), offset=4000 * i) for i in range(B)]
        rt.prefill_batch(seqs, [x[:a.batch_context] for x in ctxs])
        batch = report(f"{B} x {a.batch_context}", call_times(rt, seqs, ctxs[0][a.batch_context:], rows, a.reps))
        print(f"{B} sequences a call: a verified row (each sequence's) costs {min(batch):.2f}-{max(batch):.2f} of "
              f"their batched step; the backend declares verify_row_cost_batch {caps.verify_row_cost_batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
