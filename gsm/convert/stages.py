"""Stages of a conversion: progress while one runs (gsm.progress), its wall time when it ends.

A 1B conversion runs for a long time on a CPU; the user must see which stage is running, how far
it is and how long it has left, and afterwards what each stage cost (the times also go into the
report).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from gsm.progress import track


def resolve_device(name: str) -> torch.device:
    """`--device`: cpu, cuda, or auto (cuda when one is visible)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or auto, got {name!r}")
    return torch.device(name)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread inside the block.

    Most stages are chains of small ops (indexer steps, H x H factorisations, the golden model one
    sequence at a time); a second thread gains little on them, and on a busy machine its
    synchronisation costs far more: measured at load average 7-9 on 2 cores, stories260K's quality
    report took 676 s with 2 threads and 29 s with 1, an indexer Adam step 0.5 s and 0.035 s.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Stages:
    """`with stages.run("name", total, unit) as advance:` shows the stage's progress, then reports and records
    its time.

    A stage runs on one torch thread (`one_thread`) unless `parallel`: only the streamed statistics and the long
    sample, large matrix products over many tokens, use every thread torch was given. Progress: a bar on a
    terminal, else a line every few seconds (gsm.progress.track); `show_bars` None decides by stderr.
    """

    def __init__(self, progress: Callable[[str], Any], show_bars: bool | None = None) -> None:
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self.show_bars = show_bars

    @contextmanager
    def run(self, name: str, total: int | None = None, parallel: bool = False,
            unit: str = "steps") -> Iterator[Callable[[int], None]]:
        with nullcontext() if parallel else one_thread():
            yield from self._run(name, total, unit)

    def _run(self, name: str, total: int | None, unit: str) -> Iterator[Callable[[int], None]]:
        t0 = time.perf_counter()
        with track(name, total, unit, log=self.progress, bar=self.show_bars, end_line=False) as advance:
            yield advance
        dt = time.perf_counter() - t0
        self.seconds[name] = self.seconds.get(name, 0.0) + dt
        self.progress(f"{name}: done in {dt:.1f} s")
