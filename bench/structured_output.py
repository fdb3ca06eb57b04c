"""Structured output on a real bundle: how often the output validates, and what the token mask costs.

    python bench/structured_output.py --bundle B8 --generations 200 --out bench-structured.json

1. Validity: `--generations` chat requests (the inspection app's detections and a few other prompts) under
   four JSON schemas (enums, integers with bounds, nested arrays, strings with lengths) at temperatures
   0..1.2 and several seeds, all submitted to one continuous-batching engine; each finished answer is
   parsed and validated with `jsonschema`; an answer cut by max_tokens is counted apart (a schema without
   length bounds can outgrow any limit).
2. Cost: decode tokens/s of the same requests with and without the schema, at batch 1 (one request at a
   time) and batch `--batch` (that many concurrent), alternated `--rounds` times. The unconstrained run of a
   request generates exactly as many tokens as its constrained run did (max_tokens = that count, no stop
   id), so both keep the same batch occupancy step by step and differ only by the mask. And the time inside
   the mask (llguidance's next-token bitmask and the token's consumption) per decode step, measured around
   the constraint's own calls.
Figures are for this machine's CPU and the bundle's backend (onnxruntime by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMAS = {
    "report": {"type": "object", "properties": {"description": {"type": "string", "minLength": 8, "maxLength": 120},
                                                "severity": {"enum": ["low", "medium", "high"]}},
               "required": ["description", "severity"], "additionalProperties": False},
    "measure": {"type": "object", "properties": {"part": {"type": "string", "maxLength": 16},
                                                 "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                                                 "ok": {"type": "boolean"}},
                "required": ["part", "count", "ok"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["scratch", "dent",
                                                                                           "crack", "stain"]},
                                                       "minItems": 1, "maxItems": 4}},
             "required": ["tags"], "additionalProperties": False},
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                "city": {"type": "string", "maxLength": 24}},
               "required": ["name", "age"], "additionalProperties": False},
}
PROMPTS = [
    "Describe the defect: a scratch on part BRK-0001, confidence 0.81, near the edge. Answer in JSON.",
    "Part HSG-0107 shows a crack of 12 mm at the weld seam. Give a JSON report.",
    "Count the dents on panel P-44 and say whether it passes. Reply as JSON.",
    "Tag this finding: discoloration and a small dent on the housing. JSON only.",
    "Tell me about a person who lives in Lyon, as JSON.",
    "Write a short JSON record of a stain found on a white cover.",
]
TEMPERATURES = (0.0, 0.4, 0.8, 1.2)


def fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


class MaskTimer:
    """Wraps runtime.constrained.GrammarConstraint's calls to time them (seconds per call)."""

    def __init__(self) -> None:
        from runtime import constrained

        self.mod, self.allowed, self.advance = constrained, [], []
        self._orig = (constrained.GrammarConstraint.allowed, constrained.GrammarConstraint.advance)

    def __enter__(self) -> MaskTimer:
        orig_allowed, orig_advance = self._orig

        def allowed(c):
            t = time.perf_counter()
            r = orig_allowed(c)
            self.allowed.append(time.perf_counter() - t)
            return r

        def advance(c, tok):
            t = time.perf_counter()
            orig_advance(c, tok)
            self.advance.append(time.perf_counter() - t)

        self.mod.GrammarConstraint.allowed, self.mod.GrammarConstraint.advance = allowed, advance
        return self

    def __exit__(self, *exc) -> None:
        self.mod.GrammarConstraint.allowed, self.mod.GrammarConstraint.advance = self._orig


def decode_rate(reqs) -> float:
    """Decode tokens per second over the requests: tokens after the first / time after the first."""
    toks = sum(max(0, len(r.ids) - 1) for r in reqs)
    span = max(r.t_end for r in reqs) - min(r.t_first for r in reqs if r.t_first is not None)
    return toks / span if span > 0 else float("nan")


