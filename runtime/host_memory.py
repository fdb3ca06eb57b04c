"""Host memory under the backends: the cache buffers' pages, and the process heap (glibc's malloc; on another C
library the heap calls do nothing).

The cache buffers (pools, keys, row caches: one block per layer and buffer, all rows) come from `cache_zeros`: their
own anonymous mappings, advised against transparent huge pages. numpy asks for huge pages on any block of 4 MiB or
more, and a 2 MiB page is made resident whole at its first write (zeroed, memory compacted first under the usual
`defrag=madvise`), so on a many-sequence plan a short context held whole huge pages of every layer's buffers in each
row it used: SmolLM2, eight ~300-token inspection requests on a build for 8 sequences of 4,352 positions, 715 MiB
resident against 390 on 4 KiB pages, and a row's first prefix copy took ~120 ms against ~1. Their pages are the
OS's zero pages until written, as np.zeros' are.

A prefill chunk allocates and frees tens of MB of working memory (the attention op's scores and selections, ONNX
Runtime's outputs), of sizes that grow with the context. glibc raises its mmap threshold after each large block
it frees, so later blocks come from the heap, which keeps them after they are freed: over an 8K prompt the process
held ~35 MiB of freed blocks at its peak (SmolLM2). A fixed threshold gives every block of HEAP_MMAP_THRESHOLD or
more back to the system when it is freed; a trim after loading and after a prefill chunk returns the small blocks'
free pages (the tokenizer's JSON parse leaves ~16 MiB of them). A decode step allocates no block that large.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import Any

import numpy as np

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
HEAP_MMAP_THRESHOLD = 256 * 1024  # above a decode step's largest block (logits: 4 B x vocabulary, 196 KB on SmolLM2)


@functools.cache
def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@functools.cache
def bound_heap() -> bool:
    """Fix glibc's mmap threshold (once per process); False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def cache_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed, writable array on its own anonymous mapping in 4 KiB pages (MADV_NOHUGEPAGE where the system has
    it), resident as it is written."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0:
        return np.zeros(shape, dtype)
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        block.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(block, dtype).reshape(shape)  # the array keeps the mapping alive
