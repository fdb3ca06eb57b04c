"""Cache pages faulted in ahead of the positions a row writes.

The ONNX Runtime backend's cache buffers are zeroed pages the OS hands out on first write, so resident memory grows
with the positions written, not with N_max. Left to the writes themselves, every new position of a decode step
touches a fresh page in some of the ~120 buffers of a SmolLM2-sized model: one fault each, inside the step (on this
workplace's VM 1.1 ms a step; a whole row written page by page ran 5x slower than the same pages prefaulted in ranges).
So a row is prefaulted ahead of its writes in spans of `ahead` positions with `madvise(MADV_POPULATE_WRITE)` (Linux
5.14+), one call per buffer per span: contents are left as they are (a page already present is not touched), and
resident memory runs at most `ahead` positions per row ahead of what was written (numpy backs large arrays with
transparent huge pages where the kernel offers them, so either way a row's buffer grows in steps of up to 2 MB).
Where the call is not available (older kernels, other systems) nothing is done and the pages fault in on write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
PAGE = 4096  # the span's start is rounded down to it (madvise takes page-aligned addresses)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class PageReserve:
    """Prefaults rows of buffers [R, N, ...] (C-contiguous) ahead of their writes; `reserve(row, end)` before
    positions < end of `row` are written. `reserved[row]` = positions prefaulted so far (kept when a row is reused:
    its pages stay)."""

    def __init__(self, buffers: list[np.ndarray], rows: int, n_max: int, ahead: int = 256) -> None:
        self.spans = [(b.ctypes.data, b.strides[0], b.strides[1]) for b in buffers]
        self.n_max, self.ahead = n_max, ahead
        self.reserved = np.zeros(rows, np.int64)
        self._madvise = _madvise()

    @property
    def active(self) -> bool:
        return self._madvise is not None

    def reserve(self, row: int, end: int) -> None:
        start = int(self.reserved[row])
        if end <= start or self._madvise is None:
            return
        stop = min(self.n_max, max(end, start + self.ahead))
        for base, row_stride, pos_stride in self.spans:
            a = base + row * row_stride + start * pos_stride
            a0 = a & ~(PAGE - 1)
            if self._madvise(a0, base + row * row_stride + stop * pos_stride - a0, MADV_POPULATE_WRITE) != 0:
                self._madvise = None  # EINVAL on kernels before 5.14: fault on write from now on
                return
        self.reserved[row] = stop