def run(eng, jobs, concurrent: int):
    """Submit `jobs` (messages, kw) `concurrent` at a time; returns the finished requests. Each group is
    submitted under the engine's lock, so it starts in one step as a batch that arrives at once does (a
    constrained submit compiles its grammar, about a millisecond: unlocked, the engine would start the first
    requests alone and prefill the rest in a later step, and the comparison would measure that)."""
    done = []
    for i in range(0, len(jobs), concurrent):
        with eng._cond:
            batch = [eng.submit_chat(m, kw.pop("max_tokens"), **kw) for m, kw in [(m, dict(k)) for m, k in
                                                                                jobs[i:i + concurrent]]]
        for r in batch:
            r.result(600)
        done += batch
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--generations", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speed-requests", type=int, default=8, help="requests per speed configuration")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import jsonschema

    import runtime
    from runtime.engine import Engine, EngineConfig

    rt = runtime.load(args.bundle, args.backend, threads=args.threads)
    cfg = EngineConfig(max_running=args.batch, min_hit_rate=0.0, max_kv_noise=None)
    names = list(SCHEMAS)
    jobs = []
    for i in range(args.generations):
        name, temp = names[i % len(names)], TEMPERATURES[(i // len(names)) % len(TEMPERATURES)]
        msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        jobs.append((msgs, dict(max_tokens=args.max_tokens, temperature=temp, seed=i, response_format=fmt(name)),
                     name))
    out: dict = {"bundle": str(args.bundle), "backend": rt.backend.name, "schemas": names}
    with Engine(rt, cfg) as eng:
        eng.ready.wait()
        t0 = time.monotonic()
        with MaskTimer() as mt:
            reqs = run(eng, [(m, kw) for m, kw, _ in jobs], args.batch)
        wall = time.monotonic() - t0
        valid = invalid = cut = 0
        failures = []
        for (_, _, name), r in zip(jobs, reqs):
            if r.finish_reason != "stop":
                cut += 1
                continue
            try:
                jsonschema.validate(json.loads(r.text), SCHEMAS[name])
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                invalid += 1
                failures.append({"schema": name, "text": r.text, "error": str(e)[:200]})
        steps = len(mt.allowed)
        out["validity"] = {"generations": len(reqs), "valid": valid, "invalid": invalid, "cut_by_max_tokens": cut,
                           "wall_s": round(wall, 1), "failures": failures[:5],
                           "mask_us_per_step": {"p50": 1e6 * statistics.median(mt.allowed),
                                                "mean": 1e6 * statistics.fmean(mt.allowed),
                                                "p99": 1e6 * sorted(mt.allowed)[int(0.99 * (steps - 1))]},
                           "consume_us_per_step": 1e6 * statistics.fmean(mt.advance), "steps": steps}
        print(f"validity: {valid}/{len(reqs) - cut} finished answers valid ({invalid} invalid), {cut} cut by "
              f"max_tokens, {wall:.0f} s; mask {out['validity']['mask_us_per_step']['p50']:.0f} us/step median "
              f"({out['validity']['mask_us_per_step']['p99']:.0f} p99), consume "
              f"{out['validity']['consume_us_per_step']:.0f} us", file=sys.stderr)
        speed: dict = {}
        sjobs = [(m, kw) for m, kw, _ in jobs[:args.speed_requests]]
        for rnd in range(args.rounds):
            for conc in (1, args.batch):
                done = run(eng, sjobs, conc)
                plain = [(m, {**{k: v for k, v in kw.items() if k != "response_format"}, "max_tokens": len(r.ids),
                              "stop_ids": []}) for (m, kw), r in zip(sjobs, done)]
                for label, rate in (("schema", decode_rate(done)), ("plain", decode_rate(run(eng, plain, conc)))):
                    speed.setdefault(f"batch {conc}", {}).setdefault(label, []).append(round(rate, 2))
                    print(f"round {rnd + 1} batch {conc:>2} {label:>6}: {rate:.2f} decode tok/s", file=sys.stderr)
        out["speed"] = speed
        for key, v in speed.items():
            p, s = max(v["plain"]), max(v["schema"])
            print(f"{key}: best plain {p:.2f}, schema {s:.2f} tok/s ({100 * (s / p - 1):+.1f} %)", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
