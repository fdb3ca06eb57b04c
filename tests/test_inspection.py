"""examples/inspection: the inspection app on the demo bundle (a random model: structure, not content),
in-process and through the HTTP server with the plain OpenAI client, plain-prompt and chat bundles; bad
detection lines are exit 2 with one error line and no report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from runtime_bundles import ROOT

APP = ROOT / "examples" / "inspection"
KEYS = {"part_id", "defect_class", "confidence", "description", "severity", "severity_source", "finish_reason",
        "completion_tokens", "latency_s"}


@pytest.fixture(scope="module")
def app():
    sys.path.insert(0, str(APP))
    import inspect_defects

    yield inspect_defects
    sys.path.remove(str(APP))


def check_report(path, mode, n=5):
    rep = json.loads(path.read_text())
    assert rep["mode"] == mode and rep["summary"]["detections"] == n and len(rep["items"]) == n
    dets = [json.loads(ln) for ln in (APP / "detections.jsonl").read_text().splitlines() if ln.strip()]
    for item, det in zip(rep["items"], dets):
        assert set(item) == KEYS and item["part_id"] == det["part_id"]
        assert item["severity"] in ("low", "medium", "high") and item["severity_source"] in ("model", "rule")
        assert isinstance(item["description"], str) and "\n" not in item["description"]
        assert 0 <= item["completion_tokens"] <= 12 and item["finish_reason"] in ("stop", "length")
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
                         "--max-tokens", "12"]) == 0
        rep = check_report(out, "in-process")
        assert rep["model"] == b.name


def test_through_http_server(app, tmp_path):
    from runtime_bundles import build_demo
    from test_serve import live_server

    import runtime

    rt = runtime.load(build_demo(tmp_path / "demo", max_seq=512, max_input=64), "onnxruntime", threads=1)
    with live_server(rt, "demo") as (_, url):
        out = tmp_path / "http.json"
        assert app.main(["--server", url, "--detections", str(APP / "detections.jsonl"), "--out", str(out),
                         "--max-tokens", "12"]) == 0
    rep = check_report(out, "http")
    assert rep["model"] == "demo"


def test_rule_severity_and_sentence(app):
    d = app.Detection("P1", "crack", (0, 0, 1, 1), 0.4, "")
    assert app.rule_severity(d) == "medium"
    assert app.to_item(d, "A thin crack. It runs along.\nSeverity: HIGH", "stop", 9, 0.1).severity == "high"
    assert app.first_sentence("A thin crack runs along the seam. More text\nSeverity: high") == \
        "A thin crack runs along the seam."


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
