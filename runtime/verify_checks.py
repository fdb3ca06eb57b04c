"""The golden check's figures: pure functions of a probe record (the golden's) and what a backend gave on it.

Per output (a call's last-row logits; gsm.probe_format), three things may fail: the centred logits' max or mean
difference beyond the precision's limit (outputs whose logits the probe stores), or a top-1 other than the golden's
where the golden's own top-2 margin is clear. A failing output is *excused* where the golden's own top-k boundary
was a near-tie there (the precision may select other positions, and a re-selected output is another computation);
at most EXCUSED_SHARE of the outputs may be. Never torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gsm.probe_format import ProbeRecord
from runtime.tolerances import EXCUSED_SHARE, Tolerance

LOGITS_MAX, LOGITS_MEAN, TOP1, EXCUSED, SELECTION, GREEDY, PROBE_RUN = (
    "max |dlogit|", "mean |dlogit|", "top-1 agreement", "near-tie re-selections", "selection overlap",
    "greedy continuation", "probe run")


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    limit: str
    passed: bool
    where: str = ""  # the worst record and output, for the failure line


def half_ulp(stored: np.ndarray) -> np.ndarray:
    """Half an fp16 ulp of each stored golden logit: how far it may lie from the float32 golden."""
    return np.spacing(np.abs(np.asarray(stored, np.float16))).astype(np.float64) / 2


def centred_difference(got: np.ndarray, golden: np.ndarray) -> np.ndarray:
    """[P, V] backend minus golden logits, less each row's mean difference (softmax is shift-invariant)."""
    d = np.asarray(got, np.float64) - np.asarray(golden, np.float64)
    return d - d.mean(axis=1, keepdims=True)


