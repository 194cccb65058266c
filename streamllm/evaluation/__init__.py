"""Offline: calibrate gate thresholds on recorded data, reports, intervals, inspection of recorded files."""
