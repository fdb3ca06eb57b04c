"""Admission by memory: how many requests may run at once, from the backend's capabilities.

Every running request holds one cache row of the bundle's memory plan from admission to its end, and a row
holds max_seq positions whatever the request asks for (a generation that reaches the end of its row ends with
finish reason "context"). So the plan's KV budget is a row count: a request runs when a row is free, else it
waits in the queue (first come, first served: every row is alike, so the head of the queue is the next to fit),
and only a prompt longer than a row can never run (refused at submit by the Runtime's request check).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.backend import Capabilities


@dataclass(frozen=True)
class KVBudget:
    """The scheduler's view of the memory plan: `rows` requests running at most, `max_running` of them."""

    rows: int  # the backend's resident sequences (the plan's max_batch rows)
    positions: int  # per row (max_seq)
    row_bytes: int  # one row's cache bytes on this backend
    max_running: int  # what the engine runs at once: the asked-for limit, at most `rows`
    asked: int  # the limit asked for (EngineConfig.max_running, or its default)

    @classmethod
    def of(cls, caps: Capabilities, *, max_running: int, interleave: int, max_batch: int) -> KVBudget:
        """max_running 0: the bundle's max_batch, or `interleave` on a bundle built for batch 1; either way
        clamped to the rows the backend holds."""
        asked = max_running or (max_batch if max_batch > 1 else interleave)
        return cls(rows=caps.max_resident, positions=caps.positions, row_bytes=caps.kv_bytes_per_sequence,
                   max_running=min(asked, caps.max_resident), asked=asked)

    @property
    def clamped(self) -> bool:
        return self.asked > self.max_running

    @property
    def budget_bytes(self) -> int:
        return self.rows * self.row_bytes

    def describe(self) -> str:
        """One log line: the limit and the bytes behind it."""
        text = (f"{self.max_running} running request(s) at most: the memory plan holds {self.rows} cache row(s) of "
                f"{self.positions} positions, {fmt_mib(self.row_bytes)} each, {fmt_mib(self.budget_bytes)} of KV "
                "cache in all")
        if self.clamped:
            text += (f" (max_running {self.asked} asked for, clamped to the plan's rows; rebuild with "
                     f"--max-batch {self.asked} to run that many)")
        return text


def fmt_mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"
