"""A prefill's working memory on the onnxruntime backend: calls late in a long prompt carry fewer tokens
(Capabilities.call_positions, Runtime.chunk_tokens), and the process heap gives freed blocks back
(runtime/host_memory.py). The figures these bound are in docs/runtime.md ("Where it stands")."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from runtime import host_memory
from runtime.ort_backend import CALL_POSITIONS
from runtime.step_worker import PREFILL_ALIGN, prefill_chunk


@pytest.mark.parametrize(("max_input", "past", "cap", "want"), [
    (512, 0, 0, 512),  # no bound: max-input whatever the context
    (512, 7000, 0, 512),
    (512, 0, 1 << 20, 512),  # 2^20 // 512 = 2048 tokens would fit: max-input
    (512, 1536, 1 << 20, 512),  # 2^20 // 2048 = 512 exactly
    (512, 1537, 1 << 20, 448),  # 2^20 // 2049 = 511 -> 448, a multiple of 64
    (512, 7680, 1 << 20, 128),  # 2^20 // 8192 = 128
    (512, 100_000, 1 << 20, 64),  # never below PREFILL_ALIGN
    (16, 100_000, 1 << 20, 16),  # nor above max-input
])
def test_prefill_chunk(max_input: int, past: int, cap: int, want: int) -> None:
    assert prefill_chunk(max_input, past, cap) == want
    if cap and want > PREFILL_ALIGN:
        assert want * (past + max_input) <= cap


@pytest.fixture(scope="module")
def long_input(tmp_path_factory):
    """A bundle whose max-input (192) leaves room below it for PREFILL_ALIGN-token calls, two sequences at once."""
    import runtime
    from builder.build import BuildConfig, build
    from gsm.synth import synth_checkpoint

    root = tmp_path_factory.mktemp("prefill_memory")
    build(BuildConfig(device="orin", checkpoint=synth_checkpoint("tiny", root / "tiny", seed=3), output=root / "b",
                      max_seq=512, max_input=192, max_batch=2))
    return runtime.load(root / "b", "onnxruntime", threads=1)


def test_prefill_calls_shrink_as_the_context_grows(long_input) -> None:
    """A bound that bites: every call carries prefill_chunk(its context) tokens (worked out by hand: 57,600 // (past
    + 192) rounded down to a multiple of 64, at most 192), and the prompt goes in whole."""
    rt = long_input
    be = rt.backend
    cap = 192 * 300
    caps = be.capabilities
    be.capabilities = dataclasses.replace(caps, call_positions=cap)
    calls = []
    forward = be.forward

    def spy(caches, ids, past, new, *a, **k):
        calls.append((int(past.max()), int(new.max())))
        return forward(caches, ids, past, new, *a, **k)

    be.forward = spy
    try:
        s = rt.new_sequence()
        n = 480
        rt.prefill_batch([s], [list(np.arange(n) % 50 + 3)])
        assert s.length == n
    finally:
        be.forward, be.capabilities = forward, caps
    assert sum(t for _, t in calls) == n
    # past 0: 300 -> 192; 192: 150 -> 128; 320: 112 -> 64; 384: 100 -> 64; 448: the last 32
    assert [t for _, t in calls] == [192, 128, 64, 64, 32]
    for past, tokens in calls[:-1]:
        assert tokens == prefill_chunk(rt.max_input, past, cap)


@pytest.mark.parametrize(("lengths", "want"), [
    # 60 + 60 tokens x (0 + 192) = 23,040 <= 57,600: one call
    ((60, 60), [(2, 0, 60)]),
    # 192 + 192 tokens x 192 = 73,728 > 57,600: one sequence a call, each with its own chunks (the test above's)
    ((480, 480), [(1, 0, 192), (1, 192, 128), (1, 320, 64), (1, 384, 64), (1, 448, 32)] * 2),
    # 60 + 192 tokens x 192 = 48,384 fits the bound, but not max-input (192): one at a time
    ((60, 480), [(1, 0, 60), (1, 0, 192), (1, 192, 128), (1, 320, 64), (1, 384, 64), (1, 448, 32)]),
    ((100, 92), [(2, 0, 100)]),  # 192 tokens: max-input exactly
])
def test_a_call_carries_sequences_while_the_bound_holds(long_input, lengths, want) -> None:
    """prefill_batch puts the next sequence into a call while the call stays within max-input tokens and its tokens x
    (past + max-input) within the bound, each sequence with the tokens it gets alone (shared, a call of 8 sequences
    of 4K gave each 32 tokens, and the op makes the rows each call's picks need: ~30 MiB of scratch at the end):
    (sequences, past, most new tokens) of each call, worked out by hand with the bound 57,600."""
    rt = long_input
    be = rt.backend
    caps = be.capabilities
    be.capabilities = dataclasses.replace(caps, call_positions=192 * 300)
    calls = []
    forward = be.forward

    def spy(caches, ids, past, new, *a, **k):
        calls.append((len(caches), int(past.max()), int(new.max())))
        return forward(caches, ids, past, new, *a, **k)

    be.forward = spy
    seqs = [rt.new_sequence() for _ in lengths]
    try:
        rt.prefill_batch(seqs, [list(np.arange(n) % 50 + 3) for n in lengths])
    finally:
        be.forward, be.capabilities = forward, caps
        for s in seqs:
            s.close()
    assert calls == want


def test_the_onnxruntime_backend_bounds_its_calls(rts) -> None:
    assert rts["demo"].backend.capabilities.call_positions == CALL_POSITIONS > 0


HEAP_CHECK = """
import ctypes, sys
from runtime import host_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
libc = host_memory._glibc()
if libc is None:
    print("not glibc"); sys.exit(0)
if sys.argv[1] == "bound":
    assert host_memory.bound_heap()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = host_memory.HEAP_MMAP_THRESHOLD + 4096
before = rss()
for size in (8 << 20, n, 8 * n):  # a large block freed raises glibc's own threshold past the next ones
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("mode", ["bound", "glibc default"])
def test_the_heap_gives_freed_blocks_back(mode: str) -> None:
    """In a fresh process (its heap as a process starts): after bound_heap, blocks of HEAP_MMAP_THRESHOLD or more,
    freed, leave nothing resident; with glibc's adaptive threshold (the control) the large block freed first raises
    the threshold, the next ones come from the heap, and their pages stay."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", HEAP_CHECK, mode.split()[0]], capture_output=True, text=True,
                       check=True)
    if r.stdout.strip() == "not glibc":
        pytest.skip("not glibc")
    kept = int(r.stdout.strip())
    if mode == "bound":
        assert kept < host_memory.HEAP_MMAP_THRESHOLD, kept
    else:
        assert kept >= host_memory.HEAP_MMAP_THRESHOLD, kept
