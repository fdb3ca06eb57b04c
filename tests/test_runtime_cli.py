"""`python -m runtime generate` probes (issue 8): every bad flag or input is exit 2 with one `error:` line
naming the flag and what is allowed, no traceback, no output; plus per-request state (issue 8/12)."""

from __future__ import annotations

import contextlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_bundles import demo_and_chat_bundles, run_module, with_text_files

MAX_SEQ, MAX_INPUT, VOCAB = 64, 16, 384  # the demo model's vocabulary; prompts prefill in chunks of 16


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    return demo_and_chat_bundles(tmp_path_factory.mktemp("rtcli"), max_seq=MAX_SEQ, max_input=MAX_INPUT,
                                 vocab=VOCAB, max_batch=8)


def generate(bundle: Path, *args: str) -> tuple[int, str, str]:
    r = run_module("runtime", "generate", str(bundle), *args, cwd=bundle.parent, timeout=120)
    return r.returncode, r.stdout, r.stderr


# The demo vocabulary has no merge starting with x, y or z: one token per character, far past max-seq 64.
LONG_PROMPT = "xyz" * 410

# (arguments, flag named in the message, words the message must hold)
BAD = [
    (["--prompt", "x", "--temperature", "-1"], "--temperature", ">= 0"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature", ">= 0"),
    (["--prompt", "x", "--top-p", "2"], "--top-p", "(0, 1]"),
    (["--prompt", "x", "--top-p", "0"], "--top-p", "(0, 1]"),
    (["--prompt", "x", "--top-k", "-1"], "--top-k", ">= 0"),
    (["--ids", "1,abc"], "--ids", "'abc'"),
    (["--ids", ""], "--ids", "got nothing"),
    (["--prompt", "x", "--stop-ids", "x"], "--stop-ids", "'x'"),
    (["--prompt", "x", "--stop-ids", f"2,{VOCAB}"], "--stop-ids", f"0..{VOCAB - 1}"),
    (["--ids", f"1,{VOCAB}"], "--ids", f"id {VOCAB} (position 1) is outside the vocabulary 0..{VOCAB - 1}"),
    (["--ids", "1,-5"], "--ids", "negative"),
    (["--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens", ">= 0"),
    (["--prompt", "x", "--threads", "-1"], "--threads", ">= 0"),
    (["--prompt", "x", "--sparse-window", "0"], "--sparse-window", ">= 1"),
    (["--prompt", "x", "--sparse-window", "9"], "--sparse-window", "1..8"),
    (["--prompt", "x", "--seed", "-3"], "--seed", ">= 0"),
    (["--prompt", LONG_PROMPT], "--prompt", f"is {len(LONG_PROMPT) + 1} tokens"),
    (["--ids", ",".join(["5"] * (MAX_SEQ + 1))], "--ids", f"is {MAX_SEQ + 1} tokens"),
    (["--chat", "hi"], "--chat", "no chat template"),
    (["--prompt", "x", "--chat", "hi"], "--chat", "not allowed with"),
]


@pytest.mark.parametrize("args,flag,words", BAD, ids=[" ".join(a)[:40] for a, _, _ in BAD])
def test_bad_flag_is_one_error_line_exit_2(bundles, args, flag, words):
    code, out, err = generate(bundles["demo"], *args)
    assert code == 2, err
    assert "Traceback" not in err and out == ""  # nothing printed before the refusal
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    assert flag in errors[0] and words in errors[0], errors[0]


def test_long_prompt_message_reports_real_count_and_max_seq(bundles):
    """The old message counted per prefill chunk (max-input 16), not the prompt."""
    code, _, err = generate(bundles["demo"], "--prompt", LONG_PROMPT)
    n = len(LONG_PROMPT) + 1  # one token per character, plus BOS
    assert code == 2 and f"the prompt is {n} tokens, more than the bundle's max-seq {MAX_SEQ}" in err


@pytest.mark.parametrize("damage", ["missing", "not-a-bundle", "corrupt", "bad-config"])
def test_bad_bundle_is_one_error_line_exit_2(bundles, tmp_path, damage):
    import shutil

    b = tmp_path / "b"
    if damage == "not-a-bundle":
        b.mkdir()
        (b / "x.txt").write_text("hello")
    elif damage != "missing":
        shutil.copytree(bundles["demo"], b)
        if damage == "corrupt":
            with open(b / "weights.bin", "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xfe")
        else:
            b = with_text_files(bundles["demo"], tmp_path / "b2", tokenizer_config={"add_bos_token": "yes"})
    code, out, err = generate(b, "--prompt", "x")
    assert code == 2 and out == "" and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "bundle" in errors[0] and str(b) in errors[0], err


def test_ok_prompt_ids_and_chat(bundles):
    code, out, err = generate(bundles["demo"], "--prompt", "Once upon", "--max-new-tokens", "4")
    assert code == 0 and out.startswith("Once upon") and "[4 tokens" in err and "finish: length" in err
    assert "backend onnxruntime (graph " in err  # which network ran: cpu (fused op) or portable
    code, _, err = generate(bundles["demo"], "--prompt", "Once upon", "--max-new-tokens", "2", "--graph", "portable")
    assert code == 0 and "(graph portable)" in err
    code, out, err = generate(bundles["demo"], "--ids", "1,76,111", "--max-new-tokens", "3", "--stop-ids", "")
    assert code == 0 and len(out.split()) == 3 and all(0 <= int(t) < VOCAB for t in out.split())
    code, out, err = generate(bundles["chat"], "--chat", "Hello", "--max-new-tokens", "5", "--temperature", "0.9",
                              "--seed", "1")
    assert code == 0, err
    assert "<|im_start|>" not in out and "finish:" in err  # the answer only, not the rendered prompt


# The fuzz: any mix of good and bad flag values ends in exit 0 or 2, never an escaping exception.
VALUES = {
    "--temperature": ["0", "0.7", "-1", "nan", "inf", "x", ""],
    "--top-p": ["1", "0.5", "0", "2", "-0.1", "nan", "p"],
    "--top-k": ["0", "5", "-1", "1.5", "k"],
    "--max-new-tokens": ["0", "1", "3", "-1", "two"],
    "--seed": ["0", "7", "-1", "s"],
    "--stop-ids": ["", "2", "2,3", "x", f"{VOCAB}", "1,,2"],
    "--threads": ["0", "1", "-1", "t"],
    "--sparse-window": ["1", "8", "0", "9", "-2", "w"],
}
SOURCES = [["--prompt", "Once"], ["--prompt", ""], ["--ids", "1,5"], ["--ids", "1,-5"], ["--ids", ""],
           ["--ids", f"1,{VOCAB}"], ["--chat", "hi"], ["--ids", "a"]]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(SOURCES),
       flags=st.dictionaries(st.sampled_from(sorted(VALUES)), st.integers(0, 6), max_size=4))
def test_fuzz_generate_flags_exit_0_or_2(bundles, source, flags):
    from runtime.__main__ import main

    argv = ["generate", str(bundles["demo"]), *source]
    for flag, i in flags.items():
        choices = VALUES[flag]
        argv += [f"{flag}={choices[i % len(choices)]}"]
    if "--max-new-tokens" not in flags:
        argv += ["--max-new-tokens", "2"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code in (0, 2), (argv, err.getvalue())
    if code == 2:
        assert sum("error:" in ln for ln in err.getvalue().splitlines()) == 1, (argv, err.getvalue())
        assert out.getvalue() == ""


# --- per-request state ---------------------------------------------------------------------------

def test_library_checks_ids_against_the_vocabulary(bundles):
    import runtime

    rt = runtime.load(bundles["demo"], "onnxruntime", threads=1)
    with pytest.raises(runtime.RequestError, match=rf"prompt: id {VOCAB} \(position 2\) is outside the vocabulary "
                                                   rf"0\.\.{VOCAB - 1}"):
        rt.generate([1, 5, VOCAB], 2)
    with pytest.raises(ValueError, match=r"id -5 \(position 1\)"):  # RequestError is a ValueError
        rt.stream([1, -5], 2)
    with pytest.raises(runtime.RequestError, match="stop_ids: id 999"):
        rt.stream([1, 5], 2, stop_ids=[2, 999])
    with pytest.raises(runtime.RequestError, match=f"the prompt is {MAX_SEQ + 1} tokens.*max-seq {MAX_SEQ}"):
        rt.stream([5] * (MAX_SEQ + 1), 2)  # refused at the call, before any prefill chunk runs
    with pytest.raises(runtime.RequestError, match="top_p"):
        rt.stream([1, 5], 2, temperature=1.0, top_p=0.0)


def test_streams_keep_their_own_state(bundles):
    """Two requests interleaved step by step, and on two threads, equal the same requests run alone."""
    import runtime

    rt = runtime.load(bundles["demo"], "onnxruntime", threads=1)
    reqs = [([1, 76, 111, 120], dict(temperature=0.0)), ([1, 40, 41], dict(temperature=1.0, seed=3))]
    alone = [rt.generate(p, 12, stop_ids=[], **kw) for p, kw in reqs]
    a, b = (rt.stream(p, 12, stop_ids=[], **kw) for p, kw in reqs)
    assert a.finish_reason is None and b.finish_reason is None
    ia, ib = iter(a), iter(b)
    for _ in range(12):
        next(ia), next(ib)
    for s in (a, b):
        with pytest.raises(StopIteration):
            next(iter(s))
    for s, g in zip((a, b), alone):
        assert s.ids == g.ids and s.text == g.text and s.finish_reason == g.finish_reason == "length"
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda r: rt.generate(r[0], 12, stop_ids=[], **r[1]), reqs * 2))
    assert [g.ids for g in threaded] == [g.ids for g in alone] * 2
    assert not hasattr(rt, "finish_reason")  # nothing per call on the shared object


