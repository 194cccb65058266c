"""bench learn --overhead: the same bars with the questions learning and still, then a steady feed."""

from __future__ import annotations

import json

import pytest

from bench.common import BTC_BARS as BTC
from bench.learn import cli_main


@pytest.mark.skipif(not BTC.is_file(), reason="../shared/data/bars not present (a fresh clone has none)")
def test_overhead_reports_both_modes_and_the_lag_under_a_steady_feed(tmp_path):
    out = tmp_path / "o.json"
    assert cli_main(["--model", "tiny", "--overhead", "12", "--rate", "20", "--steady-s", "0.5", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    for tag in ("learning", "still"):
        assert metrics[f"fast_ms_p99.{tag}"] > 0 and metrics[f"update_ms_p50.{tag}"] > 0
        assert metrics[f"fast_first_ms_p99.{tag}"] > 0 and metrics[f"fast_rest_ms_p99.{tag}"] > 0
        # sampled while 10 bars were pushed: a lag is a count of versions, never negative
        assert 0 <= metrics[f"lag_p50_versions.{tag}"] <= metrics[f"lag_p99_versions.{tag}"] <= 10
    assert metrics["fast_p99_ratio"] > 0 and metrics["update_p50_ratio"] > 0
    assert metrics["fast_first_p99_ratio"] > 0 and metrics["fast_rest_p99_ratio"] > 0
    assert metrics["fast_p99_still_spread"] >= 1.0  # worse still run over better
