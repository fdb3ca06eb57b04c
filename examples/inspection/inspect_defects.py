"""Inspection app: detections (JSON lines) -> an LLM description and severity per detection -> JSON report.

Runs the engine in-process (`--bundle`) or talks to `python -m runtime serve` with the plain OpenAI client
(`--server`). See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gsm.outputs import write_text_atomic

SEVERITIES = ("low", "medium", "high")
# What the model must answer, as data: decoding is constrained to it (response_format), so every finished
# answer parses; maxLength bounds the description so the object closes within --max-tokens.
REPORT_SCHEMA = {
    "type": "object",
    "properties": {"description": {"type": "string", "minLength": 8, "maxLength": 160},
                   "severity": {"enum": list(SEVERITIES)}},
    "required": ["description", "severity"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "defect_report", "schema": REPORT_SCHEMA,
                                                          "strict": True}}
SYSTEM = ("You are a quality inspector on a production line. Answer with a JSON object: \"description\", one "
          "sentence that describes the defect, and \"severity\": \"low\", \"medium\" or \"high\".")
# Worked examples before the real detection (--examples): they show a small model what to put in the fields
# (the schema fixes only their form).
EXAMPLES = (
    ("Part A-1: a scratch detected with confidence 0.60 at x=10, y=10, size 20x4 px. Sensor notes: light surface "
     "mark.", '{"description": "A light surface scratch on part A-1 that does not affect its function.", '
              '"severity": "low"}'),
    ("Part B-7: a crack detected with confidence 0.95 at x=200, y=30, size 8x50 px. Sensor notes: near a bolt "
     "hole.", '{"description": "A long crack next to a bolt hole of part B-7 that can grow under load.", '
              '"severity": "high"}'),
)
# Classes that weaken a part, whatever the confidence.
STRUCTURAL = frozenset({"crack", "porosity", "fracture", "missing_part"})


class DetectionError(ValueError):
    pass


@dataclass(frozen=True)
class Detection:
    part_id: str
    defect_class: str
    bbox: tuple[float, float, float, float]
    confidence: float
    sensor_notes: str

    @classmethod
    def from_json(cls, d: Any, where: str) -> Detection:
        if not isinstance(d, dict):
            raise DetectionError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for key, kind in (("part_id", str), ("defect_class", str)):
            if not isinstance(d.get(key), kind) or not d[key]:
                raise DetectionError(f"{where}: '{key}' must be a non-empty string, got {d.get(key)!r}")
        box = d.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and not
                                                                  isinstance(v, bool) for v in box)):
            raise DetectionError(f"{where}: 'bbox' must be [x, y, w, h] numbers, got {box!r}")
        c = d.get("confidence")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1:
            raise DetectionError(f"{where}: 'confidence' must be a number in [0, 1], got {c!r}")
        notes = d.get("sensor_notes", "")
        if not isinstance(notes, str):
            raise DetectionError(f"{where}: 'sensor_notes' must be a string, got {notes!r}")
        return cls(d["part_id"], d["defect_class"], tuple(float(v) for v in box), float(c), notes)

    def prompt(self) -> str:
        x, y, w, h = self.bbox
        notes = f" Sensor notes: {self.sensor_notes}." if self.sensor_notes else ""
        return (f"Part {self.part_id}: a {self.defect_class} detected with confidence {self.confidence:.2f} "
                f"at x={x:g}, y={y:g}, size {w:g}x{h:g} px.{notes}")


def read_detections(path: Path) -> list[Detection]:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise DetectionError(f"{path}:{i}: not JSON ({e})") from None
            out.append(Detection.from_json(d, f"{path}:{i}"))
    if not out:
        raise DetectionError(f"{path}: no detections")
    return out


def rule_severity(d: Detection) -> str:
    if d.defect_class in STRUCTURAL:
        return "high" if d.confidence >= 0.5 else "medium"
    return "medium" if d.confidence >= 0.8 else "low"


def parse_answer(text: str) -> tuple[str, str] | None:
    """(description, severity) of an answer in REPORT_SCHEMA's form; None when it is not one (cut short by
    --max-tokens, or a server without structured output)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(d, dict) or d.get("severity") not in SEVERITIES or not isinstance(d.get("description"), str):
        return None
    return " ".join(d["description"].split()), d["severity"]


