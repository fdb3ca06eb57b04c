"""examples/inspection: the inspection app on the demo bundle (a random model: structure, not content),
in-process and through the HTTP server with the plain OpenAI client, plain-prompt and chat bundles, its answers
constrained to the report schema (every answer that ends parses; one cut by --max-tokens falls back to the
rule); the app on a SmolLM2 bundle when one is at $GSM_EDGE_SMOLLM2_BUNDLE (slow: building it needs the
conversion); bad detection lines are exit 2 with one error line and no report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runtime_bundles import ROOT

APP = ROOT / "examples" / "inspection"
KEYS = {"part_id", "defect_class", "confidence", "description", "severity", "severity_source", "rule_severity",
        "finish_reason", "completion_tokens", "latency_s"}


# the class/confidence rule on detections.jsonl, by hand: structural classes high at confidence >= 0.5,
# others medium at >= 0.8, else low
RULE = {"BRK-0001": "medium", "BRK-0002": "high", "BRK-0003": "low", "HSG-0107": "high", "HSG-0108": "low"}


@pytest.fixture(scope="module")
def app():
    sys.path.insert(0, str(APP))
    import inspect_defects

    yield inspect_defects
    sys.path.remove(str(APP))


def check_report(path, mode, n=5, max_tokens=40):
    rep = json.loads(path.read_text())
    assert rep["mode"] == mode and rep["summary"]["detections"] == n and len(rep["items"]) == n
    dets = [json.loads(ln) for ln in (APP / "detections.jsonl").read_text().splitlines() if ln.strip()]
    for item, det in zip(rep["items"], dets):
        assert set(item) == KEYS and item["part_id"] == det["part_id"]
        assert item["severity"] in ("low", "medium", "high") and item["severity_source"] in ("model", "rule")
        assert isinstance(item["description"], str) and "\n" not in item["description"]
        assert 0 <= item["completion_tokens"] <= max_tokens and item["finish_reason"] in ("stop", "length")
        assert item["rule_severity"] == RULE[det["part_id"]]
        # constrained to the schema: an answer that ended is the model's; only one cut short is the rule's
        assert (item["severity_source"] == "model") == (item["finish_reason"] == "stop"), item
    assert sum(rep["summary"]["by_severity"].values()) == n
    return rep


def test_in_process_plain_and_chat(app, tmp_path):
    from runtime_bundles import CHATML, build_demo, byte_bpe_json, with_text_files

    demo = build_demo(tmp_path / "demo", max_seq=512, max_input=64)
    tok = byte_bpe_json(384, ("<|im_start|>", "<|im_end|>"))
    cfg = {"chat_template": CHATML, "eos_token": "<|im_end|>", "add_bos_token": False}
    chat = with_text_files(demo, tmp_path / "chat", tokenizer_json=tok, tokenizer_config=cfg)
    for b in (demo, chat):
        out = tmp_path / f"{b.name}.json"
        assert app.main(["--bundle", str(b), "--detections", str(APP / "detections.jsonl"), "--out", str(out),
                         "--max-tokens", "40", "--examples", "0"]) == 0
        rep = check_report(out, "in-process")
        assert rep["model"] == b.name
        # the system prompt every chat prompt starts with is prefilled before the first detection; no template: none
        assert (rep["engine"]["prefix"]["warm_tokens"] > 0) == (b is chat)
    # the chat bundle drafting with a draft bundle (itself): the same reports
    out = tmp_path / "drafted.json"
    assert app.main(["--bundle", str(chat), "--draft-bundle", str(chat), "--detections", str(APP / "detections.jsonl"),
                     "--out", str(out), "--max-tokens", "40", "--examples", "0"]) == 0
    answers = [{k: v for k, v in i.items() if k != "latency_s"} for i in check_report(out, "in-process")["items"]]
    assert answers == [{k: v for k, v in i.items() if k != "latency_s"} for i in rep["items"]]
    bad = tmp_path / "bad.json"
    assert app.main(["--server", "http://127.0.0.1:9", "--draft-bundle", str(chat), "--detections",
                     str(APP / "detections.jsonl"), "--out", str(bad)]) == 2 and not bad.exists()
    assert app.main(["--bundle", str(chat), "--draft-bundle", str(tmp_path), "--detections",
                     str(APP / "detections.jsonl"), "--out", str(bad)]) == 2 and not bad.exists()


def test_through_http_server(app, tmp_path):
    from runtime_bundles import build_demo
    from test_serve import live_server

    import runtime

    rt = runtime.load(build_demo(tmp_path / "demo", max_seq=512, max_input=64), "onnxruntime", threads=1)
    with live_server(rt, "demo") as (_, url):
        out = tmp_path / "http.json"
        assert app.main(["--server", url, "--detections", str(APP / "detections.jsonl"), "--out", str(out),
                         "--max-tokens", "40", "--examples", "0"]) == 0
    rep = check_report(out, "http")
    assert rep["model"] == "demo"


def test_rule_severity_and_answer_parsing(app):
    d = app.Detection("P1", "crack", (0, 0, 1, 1), 0.4, "")
    assert app.rule_severity(d) == "medium"
    item = app.to_item(d, '{"description": "A thin  crack.", "severity": "high"}', "stop", 9, 0.1)
    assert (item.description, item.severity, item.severity_source) == ("A thin crack.", "high", "model")
    for cut in ('{"description": "A thin cr', '{"description": "x", "severity": "urgent"}', "Severity: high"):
        item = app.to_item(d, cut, "length", 9, 0.1)
        assert (item.description, item.severity, item.severity_source) == ("", "medium", "rule")


def test_prompt_has_the_worked_examples(app):
    d = app.Detection("P1", "dent", (1, 2, 3, 4), 0.5, "")
    msgs = app.messages(d)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    jsonschema = pytest.importorskip("jsonschema")
    for m in msgs:
        if m["role"] == "assistant":  # the worked answers are in the schema's form
            jsonschema.validate(json.loads(m["content"]), app.REPORT_SCHEMA)
    assert msgs[-1]["content"] == "Part P1: a dent detected with confidence 0.50 at x=1, y=2, size 3x4 px."
    assert app.plain_prompt(d).endswith("Report: " + msgs[-1]["content"] + "\nAnswer:")
    assert app.messages(d, 0) == [msgs[0], msgs[-1]]  # --examples 0 (the demo bundles' max-seq 512)


SMOLLM2_BUNDLE = os.environ.get("GSM_EDGE_SMOLLM2_BUNDLE")


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_BUNDLE, reason="no SmolLM2 bundle at $GSM_EDGE_SMOLLM2_BUNDLE (docs/serving.md)")
def test_smollm2_bundle_in_process(app, tmp_path):
    """The real model, constrained to the report schema: every answer parses, its severity is the model's, and
    its description names the defect (the class or its stem); each ends at the grammar's end, not max-tokens."""
    out = tmp_path / "smol.json"
    assert app.main(["--bundle", SMOLLM2_BUNDLE, "--detections", str(APP / "detections.jsonl"), "--out",
                     str(out)]) == 0
    rep = check_report(out, "in-process", max_tokens=80)
    stems = {"scratch": "scratch", "crack": "crack", "dent": "dent", "porosity": "por", "discoloration": "discolo"}
    for item in rep["items"]:
        assert item["severity_source"] == "model" and item["finish_reason"] == "stop"
        # a sentence, or the schema's 160 characters of one
        assert stems[item["defect_class"]] in item["description"].lower()
        assert item["description"].endswith(".") or len(item["description"]) >= 150
    assert set(rep["engine"]["fallbacks"]) == {"hit_rate", "kv_noise"}


@pytest.mark.parametrize("line,words", [
    ("{not json", "not JSON"),
    ('{"part_id": "", "defect_class": "x", "bbox": [0,0,1,1], "confidence": 0.5}', "'part_id'"),
    ('{"part_id": "a", "defect_class": "x", "bbox": [0,0,1], "confidence": 0.5}', "'bbox'"),
    ('{"part_id": "a", "defect_class": "x", "bbox": [0,0,1,1], "confidence": 1.5}', "'confidence'"),
])
def test_bad_detection_line_is_exit_2(tmp_path, line, words):
    det = tmp_path / "d.jsonl"
    det.write_text(line + "\n")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(APP / "inspect_defects.py"), "--bundle", str(tmp_path), "--detections",
                        str(det), "--out", str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and not out.exists() and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and words in errors[0] and "d.jsonl:1" in errors[0], r.stderr
