"""Speculative decoding on a real bundle: drafting off vs auto on four workloads, each mode in a fresh process (its
peak RSS beside its speed), and llama.cpp's prompt-lookup decoding (`llama-lookup`) on the same prompts where that
tool is built.

Workloads (greedy; the same tokens with drafting on and off is checked and printed):
- inspection: the inspection app's detections (examples/inspection), its chat prompt with worked examples and the
  report schema as structured output; time to report = the request's whole time, one request at a time;
- chat: eight questions through the chat template, answers up to 128 tokens;
- story: eight held-out TinyStories openings (tinystories_eval.txt, ~200 tokens each), continued 128 tokens;
- engine8: the inspection detections, 8 at once through the Engine (continuous batching): aggregate tokens/s.

    python bench/speculative.py --bundle B [--threads 2] [--repeat 2] [--json out.json] [--llama DIR]

Each mode runs `--repeat` times, alternating; a workload's figure is its fastest run (this machine's timing noise
is one-sided). Run it alone: another busy process makes every figure meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def story_prompts(rt) -> list[list[int]]:
    """The first ~STORY_PROMPT tokens of the first N_STORIES held-out stories long enough to hold them."""
    paras = [p for p in (DATA / "tinystories_eval.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out = []
    for p in paras:
        ids = rt.encode(p)
        if len(ids) >= STORY_PROMPT + 20:
            out.append(ids[:STORY_PROMPT])
        if len(out) == N_STORIES:
            break
    return out


def child(bundle: Path, mode: str, threads: int) -> dict:
    """Every workload in one mode; the figures and the token ids (for the identity check)."""
    sys.path.insert(0, str(ROOT))
    import runtime
    from examples.inspection.inspect_defects import RESPONSE_FORMAT, messages, read_detections
    from runtime.engine import Engine, EngineConfig, Observer
    from runtime.request import TokenStream

    rt = runtime.load(bundle, threads=threads, speculative=mode)
    dets = read_detections(ROOT / "examples" / "inspection" / "detections.jsonl")
    res: dict = {"mode": mode}

    def timed(name: str, reqs) -> None:
        ids, drafted, accepted, t0 = [], 0, 0, time.perf_counter()
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
            if req.draft_length is not None:
                drafted += req.draft_length.drafted
                accepted += req.draft_length.accepted
        wall = time.perf_counter() - t0
        res[name] = {"wall_s": wall, "tokens": sum(map(len, ids)), "per_request_s": times, "ids": ids,
                     "drafted": drafted, "accepted": accepted, "decode_s": decode_s,
                     "decode_tokens": sum(max(0, len(i) - 1) for i in ids)}

    chat_kw = dict(temperature=0.0)
    timed("inspection", [lambda d=d: rt.chat_request(messages(d), 80, response_format=RESPONSE_FORMAT, **chat_kw)
                         for d in dets])
    timed("chat", [lambda q=q: rt.chat_request([{"role": "user", "content": q}], NEW_TOKENS, **chat_kw)
                   for q in QUESTIONS])
    timed("story", [lambda p=p: rt.request(p, NEW_TOKENS, stop_ids=[], **chat_kw) for p in story_prompts(rt)])

    class Count(Observer):
        drafted = accepted = 0

        def on_drafts(self, req, d, a):
            Count.drafted += d
            Count.accepted += a

    with Engine(rt, EngineConfig(max_running=8), observer=Count()) as eng:
        eng.ready.wait()
        t0 = time.perf_counter()
        hs = [eng.submit_chat(messages(dets[i % len(dets)]), 80, response_format=RESPONSE_FORMAT, temperature=0.0)
              for i in range(8)]
        ids = [h.result(600).ids for h in hs]
        wall = time.perf_counter() - t0
    res["engine8"] = {"wall_s": wall, "tokens": sum(map(len, ids)), "ids": ids, "drafted": Count.drafted,
                      "accepted": Count.accepted}
    res["peak_rss_mib"] = peak_rss_mib()
    return res


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(bundle: Path, mode: str, threads: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--bundle", str(bundle), "--threads", str(threads), "--child", mode],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_lookup(d: Path, bundle: Path, threads: int) -> dict | None:
    """llama.cpp's prompt-lookup decoding (`llama-lookup`, draft 8) and plain decoding (`llama-completion`) on the
    story prompts (raw text: the tool takes no chat messages): decode tokens/s from each tool's own timing lines."""
    lookup, plain = d / "bin" / "llama-lookup", d / "bin" / "llama-completion"
    gguf = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not lookup.is_file():
        return None
    sys.path.insert(0, str(ROOT))
    import runtime

    rt = runtime.load(bundle, threads=threads, speculative="off")
    prompts = [rt.decode(p) for p in story_prompts(rt)]
    out = {}
    for name, tool, extra in (("llama.cpp", plain, ["-no-cnv"]), ("llama.cpp lookup", lookup, ["--draft", "8"])):
        total_t = total_n = 0.0
        for text in prompts:
            cmd = [str(tool), "-m", str(gguf), "-p", text, "-n", str(NEW_TOKENS), "-t", str(threads), "--temp", "0",
                   "-c", "1024", "--ignore-eos", *extra]
            r = subprocess.run(cmd, capture_output=True, text=True)
            m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) (runs|tokens)", r.stderr.split("prompt eval")[-1])
            dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", r.stderr)
            if dec:  # llama-lookup's own summary
                total_n += int(dec.group(1))
                total_t += float(dec.group(2))
            elif m:
                total_t += float(m.group(1)) / 1000
                total_n += int(m.group(2))
        out[name] = {"tok_s": total_n / total_t if total_t else float("nan")}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--llama", type=Path, default=Path.home() / ".cache" / "gsm-edge" / "llama.cpp")
    p.add_argument("--child", choices=["off", "auto"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.bundle, a.child, a.threads)))
        return 0
    runs: dict[str, list[dict]] = {"off": [], "auto": []}
    for _ in range(a.repeat):
        for mode in ("off", "auto"):
            runs[mode].append(run_child(a.bundle, mode, a.threads))
            print(f"  {mode}: " + ", ".join(f"{w} {runs[mode][-1][w]['wall_s']:.2f} s"
                                           for w in ("inspection", "chat", "story", "engine8")), file=sys.stderr)
    best = {m: {w: min(r[w]["wall_s"] for r in rs) for w in ("inspection", "chat", "story", "engine8")}
            for m, rs in runs.items()}
    rows = []
    for w in ("inspection", "chat", "story", "engine8"):
        off, on = runs["off"][0][w], runs["auto"][0][w]
        same = all(r[w]["ids"] == off["ids"] for r in runs["off"] + runs["auto"])
        rate = on["accepted"] / on["drafted"] if on["drafted"] else float("nan")
        rows.append((w, off["tokens"], off["tokens"] / best["off"][w], on["tokens"] / best["auto"][w],
                     best["off"][w] / best["auto"][w], on["drafted"], rate, same))
    print(f"bundle {a.bundle.name}, {a.threads} threads, best of {a.repeat}; peak RSS off "
          f"{max(r['peak_rss_mib'] for r in runs['off']):.0f} MiB, auto "
          f"{max(r['peak_rss_mib'] for r in runs['auto']):.0f} MiB")
    print("| workload | tokens | off tok/s | auto tok/s | speed-up | drafted | kept | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for w, n, t_off, t_on, up, dr, rate, same in rows:
        print(f"| {w} | {n} | {t_off:.1f} | {t_on:.1f} | {up:.2f}x | {dr} | {rate:.2f} | {'yes' if same else 'NO'} |")
    insp = [min(r["inspection"]["per_request_s"][i] for r in runs[m]) for m in ("off", "auto")
            for i in range(len(runs[m][0]["inspection"]["per_request_s"]))]
    k = len(insp) // 2
    print(f"inspection time to report (mean of {k}): off {sum(insp[:k]) / k:.3f} s, auto {sum(insp[k:]) / k:.3f} s")
    for m in ("off", "auto"):
        st = min((r["story"] for r in runs[m]), key=lambda x: x["decode_s"])
        print(f"gsm-edge {m} on the story prompts: {st['decode_tokens'] / st['decode_s']:.1f} tok/s decode")
    anchors = llama_lookup(a.llama, a.bundle, a.threads)
    if anchors is None:
        print(f"llama.cpp lookup: {a.llama / 'bin' / 'llama-lookup'} not built (target llama-lookup of the source "
              "../shared/tools/llama_cpp.sh builds)")
    else:
        for name, v in anchors.items():
            print(f"{name} on the story prompts: {v['tok_s']:.1f} tok/s decode")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "anchors": anchors}, indent=1))
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
