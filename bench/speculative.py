"""Speculative decoding and prefix reuse on a real bundle, three modes on four workloads, each mode in a fresh process
(its peak RSS beside its speed), and llama.cpp's server with and without its n-gram speculation on the same prompts
where it is built. Modes: off (no drafting, no prefix cache: every prompt prefilled whole), prefix (the prefix cache
alone), auto (both, the default), and with --draft-bundle D draft (auto, and D's greedy tokens where prompt lookup
finds none: runtime.draft_model; a D step's cost against the target's, timed at load, is printed).

Workloads (greedy; the same tokens in every mode is checked and printed):
- inspection: the inspection app's detections (examples/inspection), its chat prompt with worked examples and the
  report schema as structured output; time to report = the request's whole time, one request at a time, the mean
  over all five; as in the app, the report schema is compiled and the prompts' shared prefix prefilled when the
  process starts (Runtime.warm_format, Runtime.warm_prefix; their times are printed apart);
- chat: eight questions through the chat template, answers up to 128 tokens;
- story: eight held-out TinyStories openings (tinystories_eval.txt, ~200 tokens each), continued 128 tokens;
- engine8: the inspection detections, 8 at once through the Engine (continuous batching): aggregate tokens/s.

    python bench/speculative.py --bundle B --engine-bundle B8 [--threads 2] [--repeat 2] [--json out.json] \
        [--llama DIR] [--draft-bundle D] [--modes off,auto,...]
        (DIR: scripts/llama_server.sh's; B8: B's build with --max-seq 4352 --max-batch 8)

Each mode runs `--repeat` times, alternating; a workload's figure is its fastest run (this machine's timing noise
is one-sided). Run it alone: another busy process makes every figure meaningless.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # its helpers, also where it is imported as bench.speculative
from llama_server import DEFAULT_DIR, LlamaServer, binary  # noqa: E402
from proc_status import proc_status_mib  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
QUESTIONS = (
    "What is the difference between a crack and a scratch on a metal part?",
    "Explain in a few sentences how a conveyor belt works.",
    "Give three tips for keeping a workshop clean and safe.",
    "Why do castings sometimes have small holes in them?",
    "Describe what a quality inspector does during a shift.",
    "What is rust and how can it be prevented?",
    "Write a short note to a colleague asking them to check machine 4.",
    "List the steps to replace a worn drill bit.",
)
N_STORIES, STORY_PROMPT, NEW_TOKENS = 8, 200, 128
MODES = ("off", "prefix", "auto")
ALL_MODES = (*MODES, "draft")


def story_prompts(rt) -> list[list[int]]:
    """N_STORIES held-out openings of STORY_PROMPT tokens: consecutive paragraphs of tinystories_eval.txt from every
    20th paragraph on, joined until they hold that many tokens."""
    paras = [p for p in (DATA / "tinystories_eval.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out = []
    for start in range(0, 20 * N_STORIES, 20):
        ids, i = [], start
        while len(ids) < STORY_PROMPT:
            ids = rt.encode("\n\n".join(paras[start:i + 1]))
            i += 1
        out.append(ids[:STORY_PROMPT])
    return out


def child(bundle: Path, mode: str, threads: int, part: str, draft: Path | None = None) -> dict:
    """One mode's single-request workloads (part "single") or its engine workload ("engine"); the figures and the
    token ids (for the identity check)."""
    sys.path.insert(0, str(ROOT))
    import runtime
    from examples.inspection.inspect_defects import RESPONSE_FORMAT, messages, read_detections
    from runtime.prefix_cache import DEFAULT_PREFIX_CACHE_MIB
    from runtime.request import TokenStream

    rt = runtime.load(bundle, threads=threads, speculative="off" if mode in ("off", "prefix") else "auto",
                      prefix_cache_mib=0 if mode == "off" else DEFAULT_PREFIX_CACHE_MIB,
                      draft_bundle=draft if mode == "draft" else None)
    dets = read_detections(ROOT / "examples" / "inspection" / "detections.jsonl")
    res: dict = {"mode": mode, "draft_cost": None if rt.draft is None else rt.draft.cost}

    def timed(name: str, reqs) -> None:
        ids, prompts, drafted, accepted, t0 = [], [], 0, 0, time.perf_counter()
        times, decode_s = [], 0.0
        for make in reqs:
            t = time.perf_counter()
            req = make()
            stream = TokenStream(rt, req)
            first = None
            for _ in stream:
                first = first or time.perf_counter()
            end = time.perf_counter()
            times.append(end - t)
            decode_s += end - (first or end)
            ids.append(stream.ids)
            prompts.append(list(req.prompt_ids))
            d, k = req.draft_counts
            drafted, accepted = drafted + d, accepted + k
        wall = time.perf_counter() - t0
        res[name] = {"wall_s": wall, "tokens": sum(map(len, ids)), "per_request_s": times, "ids": ids,
                     "prompts": prompts, "drafted": drafted, "accepted": accepted, "decode_s": decode_s,
                     "decode_tokens": sum(max(0, len(i) - 1) for i in ids)}

    chat_kw = dict(temperature=0.0)
    # as the inspection app does at start, in every mode: the report schema compiled, the system prompt and worked
    # examples prefilled once (none: cache off)
    t = time.perf_counter()
    rt.warm_format(RESPONSE_FORMAT)
    res["format_s"] = time.perf_counter() - t
    t = time.perf_counter()
    res["warm_tokens"] = rt.warm_prefix(messages(dets[0])[:-1])
    res["warm_s"] = time.perf_counter() - t
    if part == "engine":
        engine8(rt, dets, res)
        res["peak_rss_mib"] = proc_status_mib("VmHWM")
        return res
    timed("inspection", [lambda d=d: rt.chat_request(messages(d), 80, response_format=RESPONSE_FORMAT, **chat_kw)
                         for d in dets])
    timed("chat", [lambda q=q: rt.chat_request([{"role": "user", "content": q}], NEW_TOKENS, **chat_kw)
                   for q in QUESTIONS])
    timed("story", [lambda p=p: rt.request(p, NEW_TOKENS, stop_ids=[], **chat_kw) for p in story_prompts(rt)])
    res["peak_rss_mib"] = proc_status_mib("VmHWM")
    return res


def engine8(rt, dets, res: dict) -> None:
    """The inspection detections, 8 requests at once through the Engine."""
    from examples.inspection.inspect_defects import RESPONSE_FORMAT, messages
    from runtime.engine import Engine, EngineConfig, Observer

    class Count(Observer):
        drafted = accepted = 0

        def on_drafts(self, req, d, a):
            Count.drafted += d
            Count.accepted += a

    # the KV-noise fallback refreshes an INT4-mix cache at FP16 (its noise is ~0.1 > 0.05): off here, as the
    # inspection bundle's deployment would set it
    with Engine(rt, EngineConfig(max_running=8, max_kv_noise=None, min_hit_rate=0), observer=Count()) as eng:
        eng.ready.wait()
        t0 = time.perf_counter()
        hs = [eng.submit_chat(messages(dets[i % len(dets)]), 80, response_format=RESPONSE_FORMAT, temperature=0.0)
              for i in range(8)]
        ids = [h.result(600).ids for h in hs]
        wall = time.perf_counter() - t0
    res["engine8"] = {"wall_s": wall, "tokens": sum(map(len, ids)), "ids": ids, "drafted": Count.drafted,
                      "accepted": Count.accepted}


def lookup_ceiling(prompts: list[list[int]], outputs: list[list[int]], row_cost: float) -> float:
    """Decode speed-up prompt lookup can give a workload at most, replayed on its non-speculative greedy tokens: the
    request's drafts and adaptive rule (runtime.speculative) at each step, a verification of k drafts costing
    1 + row_cost * k one-token steps and yielding its agreeing prefix + 1 (the bound of the drafter, not of a
    backend: timing overheads are left out)."""
    from runtime.speculative import DraftLength, NgramDrafts, SpeculativeConfig

    cfg = SpeculativeConfig(row_cost=row_cost)
    cost = made = 0.0
    for prompt, out in zip(prompts, outputs):
        drafts, rule, i = NgramDrafts([*prompt, *out[:1]], cfg), DraftLength(cfg), 0
        while i < len(out) - 1:
            guess = drafts.propose(rule.length(len(out) - 1 - i))
            kept = next((j for j, t in enumerate(guess) if i + 1 + j >= len(out) or out[i + 1 + j] != t), len(guess))
            if guess:
                rule.record(len(guess), kept)
            drafts.extend(out[i + 1:i + 2 + kept])
            cost, made, i = cost + 1 + row_cost * len(guess), made + 1 + kept, i + 1 + kept
    return made / cost if cost else 1.0


def run_child(bundle: Path, mode: str, threads: int, part: str, draft: Path | None) -> dict:
    r = subprocess.run([sys.executable, __file__, "--bundle", str(bundle), "--threads", str(threads), "--child", mode,
                        "--part", part, *(["--draft-bundle", str(draft)] if draft else [])],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_server(d: Path, bundle: Path, threads: int) -> dict | None:
    """llama.cpp's server on the user's Q4_1 file, plain and with its n-gram speculation (`--spec-type ngram-simple`,
    prompt lookup), on the same workloads: the inspection prompts with the report schema (its `response_format`),
    the chat questions, the story openings as raw text; decode tokens/s and time to report from the server's own
    timings (its default prompt cache on, as a user gets it), its peak RSS. None when llama-server is not built."""
    server = binary(d)
    if server is None:
        return None
    sys.path.insert(0, str(ROOT))
    import runtime
    from examples.inspection.inspect_defects import RESPONSE_FORMAT, messages, read_detections

    rt = runtime.load(bundle, threads=threads, speculative="off")
    stories = [rt.decode(p) for p in story_prompts(rt)]
    dets = read_detections(ROOT / "examples" / "inspection" / "detections.jsonl")
    gguf = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = {}
    for name, extra in (("llama.cpp", ()), ("llama.cpp ngram-simple", ("--spec-type", "ngram-simple"))):
        with LlamaServer(server, gguf, threads=threads, ctx=4096, extra=extra) as srv:
            res = {}
            for work, bodies in (
                    ("inspection", [("/v1/chat/completions", {"messages": messages(x), "max_tokens": 80,
                                                              "temperature": 0, "response_format": RESPONSE_FORMAT})
                                    for x in dets]),
                    ("chat", [("/v1/chat/completions", {"messages": [{"role": "user", "content": q}],
                                                        "max_tokens": NEW_TOKENS, "temperature": 0})
                              for q in QUESTIONS]),
                    ("story", [("/completion", {"prompt": t, "n_predict": NEW_TOKENS, "temperature": 0,
                                                "ignore_eos": True}) for t in stories])):
                n = ms = total_ms = drafted = kept = 0.0
                for path, body in bodies:
                    t = srv.post(path, body)["timings"]
                    n += t["predicted_n"]
                    ms += t["predicted_ms"]
                    total_ms += t["predicted_ms"] + t["prompt_ms"]
                    drafted += t.get("draft_n", 0)
                    kept += t.get("draft_n_accepted", 0)
                res[work] = {"tok_s": n / ms * 1000, "request_s": total_ms / 1000 / len(bodies), "drafted": drafted,
                             "kept": kept / drafted if drafted else float("nan")}
            res["peak_rss_mib"] = srv.peak_rss_mib()
            out[name] = res
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--llama", type=Path, default=DEFAULT_DIR,
                   help="where scripts/llama_server.sh put bin/llama-server")
    p.add_argument("--engine-bundle", type=Path, help="the bundle of the engine workload (built with --max-batch 8; "
                                                           "default --bundle)")
    p.add_argument("--draft-bundle", type=Path, help="adds the mode draft: this bundle's greedy tokens as the drafts "
                                                          "(the same tokenizer as --bundle)")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(ALL_MODES)} (default: all; draft with "
                                   "--draft-bundle); the first is the others' reference")
    p.add_argument("--child", choices=ALL_MODES, help=argparse.SUPPRESS)
    p.add_argument("--part", choices=["single", "engine"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.bundle, a.child, a.threads, a.part, a.draft_bundle)))
        return 0
    modes = tuple(a.modes.split(",")) if a.modes else MODES + (("draft",) if a.draft_bundle else ())
    if not set(modes) <= set(ALL_MODES) or ("draft" in modes and a.draft_bundle is None):
        p.error(f"--modes: each of {', '.join(ALL_MODES)} (draft needs --draft-bundle), got {a.modes}")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.repeat):
        for mode in modes:
            one = run_child(a.bundle, mode, a.threads, "single", a.draft_bundle)
            eng = run_child(a.engine_bundle or a.bundle, mode, a.threads, "engine", a.draft_bundle)
            runs[mode].append({**one, "engine8": eng["engine8"], "engine_rss_mib": eng["peak_rss_mib"]})
            print(f"  {mode}: " + ", ".join(f"{w} {runs[mode][-1][w]['wall_s']:.2f} s"
                                           for w in ("inspection", "chat", "story", "engine8")), file=sys.stderr)
    works = ("inspection", "chat", "story")
    same = {w: all(r[w]["ids"] == runs[modes[0]][0][w]["ids"] for m in modes for r in runs[m])
            for w in (*works, "engine8")}
    print(f"bundle {a.bundle.name}, {a.threads} threads, best of {a.repeat} fresh processes per mode; the same tokens "
          "in every mode: " + ", ".join(f"{w} {'yes' if ok else 'NO'}" for w, ok in same.items()))
    print("| engine | inspection s/report | inspection tok/s | chat tok/s | story tok/s | drafts kept | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in modes:
        def best(w: str, key: str, rs=runs[m]) -> dict:
            return min((r[w] for r in rs), key=lambda x: x[key])
        insp = best("inspection", "wall_s")
        cells = [f"{insp['wall_s'] / len(insp['per_request_s']):.3f}"]
        for w in works:
            b = best(w, "decode_s")
            cells.append(f"{b['decode_tokens'] / b['decode_s']:.1f}")
        kept = "/".join(f"{r[w]['accepted'] / r[w]['drafted']:.2f}" if r[w]["drafted"] else "-"
                        for r in runs[m][:1] for w in works)
        print(f"| gsm-edge {m} | " + " | ".join(cells) + f" | {kept} | {max(r['peak_rss_mib'] for r in runs[m]):.0f} |")
    costs = [r["draft_cost"] for m in modes for r in runs[m] if r["draft_cost"] is not None]
    if costs:
        print(f"draft bundle {a.draft_bundle.name}: a step costs {min(costs):.2f}-{max(costs):.2f} of the target's "
              "(measured at load)")
    from runtime.ort_backend import VERIFY_ROW_COST

    off = runs[modes[0]][0]
    print("prompt-lookup ceiling (the off run's tokens replayed through the drafter and its rule; a verified row "
          "costing c one-token steps): " + ", ".join(
              f"{w} {lookup_ceiling(off[w]['prompts'], off[w]['ids'], VERIFY_ROW_COST):.2f}x at c={VERIFY_ROW_COST} / "
              f"{lookup_ceiling(off[w]['prompts'], off[w]['ids'], 0.01):.2f}x at c=0.01" for w in works))
    print("inspection schema compiled and prefix prefilled at start (Runtime.warm_format, warm_prefix, as the app "
          "does): " + ", ".join(f"{m} {min(r['format_s'] for r in runs[m]):.3f} s, {runs[m][0]['warm_tokens']} "
                                f"tokens in {min(r['warm_s'] for r in runs[m]):.3f} s" for m in modes))
    anchors = llama_server(a.llama, a.bundle, a.threads)
    if anchors is None:
        print(f"| llama.cpp | not run: {a.llama / 'bin' / 'llama-server'} not built (scripts/llama_server.sh) |")
    else:
        for name, v in anchors.items():
            print(f"| {name} | {v['inspection']['request_s']:.3f} | {v['inspection']['tok_s']:.1f} | "
                  f"{v['chat']['tok_s']:.1f} | {v['story']['tok_s']:.1f} | "
                  + "/".join("-" if math.isnan(v[w]["kept"]) else f"{v[w]['kept']:.2f}" for w in works)
                  + f" | {v['peak_rss_mib']:.0f} |")
    e = {m: min((r["engine8"] for r in runs[m]), key=lambda x: x["wall_s"]) for m in modes}
    print(f"engine8 ({(a.engine_bundle or a.bundle).name}, 8 inspection requests at once, fallbacks off): "
          + ", ".join(f"{m} {e[m]['tokens'] / e[m]['wall_s']:.1f} tok/s" for m in modes)
          + "; drafts kept " + ", ".join(f"{m} {e[m]['accepted']}/{e[m]['drafted']}" for m in modes if e[m]["drafted"])
          + "; peak RSS "
          + " / ".join(f"{max(r['engine_rss_mib'] for r in runs[m]):.0f}" for m in modes) + " MiB")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "anchors": anchors}, indent=1))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
