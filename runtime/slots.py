"""Slot table and row allocation of the latent pools (docs/engine_io.md section 3), host side.

Used by the TensorRT backend, whose cache is one byte pool per owning layer with FP16 / INT12 /
INT8 / INT4 regions addressed by a global row `g`, and one `kv_slots` table per sequence holding
`(tier << 24) | g` for each cached position (-1: none). Pure numpy, so it is tested on any machine.

Rules (engine_io section 3):
- a new position gets an FP16 row in the FP16 region;
- a row may live in a wider region than its tier needs; a demoted row moves to the narrowest region
  with a free row that fits its new tier, or stays where it is;
- when the FP16 region is full but holds borrowed rows (INT12/INT8 rows living there), those move
  to narrower regions first (a demotion-list entry with an unchanged tier);
- rows freed by a demotion pass are reused only from the next pass on, so no entry's destination is
  a live source row of another entry of the same list.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from gsm.tiers import FP16, INT4, INT8, INT12, NAMES  # noqa: F401  (tier codes, named here for callers)

REGION_NAMES = tuple(n.upper() for n in NAMES)
ROW_MASK = 0xFFFFFF


class CacheOverflowError(RuntimeError):
    """A pool region has no row left; the message names the region and the build option to raise."""


def entry(tier: int, row: int) -> int:
    return (tier << 24) | row


class SlotTable:
    """Slots of one sequence: `entries` [n_max] int32 is what the engine reads as kv_slots[b]."""

    def __init__(self, n_max: int, rows: Sequence[int]) -> None:
        """rows: C16, C12, C8 and C4 (three sizes: no INT4 region)."""
        self.n_max = n_max
        self.sizes = tuple(int(x) for x in rows) + (0,) * (len(NAMES) - len(rows))
        self.starts = tuple(int(x) for x in np.cumsum((0, *self.sizes[:-1])))
        self.entries = np.full(n_max, -1, np.int32)
        # free rows per region, lowest first (deterministic layouts make engine bugs reproducible)
        self.free: list[list[int]] = [list(range(s + c - 1, s - 1, -1)) for s, c in zip(self.starts, self.sizes)]

    def region(self, row: int) -> int:
        """The region holding global row `row` (the last one starting at or before it: empty ones are skipped)."""
        return bisect.bisect_right(self.starts, row) - 1

    def _take(self, region: int) -> int:
        return self.free[region].pop()

    def _give(self, row: int) -> None:
        f = self.free[self.region(row)]
        f.append(row)
        f.sort(reverse=True)

    def reset(self) -> None:
        self.__init__(self.n_max, self.sizes)  # type: ignore[misc]

    def compaction(self, needed: int) -> list[tuple[int, int]]:
        """Moves (old entry, new entry) that free FP16-region rows for `needed` new positions, by
        moving borrowed rows (tier > FP16) to narrower regions; CacheOverflowError if impossible."""
        moves: list[tuple[int, int]] = []
        if len(self.free[0]) >= needed:
            return moves
        borrowed = [p for p in np.nonzero(self.entries >= 0)[0]
                    if (self.entries[p] >> 24) > FP16 and self.region(int(self.entries[p]) & ROW_MASK) == 0]
        freed: list[int] = []
        for p in borrowed:
            if len(self.free[0]) + len(freed) >= needed:
                break
            old = int(self.entries[p])
            tier, row = old >> 24, old & ROW_MASK
            dest = next((r for r in range(tier, 0, -1) if self.free[r]), None)  # narrowest first
            if dest is None:
                continue
            new = entry(tier, self._take(dest))
            moves.append((old, new))
            self.entries[p] = new
            freed.append(row)
        for row in freed:
            self._give(row)
        if len(self.free[0]) < needed:
            raise CacheOverflowError(
                f"the FP16 region of the latent pool is full ({self.sizes[0]} rows, {len(self.free[0])} free, "
                f"{needed} needed); rebuild the bundle with a larger --max-seq or a smaller --max-input, or "
                "lower quantization_adaptation_rate")
        return moves

    def allocate(self, positions: range) -> None:
        """FP16 rows for new positions (call `compaction` first)."""
        for p in positions:
            if self.entries[p] >= 0:
                raise ValueError(f"position {p} already has a row")
            if not self.free[0]:
                raise CacheOverflowError(f"the FP16 region of the latent pool is full ({self.sizes[0]} rows)")
            self.entries[p] = entry(FP16, self._take(0))

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a rollback): their rows go back to the free lists, and the next
        call writes those positions anew."""
        for p in np.nonzero(self.entries[length:] >= 0)[0] + length:
            self._give(int(self.entries[p]) & ROW_MASK)
            self.entries[p] = -1

    def demote(self, new_tier: np.ndarray) -> list[tuple[int, int]]:
        """Entries (old, new) for every position with new_tier >= 0; updates the table."""
        moves: list[tuple[int, int]] = []
        freed: list[int] = []
        for p in np.nonzero(new_tier >= 0)[0]:
            old = int(self.entries[p])
            if old < 0:
                raise ValueError(f"position {p} has no row to demote")
            tier, row, t = old >> 24, old & ROW_MASK, int(new_tier[p])
            if t < tier:
                raise ValueError(f"position {p}: tier {t} would promote a row of tier {tier}")
            here = self.region(row)
            dest = next((r for r in range(t, here, -1) if self.free[r]), None)  # narrower than `here`
            if dest is None:
                new = entry(t, row)
            else:
                new = entry(t, self._take(dest))
                freed.append(row)
            moves.append((old, new))
            self.entries[p] = new
        for row in freed:
            self._give(row)
        return moves
