"""The tiers of the mixed-precision latent cache (spec 5; decisions "A 4-bit tier"), declared once.

Standard library only: the golden model, the builder's planner, calibration and the runtime's tier policy
all read these tables, so a tier's code, width and count rule exist in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Tier codes, ordered by precision lost: demotion only ever increases the code (kv_slots' tier field).
FP16, INT12, INT8, INT4 = 0, 1, 2, 3
NAMES = ("fp16", "int12", "int8", "int4")
BYTES = (2.0, 1.5, 1.0, 0.5)  # bytes per latent value (spec 6)
QMAX = {INT12: 2047, INT8: 127, INT4: 7}
BIT_WIDTHS_V1 = (16, 12, 8)
BIT_WIDTHS_V2 = (16, 12, 8, 4)
BIT_WIDTHS = (BIT_WIDTHS_V1, BIT_WIDTHS_V2)
_GUARD = 1e-9  # float noise in a product of fractions must not drop a row from a tier


def fractions4(fractions: Sequence[float]) -> tuple[float, float, float, float]:
    """A v1 triple (f16, f12, f8) means f4 = 0; four fractions are returned as given."""
    f = tuple(float(x) for x in fractions)
    if len(f) == 3:
        return (*f, 0.0)  # type: ignore[return-value]
    if len(f) != 4:
        raise ValueError(f"tier fractions must be 3 or 4 numbers, got {list(fractions)}")
    return f  # type: ignore[return-value]


def tier_counts(fractions: Sequence[float], n: int) -> tuple[int, int, int, int]:
    """Positions of each tier among n ranked ones (decisions "Re-tier pass"): n16 = floor(f0 n),
    n12 = floor((f0 + f1) n) - n16, n8 = floor((f0 + f1 + f2) n) - n16 - n12, the rest INT4; with f4 = 0
    the rest is INT8, so a v1 config never makes an INT4 row whatever the float sum of its fractions."""
    f0, f1, f2, f3 = fractions4(fractions)
    n16 = math.floor(f0 * n + _GUARD)
    n12 = math.floor((f0 + f1) * n + _GUARD) - n16
    n8 = (n if f3 == 0 else min(n, math.floor((f0 + f1 + f2) * n + _GUARD))) - n16 - n12
    return n16, n12, n8, n - n16 - n12 - n8


def avg_bytes(fractions: Sequence[float]) -> float:
    """Bytes per latent value under steady-state tier fractions (spec 6)."""
    return sum(f * b for f, b in zip(fractions4(fractions), BYTES))


def row_bytes(r_k: int, r_v: int) -> tuple[int, int, int, int]:
    """W16, W12, W8, W4 (docs/engine_io.md section 3): bytes of one row of each region of a latent pool.
    A wider region must hold any narrower tier's row: with tiny odd ranks a padded INT12 row
    (3 ceil(r_k/2) + 3 ceil(r_v/2)) exceeds 2r (r < 6), hence W16's max; W8 = r >= W4 always."""
    w12 = 3 * math.ceil(r_k / 2) + 3 * math.ceil(r_v / 2)
    return max(2 * (r_k + r_v), w12), w12, r_k + r_v, math.ceil(r_k / 2) + math.ceil(r_v / 2)


def uses_int4(fractions: Sequence[float]) -> bool:
    return fractions4(fractions)[3] > 0


def region_rows(max_seq: int, max_input: int, sink_tokens: int, fp16_window: int, fractions: Sequence[float],
                rate: int, hot_rows: int = 0) -> tuple[int, int, int, int]:
    """Rows per sequence of the FP16 / INT12 / INT8 / INT4 regions of a latent pool (docs/engine_io.md section 3;
    a row may live in a wider region than its tier):

    C16 = min(N, sinks + fp16_window + n16 + R + H), R = max(prefill chunk, rate) rows written between two re-tier
    passes, H = rows reserved for hot_token_ids; C12 = min(N - C16, n12); C8 = min(N - C16 - C12, n8);
    C4 = N - C16 - C12 - C8, with n16, n12, n8 = tier_counts(fractions, N) (so C4 = 0 without an INT4 fraction).
    Why these bound the tier policy: after a pass at most n16 eligible rows are FP16, at most n16 + n12 FP16 or
    INT12 and n16 + n12 + n8 wider than INT4 (demotion only never adds a wider row), and between passes only new
    FP16 rows appear (at most R)."""
    n16, n12, n8, _ = tier_counts(fractions, max_seq)
    c16 = min(max_seq, sink_tokens + fp16_window + n16 + max(max_input, rate) + hot_rows)
    c12 = min(max_seq - c16, n12)
    c8 = min(max_seq - c16 - c12, n8)
    return c16, c12, c8, max_seq - c16 - c12 - c8