def test_stop_id_ends_the_stream_and_is_not_yielded(bundles):
    import runtime

    rt = runtime.load(bundles["demo"], "onnxruntime", threads=1)
    free = rt.generate([1, 76, 111], 8, stop_ids=[])
    k = next(i for i, t in enumerate(free.ids) if t not in free.ids[:i] and i > 0)  # first repeat-free token
    stopped = rt.generate([1, 76, 111], 8, stop_ids=[free.ids[k]])
    assert stopped.ids == free.ids[:k] and stopped.finish_reason == "stop"
    ctx = rt.generate([5] * (MAX_SEQ - 2), 8, stop_ids=[])
    assert len(ctx.ids) == 3 and ctx.finish_reason == "context"  # prefill fills 62, decodes add 2 more
    assert rt.generate([1, 5], 0).ids == [] and rt.generate([1, 5], 0).finish_reason == "length"


def test_manifest_helper_keeps_bundle_fields(bundles):
    m = json.loads((bundles["chat"] / "manifest.json").read_text())
    assert m["bundle_format"] == "gsm-edge-bundle" and "tokenizer_config.json" in m["files"]


def test_spinning_is_a_session_option_that_changes_no_output(bundles):
    """`load(spinning=True)` / `generate --spinning` (docs/runtime.md "ONNX Runtime session"): ONNX Runtime's
    intra-op threads busy-wait; the option reaches the session, the default keeps them parked, and the
    generated ids do not depend on it."""
    import runtime

    runs = {}
    for spin in (False, True):
        rt = runtime.load(bundles["demo"], "onnxruntime", threads=2, spinning=spin)
        opts = rt.backend.session.get_session_options()
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == ("1" if spin else "0")
        assert opts.intra_op_num_threads == 2
        # the portable graph's demotion session never spins: after a re-tier pass its workers would take the main
        # session's cores (model.cpu.onnx demotes its pools in the calling thread)
        assert rt.backend.graph == "cpu" and rt.backend.demote_session is None
        portable = runtime.load(bundles["demo"], "onnxruntime", threads=2, spinning=spin, graph="portable")
        demote = portable.backend.demote_session.get_session_options()
        assert demote.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert demote.intra_op_num_threads == 2
        runs[spin] = rt.generate([1, 5, 9, 17], 12).ids
    assert runs[True] == runs[False] and len(runs[True]) == 12
    code, out, err = generate(bundles["demo"], "--ids", "1,5,9,17", "--max-new-tokens", "4", "--threads", "2",
                              "--spinning")
    assert code == 0 and "error" not in err, err


