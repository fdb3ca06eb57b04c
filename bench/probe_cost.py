"""Cost of the sampled mask hit-rate probe (issue 10): decode throughput of an in-process Engine with the
probe off, at one step in N, and (optionally) on every step.

    python bench/probe_cost.py BUNDLE --text FILE [--requests 8] [--prompt-tokens 512] [--new-tokens 128]
        [--every 0,64,1] [--repeats 2] [--threads 1] [--pairs 20]

Each run submits `--requests` prompts of `--prompt-tokens` tokens (consecutive windows of the text file) at
once and generates `--new-tokens` greedy tokens each (no stop id). `--min-hit-rate` is 0 in every run, so
the probe only measures and no sequence switches to dense: the difference is the probe's own cost (its
dense shadow call). Configurations are alternated run by run (`--repeats` rounds) so a machine whose load
changes affects them alike. Decode throughput counts the tokens after each request's first, over the
time from the first request's first token to the last request's end (prefill excluded). `--pairs`
times plain and probed decode steps directly at the same context (alternated, medians): the expected cost
at one probe in N is (probed / plain - 1) / N, which end-to-end runs on a loaded machine cannot resolve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run_once(rt, prompts: list[list[int]], new_tokens: int, every: int) -> dict[str, float]:
    from runtime.engine import Engine, EngineConfig

    cfg = EngineConfig(max_running=len(prompts), min_hit_rate=0.0, hit_rate_every=every, max_kv_noise=None)
    with Engine(rt, cfg) as eng:
        eng.ready.wait()
        reqs = [eng.submit(p, new_tokens, stop_ids=[]) for p in prompts]
        for r in reqs:
            r.result()
    t_first = min(r.t_first for r in reqs)
    t_end = max(r.t_end for r in reqs)
    decoded = sum(len(r.ids) - 1 for r in reqs)
    return {"every": every, "decode_tokens": decoded, "decode_s": t_end - t_first,
            "decode_tokens_per_s": decoded / (t_end - t_first)}


def step_pairs(rt, prompts: list[list[int]], pairs: int) -> dict[str, float]:
    """Per-step times at the same context: the prompts' sequences take a plain decode step and a probed
    one (every sequence probed), alternately, `pairs` times; medians of each."""
    import statistics
    import time

    seqs = [rt.new_sequence() for _ in prompts]
    logits = rt.prefill_batch(seqs, prompts)
    toks = [int(lg.argmax()) for lg in logits]
    plain, probed = [], []
    for i in range(2 * pairs):
        probe = i % 2 == 1
        t0 = time.perf_counter()
        logits = rt.decode_batch(seqs, toks, probe=[probe] * len(seqs))
        (probed if probe else plain).append(time.perf_counter() - t0)
        toks = [int(lg.argmax()) for lg in logits]
    a, b = statistics.median(plain), statistics.median(probed)
    return {"plain_step_s": a, "probed_step_s": b, "probed_over_plain": b / a, "pairs": pairs,
            "context": len(prompts[0]) + pairs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--text", type=Path, required=True, help="text to cut the prompts from")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--every", default="0,64", help="probe intervals to compare (0: no probe)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=0,
                   help="also time this many plain/probed step pairs directly (batch = --requests)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import runtime

    rt = runtime.load(args.bundle, threads=args.threads)
    ids = rt.encode(args.text.read_text(encoding="utf-8"))
    need = args.requests * args.prompt_tokens
    if len(ids) < need or args.prompt_tokens + args.new_tokens > rt.n_max:
        print(f"probe_cost: error: need {need} tokens of text (have {len(ids)}) and prompt + new tokens <= "
              f"max-seq {rt.n_max}", file=sys.stderr)
        return 2
    prompts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.requests)]
    everies = [int(e) for e in args.every.split(",")]
    runs = []
    for rep in range(args.repeats):
        for every in everies:
            r = run_once(rt, prompts, args.new_tokens, every)
            r["repeat"] = rep
            runs.append(r)
            print(json.dumps(r), flush=True)
    summary = {}
    for every in everies:
        tps = [r["decode_tokens_per_s"] for r in runs if r["every"] == every]
        if tps:  # --repeats 0: only the step pairs
            summary[every] = sum(tps) / len(tps)
    base = summary.get(0)
    for every, tps in summary.items():
        rel = "" if base is None else f"  ({(base / tps - 1) * 100:+.1f} % time per token vs no probe)"
        print(f"every {every}: {tps:.1f} decode tokens/s{rel}")
    pairs = None
    if args.pairs:
        pairs = step_pairs(rt, prompts, args.pairs)
        print(json.dumps(pairs))
        per = pairs["probed_over_plain"] - 1
        for every in everies:
            if every:
                print(f"every {every}: expected +{per / every * 100:.1f} % decode time (a probed step costs "
                      f"{pairs['probed_over_plain']:.2f} plain ones)")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                        "mean_tokens_per_s": summary, "step_pairs": pairs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
