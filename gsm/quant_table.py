"""The engines' per-layer quantisation table `quant` [5, r] (engine_io section 6), declared once in numpy.

Rows s12, s8, comp8, s4, comp4 (TABLE_ROWS); columns the c_k channels, then c_v's. The builder writes it from a
calibration file, the runtime reads it back from a graph (one built before the 4-bit tier holds [3, r]). The
optional rows get the defaults of decisions "Rounding" and "A 4-bit tier", float32 operations in the golden's
order (gsm/golden/quant.py), so a default engines compute equals the golden's bit for bit. numpy only: the
runtime imports this, never torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

TABLE_ROWS = ("scale_int12", "scale_int8", "comp_int8", "scale_int4", "comp_int4")
_V1_ROWS = 3  # s12, s8, comp8: a table written before the 4-bit tier


def default_int12_scale(s8: np.ndarray) -> np.ndarray:
    """s12 = float32(float32(s8 * 127) / 2047)."""
    return (s8.astype(np.float32) * np.float32(127.0)) / np.float32(2047.0)


def default_int4_scale(s8: np.ndarray) -> np.ndarray:
    """s4 = float32(float32(s8 * 127) / 7)."""
    return (s8.astype(np.float32) * np.float32(127.0)) / np.float32(7.0)


def table_of(rows: Mapping[str, np.ndarray]) -> np.ndarray:
    """[5, r] float32 in TABLE_ROWS order from the rows given (scale_int8 and comp_int8 at least); the others
    get their defaults."""
    s8 = rows["scale_int8"]
    defaults = {"scale_int12": lambda: default_int12_scale(s8), "scale_int4": lambda: default_int4_scale(s8),
                "comp_int4": lambda: np.zeros_like(s8)}
    return np.stack([rows[w] if w in rows else defaults[w]() for w in TABLE_ROWS]).astype(np.float32)


def full_table(a: np.ndarray) -> np.ndarray:
    """A layer's table as the plugins read it, [5, r]: a [3, r] one (no INT4 rows were ever made with it) gets the
    INT4 rows' defaults."""
    a = np.asarray(a, np.float32)
    return table_of(dict(zip(TABLE_ROWS, a))) if a.shape[0] == _V1_ROWS else a
