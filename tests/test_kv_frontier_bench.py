"""bench/kv_frontier.py: the names of the tier-policy rows and the bytes they are charged (spec 6)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kv_frontier as kf  # noqa: E402


def test_tier_rows_are_charged_spec6_bytes():
    assert kf.tier_mix("tiers:0.25/0/0.25/0.5") == (0.25, 0.0, 0.25, 0.5)
    assert kf.format_bytes("tiers:0.25/0/0.25/0.5") == (pytest.approx(2 * 0.25 + 0.25 + 0.5 * 0.5), 2.0)
    assert kf.format_bytes("tiers:0/0/0/1+keys8") == (0.5, 1.0)
    assert kf.format_bytes("tiers:0/0/1") == (1.0, 2.0)  # a v1 triple: INT8, no INT4
    assert kf.format_bytes("int4-g32") == kf.GSM_FORMATS["int4-g32"]
    assert kf.format_bytes("int4-mse+keys8") == (0.5, 1.0)


@pytest.mark.parametrize("fmt,ok", [("tiers:0/0/0/1", True), ("tiers:0.5/0.5/0", True), ("tiers:0/0/0/1+keys8", True),
                                    ("tiers:0.5/0.6/0/0", False), ("tiers:1", False), ("tiers:a/b/c", False),
                                    ("tiers:0/0/0/1+keys4", False), ("int4-mse", True), ("int4-mse+keys8", True),
                                    ("int3", False), ("int3+keys8", False)])
def test_format_names(fmt, ok):
    assert kf.valid_format(fmt) is ok
