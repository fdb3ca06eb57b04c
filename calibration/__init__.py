"""Calibration: INT8/INT12 latent scales, compensation tables and tier fractions from real text.

Arrives with the calibration issue; it uses `gsm` (the golden model) for statistics.
"""
