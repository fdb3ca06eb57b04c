"""tegrastats lines -> numbers (device memory, GPU load, CPU, temperatures, power rails).

tegrastats prints one line per interval; its fields changed across JetPack releases, so each field is
matched on its own and missing ones stay None:
- `RAM used/totalMB (lfb ...)`, `SWAP used/totalMB (cached NMB)`;
- `CPU [load%@MHz,...,off]` (an offline core is `off`);
- `EMC_FREQ load%[@MHz]`, `GR3D_FREQ load%[@MHz | @[MHz,MHz]]` and on two-GPC Orins `GR3D2_FREQ`;
- temperatures `name@42.5C`; power rails `NAME cur/avg` in mW, with or without the `mW` unit (older
  releases print bare numbers);
- JetPack 5+ prefix the line with `MM-DD-YYYY HH:MM:SS`.
`TegrastatsMonitor` runs `tegrastats --interval MS` and keeps the latest sample for /metrics.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

_TIME = re.compile(r"^(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_CORE = re.compile(r"^(\d+)%@(\d+)$")
_ENGINE = re.compile(r"\b(EMC_FREQ|GR3D_FREQ|GR3D2_FREQ) (\d+)%(?:@\[?([\d,]+)\]?)?")
_TEMP = re.compile(r"\b([A-Za-z][A-Za-z0-9_]*)@(-?\d+(?:\.\d+)?)C\b")
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?=\s|$)")
# Sensors that read -256C are absent (tegrastats prints them anyway on Orin).
ABSENT_TEMP = -256.0


@dataclass(frozen=True)
class TegraSample:
    time: str | None = None
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    cpu_load_pct: tuple[int | None, ...] = ()  # per core; None: core offline
    cpu_freq_mhz: tuple[int | None, ...] = ()
    emc_load_pct: int | None = None
    gpu_load_pct: tuple[int, ...] = ()  # GR3D_FREQ, then GR3D2_FREQ where there is one
    gpu_freq_mhz: tuple[int, ...] = ()
    temps_c: dict[str, float] = field(default_factory=dict)
    power_mw: dict[str, tuple[int, int]] = field(default_factory=dict)  # rail -> (current, average)

    @property
    def gpu_load(self) -> float | None:
        """GPU load in 0..1 (the mean over GPCs), None when the line has none."""
        return None if not self.gpu_load_pct else sum(self.gpu_load_pct) / len(self.gpu_load_pct) / 100


class TegrastatsError(ValueError):
    """A line that is not tegrastats output."""


def parse_line(line: str) -> TegraSample:
    """One tegrastats line; TegrastatsError when it has no RAM field (not a tegrastats line)."""
    ram = _RAM.search(line)
    if ram is None:
        raise TegrastatsError(f"not a tegrastats line (no 'RAM used/totalMB'): {line[:80]!r}")
    t = _TIME.search(line)
    swap = _SWAP.search(line)
    loads: list[int | None] = []
    freqs: list[int | None] = []
    cpu = _CPU.search(line)
    if cpu:
        for core in cpu.group(1).split(","):
            m = _CORE.match(core.strip())
            loads.append(int(m.group(1)) if m else None)
            freqs.append(int(m.group(2)) if m else None)
    emc, gpu_load, gpu_freq = None, [], []
    for name, load, mhz in _ENGINE.findall(line):
        if name == "EMC_FREQ":
            emc = int(load)
        else:
            gpu_load.append(int(load))
            gpu_freq.extend(int(f) for f in mhz.split(",") if f)
    temps = {n: float(v) for n, v in _TEMP.findall(line) if float(v) != ABSENT_TEMP}
    rest = _CPU.sub("", line)
    rails = {n: (int(c), int(a)) for n, c, a in _RAIL.findall(rest) if n not in ("RAM", "SWAP")}
    return TegraSample(time=t.group(1) if t else None, ram_used_mb=int(ram.group(1)), ram_total_mb=int(ram.group(2)),
                       swap_used_mb=int(swap.group(1)) if swap else None,
                       swap_total_mb=int(swap.group(2)) if swap else None, cpu_load_pct=tuple(loads),
                       cpu_freq_mhz=tuple(freqs), emc_load_pct=emc, gpu_load_pct=tuple(gpu_load),
                       gpu_freq_mhz=tuple(gpu_freq), temps_c=temps, power_mw=rails)


class TegrastatsMonitor:
    """Runs `tegrastats --interval MS` in a thread; `latest` is the newest parsed sample (or None)."""

    def __init__(self, interval_ms: int = 1000, command: str = "tegrastats") -> None:
        self.interval_ms, self.command = interval_ms, command
        self.latest: TegraSample | None = None
        self._proc: subprocess.Popen | None = None

    @staticmethod
    def available(command: str = "tegrastats") -> bool:
        return shutil.which(command) is not None

    def feed(self, line: str) -> None:
        try:
            self.latest = parse_line(line)
        except TegrastatsError:
            pass  # banners and warnings tegrastats prints between samples

    def start(self) -> TegrastatsMonitor:
        self._proc = subprocess.Popen([self.command, "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, name="tegrastats", daemon=True).start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.feed(line)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)
            self._proc = None
