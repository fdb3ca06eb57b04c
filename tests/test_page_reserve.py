"""runtime/page_reserve.py: cache rows prefaulted ahead of their writes, contents untouched; the pages' residency read
back from the kernel (mincore), not from the class's own bookkeeping."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from runtime.page_reserve import PAGE, PageReserve

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux")


def fresh_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros on pages of their own that nothing has touched (an anonymous mapping: malloc may hand back pages an
    earlier test made resident), without transparent huge pages (a first write would then make 2 MB resident at
    once), so that residency shows the span a reserve asked for."""
    m = mmap.mmap(-1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    a = np.frombuffer(m, dtype).reshape(shape)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(a.ctypes.data, a.nbytes, 15) == 0, ctypes.get_errno()  # MADV_NOHUGEPAGE
    return a


def resident(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Whether each page of a's bytes [start, stop) is in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lo = (a.ctypes.data + start) & ~(PAGE - 1)
    n = (a.ctypes.data + stop - lo + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(lo, n * PAGE, vec) == 0, ctypes.get_errno()
    return np.frombuffer(vec, np.uint8) & 1 == 1


@linux
def test_rows_are_prefaulted_ahead_and_nothing_else():
    rows, n_max, width = 3, 4096, 256  # a position is 1 KB: 4 a page
    buf = fresh_zeros((rows, n_max, width), np.float32)  # none resident yet
    pages = PageReserve([buf], rows, n_max, ahead=64)
    if not pages.active:
        pytest.skip("madvise(MADV_POPULATE_WRITE) needs Linux 5.14+")
    row_bytes = n_max * width * 4
    assert not resident(buf, row_bytes, 2 * row_bytes).any()
    pages.reserve(1, 10)  # 10 positions written next: 64 are prefaulted
    assert pages.reserved.tolist() == [0, 64, 0]
    got = resident(buf, row_bytes, 2 * row_bytes)
    assert got[:16].all() and not got[17:].any()  # 64 positions = 16 pages (the 17th may share the row's start)
    assert not resident(buf, 2 * row_bytes + PAGE, 3 * row_bytes).any()  # the next row untouched
    pages.reserve(1, 64)  # within what is reserved: nothing to do
    assert pages.reserved[1] == 64
    pages.reserve(1, 200)  # past it: through the write's end (beyond a span ahead)
    assert pages.reserved[1] == 200 and resident(buf, row_bytes, row_bytes + 200 * width * 4).all()
    pages.reserve(1, n_max - 3)
    assert pages.reserved[1] == n_max - 3
    pages.reserve(1, n_max - 2)  # a span ahead would run past the buffer: up to its end
    assert pages.reserved[1] == n_max and resident(buf, row_bytes, 2 * row_bytes).all()


@linux
def test_contents_are_left_as_they_are():
    buf = np.zeros((2, 1024, 96), np.int8)
    buf[1, :300] = np.random.default_rng(0).integers(-128, 127, (300, 96), dtype=np.int8)
    before = buf.copy()
    pages = PageReserve([buf], 2, 1024, ahead=512)
    pages.reserve(1, 300)  # over written positions and beyond
    pages.reserve(0, 1024)
    assert np.array_equal(buf, before)


def test_without_madvise_nothing_is_done():
    buf = np.zeros((2, 64, 8), np.float32)
    pages = PageReserve([buf], 2, 64)
    pages._madvise = None  # a kernel before 5.14, or not Linux
    pages.reserve(0, 10)
    assert not pages.active and pages.reserved.tolist() == [0, 0]
