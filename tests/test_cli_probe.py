"""The careless-user probe (issue 8), kept as tests: every writing command, run as a subprocess.

Each case asserts the exit code of the convention (2 bad usage/input), one message that names the
flag or path, no traceback, and, where data could be lost, that every input file is still there
with its original sha256 and nothing else was created.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CALIB_TEXT, DATA, EVAL_TEXT, STORIES, needs_data

from gsm.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=600)


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (or of root itself when it is a file)."""
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def refused(r: subprocess.CompletedProcess[str], *names: str) -> str:
    """Assert exit 2, no traceback and exactly one error line naming `names`; return that line."""
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, out
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("ck") / "tiny")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A user's folder: the source model, its tokenizer, the texts and an unrelated notes file."""
    if not STORIES.is_file():
        pytest.skip(f"real data not found at {DATA}")
    d = tmp_path / "models"
    d.mkdir()
    for f in (STORIES, DATA / "tok512.bin", CALIB_TEXT, EVAL_TEXT):
        shutil.copy(f, d / f.name)
    (d / "notes.txt").write_text("my notes\n")
    return d


# --- data loss -------------------------------------------------------------------------------

@needs_data
def test_convert_out_holding_the_source_is_refused_with_overwrite(model_dir, tmp_path):
    before = snapshot(model_dir)
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(model_dir),
            "--overwrite", cwd=tmp_path)
    refused(r, "--out", str(model_dir), "contains the input SRC")
    assert snapshot(model_dir) == before


@needs_data
@pytest.mark.parametrize("which", ["--calib-text", "--eval-text", "SRC"])
def test_convert_out_equal_to_an_input_file_is_refused(model_dir, tmp_path, which):
    target = {"--calib-text": model_dir / CALIB_TEXT.name, "--eval-text": model_dir / EVAL_TEXT.name,
              "SRC": model_dir / "stories260K.bin"}[which]
    before = snapshot(model_dir)
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(target),
            "--overwrite", cwd=tmp_path)
    refused(r, "--out", str(target))
    assert snapshot(model_dir) == before


def test_build_output_equal_to_checkpoint_is_refused(tiny, tmp_path):
    before = snapshot(tiny)
    r = run("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(tiny),
            "--overwrite", cwd=tmp_path)
    refused(r, "--output", "is the input --checkpoint")
    assert snapshot(tiny) == before


def test_build_output_inside_checkpoint_is_refused(tiny, tmp_path):
    before = snapshot(tiny)
    r = run("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(tiny / "b"),
            cwd=tmp_path)
    refused(r, "--output", "lies inside the input --checkpoint")
    assert snapshot(tiny) == before


@pytest.mark.parametrize("cmd", ["synth", "build", "calibration"])
def test_overwrite_never_turns_a_file_into_a_directory(tiny, tmp_path, cmd):
    f = tmp_path / "precious.bin"
    f.write_bytes(b"\x00data")
    args = {"synth": ["gsm", "synth", "--preset", "tiny", "--out", str(f)],
            "build": ["builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(f)],
            "calibration": ["calibration", "run", "--checkpoint", str(tiny), "--out", str(f)]}[cmd]
    r = run(*args, "--overwrite", cwd=tmp_path)
    refused(r, str(f), "not a directory")
    assert f.is_file() and f.read_bytes() == b"\x00data"


@needs_data
def test_convert_over_a_plain_file_is_refused(model_dir, tmp_path):
    notes = model_dir / "notes.txt"
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(notes),
            "--overwrite", cwd=tmp_path)
    refused(r, "--out", "not a directory")
    assert notes.read_text() == "my notes\n"


