"""Calibration: INT8/INT12 latent scales, compensation tables and tier fractions from real text.

`python -m calibration run --checkpoint DIR --data FILE|DIR` (cli.py) runs pipeline.py: statistics
by a latent hook on the golden model (stats.py), scales and compensation (scales.py), tier fractions
within an error budget (tiers.py, measured by measure.py), held-out report (report.py), atomic
write (writer.py). docs/calibration.md has the method, the decisions and the measured numbers.
"""