@dataclass(frozen=True)
class OutputFigures:
    """One record's figures by output [K]; the logit ones NaN where the probe stores no logits."""

    max_d: np.ndarray
    max_limit: np.ndarray
    mean_d: np.ndarray
    mean_limit: np.ndarray
    tie: np.ndarray  # the golden's top-2 margin below the max limit: either token is right
    top1_same: np.ndarray
    fragile: np.ndarray  # the golden's top-k boundary gap below the precision's sel_gap

    @property
    def failing(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            logits = (self.max_d > self.max_limit) | (self.mean_d > self.mean_limit)
        return logits | (~self.tie & ~self.top1_same)

    @property
    def excusable(self) -> np.ndarray:
        return self.failing & self.fragile


def output_figures(rec: ProbeRecord, logits: np.ndarray, top1: np.ndarray, tol: Tolerance) -> OutputFigures:
    """The figures of one record: `logits` [P, V] at rec.logit_outputs, `top1` [K] of every output."""
    k = rec.outputs
    figs = {n: np.full(k, np.nan) for n in ("max_d", "max_limit", "mean_d", "mean_limit")}
    d = np.abs(centred_difference(logits, rec.logits))
    rounding = 2 * half_ulp(rec.logits)  # the centring moves the stored rounding by at most as much again
    scale = rec.scale[rec.logit_outputs].astype(np.float64)
    figs["max_d"][rec.logit_outputs] = d.max(axis=1)
    figs["max_limit"][rec.logit_outputs] = tol.max_limit(scale) + rounding.max(axis=1)
    figs["mean_d"][rec.logit_outputs] = d.mean(axis=1)
    figs["mean_limit"][rec.logit_outputs] = tol.mean_limit(scale) + rounding.mean(axis=1)
    tie = rec.margin < tol.max_limit(rec.scale) + 2 * half_ulp(rec.scale)
    return OutputFigures(**figs, tie=tie, top1_same=np.asarray(top1) == rec.top1, fragile=rec.sel_gap < tol.sel_gap)


def logit_checks(records: Sequence[ProbeRecord], figures: Sequence[OutputFigures],
                 excused: Sequence[np.ndarray]) -> list[Check]:
    """max and mean |dlogit| over the outputs not excused, the worst ratio to its limit reported."""
    out = []
    for name, value, limit in ((LOGITS_MAX, "max_d", "max_limit"), (LOGITS_MEAN, "mean_d", "mean_limit")):
        worst = (-1.0, 0.0, 0.0, "")
        for rec, f, skip in zip(records, figures, excused):
            v, lim = getattr(f, value), getattr(f, limit)
            held = ~np.isnan(v) & ~skip
            if held.any():
                i = int(np.flatnonzero(held)[np.argmax((v / lim)[held])])
                if v[i] / lim[i] > worst[0]:
                    worst = (float(v[i] / lim[i]), float(v[i]), float(lim[i]), f"{rec.case}, output {i}")
        ratio, v, lim, where = worst
        out.append(Check(name, "n/a (no stored output held)", "", True) if ratio < 0 else
                   Check(name, f"{v:.4g}", f"{lim:.4g}", ratio <= 1.0, where))
    return out


def top1_check(records: Sequence[ProbeRecord], figures: Sequence[OutputFigures],
               excused: Sequence[np.ndarray]) -> Check:
    """The backend's top-1 equals the golden's at every output whose golden margin is clear (and not excused)."""
    agree = total = skipped = 0
    where = ""
    for rec, f, skip in zip(records, figures, excused):
        held = ~f.tie & ~skip
        agree, total, skipped = agree + int((f.top1_same & held).sum()), total + int(held.sum()), skipped + int(
            (~held).sum())
        if not where and (~f.top1_same & held).any():
            where = f"{rec.case}, output {int(np.argmax(~f.top1_same & held))}"
    note = f" ({skipped} near-ties or excused not counted)" if skipped else ""
    return Check(TOP1, f"{agree}/{total}{note}", "all", agree == total, where)


def excused_outputs(records: Sequence[ProbeRecord], figures: Sequence[OutputFigures]) -> tuple[list[np.ndarray], Check]:
    """The failing outputs excused as near-tie re-selections, and the check that they are at most EXCUSED_SHARE of
    all outputs: past it none is excused (a bug moves many outputs, and each is then judged)."""
    n = sum(int(f.excusable.sum()) for f in figures)
    total = sum(rec.outputs for rec in records)
    allowed = int(EXCUSED_SHARE * total)
    where = ", ".join(f"{rec.case} outputs {np.flatnonzero(f.excusable).tolist()}" for rec, f in zip(records, figures)
                      if f.excusable.any())
    excused = [f.excusable if n <= allowed else np.zeros_like(f.excusable) for f in figures]
    return excused, Check(EXCUSED, f"{n}/{total}", f"<= {allowed}", n <= allowed, where)


def greedy_check(records: Sequence[ProbeRecord], figures: Sequence[OutputFigures],
                 excused: Sequence[np.ndarray]) -> Check:
    """Each record's continuation, token by token, up to its first golden near-tie (or excused output)."""
    parts, ok, where = [], True, ""
    for rec, f, skip in zip(records, figures, excused):
        first = len(rec.calls) - 1  # the output that predicts tokens[0]
        stop = (f.tie | skip)[first:]
        upto = int(np.argmax(stop)) if stop.any() else len(rec.tokens)
        same = f.top1_same[first:first + upto]
        n = int(np.argmax(~same)) if (~same).any() else upto
        ok = ok and n == upto
        if n < upto and not where:
            where = f"{rec.case}, token {n}"
        parts.append(f"{rec.case} {n}/{upto}" + (f" of {len(rec.tokens)}" if upto < len(rec.tokens) else ""))
    return Check(GREEDY, ", ".join(parts), "equal up to a near-tie", ok, where)


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a & b| / |a | b| over the last axis of two bool arrays (1 where both are empty)."""
    inter, union = (a & b).sum(axis=-1), (a | b).sum(axis=-1)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def selection_check(records: Sequence[ProbeRecord], selected: Sequence[np.ndarray], tol: Tolerance) -> Check:
    """The Jaccard overlap of the backend's selected positions with the golden's at the stored (layer, row) pairs where
    the golden's selection is sparse (a dense one is every position, whatever the backend's budget), averaged per
    layer: the worst layer is held to the precision's overlap (one layer's wrong attribute shows there, where a mean
    over every layer would hide it)."""
    by_layer: dict[int, list[np.ndarray]] = {}
    for rec, got in zip(records, selected):
        gold = rec.selected()  # [Ls, Q, N]
        sparse = gold.sum(axis=-1) < (rec.sel_rows + 1)[None, :]
        scores = jaccard(gold, np.asarray(got, bool))
        for i, layer in enumerate(rec.sel_layers):
            if sparse[i].any():
                by_layer.setdefault(int(layer), []).append(scores[i][sparse[i]])
    if not by_layer:
        return Check(SELECTION, "n/a (the golden selects densely at the stored rows)", f">= {tol.overlap:g}", True)
    means = {layer: float(np.concatenate(v).mean()) for layer, v in by_layer.items()}
    worst = min(means, key=lambda layer: (means[layer], layer))
    overall = float(np.concatenate([np.concatenate(v) for v in by_layer.values()]).mean())
    return Check(SELECTION, f"{means[worst]:.4f} worst layer ({worst}; all {len(means)} sparse layers {overall:.4f})",
                 f">= {tol.overlap:g}", means[worst] >= tol.overlap, f"layer {worst}")


def checks(records: Sequence[ProbeRecord], logits: Sequence[np.ndarray], top1: Sequence[np.ndarray],
           selected: Sequence[np.ndarray], tol: Tolerance) -> tuple[Check, ...]:
    """Every check of a probe run, in the table's order."""
    figures = [output_figures(rec, lg, t, tol) for rec, lg, t in zip(records, logits, top1)]
    excused, excuses = excused_outputs(records, figures)
    return (*logit_checks(records, figures, excused), top1_check(records, figures, excused), excuses,
            selection_check(records, selected, tol), greedy_check(records, figures, excused))
