"""Jetson and GPU device facts: detection, profiles, power and memory figures."""

from jetson.detect import Detection, DetectionError, detect
from jetson.profiles import ALIASES, PROFILES, DeviceProfile, UnknownDeviceError, device_names, get_profile


def resolve_device(name: str) -> DeviceProfile:
    """--device value -> profile; `auto` runs detection (DetectionError when nothing is found)."""
    return detect().profile if name.lower() == "auto" else get_profile(name)


__all__ = ["ALIASES", "PROFILES", "Detection", "DetectionError", "DeviceProfile", "UnknownDeviceError",
           "detect", "device_names", "get_profile", "resolve_device"]
