"""Binance's documented local-book sync (feeds/books.py) on captures built as a recorder writes them:
depth events before the REST snapshot line and after it, for spot and USD-M futures."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from feeds.books import DepthSync, LocalBooks, Step
from feeds.capture import CaptureSource
from feeds.events import BookDelta
from streamllm.cli import main

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "binance-spot"
# The USD-M capture of issue #47: lastUpdateId 5123107852948 at line 55, spanned by an update received
# at line 50 (U 5123107850310 <= lastUpdateId <= u 5123107853551); the next one follows by `pu`.
SNAP = 5123107852948


def _depth(U: int, u: int, bid: tuple[str, str], pu: int | None = None) -> dict:
    d = {"e": "depthUpdate", "E": 1700000000000, "T": 1700000000000, "s": "BTCUSDT", "U": U, "u": u,
         "b": [list(bid)], "a": []}
    if pu is not None:
        d["pu"] = pu
    return {"stream": "btcusdt@depth@100ms", "data": d}


def _capture(tmp_path: Path, messages: list[dict]) -> Path:
    path = tmp_path / "btcusdt_capture.gz"
    lines = [f"{1000 + i} {json.dumps(m)}" for i, m in enumerate(messages)]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def _snapshot(last: int) -> dict:
    return {"lastUpdateId": last, "E": 1700000000000, "T": 1700000000000,
            "bids": [["100", "1"], ["99", "2"], ["98", "3"]], "asks": [["101", "1"]]}


def _read(path: Path, market: str) -> tuple[CaptureSource, list]:
    src = CaptureSource(path, venue="binance", market=market)
    return src, list(src)


def _futures_messages(after: list[dict]) -> list[dict]:
    return [
        _depth(5123107840000, 5123107845000, ("97", "9"), pu=5123107839000),  # stale: u < lastUpdateId
        _depth(5123107845100, 5123107850200, ("99", "5"), pu=5123107845000),  # stale
        _depth(5123107850310, 5123107853551, ("100", "0"), pu=5123107850200),  # spans lastUpdateId: the bridge
        _snapshot(SNAP),
        *after,
    ]


def test_usdm_bridge_before_the_snapshot_line_is_applied_not_a_gap(tmp_path: Path) -> None:
    after = [_depth(5123107856267, 5123107857000, ("98", "7"), pu=5123107853551),
             _depth(5123107857100, 5123107858000, ("96", "1"), pu=5123107857000)]
    src, events = _read(_capture(tmp_path, _futures_messages(after)), "usdm")
    assert src.stats.errors == 0 and src.stats.gaps == 0, src.stats.gap_samples
    books = LocalBooks.for_venue("binance", "usdm").extend(e for e in events if type(e) is BookDelta)
    book = books.books["BTCUSDT"]
    # Reference, by the documented procedure: the snapshot, then the bridge (removes 100), then the rest.
    assert book.bids == {99.0: 2.0, 98.0: 7.0, 96.0: 1.0} and book.asks == {101.0: 1.0}
    assert (book.snapshot_id, book.applied, book.best) == (SNAP, 3, (99.0, 101.0))


def test_usdm_true_gaps_are_counted_where_the_rule_says(tmp_path: Path) -> None:
    lost = [_depth(5123107856267, 5123107857000, ("98", "7"), pu=5123107853551),
            _depth(5123107858100, 5123107859000, ("96", "1"), pu=5123107858000)]  # pu != 5123107857000
    src, _ = _read(_capture(tmp_path, _futures_messages(lost)), "usdm")
    assert src.stats.gaps == 1 and src.stats.gap_samples == ["BTCUSDT@depth pu: expected 5123107857000, got 5123107858000"]
    # No buffered update spans the snapshot and the first one after it starts beyond it: a gap.
    late = [_depth(5123107840000, 5123107845000, ("97", "9"), pu=5123107839000), _snapshot(SNAP),
            _depth(5123107856267, 5123107857000, ("98", "7"), pu=5123107853551)]
    src, _ = _read(_capture(tmp_path, late), "usdm")
    assert src.stats.gap_samples == [f"BTCUSDT@depth: expected {SNAP}, got 5123107856267"]


def test_spot_sync_drops_stale_and_bridges_before_the_snapshot(tmp_path: Path) -> None:
    messages = [
        _depth(150, 155, ("97", "9")),  # stale: u <= 160
        _depth(158, 160, ("99", "5")),  # stale (u == lastUpdateId), and a break 156..157 among stale ones
        _depth(161, 164, ("100", "0")),  # U <= 161 <= u: the bridge, received before the snapshot
        _snapshot(160),
        _depth(165, 170, ("98", "7")),
    ]
    src, events = _read(_capture(tmp_path, messages), "spot")
    assert src.stats.gaps == 0, src.stats.gap_samples  # the break was counted, then taken back
    assert src.stats.gap_keys == {}
    book = LocalBooks("spot").extend(e for e in events if type(e) is BookDelta).books["BTCUSDT"]
    assert book.bids == {99.0: 2.0, 98.0: 7.0} and (book.applied, book.dropped) == (2, 2)
    # A true gap after the sync, and a snapshot no buffered or later update spans.
    src, _ = _read(_capture(tmp_path, [*messages, _depth(175, 180, ("95", "1"))]), "spot")
    assert src.stats.gap_samples == ["BTCUSDT@depth: expected 171, got 175"]
    src, _ = _read(_capture(tmp_path, [_snapshot(160), _depth(163, 170, ("95", "1"))]), "spot")
    assert src.stats.gap_samples == ["BTCUSDT@depth: expected 161, got 163"]


def test_break_kept_when_the_snapshot_applies_both_sides() -> None:
    sync = DepthSync(futures=True)
    assert sync.update("X", 100, 110, prev=90) is Step.BUFFER  # spans 105
    assert sync.update("X", 120, 130, prev=115) is Step.BUFFER  # pu 115 != 110: counted now
    assert sync.stats.gaps == 1
    assert sync.snapshot("X", 105) == [None, None]  # both applied: the break stands
    assert sync.stats.gaps == 1 and sync.update("X", 131, 140, prev=130) is Step.APPLY
    assert sync.update("X", 90, 95, prev=80) is Step.APPLY and sync.stats.gaps == 2  # no snapshot pending: chain


def test_live_stream_without_snapshot_still_counts_breaks() -> None:
    sync = DepthSync(futures=False)
    sync.update("X", 1, 5)
    sync.update("X", 8, 9)
    assert sync.stats.gap_samples == ["X@depth: expected 6, got 8"] and not sync.synced("X")


def test_inspect_usdm_capture_reports_no_false_gap(tmp_path: Path, capsys) -> None:
    after = [_depth(5123107856267, 5123107857000, ("98", "7"), pu=5123107853551)]
    path = _capture(tmp_path, _futures_messages(after))
    out = tmp_path / "r.json"
    assert main(["inspect", str(path), "--market", "usdm", "--tokenizer", "none", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["gaps"] == 0 and rep["streams"]["BTCUSDT book"]["gaps"] == 0
    text = capsys.readouterr().out
    assert "gap:" not in text and "0 gaps" in text


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data/binance-spot is absent (a fresh clone)")
def test_real_spot_capture_syncs_and_rebuilds_its_book() -> None:
    src = CaptureSource(DATA / "ethusdt_20240808.gz", venue="binance")
    books = LocalBooks("spot").extend(e for e in src if type(e) is BookDelta)
    book = books.books["ETHUSDT"]
    assert src.stats.gaps == 0 and book.snapshot_id is not None and book.applied > 3000
    bid, ask = book.best
    assert bid is not None and ask is not None and bid < ask  # a rebuilt book is never crossed
