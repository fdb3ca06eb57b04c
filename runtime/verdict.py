"""The golden check's verdict: the table an edge engineer pastes into a bug report, and the verdicts a bundle's
report records, which `runtime serve` and the Triton model read before serving (docs/verify.md).

Never torch: the runtime imports this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gsm.bundle_format import FILES
from runtime.verify_checks import Check

VERIFY_KEY = "verify"  # report.json: backend -> the verdict recorded for it (builder engine writes tensorrt's)
PASS, FAIL, UNVERIFIED = "pass", "fail", "not verified"
ALLOW_FAILED_VERIFY = "--allow-failed-verify"  # the flag of `runtime serve` / `runtime triton` that overrides a failure


@dataclass(frozen=True)
class Verdict:
    """One backend's result on a bundle's probe: what ran, where, and each check."""

    bundle: str
    backend: str  # with the graph, e.g. "onnxruntime (graph cpu)"
    versions: str  # the backend library's version(s), e.g. "TensorRT 10.3.0" or "onnxruntime 1.23.2"
    device: str
    precision: str
    checks: tuple[Check, ...]
    seconds: float
    probe: str  # what the probe was, one line
    tolerance: str = field(default="")

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def failure_line(self) -> str:
        return "; ".join(f"{c.name} {c.value} (limit {c.limit}{', ' + c.where if c.where else ''})"
                         for c in self.failed)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        d["status"] = PASS if self.passed else FAIL
        return d

    def table(self) -> str:
        head = [("bundle", self.bundle), ("backend", self.backend), ("versions", self.versions),
                ("device", self.device), ("precision", f"{self.precision}: {self.tolerance}"), ("probe", self.probe)]
        w = max(len(c.name) for c in self.checks)
        vw = max(len(c.value) for c in self.checks)
        lw = max(len(c.limit) for c in self.checks)
        lines = [f"{k:<10} {v}" for k, v in head] + [""]
        lines.append(f"{'check':<{w}}  {'value':<{vw}}  {'limit':<{lw}}  result")
        lines += [f"{c.name:<{w}}  {c.value:<{vw}}  {c.limit:<{lw}}  {PASS if c.passed else 'FAIL'}"
                  for c in self.checks]
        verdict = "PASS" if self.passed else f"FAIL: {self.failure_line()}"
        lines.append(f"verdict: {verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)


def recorded_verdicts(bundle: Path) -> Mapping[str, Any]:
    """The verdicts the bundle's report.json records, by backend (empty where none; a verified bundle's report)."""
    try:
        report = json.loads((Path(bundle) / FILES.report).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    got = report.get(VERIFY_KEY) if isinstance(report, dict) else None
    return got if isinstance(got, dict) else {}


def verdict_status(bundle: Path, backend: str) -> dict[str, Any]:
    """What /health says of the bundle's recorded verdict for `backend`: status pass / fail / not verified, and
    what failed, where the report says."""
    rec = recorded_verdicts(bundle).get(backend)
    if not isinstance(rec, dict):
        return {"backend": backend, "status": UNVERIFIED}
    out = {"backend": backend, "status": PASS if rec.get("status") == PASS else FAIL}
    for key in ("versions", "device", "precision"):
        if key in rec:
            out[key] = rec[key]
    if out["status"] == FAIL:
        out["failed"] = [c.get("name") for c in rec.get("checks", []) if isinstance(c, dict) and not c.get("passed")]
    return out


class VerdictRefused(ValueError):
    """The bundle's recorded verdict for the backend is a failure (a flag overrides)."""


def refuse_failed(bundle: Path, backend: str, *, flag: str, allow: bool) -> dict[str, Any]:
    """The recorded verdict's status for `backend`; VerdictRefused naming `flag` where it failed and not `allow`."""
    status = verdict_status(bundle, backend)
    if status["status"] == FAIL and not allow:
        raise VerdictRefused(f"bundle {bundle}: its recorded golden check on backend {backend} failed "
                             f"({', '.join(str(f) for f in status.get('failed', [])) or 'see report.json'}); rebuild "
                             f"the bundle or its engine, or pass {flag} to serve it anyway")
    return status
