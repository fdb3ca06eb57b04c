"""Progress of long steps (gsm/progress.py): units done / total and the time left, a line every N seconds in a log.

The pipeline tests slow one stage down on purpose (a fake that sleeps before the real work, no unit done meanwhile)
and check that the log still gets a line at least every N seconds while it runs, in the stated format. N is made
small through GSM_EDGE_PROGRESS_SECONDS, so each test takes seconds.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import CALIB_TEXT, EVAL_TEXT, STORIES, needs_data

from gsm.progress import SECONDS_ENV, Progress, duration, line_seconds, track

EVERY = 0.2  # seconds between lines in these tests
# the largest gap allowed between two lines while a slow stage runs: the interval plus room for a loaded machine
# (without the timer thread the gap is the whole slow stage, several seconds)
MAX_GAP = EVERY + 0.8
SLOW = 0.6  # seconds each slowed-down call sleeps before doing its work


class Log:
    """A progress callable that keeps (time, message)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, msg: str) -> None:
        self.lines.append((time.monotonic(), msg))

    def window(self, first: str, last: str) -> list[tuple[float, str]]:
        """The lines from the one starting `first` (exclusive of earlier ones) to the one starting `last`."""
        msgs = [m for _, m in self.lines]
        a = next(i for i, m in enumerate(msgs) if m.startswith(first))
        b = next(i for i, m in enumerate(msgs) if i > a and m.startswith(last))
        return self.lines[a:b + 1]


def max_gap(lines: list[tuple[float, str]]) -> float:
    return max(b - a for (a, _), (b, _) in zip(lines, lines[1:]))


def ticker_lines(lines: list[tuple[float, str]], name: str, unit: str) -> list[re.Match]:
    pat = re.compile(rf"^{re.escape(name)}: ([\d,]+)/([\d,]+) {unit} \((\d+) %\), .+ elapsed, "
                     r"(about .+ left|time left unknown until a unit is done)$")
    return [m for _, msg in lines if (m := pat.match(msg))]


# -- the helper ---------------------------------------------------------------------------------------
def test_line_counts_units_and_estimates_the_time_left():
    now = [100.0]
    p = Progress("long fit", 48, "chunks", log=print, clock=lambda: now[0])
    assert p.line() == "long fit: 0/48 chunks (0 %), 0 s elapsed, time left unknown until a unit is done"
    now[0] += 40
    p.advance(12)
    assert p.eta() == pytest.approx(120.0)
    assert p.line() == "long fit: 12/48 chunks (25 %), 40 s elapsed, about 2 min 00 s left"
    q = Progress("write checkpoint", None, "steps", log=print, clock=lambda: now[0])
    now[0] += 7
    assert q.line() == "write checkpoint: 7 s elapsed" and q.eta() is None
    assert [duration(s) for s in (0.4, 59, 61, 3725)] == ["0 s", "59 s", "1 min 01 s", "1 h 02 min"]


def test_a_unit_slower_than_the_interval_still_leaves_lines():
    log = Log()
    t0 = time.monotonic()
    with track("slow", 2, "units", log=log, bar=False, every=EVERY) as advance:
        time.sleep(3 * SLOW)  # one unit, far longer than the interval
        advance(1)
        time.sleep(SLOW)
    assert len(log.lines) >= 4
    assert max_gap([(t0, "")] + log.lines) <= MAX_GAP  # lines came while the unit ran, not after it
    ms = ticker_lines(log.lines, "slow", "units")
    assert len(ms) == len(log.lines) - 1 and ms[-1].group(1) == "1" and ms[-1].group(4).startswith("about")
    assert log.lines[-1][1] == "slow: done in 2 s"  # a step that printed lines says when it ended


def test_a_short_step_prints_nothing_and_the_interval_is_checked(monkeypatch):
    log = Log()
    with track("quick", 3, log=log, bar=False, every=5.0) as advance:
        advance(3)
    assert log.lines == []
    monkeypatch.setenv(SECONDS_ENV, "2.5")
    assert line_seconds() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(SECONDS_ENV, bad)
        with pytest.raises(ValueError, match=SECONDS_ENV):
            line_seconds()


# -- the converter and the calibration ----------------------------------------------------------------
@needs_data
def test_convert_emits_progress_at_least_every_n_seconds_on_a_slow_stage(tmp_path, monkeypatch):
    from gsm.config import GSMParams
    from gsm.convert import indexer as ixr
    from gsm.convert.pipeline import ConvertOptions, convert
    from gsm.sources.llama2c import read_llama2c

    monkeypatch.setenv(SECONDS_ENV, str(EVERY))
    real_fit = ixr.fit

    def slow_fit(*a, **k):  # a layer's fit that takes SLOW seconds before its first Adam step
        time.sleep(SLOW)
        return real_fit(*a, **k)

    monkeypatch.setattr(ixr, "fit", slow_fit)
    log = Log()
    opts = ConvertOptions(calib_text=CALIB_TEXT, seq_len=128, calib_tokens=1024, indexer_sequences=4, indexer_steps=10,
                          long_fit_windows=0, gsm=GSMParams(sparse_window=16, max_sparse_window=16, sparse_top_k=32,
                                                           indexer_dim=8))
    convert(read_llama2c(STORIES), tmp_path / "gsm", opts, progress=log, show_bars=False)
    stage = log.window("whitened SVD: done in", "indexer fit: done in")  # 5 layers x SLOW seconds
    assert stage[-1][0] - stage[0][0] >= 5 * SLOW
    assert max_gap(stage) <= MAX_GAP
    ms = ticker_lines(stage, "indexer fit", "Adam steps")
    assert len(ms) >= 5 * SLOW / MAX_GAP and all(m.group(2) == "50" for m in ms)  # 5 layers x 10 steps
    assert any(m.group(4).startswith("about") for m in ms)  # an estimate once a unit is done


@needs_data
def test_calibration_emits_progress_at_least_every_n_seconds_on_a_slow_stage(tmp_path, monkeypatch):
    import calibration.measure as measure
    from calibration.pipeline import CalibrateOptions, calibrate_checkpoint
    from gsm.synth import synth_checkpoint

    monkeypatch.setenv(SECONDS_ENV, str(EVERY))
    real = measure.decode_scores

    def slow_decode(*a, **k):  # a lockstep batch that takes SLOW seconds before its first decode step
        time.sleep(3 * SLOW)
        return real(*a, **k)

    monkeypatch.setattr(measure, "decode_scores", slow_decode)
    ck = synth_checkpoint("tiny", tmp_path / "ck", seed=0)
    log = Log()
    calibrate_checkpoint(CalibrateOptions(checkpoint=ck, data=CALIB_TEXT, eval_data=EVAL_TEXT, samples=4, seq_len=48,
                                          search_samples=2, eval_samples=2, out=tmp_path / "cal"), progress=log)
    for name, last in (("tier search at 1 B/value (1 candidates)", "fractions [0.0, 0.0, 1.0]"),
                       ("held-out report", "deployed, all FP16")):
        stage = log.window(f"{name}:", last)
        assert max_gap(stage) <= MAX_GAP, name
        ms = ticker_lines(stage, name, "decode steps")
        assert len(ms) >= 3 * SLOW / MAX_GAP and ms[0].group(2) != "0", name