@dataclass
class Item:
    part_id: str
    defect_class: str
    confidence: float
    description: str
    severity: str
    severity_source: str  # "model" | "rule"
    rule_severity: str  # the class/confidence rule's, beside the model's: a small model's judgement is weak
    finish_reason: str
    completion_tokens: int
    latency_s: float


def to_item(d: Detection, text: str, finish_reason: str, tokens: int, latency: float) -> Item:
    answer, rule = parse_answer(text), rule_severity(d)
    desc, sev = answer if answer is not None else ("", None)
    return Item(d.part_id, d.defect_class, d.confidence, desc, sev or rule, "rule" if sev is None else "model",
                rule, finish_reason, tokens, round(latency, 4))


def messages(d: Detection, examples: int = len(EXAMPLES)) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}]
    for question, answer in EXAMPLES[:examples]:
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return out + [{"role": "user", "content": d.prompt()}]


def plain_prompt(d: Detection, examples: int = len(EXAMPLES)) -> str:
    shots = "".join(f"Report: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES[:examples])
    return f"{SYSTEM}\n\n{shots}Report: {d.prompt()}\nAnswer:"


def run_in_process(bundle: Path, dets: Sequence[Detection], max_tokens: int,
                   examples: int = len(EXAMPLES), speculative: str = "auto",
                   draft_bundle: Path | None = None) -> tuple[str, list[Item], dict]:
    """All detections submitted at once to an in-process engine; answers collected in order. Also
    returns the engine's fallback counts (docs/serving.md, "Fallback policies") and its drafted and kept tokens."""
    import runtime
    from runtime.engine import Engine, Observer

    class Drafts(Observer):
        counts = {"drafted": 0, "accepted": 0}

        def on_drafts(self, req: Any, drafted: int, accepted: int) -> None:
            self.counts["drafted"] += drafted
            self.counts["accepted"] += accepted

    rt = runtime.load(bundle, speculative=speculative, draft_bundle=draft_bundle)
    drafts = Drafts()
    t = time.monotonic()
    # every prompt starts with the system prompt and the worked examples, and every report follows one schema: both
    # made ready once before the first detection
    rt.warm_format(RESPONSE_FORMAT)
    warm = rt.warm_prefix(messages(dets[0], examples)[:-1]) if rt.has_chat_template and dets else 0
    prefix = {"warm_tokens": warm, "warm_s": round(time.monotonic() - t, 3)}
    with Engine(rt, observer=drafts) as eng:
        eng.ready.wait()
        t0 = time.monotonic()
        kw = dict(temperature=0.0, response_format=RESPONSE_FORMAT)
        reqs = [eng.submit_chat(messages(d, examples), max_tokens, **kw) if rt.has_chat_template
                else eng.submit(plain_prompt(d, examples), max_tokens, **kw) for d in dets]
        items = []
        for d, r in zip(dets, reqs):
            r.result()
            items.append(to_item(d, r.text or "", r.finish_reason or "", len(r.ids), (r.t_end or t0) - r.t_submit))
        fallbacks = dict(eng.fallbacks)
    return bundle.resolve().name, items, {"fallbacks": fallbacks, "prefix": prefix,
                                          "speculative": {"mode": speculative, **drafts.counts}}


def run_http(url: str, dets: Sequence[Detection], max_tokens: int, examples: int = len(EXAMPLES),
             workers: int = 8, speculative: str = "auto") -> tuple[str, list[Item], dict]:
    """The same through the HTTP server with the plain OpenAI client (chat, else completions)."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=2, timeout=120)
    model = client.models.list().data[0].id
    use_chat = [True]

    def ask(d: Detection) -> Item:
        t0 = time.monotonic()
        if use_chat[0]:
            try:
                r = client.chat.completions.create(model=model, messages=messages(d, examples), max_tokens=max_tokens,
                                                   temperature=0, response_format=RESPONSE_FORMAT,
                                                   extra_body={"speculative": speculative})
                c = r.choices[0]
                return to_item(d, c.message.content or "", c.finish_reason, r.usage.completion_tokens,
                               time.monotonic() - t0)
            except openai.BadRequestError as e:
                if "chat template" not in str(e):
                    raise
                use_chat[0] = False
        r = client.completions.create(model=model, prompt=plain_prompt(d, examples), max_tokens=max_tokens,
                                      temperature=0, extra_body={"response_format": RESPONSE_FORMAT,
                                                                 "speculative": speculative})
        c = r.choices[0]
        return to_item(d, c.text, c.finish_reason, r.usage.completion_tokens, time.monotonic() - t0)

    with ThreadPoolExecutor(workers) as pool:
        return model, list(pool.map(ask, dets)), {}


def report(model: str, mode: str, items: Sequence[Item], wall_s: float, engine: dict | None = None) -> dict[str, Any]:
    out = {"model": model, "mode": mode, "created": int(time.time()), "wall_s": round(wall_s, 3),
           "summary": {"detections": len(items), "by_severity": dict(Counter(i.severity for i in items)),
                       "severity_from_model": sum(i.severity_source == "model" for i in items),
                       "severity_agrees_with_rule": sum(i.severity == i.rule_severity for i in items),
                       "completion_tokens": sum(i.completion_tokens for i in items)},
           "items": [asdict(i) for i in items]}
    if engine:
        out["engine"] = engine
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")  # never half a report


def main(argv: list[str] | None = None, *, err: Callable[[str], None] | None = None) -> int:
    err = err or (lambda m: print(f"inspect_defects: error: {m}", file=sys.stderr))
    p = argparse.ArgumentParser(prog="inspect_defects", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="run the engine in-process on this bundle")
    src.add_argument("--server", help="base URL of `python -m runtime serve` (e.g. http://127.0.0.1:8000)")
    p.add_argument("--detections", type=Path, required=True, help="JSON lines, one detection each")
    p.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    p.add_argument("--max-tokens", type=int, default=80, help="per answer (a 160-character description fits)")
    p.add_argument("--examples", type=int, choices=range(len(EXAMPLES) + 1), default=len(EXAMPLES),
                   help="worked examples before each detection (what a small model should put in the fields; "
                        "fewer: a shorter prompt)")
    p.add_argument("--speculative", choices=["auto", "off"], default="auto",
                   help="auto: tokens drafted from the prompt and the answer so far, verified several per call (the "
                        "same reports as off); off: one token per call")
    p.add_argument("--draft-bundle", type=Path, help="with --bundle: draft with this bundle's greedy tokens (a "
                                                     "bundle with the same tokenizer) where the prompt has none")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if args.max_tokens < 1:
        err(f"argument --max-tokens: must be >= 1, got {args.max_tokens}")
        return 2
    if not args.out.parent.is_dir():
        err(f"argument --out: directory {args.out.parent} does not exist")
        return 2
    try:
        dets = read_detections(args.detections)
    except (OSError, UnicodeDecodeError) as e:
        err(f"argument --detections: {e}")
        return 2
    except DetectionError as e:
        err(str(e))
        return 2
    if args.bundle is not None:
        import runtime

        try:
            runtime.verify_bundle(args.bundle)
        except runtime.BundleError as e:
            err(f"argument --bundle: {e}")
            return 2
    if args.draft_bundle is not None and args.bundle is None:
        err("argument --draft-bundle: needs --bundle (a server drafts with `runtime serve --draft-bundle`)")
        return 2
    from runtime.draft_model import DraftBundleError

    t0 = time.monotonic()
    try:
        if args.bundle is not None:
            model, items, extra = run_in_process(args.bundle, dets, args.max_tokens, args.examples, args.speculative,
                                                 args.draft_bundle)
        else:
            model, items, extra = run_http(args.server, dets, args.max_tokens, args.examples,
                                           speculative=args.speculative)
    except DraftBundleError as e:  # not a bundle, or another tokenizer than --bundle's
        err(f"argument --draft-bundle: {e}")
        return 2
    except Exception as e:  # a bundle that does not load, a server that does not answer
        err(f"{type(e).__name__}: {e}")
        return 1
    write_json(args.out, report(model, "in-process" if args.bundle else "http", items, time.monotonic() - t0, extra))
    print(f"{len(items)} detections -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
