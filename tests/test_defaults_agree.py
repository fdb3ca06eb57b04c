"""What `builder build` does with no weight flag, said the same way everywhere, and a summary whose sizes are true.

The rule (docs/decisions.md "`builder build` quantises only what its flags ask for"): with no `--weights` every
weight stays FP16 on the device. This reads the rule from the code (the parser's default, builder/plan.py's
tables), then checks `--help`, README.md, docs/weights.md and the summary of a real default build against it, and
that the summary's sizes on disk are the bundle files' own sizes. A synthetic tiny checkpoint keeps the builds to
seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from builder.__main__ import build_parser
from builder.__main__ import main as builder_main
from builder.plan import DEFAULT_GSM, DEFAULT_HEAD, DEFAULT_WEIGHTS, WEIGHT_CHOICES, fmt_bytes
from gsm.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
WEIGHTS_DOC = (ROOT / "docs" / "weights.md").read_text(encoding="utf-8")
CHOICE = r"(fp16|int8|int4|auto)"


def build_help() -> str:
    """`builder build --help` as one line (argparse's wrapping undone)."""
    return " ".join(build_command().format_help().split())


def build_command():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["build"]


def flag_help(text: str, flag: str) -> str:
    """The help of `flag` as `--help` prints it (one line; checked to be part of `text`)."""
    action = next(a for a in build_command()._actions if flag in a.option_strings)
    words = " ".join(action.help.split())
    assert words in text, f"{flag}'s help not in --help"
    return words


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The summaries of a default build and an --weights int8 build of one tiny checkpoint."""
    import contextlib
    import io

    d = tmp_path_factory.mktemp("defaults")
    ck = synth_checkpoint("tiny", d / "ck", seed=0)
    out = {}
    for name, extra in (("default", []), ("int8", ["--weights", "int8"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert builder_main(["build", "--device", "orin", "--checkpoint", str(ck), "--output",
                                 str(d / name), *extra]) == 0
        out[name] = (d / name, buf.getvalue())
    return out


def test_the_parser_default_is_the_rule():
    args = build_parser().parse_args(["build", "--device", "orin"])
    assert args.weights == DEFAULT_WEIGHTS == "fp16" and args.head_weights is None and args.gsm_weights is None
    assert DEFAULT_HEAD[DEFAULT_WEIGHTS] == DEFAULT_GSM[DEFAULT_WEIGHTS] == "fp16"  # no flag: nothing quantised


def test_the_cli_and_the_api_share_their_defaults():
    """A build with no flags but --device is the Python API's BuildConfig with its defaults, but for --uncalibrated:
    the API uses data-free scales (the golden-regression tests), the CLI keeps an uncalibrated cache FP16."""
    from builder.__main__ import build_config
    from builder.build import BuildConfig

    assert build_config(build_parser().parse_args(["build", "--device", "orin"])) == BuildConfig(
        device="orin", uncalibrated="fp16")


def test_help_states_every_weight_default():
    text = build_help()
    m = re.search(rf"Default {CHOICE}: with no --weights every weight stays (\w+)", flag_help(text, "--weights"))
    assert m and m.group(1) == DEFAULT_WEIGHTS and m.group(2) == DEFAULT_WEIGHTS.upper()
    for flag, table in (("--head-weights", DEFAULT_HEAD), ("--gsm-weights", DEFAULT_GSM)):
        said = dict((w, d) for d, w in re.findall(rf"\b{CHOICE} for {CHOICE}\b", flag_help(text, flag)))
        assert set(said) == set(WEIGHT_CHOICES), flag
        for w in WEIGHT_CHOICES:
            # the head's int4 default depends on the calibration; --help names both cases
            assert said[w] == table[w] or (flag == "--head-weights" and w == "int4"), (flag, w)
    assert "default fast when anything is quantised, else exact" in flag_help(text, "--matmul-accuracy")


def test_readme_and_weights_doc_state_the_same_default():
    said = re.findall(rf"--weights(?:[^\n|]|\\\|){{0,80}}?default\s+`{CHOICE}`", README)  # `\|`: a table's |
    assert len(said) >= 2 and set(said) == {DEFAULT_WEIGHTS}  # the Commands row and the real-model section
    assert "INT8 by default" not in README  # only what a quantised build brings is INT8
    row = next(line for line in WEIGHTS_DOC.splitlines() if line.startswith("| `--weights` |"))
    assert re.search(rf"\(`{CHOICE}`\)", row).group(1) == DEFAULT_WEIGHTS


def test_the_summary_says_what_was_built_and_why(built):
    _, text = built["default"]
    assert (f"projections {DEFAULT_WEIGHTS.upper()}, embedding / LM head {DEFAULT_HEAD[DEFAULT_WEIGHTS].upper()}, "
            f"GSM side {DEFAULT_GSM[DEFAULT_WEIGHTS].upper()} (--weights {DEFAULT_WEIGHTS}: the default)") in text
    _, text8 = built["int8"]
    assert (f"projections INT8 g32, embedding / LM head {DEFAULT_HEAD['int8'].upper()}, "
            f"GSM side {DEFAULT_GSM['int8'].upper()} (--weights int8, ") in text8


@pytest.mark.parametrize("which", ["default", "int8"])
def test_the_summary_sizes_are_the_files_sizes(built, which):
    bundle, text = built[which]
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("on disk: "))
    m = re.match(r"on disk: (.+?) in (\d+) files: (.*)$", line)
    files = sorted(p for p in bundle.iterdir() if p.is_file())
    assert m and int(m.group(2)) == len(files)
    assert m.group(1) == fmt_bytes(sum(p.stat().st_size for p in files))
    listed = dict(re.findall(r"(?:^|, )([\w.]+) ([\d,.]+ (?:GiB|MiB|KiB|B))", m.group(3)))
    assert listed == {p.name: fmt_bytes(p.stat().st_size) for p in files}
    device = re.search(r"on the device: weights ([\d,.]+ (?:GiB|MiB|KiB|B)),", text).group(1)
    import json

    assert device == fmt_bytes(json.loads((bundle / "report.json").read_text())["engine_weight_bytes"])
