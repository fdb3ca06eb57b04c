"""A process's memory figures from /proc (Linux), for the benches' peak-RSS columns."""

from __future__ import annotations

from pathlib import Path


def proc_status_mib(field: str, pid: int | str = "self") -> float:
    """/proc/PID/status's `field` (VmRSS: resident now; VmHWM: peak resident), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")
