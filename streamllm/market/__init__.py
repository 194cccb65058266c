"""Markets meet the engine: rendering data as lines, attaching feeds, labels, calibration."""
