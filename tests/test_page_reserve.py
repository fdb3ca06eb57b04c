"""runtime/page_reserve.py: cache rows prefaulted ahead of their writes, contents untouched; runtime/host_memory.py's
cache buffers on 4 KiB pages, resident as written. The pages' residency is read back from the kernel (mincore), their
advice from /proc/self/smaps, not from the code's own bookkeeping."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.host_memory import cache_zeros
from runtime.page_reserve import PAGE, PageReserve

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux")


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
    buf = cache_zeros((rows, n_max, width), np.float32)  # none resident yet
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


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps: nh = MADV_NOHUGEPAGE, hg = MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
def test_cache_buffers_are_zeroed_4k_pages_resident_as_written():
    """A 32 MiB buffer (numpy would ask huge pages for it): zeros, writable, advised against huge pages, and one
    element written makes one 4 KiB page resident, not a 2 MiB one."""
    a = cache_zeros((8, 1 << 20), np.int32)
    assert a.shape == (8, 1 << 20) and a.dtype == np.int32 and a.flags.writeable and a.flags.c_contiguous
    assert "nh" in vm_flags(a.ctypes.data) and "hg" not in vm_flags(a.ctypes.data)
    assert not resident(a, 0, a.nbytes).any()
    a[3, 1000] = 7
    at = 3 * a[0].nbytes + 4000
    assert resident(a, 0, a.nbytes).sum() == 1 and resident(a, at, at + 1).all()
    assert int(a.sum()) == 7 and cache_zeros((0, 4), np.float32).shape == (0, 4)


@linux
@pytest.mark.parametrize("backend,graph", [("onnxruntime", "cpu"), ("onnxruntime", "portable"), ("reference", None)])
def test_every_cache_buffer_of_a_many_sequence_runtime_is_on_4k_pages(tmp_path_factory, backend, graph):
    """Pools, keys and row caches of every backend's plan for several sequences: each buffer's mapping is advised
    against huge pages (a short sequence then holds the pages it wrote, not whole 2 MiB pages of every layer)."""
    from runtime_bundles import build_demo

    import runtime
    from runtime.ref_backend import reference_usable

    if backend == "reference" and not reference_usable()[0]:
        pytest.skip(f"reference backend: {reference_usable()[1]}")
    bundle = build_demo(tmp_path_factory.mktemp("pages") / "demo", max_seq=64, max_input=16, max_batch=4)
    rt = runtime.load(bundle, backend, threads=1, **({} if graph is None else {"graph": graph}))
    buffers = rt.worker.backend.buffers
    assert len(buffers) >= 2
    for name, buf in buffers.items():
        flags = vm_flags(buf.ctypes.data)
        assert "nh" in flags and "hg" not in flags, (name, sorted(flags))
