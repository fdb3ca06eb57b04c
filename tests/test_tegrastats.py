"""jetson.tegrastats: recorded tegrastats lines of four JetPack generations, numbers read by hand.

Sources (public bug reports and READMEs quoting real devices): TX2 on JetPack 4.2 (FindHao/tx-utils
issue 3, 2019), Jetson Nano on JetPack 4 (power rails without a unit), Orin Nano on JetPack 6
(timestamp prefix, `off` cores, `mW` units, a rail whose average lost its unit), and an Orin NX
two-GPC fragment (rbonghi/jetson_stats issue 362: `GR3D_FREQ 0%@114 GR3D2_FREQ 0%@114`) placed in a line
whose other numbers (and loads 40 % / 20 %) we made up."""

from __future__ import annotations

import pytest

TX2 = ("RAM 2020/7852MB (lfb 1164x4MB) CPU [9%@345,21%@345,25%@345,3%@345,1%@345,1%@345] EMC_FREQ 0% "
       "GR3D_FREQ 0% PLL@42.5C MCPU@42.5C PMIC@100C Tboard@40C GPU@41C BCPU@42.5C thermal@41.9C Tdiode@41.25C "
       "VDD_SYS_GPU 153/158 VDD_SYS_SOC 536/547 VDD_4V0_WIFI 633/527 VDD_IN 3140/3208 VDD_SYS_CPU 536/590 "
       "VDD_SYS_DDR 557/601")
NANO = ("RAM 1766/3964MB (lfb 197x4MB) SWAP 0/2048MB (cached 0MB) CPU [24%@1224,15%@1224,13%@1224,10%@1224] "
        "EMC_FREQ 0% GR3D_FREQ 0% PLL@21C CPU@25C PMIC@100C GPU@23.5C AO@33.5C thermal@24.5C POM_5V_IN 2545/2547 "
        "POM_5V_GPU 0/0 POM_5V_CPU 549/529")
ORIN_NANO = ("12-23-2024 22:54:11 RAM 3162/7620MB (lfb 4x2MB) SWAP 0/3810MB (cached 0MB) "
             "CPU [1%@729,0%@729,0%@729,0%@729,off,off] GR3D_FREQ 1% cpu@62.843C soc2@61.968C soc0@60.625C "
             "gpu@61.687C tj@62.843C soc1@61.687C VDD_IN 3913mW/3922mW VDD_CPU_GPU_CV 598mW/598 VDD_SOC 1238mW/1237mW")
ORIN_NX = ("RAM 5120/15656MB (lfb 2x4MB) SWAP 0/7828MB (cached 0MB) CPU [12%@1984,off] EMC_FREQ 3%@3199 "
           "GR3D_FREQ 40%@114 GR3D2_FREQ 20%@114 CV0@-256C gpu@50.5C")


def test_tx2_line():
    from jetson.tegrastats import parse_line

    s = parse_line(TX2)
    assert (s.time, s.ram_used_mb, s.ram_total_mb, s.swap_used_mb) == (None, 2020, 7852, None)
    assert s.cpu_load_pct == (9, 21, 25, 3, 1, 1) and s.cpu_freq_mhz == (345,) * 6
    assert s.emc_load_pct == 0 and s.gpu_load_pct == (0,) and s.gpu_freq_mhz == () and s.gpu_load == 0
    assert s.temps_c == {"PLL": 42.5, "MCPU": 42.5, "PMIC": 100.0, "Tboard": 40.0, "GPU": 41.0, "BCPU": 42.5,
                         "thermal": 41.9, "Tdiode": 41.25}
    assert s.power_mw == {"VDD_SYS_GPU": (153, 158), "VDD_SYS_SOC": (536, 547), "VDD_4V0_WIFI": (633, 527),
                          "VDD_IN": (3140, 3208), "VDD_SYS_CPU": (536, 590), "VDD_SYS_DDR": (557, 601)}


def test_nano_line():
    from jetson.tegrastats import parse_line

    s = parse_line(NANO)
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb, s.swap_total_mb) == (1766, 3964, 0, 2048)
    assert s.cpu_load_pct == (24, 15, 13, 10)
    assert s.power_mw == {"POM_5V_IN": (2545, 2547), "POM_5V_GPU": (0, 0), "POM_5V_CPU": (549, 529)}
    assert s.temps_c["GPU"] == 23.5 and s.temps_c["AO"] == 33.5


def test_orin_nano_jetpack6_line():
    from jetson.tegrastats import parse_line

    s = parse_line(ORIN_NANO)
    assert s.time == "12-23-2024 22:54:11" and (s.ram_used_mb, s.ram_total_mb) == (3162, 7620)
    assert s.cpu_load_pct == (1, 0, 0, 0, None, None) and s.cpu_freq_mhz == (729, 729, 729, 729, None, None)
    assert s.emc_load_pct is None and s.gpu_load_pct == (1,) and s.gpu_load == pytest.approx(0.01)
    assert s.temps_c == {"cpu": 62.843, "soc2": 61.968, "soc0": 60.625, "gpu": 61.687, "tj": 62.843, "soc1": 61.687}
    assert s.power_mw == {"VDD_IN": (3913, 3922), "VDD_CPU_GPU_CV": (598, 598), "VDD_SOC": (1238, 1237)}


def test_two_gpc_orin_and_absent_sensor():
    from jetson.tegrastats import parse_line

    s = parse_line(ORIN_NX)
    assert s.gpu_load_pct == (40, 20) and s.gpu_freq_mhz == (114, 114) and s.gpu_load == pytest.approx(0.30)
    assert s.emc_load_pct == 3 and s.temps_c == {"gpu": 50.5}  # CV0@-256C: no sensor
    assert parse_line("RAM 1/2MB GR3D_FREQ 7%@[305,305]").gpu_freq_mhz == (305, 305)


def test_not_a_tegrastats_line_and_monitor_feed():
    from jetson.tegrastats import TegrastatsError, TegrastatsMonitor, parse_line

    with pytest.raises(TegrastatsError, match="not a tegrastats line"):
        parse_line("Warning: some sensors are missing")
    m = TegrastatsMonitor()
    m.feed("Warning: banner")
    assert m.latest is None
    m.feed(ORIN_NANO)
    assert m.latest is not None and m.latest.ram_used_mb == 3162
