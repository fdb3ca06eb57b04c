"""The process heap under the onnxruntime backend (glibc's malloc; on another C library both calls do nothing).

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
from typing import Any

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
