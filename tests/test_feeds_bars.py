"""Bar aggregation against hand-computed OHLCV, gaps, and recorded sources / replay."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from feeds.bars import BarAggregator, bars
from feeds.events import BUY, SELL, Bar, Quote, Trade, write_parquet
from feeds.replay import merge, paced
from feeds.sources import CaptureSource, TableSource, read_capture

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
S = 1_000_000_000


def _t(sec: float, price: float, size: float, side: int, inst: str = "BTCUSDT") -> Trade:
    ns = round(sec * S)
    return Trade("test", inst, ns, ns, price, size, side, 0, 2, 3)


def test_one_second_bars_hand_computed() -> None:
    trades = [
        _t(10.1, 100.00, 1.0, BUY),
        _t(10.5, 101.50, 2.0, SELL),
        _t(10.9, 99.50, 1.0, BUY),
        _t(11.2, 100.25, 4.0, SELL),
        # 12 and 13 have no trades
        _t(14.0, 102.00, 0.5, BUY),
    ]
    out = list(bars(trades, 1.0))
    assert [(b.ts_open // S, b.trades) for b in out] == [(10, 3), (11, 1), (12, 0), (13, 0), (14, 1)]
    b0 = out[0]
    assert (b0.open, b0.high, b0.low, b0.close, b0.volume) == (100.0, 101.5, 99.5, 99.5, 4.0)
    assert (b0.buy_volume, b0.sell_volume) == (2.0, 2.0)
    assert b0.vwap == pytest.approx((100 * 1 + 101.5 * 2 + 99.5 * 1) / 4)
    assert b0.ts_event == 11 * S and b0.interval_ns == S
    empty = out[2]
    assert (empty.open, empty.high, empty.low, empty.close, empty.volume) == (100.25,) * 4 + (0.0,)
    assert out[4].open == 102.0 and out[4].buy_volume == 0.5


def test_bars_close_on_time_and_long_gap_is_one_explicit_bar() -> None:
    agg = BarAggregator(5.0, max_empty=3)
    assert agg.update(_t(1.0, 10.0, 1.0, BUY)) == []
    assert agg.advance(4 * S) == []  # interval [0, 5) not over yet
    (closed,) = agg.advance(5 * S)
    assert closed.ts_event == 5 * S and closed.close == 10.0 and closed.ts_recv == 5 * S
    assert [b.trades for b in agg.advance(15 * S)] == [0, 0]  # [5,10) and [10,15)
    gap_bars = agg.update(_t(100.0, 11.0, 1.0, SELL))  # intervals 15..95 empty: 17 > max_empty
    assert len(gap_bars) == 1
    g = gap_bars[0]
    assert g.trades == 0 and g.ts_open == 15 * S and g.ts_event == 100 * S and g.interval_ns == 85 * S
    agg.update(_t(3.0, 9.0, 1.0, BUY))
    assert agg.late == 1


def test_bars_per_instrument_and_from_quotes() -> None:
    out = list(bars([_t(0.5, 1.0, 1, BUY, "A"), _t(0.6, 2.0, 1, BUY, "B"), _t(1.5, 3.0, 1, BUY, "A")], 1.0))
    assert sorted((b.instrument, b.close) for b in out) == [("A", 1.0), ("A", 3.0), ("B", 2.0)]
    q = [Quote("t", "X", n * S, n * S, 10.00, 1, 10.01, 1, 2, 0) for n in (0, 0)]
    (b,) = list(bars(q, 1.0, source="quotes"))
    assert b.close == pytest.approx(10.005) and b.px_dp == 3 and b.trades == 2 and b.volume == 0


def test_merge_and_pacing() -> None:
    a = [_t(1, 1, 1, BUY), _t(3, 1, 1, BUY)]
    b = [_t(2, 2, 1, BUY), _t(3, 2, 1, BUY)]
    assert [(e.ts_recv // S, e.price) for e in merge(a, b)] == [(1, 1), (2, 2), (3, 1), (3, 2)]
    now = [0.0]
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        now[0] += dt

    assert len(list(paced(merge(a, b), speed=2.0, clock=lambda: now[0], sleep=sleep))) == 4
    assert sum(slept) == pytest.approx(1.0)  # 2 s of feed at 2x
    assert list(paced(a, speed=None)) == a
    with pytest.raises(ValueError, match="positive"):
        list(paced(a, speed=-1))


def test_capture_source_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "btcusdt_x.gz"
    with gzip.open(path, "wt") as fh:
        fh.write('5 {"stream":"btcusdt@bookTicker","data":{"u":1,"s":"BTCUSDT","b":"1.10","B":"1","a":"1.20","A":"2"}}\n')
        fh.write('6 {"stream":"btcusdt@bookTicker","data":{"u":2,"s":"BTCUSDT","b":"1.1\n')  # truncated line
    src = CaptureSource(path)
    (q,) = list(src)
    assert q.bid == 1.1 and src.stats.errors == 1
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write("{}\n")
    with pytest.raises(ValueError, match="bad.gz:1"):
        list(read_capture(bad))


def test_table_source_mapping_and_own_parquet(tmp_path: Path) -> None:
    csv = tmp_path / "ethusd_trades.csv"
    csv.write_text("time_ms,px,qty\n1700000000000,2000.5,0.25\n1700000000500,2001.25,1\n")
    trades = TableSource(csv, "trade", columns={"ts_event": "time_ms", "price": "px", "size": "qty"}).events()
    assert [(t.instrument, t.ts_event, t.price, t.size) for t in trades] == [
        ("ETHUSD", 1_700_000_000 * S, 2000.5, 0.25), ("ETHUSD", 1_700_000_000_500_000_000, 2001.25, 1.0)]
    assert trades[0].px_dp == 2
    with pytest.raises(ValueError, match="no column for trade field 'ts_event'"):
        TableSource(csv, "trade").events()
    pq = tmp_path / "t.parquet"
    write_parquet(trades, pq)
    assert TableSource(pq, "trade").events() == [
        Trade(t.venue, t.instrument, t.ts_event, t.ts_recv, t.price, t.size, t.side, t.trade_id, t.px_dp, t.sz_dp)
        for t in trades]


@pytest.mark.skipif(not (DATA / "bars").exists(), reason=f"shared bars CSV not found at {DATA / 'bars'}")
def test_shared_bars_csv_loads_as_is() -> None:
    out = TableSource(DATA / "bars" / "btc-perp-20211231-20220201_1m.csv", "bar").events()
    assert len(out) == 45_031 and all(type(b) is Bar for b in out[:10])
    first = out[0]
    assert (first.open, first.high, first.low, first.close) == (46319.0, 46385.0, 46319.0, 46377.0)
    assert first.ts_open == 1640991660 * S and first.interval_ns == 60 * S and first.trades == -1


@pytest.mark.skipif(not (DATA / "binance-spot").exists(), reason=f"shared captures not found at {DATA}")
def test_merge_two_captures_in_receive_order() -> None:
    root = DATA / "binance-spot"
    srcs = [CaptureSource(root / "btcusdt_20240808.gz"), CaptureSource(root / "ethusdt_20240808.gz")]
    last, n = 0, 0
    for ev in merge(*srcs):
        assert ev.ts_recv >= last
        last, n = ev.ts_recv, n + 1
    assert n == 41_249 + 33_618
    bars_1m = list(bars(CaptureSource(root / "btcusdt_20240808.gz"), 60.0))
    assert sum(b.trades for b in bars_1m) == 9_757