def test_overwrite_refuses_a_folder_gsm_edge_did_not_write(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    r = run("gsm", "synth", "--preset", "tiny", "--out", str(d), "--overwrite", cwd=tmp_path)
    refused(r, "--out", "no gsm-edge manifest.json")
    assert snapshot(d) == {"thesis.tex": hashlib.sha256(b"years of work").hexdigest()}


def test_overwrite_refuses_our_output_holding_a_users_file(tmp_path):
    out = tmp_path / "ck"
    assert run("gsm", "synth", "--preset", "tiny", "--out", str(out), cwd=tmp_path).returncode == 0
    (out / "notes.md").write_text("added by a person")
    before = snapshot(out)
    r = run("gsm", "synth", "--preset", "tiny", "--out", str(out), "--overwrite", cwd=tmp_path)
    refused(r, "--out", "notes.md", "does not list")
    assert snapshot(out) == before


def test_overwrite_replaces_our_own_output_and_every_writer_accepts_the_flag(tiny, tmp_path):
    out = tmp_path / "ck"
    first = run("gsm", "synth", "--preset", "tiny", "--out", str(out), "--seed", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run("gsm", "synth", "--preset", "tiny", "--out", str(out), "--seed", "1", cwd=tmp_path)
    refused(again, "--out", "already exists", "--overwrite")
    old = snapshot(out)
    r = run("gsm", "synth", "--preset", "tiny", "--out", str(out), "--seed", "2", "--overwrite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert snapshot(out) != old and run("gsm", "verify", str(out), cwd=tmp_path).returncode == 0
    b = tmp_path / "b"
    for _ in range(2):  # the second build replaces the first bundle
        r = run("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(b),
                "--overwrite", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    for cmd in (["gsm", "convert"], ["gsm", "synth"], ["calibration", "run"], ["builder", "build"]):
        h = run(*cmd, "--help", cwd=tmp_path)
        assert h.returncode == 0 and "--overwrite" in h.stdout, cmd


def test_calibration_out_inside_checkpoint_is_refused(tiny, tmp_path):
    before = snapshot(tiny)
    r = run("calibration", "run", "--checkpoint", str(tiny), "--out", str(tiny / "cal"), cwd=tmp_path)
    refused(r, "--out", str(tiny))
    assert snapshot(tiny) == before


def test_empty_directory_counts_as_absent(tiny, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    r = run("gsm", "synth", "--preset", "tiny", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# --- unwritable outputs and late checks -------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["gsm", "synth", "--preset", "tiny", "--out", "/proc/x"], "--out /proc/x"),
    (["builder", "build", "--device", "orin", "--output", "/proc/x"], "--output /proc/x"),
])
def test_unwritable_output_is_one_error(tmp_path, args, flag):
    refused(run(*args, cwd=tmp_path), flag, "cannot write")
    assert not any(tmp_path.iterdir())


@needs_data
def test_convert_report_checked_before_any_work(model_dir, tmp_path):
    out = tmp_path / "ck"
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(out),
            "--report", "/proc/x/r.json", cwd=tmp_path)
    refused(r, "--report /proc/x/r.json")
    assert "[convert]" not in r.stderr and not out.exists()  # refused before the first stage
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(out),
            "--report", str(existing), cwd=tmp_path)
    refused(r, "--report", "already exists")
    assert "[convert]" not in r.stderr and not out.exists() and existing.read_text() == "{}"
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(out),
            "--report", str(out / "r.json"), cwd=tmp_path)
    refused(r, "--report", "inside --out")


def test_calibration_report_checked_before_any_work(tiny, tmp_path):
    r = run("calibration", "run", "--checkpoint", str(tiny), "--out", str(tmp_path / "cal"),
            "--report", "/proc/x/r.json", cwd=tmp_path)
    refused(r, "--report /proc/x/r.json")
    assert "[calibration]" not in r.stderr and not (tmp_path / "cal").exists()


# --- numeric flags, range-checked up front -------------------------------------------------------

@needs_data
@pytest.mark.parametrize("flag, value, says", [
    ("--tolerance", "-1", "(0, 1)"), ("--tolerance", "nan", "(0, 1)"), ("--kv-budget", "-5", ">= 1"),
    ("--kv-budget", "5", "at least 100 bytes"), ("--seq-len", "0", ">= 2"), ("--calib-tokens", "0", ">= 1"),
    ("--top-k", "-1", ">= 0"), ("--window", "0", "'auto' or an integer"), ("--indexer-dim", "0", ">= 1"),
    ("--sharing-budget", "-0.1", "[0,"), ("--sharing", "3:9", "--sharing"),
])
def test_convert_numeric_flags(model_dir, tmp_path, flag, value, says):
    out = tmp_path / "ck"
    r = run("gsm", "convert", "--from", "llama2c", str(model_dir / "stories260K.bin"), "--out", str(out),
            flag, value, cwd=tmp_path)
    refused(r, flag, says)
    assert "[convert]" not in r.stderr and not out.exists()


@pytest.mark.parametrize("flag, value", [
    ("--seq-len", "0"), ("--samples", "0"), ("--percentile", "101"), ("--error-budget", "-1"),
    ("--fraction-step", "0"), ("--hotness-decay", "1"), ("--threads", "-1"), ("--prefill-len", "0"),
])
def test_calibration_numeric_flags(tiny, tmp_path, flag, value):
    r = run("calibration", "run", "--checkpoint", str(tiny), "--out", str(tmp_path / "cal"), flag, value,
            cwd=tmp_path)
    line = refused(r, f"argument {flag}")
    assert "--prefill-len" not in line or flag == "--prefill-len"  # blame the flag the user typed


@pytest.mark.parametrize("flag, value", [("--max-seq", "0"), ("--max-batch", "-2"), ("--max-input", "x")])
def test_builder_numeric_flags(tiny, tmp_path, flag, value):
    r = run("builder", "build", "--device", "orin", "--checkpoint", str(tiny), "--output", str(tmp_path / "b"),
            flag, value, cwd=tmp_path)
    refused(r, f"argument {flag}")
    assert not (tmp_path / "b").exists()


def test_checker_refuses_out_of_range_gsm_config(tiny, tmp_path):
    """A checkpoint carrying tolerance -1 (once accepted by convert) does not pass verify."""
    from gsm.checker import verify

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["gsm_config"]["kv_compression_tolerance"] = -1
    (bad / "config.json").write_text(json.dumps(cfg))
    rep = verify(bad)
    assert not rep.ok and any("kv_compression_tolerance" in e.message for e in rep.errors), rep.errors
    r = run("gsm", "verify", str(bad), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr


# --- one error prefix: `python -m <package> <command>: error:`, argparse's own, whichever layer refused --------

@pytest.mark.parametrize("args, prefix", [
    (["gsm", "synth", "--preset", "tiny", "--out", "/proc/x"], "python -m gsm synth: error: --out /proc/x"),
    (["gsm", "synth", "--preset", "huge", "--out", "x"], "python -m gsm synth: error: argument --preset"),
    (["gsm", "convert", "--from", "hf", "/nonexistent", "--out", "ck"], "python -m gsm convert: error: SRC"),
    (["builder", "build", "--device", "xavier"], "python -m builder build: error: unknown device"),
    (["builder", "build", "--device", "orin", "--max-seq", "0"], "python -m builder build: error: argument --max-seq"),
    (["builder", "engine", "/nonexistent"], "python -m builder engine: error: /nonexistent"),
    (["calibration", "run", "--checkpoint", "/nonexistent"], "python -m calibration run: error: --checkpoint"),
    (["runtime", "generate", "/nonexistent", "--prompt", "x"], "python -m runtime generate: error: bundle"),
    (["runtime", "generate", "/nonexistent", "--top-k", "-1", "--prompt", "x"],
     "python -m runtime generate: error: argument --top-k"),
    (["runtime", "serve", "/nonexistent"], "python -m runtime serve: error: bundle /nonexistent"),
])
def test_every_command_names_itself_the_same_way_in_its_error_line(tmp_path, args, prefix):
    line = refused(run(*args, cwd=tmp_path))
    assert line.startswith(prefix), line
