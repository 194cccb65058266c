"""Tardis.dev's CSV datasets as its documentation writes them: trades, quotes, book_snapshot_N and
incremental_book_L2 (times in microseconds, local_timestamp the receive time, an exchange column)."""

from __future__ import annotations

import math
from pathlib import Path

from feeds.events import BUY, SELL, BookDelta, Quote, Trade
from feeds.sources import open_source
from streamllm.feeding.render import render_lines


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tardis_trades_and_quotes_keep_venue_receive_times_and_sizes(tmp_path: Path) -> None:
    trades = _write(tmp_path, "binance-futures_trades_2020-04-01_BTCUSDT.csv",
                    "exchange,symbol,timestamp,local_timestamp,id,side,price,amount\n"
                    "binance-futures,BTCUSDT,1585699209920000,1585699209934201,232544565,sell,6421.96,0.001\n"
                    "binance-futures,BTCUSDT,1585699210051000,1585699210060529,232544566,buy,6422.01,0.021\n")
    src = open_source(trades)
    t1, t2 = src
    assert isinstance(t1, Trade) and (t1.venue, t1.instrument, t1.side, t1.price, t1.size) == (
        "binance-futures", "BTCUSDT", SELL, 6421.96, 0.001)
    assert (t1.ts_event, t1.ts_recv) == (1_585_699_209_920_000_000, 1_585_699_209_934_201_000) and t2.side == BUY
    quotes = _write(tmp_path, "binance-futures_quotes_2020-04-01_BTCUSDT.csv",
                    "exchange,symbol,timestamp,local_timestamp,ask_amount,ask_price,bid_price,bid_amount\n"
                    "binance-futures,BTCUSDT,1585699200245000,1585699200355540,0.7,6416.5,6416.44,4.2\n")
    (q,) = open_source(quotes)
    assert isinstance(q, Quote) and (q.bid, q.bid_size, q.ask, q.ask_size) == (6416.44, 4.2, 6416.5, 0.7)
    # book_snapshot_N: its top level is the quote.
    snap = _write(tmp_path, "deribit_book_snapshot_25_2020-04-01_BTC-PERPETUAL.csv",
                  "exchange,symbol,timestamp,local_timestamp,asks[0].price,asks[0].amount,bids[0].price,"
                  "bids[0].amount,asks[1].price,asks[1].amount,bids[1].price,bids[1].amount\n"
                  "deribit,BTC-PERPETUAL,1585699200097000,1585699200285023,6423.5,34500,6423,2430,6424,10,6422.5,900\n")
    (top,) = open_source(snap)
    assert (top.venue, top.bid, top.bid_size, top.ask, top.ask_size) == ("deribit", 6423.0, 2430.0, 6423.5, 34500.0)


def test_a_quote_table_without_sizes_leaves_them_unknown(tmp_path: Path) -> None:
    path = _write(tmp_path, "EURUSD_quotes.csv", "time,bid,ask\n2024-01-02 00:00:00,1.10412,1.10415\n")
    src = open_source(path)
    (q,) = src
    assert math.isnan(q.bid_size) and math.isnan(q.ask_size)
    assert render_lines([q])[0].endswith("bid 1.10412 ask 1.10415")  # no "x0": nothing is claimed


def test_tardis_incremental_book_rows_become_one_delta_per_instrument_and_time(tmp_path: Path) -> None:
    path = _write(tmp_path, "binance-futures_incremental_book_L2_2020-04-01_BTCUSDT.csv",
                  "exchange,symbol,timestamp,local_timestamp,is_snapshot,side,price,amount\n"
                  # a snapshot whose rows carry two times is still one snapshot
                  "binance-futures,BTCUSDT,1585699200245000,1585699200355540,true,ask,6416.5,0.7\n"
                  "binance-futures,BTCUSDT,1585699200245000,1585699200355540,true,bid,6416.44,4.2\n"
                  "binance-futures,BTCUSDT,1585699200246000,1585699200355540,true,bid,6416.4,1\n"
                  "binance-futures,ETHUSDT,1585699200247000,1585699200355600,true,bid,132.5,10\n"
                  "binance-futures,BTCUSDT,1585699200311000,1585699200400000,false,bid,6416.44,0\n"
                  "binance-futures,BTCUSDT,1585699200311000,1585699200400000,false,ask,6416.6,2\n"
                  "binance-futures,BTCUSDT,1585699200311000,1585699200400000,false,middle,6416.6,2\n"
                  "binance-futures,BTCUSDT,1585699200312000,1585699200400100,false,ask,6416.5,0\n"
                  # updates, then a snapshot again: the book starts over
                  "binance-futures,BTCUSDT,1585699300000000,1585699300100000,true,bid,6500,1\n")
    src = open_source(path)
    deltas = list(src)
    assert all(isinstance(d, BookDelta) for d in deltas) and src.venue == "binance-futures"
    got = [(d.instrument, d.snapshot, d.ts_event // 1000, d.bids, d.asks) for d in deltas]
    assert got == [
        ("BTCUSDT", True, 1585699200245000, [(6416.44, 4.2), (6416.4, 1.0)], [(6416.5, 0.7)]),
        ("ETHUSDT", True, 1585699200247000, [(132.5, 10.0)], []),
        ("BTCUSDT", False, 1585699200311000, [(6416.44, 0.0)], [(6416.6, 2.0)]),
        ("BTCUSDT", False, 1585699200312000, [], [(6416.5, 0.0)]),
        ("BTCUSDT", True, 1585699300000000, [(6500.0, 1.0)], []),
    ]
    assert deltas[2].ts_recv == 1_585_699_200_400_000_000
    assert src.stats.error_kinds == {"bad_side": 1} and "row 7" in src.stats.error_samples[0]
    assert "middle" in src.stats.error_samples[0] and src.stats.events == 5
