"""Jetson and GPU device facts: detection, profiles, power and memory figures."""
