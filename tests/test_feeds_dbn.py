"""Databento DBN files written with databento-dbn's own encoder, read back value by value."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from types import SimpleNamespace as NS

import pyarrow as pa
import pytest

dbn = pytest.importorskip("databento_dbn", reason="databento-dbn not installed (pip install databento-dbn)")

from feeds.dbn import DbnSource, price_dp  # noqa: E402
from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, Quote, Trade  # noqa: E402
from feeds.sources import open_source  # noqa: E402
from streamllm.feeding.render import render_lines  # noqa: E402

T = 1_700_000_000_000_000_000  # 2023-11-14 22:13:20 UTC
PX = 1_000_000_000  # DBN fixed-point scale


def _metadata(schema: object) -> bytes:
    day = dt.date(2023, 11, 14)
    return dbn.Metadata(dataset="GLBX.MDP3", start=T, stype_in=dbn.SType.RAW_SYMBOL, stype_out=dbn.SType.INSTRUMENT_ID,
                        schema=schema, symbols=["ESZ3"], end=T + 10**12,
                        mappings=[NS(raw_symbol="ESZ3", intervals=[NS(start_date=day, end_date=day, symbol="123")])]
                        ).encode()


def _pair(bid: int, ask: int, bs: int, as_: int) -> object:
    return dbn.BidAskPair(bid, ask, bs, as_, 1, 1)


def trades_file(path: Path) -> Path:
    recs = [dbn.TradeMsg(1, 123, T + 1, 4500_250_000_000, 3, dbn.Action.TRADE, dbn.Side.BID, 0, T + 5, sequence=7),
            dbn.TradeMsg(1, 123, T + 2, 4500_000_000_000, 1, dbn.Action.TRADE, dbn.Side.ASK, 0, T + 6, sequence=8),
            dbn.TradeMsg(1, 123, T + 3, 4500_500_000_000, 2, dbn.Action.TRADE, dbn.Side.NONE, 0, T + 7, sequence=9),
            dbn.TradeMsg(1, 123, T + 4, -5, 2, dbn.Action.TRADE, dbn.Side.BID, 0, T + 8, sequence=10)]
    path.write_bytes(_metadata(dbn.Schema.TRADES) + b"".join(bytes(r) for r in recs))
    return path


def test_trades_value_by_value(tmp_path: Path) -> None:
    src = DbnSource(trades_file(tmp_path / "es.trades.dbn"))
    got = list(src)
    assert all(type(t) is Trade for t in got)
    assert [(t.instrument, t.price, t.size, t.side, t.ts_event, t.ts_recv, t.trade_id, t.px_dp) for t in got] == [
        ("ESZ3", 4500.25, 3.0, BUY, T + 1, T + 5, 7, 2),
        ("ESZ3", 4500.0, 1.0, SELL, T + 2, T + 6, 8, 2),
        ("ESZ3", 4500.5, 2.0, UNKNOWN_SIDE, T + 3, T + 7, 9, 2)]
    assert got[0].venue == "GLBX.MDP3" and src.schema == "trades"
    assert src.stats.error_kinds == {"bad_price": 1} and src.stats.messages == 4
    assert render_lines(got)[:2] == ["2023-11-14T22:13:20 buy 4500.25 3", "22:13:20 sell 4500 1"]
    # A market that goes below zero (a spread, CL in April 2020) is read when told so.
    signed = list(DbnSource(tmp_path / "es.trades.dbn", signed_prices=True))
    assert [t.price for t in signed][-1] == pytest.approx(-5e-9)


def test_mbp1_trades_and_top_of_book_changes(tmp_path: Path) -> None:
    recs = [dbn.MBP1Msg(1, 123, T + 1, 4500_000_000_000, 5, dbn.Action.ADD, dbn.Side.BID, 0, T + 2,
                        levels=_pair(4500_000_000_000, 4500_250_000_000, 15, 12)),
            dbn.MBP1Msg(1, 123, T + 3, 4499_750_000_000, 5, dbn.Action.ADD, dbn.Side.BID, 1, T + 4,
                        levels=_pair(4500_000_000_000, 4500_250_000_000, 15, 12)),  # below the top
            dbn.MBP1Msg(1, 123, T + 5, 4500_250_000_000, 2, dbn.Action.TRADE, dbn.Side.BID, 0, T + 6,
                        levels=_pair(4500_000_000_000, 4500_250_000_000, 15, 12)),
            dbn.MBP1Msg(1, 123, T + 7, 4500_250_000_000, 2, dbn.Action.CANCEL, dbn.Side.ASK, 0, T + 8,
                        levels=_pair(4500_000_000_000, 4500_250_000_000, 15, 10))]
    path = tmp_path / "es.mbp-1.dbn.zst"
    path.write_bytes(pa.compress(_metadata(dbn.Schema.MBP_1) + b"".join(bytes(r) for r in recs), codec="zstd",
                                 asbytes=True))
    src = open_source(path)
    got = list(src)
    assert [type(e) for e in got] == [Quote, Trade, Quote]
    q0, t, q1 = got
    assert (q0.bid, q0.bid_size, q0.ask, q0.ask_size, q0.ts_event, q0.ts_recv) == (4500.0, 15.0, 4500.25, 12.0, T + 1, T + 2)
    assert (t.price, t.size, t.side, t.ts_event) == (4500.25, 2.0, BUY, T + 5)
    assert (q1.ask_size, q1.ts_event) == (10.0, T + 7) and src.stats.errors == 0


def test_bbo_and_ohlcv_schemas(tmp_path: Path) -> None:
    bbo = [dbn.BBOMsg(dbn.RType.BBO_1S, 1, 123, T, 4500_250_000_000, 3, dbn.Side.NONE, T + 10**9,
                      levels=_pair(4500_000_000_000, 4500_250_000_000, 10, 12)),
           dbn.BBOMsg(dbn.RType.BBO_1S, 1, 123, T, 4500_250_000_000, 3, dbn.Side.NONE, T + 2 * 10**9,
                      levels=_pair(dbn.UNDEF_PRICE, 4500_250_000_000, 0, 12))]
    path = tmp_path / "es.bbo-1s.dbn"
    path.write_bytes(_metadata(dbn.Schema.BBO_1S) + b"".join(bytes(r) for r in bbo))
    src = DbnSource(path)
    (q,) = list(src)
    assert (q.bid, q.ask, q.bid_size, q.ask_size, q.ts_event) == (4500.0, 4500.25, 10.0, 12.0, T + 10**9)
    assert src.stats.error_kinds == {"undefined_price": 1}
    bars = [dbn.OHLCVMsg(dbn.RType.OHLCV_1M, 1, 123, T + 40 * 10**9, 4500 * PX, 4501 * PX, 4499 * PX, 4500_500_000_000, 900),
            dbn.OHLCVMsg(dbn.RType.OHLCV_1M, 1, 123, T + 100 * 10**9, 4500 * PX, 4499 * PX, 4501 * PX, 4500 * PX, 9)]
    path = tmp_path / "es.ohlcv-1m.dbn"
    path.write_bytes(_metadata(dbn.Schema.OHLCV_1M) + b"".join(bytes(r) for r in bars))
    src = DbnSource(path)
    (b,) = list(src)
    assert type(b) is Bar
    assert (b.ts_open, b.interval_ns, b.ts_event, b.open, b.high, b.low, b.close, b.volume, b.trades) == (
        T + 40 * 10**9, 60 * 10**9, T + 100 * 10**9, 4500.0, 4501.0, 4499.0, 4500.5, 900.0, -1)
    assert math.isnan(b.buy_volume) and b.px_dp == 1 and src.stats.error_kinds == {"bad_bar": 1}
    one_s = dbn.OHLCVMsg(dbn.RType.OHLCV_1S, 1, 123, T, 4500 * PX, 4500 * PX, 4500 * PX, 4500 * PX, 1)
    path.write_bytes(_metadata(dbn.Schema.OHLCV_1S) + bytes(one_s))
    assert next(iter(DbnSource(path))).interval_ns == 10**9


def test_truncated_and_garbage_dbn_are_counted(tmp_path: Path) -> None:
    path = trades_file(tmp_path / "es.dbn")
    path.write_bytes(path.read_bytes()[:-10])
    src = DbnSource(path)
    assert len(list(src)) == 3 and src.stats.error_kinds == {"truncated_file": 1}
    assert "es.dbn: ends mid-record" in src.stats.error_samples[0]
    junk = tmp_path / "junk.dbn"
    junk.write_bytes(b"not a dbn file at all" * 4)
    jsrc = DbnSource(junk)
    assert list(jsrc) == [] and jsrc.stats.error_kinds == {"bad_dbn": 1}


def test_price_decimals() -> None:
    assert [price_dp(x) for x in (4500_250_000_000, 4500 * PX, 1, 123_456_789)] == [2, 0, 9, 9]


def test_compression_is_told_by_content_not_name(tmp_path: Path) -> None:
    plain = trades_file(tmp_path / "a.dbn").read_bytes()
    (tmp_path / "b.dbn").write_bytes(pa.compress(plain, codec="zstd", asbytes=True))
    (tmp_path / "c.dbn.zst").write_bytes(plain)
    want = list(DbnSource(tmp_path / "a.dbn"))
    assert len(want) == 3
    assert list(DbnSource(tmp_path / "b.dbn")) == want == list(DbnSource(tmp_path / "c.dbn.zst"))