# --- the error ladder of generate and serve (gsm.cli_support.run_main, as every command) ---------------------

def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_checkpoint_says_it_is_one_and_the_command_that_bundles_it_works(tmp_path, command):
    from gsm.synth import synth_checkpoint

    ck = synth_checkpoint("tiny", tmp_path / "ck")
    r = run_module("runtime", command, str(ck), *(["--prompt", "x"] if command == "generate" else []), cwd=tmp_path,
                   timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    line = one_error(r.stderr)
    assert line.startswith(f"python -m runtime {command}: error: bundle {ck}: a GSM checkpoint (config.json with "
                           "gsm_config, quant_config.json), not a bundle; make a bundle from it with "), line
    suggested = line.split("`")[1]
    assert suggested == f"python -m builder build --device orin --checkpoint {ck} --output BUNDLE"
    if command == "generate":  # the command it names, as a new user would paste it
        out = tmp_path / "bundle"
        b = run_module(*suggested.replace("BUNDLE", str(out)).split()[2:], cwd=tmp_path)
        assert b.returncode == 0, b.stderr
        code, _, err = generate(out, "--ids", "1,5", "--max-new-tokens", "2")
        assert code == 0, err


@pytest.mark.parametrize("kind, words", [
    ("plain", "not a bundle (no manifest.json with bundle_format, no config.json); a bundle is made from a GSM "
              "checkpoint with `python -m builder build --device orin --checkpoint CHECKPOINT --output BUNDLE`"),
    ("dense", "a model directory (config.json without gsm_config), not a GSM checkpoint or a bundle; convert it with "
              "`python -m gsm convert --from hf"),
])
def test_a_directory_that_is_no_bundle_says_what_it_is(tmp_path, kind, words):
    d = tmp_path / kind
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    if kind == "dense":
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, out, err = generate(d, "--prompt", "x")
    assert code == 2 and out == ""
    assert one_error(err).startswith(f"python -m runtime generate: error: bundle {d}: {words}"), err


@pytest.mark.parametrize("module", ["uvicorn", "starlette", "prometheus_client"])
def test_serve_without_the_serve_extra_is_one_line_naming_it_exit_1(bundles, module):
    """Exit 1, not 2: the command line is right, the machine lacks the extra (README "Exit codes")."""
    import subprocess
    import sys

    code = (f"import sys\nsys.modules[{module!r}] = None  # as if not installed\n"
            f"from runtime.__main__ import main\nsys.exit(main(['serve', {str(bundles['demo'])!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=bundles["demo"].parent)
    assert r.returncode == 1 and r.stdout == ""
    assert one_error(r.stderr).startswith('python -m runtime serve: error: this command needs the serve extra: '
                                          'pip install "gsm-edge[serve]" ('), r.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_unexpected_failure_is_one_line_exit_1_and_the_traceback_on_request(bundles, monkeypatch, capsys,
                                                                               command):
    import runtime
    from runtime.__main__ import main

    def broken(*a, **kw):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(runtime, "load", broken)
    monkeypatch.delenv("GSM_EDGE_DEBUG", raising=False)
    argv = [command, str(bundles["demo"]), *(["--ids", "1,5"] if command == "generate" else [])]
    assert main(argv) == 1
    assert one_error(capsys.readouterr().err) == (
        f"python -m runtime {command}: error: internal error (ZeroDivisionError: boom); rerun with "
        "GSM_EDGE_DEBUG=1 for the traceback and report it")
    monkeypatch.setenv("GSM_EDGE_DEBUG", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: boom" in err
