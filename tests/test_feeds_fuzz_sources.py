"""No byte sequence crashes a file source: damage is counted and named, never raised past it.

The one exception a source may raise is a ValueError naming the file, for a file that
cannot be read as asked at all (unknown format, ambiguous dates); anything else is a crash.
"""

from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.feeds import read_fully
from feeds.binance import BinanceParser

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["btcusdt_f.gz", "es.dbn", "es.dbn.zst", "x_trades.csv", "bars.csv", "t.parquet"]
LINE = b'1 {"e":"trade","E":1,"s":"BTCUSDT","t":1,"p":"100.5","q":"0.1","T":1,"m":true}\n'
CSV = b"timestamp,open,high,low,close,volume\n1640991660000,100,101,99,100.5,3\n"


def _check(name: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        read_fully(path)  # raises AssertionError on a crash


@FUZZ
@given(st.sampled_from(NAMES), st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_a_source(name: str, data: bytes) -> None:
    _check(name, data)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, len(LINE) * 3))
def test_gzip_captures_with_arbitrary_content_or_cuts(tail: bytes, cut: int) -> None:
    _check("btcusdt_g.gz", gzip.compress(LINE * 3 + tail))
    _check("btcusdt_c.gz", gzip.compress(LINE * 40)[:cut])


@FUZZ
@given(st.binary(max_size=200), st.integers(0, len(CSV)))
def test_csv_with_arbitrary_rows_or_cuts(tail: bytes, cut: int) -> None:
    _check("bars_1m.csv", CSV + tail)
    _check("bars_1m.csv", CSV[:cut])


@FUZZ
@given(st.sampled_from(["spot", "usdm", "coinm"]), st.binary(max_size=300))
def test_binance_markets_survive_arbitrary_bytes(market: str, raw: bytes) -> None:
    p = BinanceParser(market=market)
    p.parse(raw, 1)
    assert p.stats.messages == 1


@pytest.mark.parametrize("text", [
    "venue,instrument,ts_event,ts_recv\nx,y,z,w\n",
    "venue,instrument,ts_event,ts_recv,price,size,side,trade_id\nx,y,1,2,a,b,c,d\n",
    "time,price,size\n2024-13-45 99:99,1,1\n",
    "time,price,size\n1,abc,1\n",
    "time,price,size,side\n1,1,1,true\n",
])
def test_odd_tables_are_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "odd_trades.csv"
    path.write_text(text)
    read_fully(path)  # refused naming the file, or read; a crash raises AssertionError here


def test_read_fully_reports_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import feeds.tables

    def boom(self):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(feeds.tables.TableSource, "events", boom)
    path = tmp_path / "x.csv"
    path.write_text("a\n1\n")
    with pytest.raises(AssertionError, match="crashed"):
        read_fully(path)
