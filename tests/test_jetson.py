"""Device profiles and `--device auto` detection, fed fake /proc files and fake nvidia-smi output."""

from __future__ import annotations

import subprocess

import pytest

from jetson import DetectionError, UnknownDeviceError, detect, get_profile, resolve_device
from jetson.detect import detect_dgpu, detect_jetson
from jetson.profiles import GIB, PROFILES

REQUIRED = ["orin-agx-64", "orin-agx-32", "orin-nx-16", "orin-nx-8", "orin-nano-8", "orin-nano-4",
            "a10", "l4", "rtx4090", "h100", "h200"]


def meminfo(gib: float) -> str:
    # the kernel sees less than the module's DRAM (carve-outs): ~92-97 %
    return f"MemTotal:       {int(gib * 0.95 * GIB / 1024)} kB\nMemFree:  1000 kB\n"


def test_every_required_profile_is_sane():
    for name in REQUIRED:
        p = PROFILES[name]
        assert p.memory_bytes > p.usable_bytes > 0
        assert p.bandwidth_bytes_s > 1e10
        assert p.sources and p.sm in {"8.6", "8.7", "8.9", "9.0"}
    assert get_profile("orin") is PROFILES["orin-agx-64"]
    assert get_profile("ORIN-NX-16").name == "orin-nx-16"
    assert not any(PROFILES[n].fp8 for n in REQUIRED if n.startswith("orin"))  # Orin: INT8 KV
    assert PROFILES["orin-agx-64"].kv_low_precision == "int8" and PROFILES["h100"].kv_low_precision == "fp8"


def test_unknown_device_lists_choices():
    with pytest.raises(UnknownDeviceError, match="orin-nx-16"):
        get_profile("xavier")


@pytest.mark.parametrize(("model", "gib", "want"), [
    ("NVIDIA Jetson AGX Orin Developer Kit\x00", 64, "orin-agx-64"),
    ("NVIDIA Jetson AGX Orin\x00", 32, "orin-agx-32"),
    ("NVIDIA Orin NX Developer Kit", 16, "orin-nx-16"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 8, "orin-nx-8"),
    ("NVIDIA Jetson Orin Nano Developer Kit", 8, "orin-nano-8"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit", 4, "orin-nano-4"),
])
def test_jetson_from_device_tree(tmp_path, model, gib, want):
    (tmp_path / "model").write_bytes(model.encode())
    (tmp_path / "meminfo").write_text(meminfo(gib))
    d = detect(device_tree_model=tmp_path / "model", tegra_release=tmp_path / "none",
               meminfo=tmp_path / "meminfo", run=lambda c: pytest.fail("nvidia-smi must not run on a Jetson"))
    assert d.profile.name == want
    assert "device-tree" in d.evidence


def test_jetson_from_tegra_release_only():
    rel = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8"
    d = detect_jetson(None, rel, meminfo(16))
    assert d is not None and d.profile.name == "orin-nx-16" and "R36" in d.evidence
    with pytest.raises(DetectionError, match="pass --device"):
        detect_jetson(None, rel, None)


def test_non_orin_jetson_is_refused():
    with pytest.raises(DetectionError, match="Xavier"):
        detect_jetson("NVIDIA Jetson Xavier NX Developer Kit", None, meminfo(8))


@pytest.mark.parametrize(("smi", "want"), [
    ("NVIDIA H200, 143771 MiB, 9.0\n", "h200"),
    ("NVIDIA H100 80GB HBM3, 81559 MiB, 9.0\nNVIDIA H100 80GB HBM3, 81559 MiB, 9.0\n", "h100"),
    ("NVIDIA GeForce RTX 4090, 24564 MiB, 8.9\n", "rtx4090"),
    ("NVIDIA L4, 23034 MiB, 8.9\n", "l4"),
    ("NVIDIA A10, 23028 MiB, 8.6\n", "a10"),
])
def test_dgpu_from_nvidia_smi(tmp_path, smi, want):
    d = detect(device_tree_model=tmp_path / "no", tegra_release=tmp_path / "no", meminfo=tmp_path / "no",
               run=lambda cmd: smi)
    assert d.profile.name == want


def test_dgpu_without_profile_and_lookalikes():
    with pytest.raises(DetectionError, match="A100"):
        detect_dgpu("NVIDIA A100-SXM4-80GB, 81920 MiB, 8.0")  # not the A10
    with pytest.raises(DetectionError, match="L40S"):
        detect_dgpu("NVIDIA L40S, 46068 MiB, 8.9")  # not the L4
    assert detect_dgpu("") is None


def test_nothing_found(tmp_path):
    def fail(cmd):
        raise subprocess.CalledProcessError(9, cmd)

    with pytest.raises(DetectionError, match="--device"):
        detect(device_tree_model=tmp_path / "no", tegra_release=tmp_path / "no", meminfo=tmp_path / "no",
               run=fail)


def test_resolve_device():
    assert resolve_device("orin").name == "orin-agx-64"
