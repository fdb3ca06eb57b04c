"""What a knob patch buys (docs/serving.md "Changing knobs"): the GSM description's window and adaptation-rate
settings on one bundle, each applied as a running server applies a patch (gsm.bundle_knobs.patch_knobs, the bundle's
limits), on held-out story text and on a chat transcript.

    python bench/knobs.py BUNDLE [--threads 2] [--prompt 1024] [--decode 2100] [--json out.json]

BUNDLE must have room for the longest rate (`builder build ... --max-adaptation-rate 2000`). For each setting and
text: a fresh sequence prefills the first --prompt tokens, then is fed the next --decode tokens one decode step each
(teacher forcing, so every setting reads the same tokens); printed are the perplexity of those --decode tokens, the
decode speed, the rows each tier holds at the end and the latent + indexer-key bytes per position in use, averaged
over the decode steps (the pools themselves are the memory plan's, fixed at load whatever the knobs). The re-tier
pass comes every `rate` decode steps, so --decode must exceed the longest rate for it to show. Timing on this 2-core
machine is only meaningful alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import runtime
from gsm.bundle_knobs import patch_knobs
from gsm.tiers import NAMES as TIERS
from runtime.metrics import CacheGeometry, cache_bytes

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# name -> JSON Patch (the description's tuning: window 2 for news, 5 for code; rate 500 for dialogue, 2000 for Q&A)
SETTINGS = {
    "as built": [],
    "window 2": [{"op": "replace", "path": "/run_time/sparse_window", "value": 2}],
    "window 3": [{"op": "replace", "path": "/run_time/sparse_window", "value": 3}],
    "window 5": [{"op": "replace", "path": "/run_time/sparse_window", "value": 5}],
    # the short rate a many-sequence build uses to shrink each sequence's FP16 rows (docs/runtime.md)
    "rate 128": [{"op": "replace", "path": "/quantization_adaptation_rate", "value": 128}],
    "rate 500": [{"op": "replace", "path": "/quantization_adaptation_rate", "value": 500}],
    "rate 2000": [{"op": "replace", "path": "/quantization_adaptation_rate", "value": 2000}],
}


def texts(rt: runtime.Runtime, n: int) -> dict[str, list[int]]:
    """Token ids of held-out stories (tinystories_eval.txt from its start) and of a chat transcript (the template's
    turns: a user asks for a story, the assistant tells one of the later stories), each at least n long."""
    paras = [p for p in (DATA / "tinystories_eval.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    story, i = [], 0
    while len(story) < n:
        i += 40
        story = rt.encode("\n\n".join(paras[:i]))
    out = {"story": story[:n]}
    if rt.has_chat_template:
        msgs, j = [], len(paras) // 2
        ids: list[int] = []
        while len(ids) < n:
            msgs += [{"role": "user", "content": "Tell me a short story."}, {"role": "assistant", "content": paras[j]}]
            j += 1
            ids = rt.chat_ids(msgs)
        out["chat"] = ids[:n]
    return out


def run(rt: runtime.Runtime, ids: list[int], prompt: int, geo: CacheGeometry) -> dict[str, float]:
    seq = rt.new_sequence()
    logits = seq.prefill(ids[:prompt])
    nll, per_pos = 0.0, []
    t0 = time.perf_counter()
    for t in range(prompt, len(ids)):
        lg = np.asarray(logits, np.float64)
        m = lg.max()
        nll -= lg[ids[t]] - m - math.log(np.exp(lg - m).sum())
        if t + 1 < len(ids):
            logits = seq.decode(ids[t])
            counts = np.bincount(seq.state.tier, minlength=4)[:4]
            per_pos.append(sum(cache_bytes(counts, geo).values()) / seq.length)
    dt = time.perf_counter() - t0
    n = len(ids) - prompt
    counts = np.bincount(seq.state.tier, minlength=4)[:4]
    seq.close()
    return {"perplexity": math.exp(nll / n), "decode_tok_s": (n - 1) / dt,
            "bytes_per_position": float(np.mean(per_pos)), "dense_fp16_bytes_per_position": geo.dense_fp16_bytes,
            **{f"rows_{t}": int(c) for t, c in zip(TIERS, counts)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024, help="tokens prefilled before the scored decode steps")
    ap.add_argument("--decode", type=int, default=2100, help="tokens fed by decode steps and scored")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rt = runtime.load(a.bundle, "onnxruntime", threads=a.threads, speculative="off", prefix_cache_mib=0)
    geo = CacheGeometry.from_bundle(rt.cfg, json.loads((a.bundle / "config.json").read_text(encoding="utf-8")))
    base = rt.knobs
    inputs = texts(rt, a.prompt + a.decode)  # the same token ids for every setting
    rows = []
    for name in a.settings.split(","):
        ops = SETTINGS[name]
        rt.set_knobs(patch_knobs(base, ops, rt.cfg.knob_limits) if ops else base)
        for text, ids in inputs.items():
            r = {"setting": name, "text": text, **run(rt, ids, a.prompt, geo)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{a.bundle.name}: {a.prompt} tokens prefilled, {a.decode} decoded (teacher-forced), {a.threads} threads, "
          f"backend {rt.backend.name} ({rt.backend.capabilities.graph})")
    print("| setting | text | perplexity | decode tok/s | KV bytes/position in use (x dense FP16) | "
          "rows FP16/INT8/INT4 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['setting']} | {r['text']} | {r['perplexity']:.3f} | {r['decode_tok_s']:.1f} | "
              f"{r['bytes_per_position']:,.0f} ({r['bytes_per_position'] / r['dense_fp16_bytes_per_position']:.3f}x) | "
              f"{r['rows_fp16']}/{r['rows_int8']}/{r['rows_int4']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
