"""bench compaction: both methods on the tiny model and recorded bars, side by side; the shifted side
computes no copy tokens, the recomputing one does, and answers agree until the first compaction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import BTC_BARS as BTC
from bench.compaction import LM_QUESTIONS, cli_main


@pytest.mark.skipif(not BTC.exists(), reason=f"{BTC} (the shared recorded bars) is not here")
def test_both_methods_compact_the_same_bars_and_only_recompute_runs_copies(tmp_path: Path, capsys):
    out = tmp_path / "compaction.json"
    assert cli_main(["--model", "tiny", "--bars", "60", "--context", "1024", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["compactions.shift"] >= 1 and report["compactions.recompute"] >= 1
    assert report["copy_tokens_per_ingest_token.shift"] == 0
    assert report["copy_tokens_per_ingest_token.recompute"] > 0
    assert report["fresh_ms_p99.shift"] >= report["fresh_ms_p50.shift"] > 0
    assert report["bars_after_first_compaction"] > 0
    ids = [q["id"] for q in LM_QUESTIONS]  # the tiny model has no shipped heads: only the model's own answers
    for qid in ids:
        assert 0 <= report[f"agreement.{qid}"] <= 1 and 0 < report[f"base_rate.{qid}"] <= 1
    table = capsys.readouterr().out
    assert "same before" in table and " NO" not in table  # identical until the first compaction
