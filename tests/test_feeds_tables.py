"""Tables and captures as users bring them: dates, zones, precision, sides, cut rows, damage."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from feeds.bars import bars
from feeds.columns import TableFormatError, infer_dp, parse_columns
from feeds.events import BUY, SELL, UNKNOWN_SIDE
from feeds.sources import CaptureSource, ReadOptions, open_recorded, open_source
from feeds.tables import TableSource
from streamllm.feeding.render import Renderer, render_lines

S = 1_000_000_000
T0 = 1_573_464_600  # 2019-11-11 09:30:00 UTC


def test_ambiguous_dates_are_refused_and_a_format_reads_them(tmp_path: Path) -> None:
    csv = tmp_path / "spy_trades.csv"
    csv.write_text("time,price,size\n11/5/2019 9:30,300.5,10\n11/6/2019 9:31,301,5\n")
    with pytest.raises(TableFormatError, match="--time-format '%m/%d/%Y %H:%M'"):
        TableSource(csv, "trade").events()
    us = TableSource(csv, "trade", time_format="%m/%d/%Y %H:%M").events()
    eu = TableSource(csv, "trade", time_format="%d/%m/%Y %H:%M").events()
    assert us[0].ts_event == 1_572_946_200 * S  # 5 November 2019 09:30 UTC
    assert eu[0].ts_event == 1_557_567_000 * S  # 11 May 2019 09:30 UTC
    proven = tmp_path / "x_trades.csv"
    proven.write_text("time,price,size\n25/5/2019 9:30,1,1\n")
    with pytest.raises(TableFormatError, match="day above 12 first: pass --time-format '%d/%m/%Y %H:%M'"):
        TableSource(proven, "trade").events()
    # One command's format for its month-first tables leaves ISO tables beside them as they read;
    # text that is neither still fails, naming the format.
    iso = tmp_path / "iso_trades.csv"
    iso.write_text("time,price,size\n2019-11-05 09:30:00,300.5,10\n")
    assert TableSource(iso, "trade", time_format="%m/%d/%Y %H:%M").events()[0].ts_event == 1_572_946_200 * S
    with pytest.raises(TableFormatError, match="pass --time-format"):
        TableSource(proven, "trade", time_format="%m/%d/%Y %H:%M").events()


def test_naive_times_take_tz_and_say_utc_by_default(tmp_path: Path) -> None:
    csv = tmp_path / "spy_trades.csv"
    csv.write_text("time,price,size\n2019-11-11 09:30:00,300.5,10\n")
    src = TableSource(csv, "trade")
    (t,) = src.events()
    assert t.ts_event == T0 * S and any("read as UTC" in n for n in src.notes)
    (ny,) = TableSource(csv, "trade", tz="America/New_York").events()
    assert ny.ts_event == (T0 + 5 * 3600) * S  # EST is UTC-5 in November
    zoned = tmp_path / "z_trades.csv"
    zoned.write_text("time,price,size\n2019-11-11T10:30:00+01:00,300.5,10\n")
    zsrc = TableSource(zoned, "trade")
    assert zsrc.events()[0].ts_event == T0 * S and zsrc.notes == []


def test_cut_rows_and_impossible_values_are_counted_not_rendered(tmp_path: Path) -> None:
    csv = tmp_path / "btc_1m.csv"
    csv.write_text("timestamp,open,high,low,close,volume\n"
                   "1640991660000,100,101,99,100.5,3\n"
                   "1640991720000,100.5,100,101,100.5,3\n"  # high < low
                   "1640991780000,100.5,102,100,103,3\n"  # close above high
                   "1640991840000,100.5,102,100,nan,3\n"
                   "1640991900000,-1,102,100,101,3\n"
                   "1640991960000,101,102\n")  # cut mid-line
    src = TableSource(csv, "bar")
    out = src.events()
    assert [(b.ts_open // S, b.close) for b in out] == [(1640991660, 100.5)]
    assert src.stats.error_kinds == {"bad_bar": 4, "missing_value": 1}
    assert any("row 6: missing low, close, volume" in s for s in src.stats.error_samples)
    assert any("high=100.0 is below low 101.0" in s for s in src.stats.error_samples)
    assert render_lines(out) == ["2021-12-31T23:01 100.5 +0.5 h+0.5 l-1 v3"]


def test_a_market_below_zero_is_read_with_signed_prices(tmp_path: Path) -> None:
    """WTI's May 2020 contract settled at -37.63: refused by default (a crypto print below zero is
    a bad tick), with the error naming the flag; read with signed_prices, moves keep their sign."""
    csv = tmp_path / "cl_1d.csv"
    csv.write_text("Date,Open,High,Low,Close,Volume\n"
                   "2020-04-17,19.87,20.29,17.31,18.27,100\n"
                   "2020-04-20,17.73,17.85,-40.32,-37.63,247947\n"
                   "2020-04-21,-14.00,13.86,-16.74,10.01,2288\n"
                   "2020-04-22,11.82,16.68,nan,13.78,100\n")
    strict = TableSource(csv, "bar")
    assert [b.close for b in strict.events()] == [18.27]
    assert strict.stats.error_kinds == {"bad_bar": 3}
    assert any("low=-40.32 must be a finite number > 0 (--signed-prices" in e for e in strict.stats.error_samples)
    (src,) = open_recorded([csv], ReadOptions(signed_prices=True))
    out = list(src)
    assert [b.close for b in out] == [18.27, -37.63, 10.01]  # the NaN row is still refused
    lines = render_lines(out, changes="bp")
    assert [line.split()[1:3] for line in lines] == [["18.27", "-805"], ["-37.63", "-30597"], ["10.01", "+12660"]]


def test_side_strings_and_maker_flags_map_and_unknown_stays_unknown(tmp_path: Path) -> None:
    csv = tmp_path / "eth_trades.csv"
    csv.write_text("ts,price,qty,side\n1700000000000,10,1,BUYER\n1700000000001,10,1,SELLER\n"
                   "1700000000002,10,1,b\n1700000000003,10,1,S\n1700000000004,10,1,sell\n1700000000005,10,1,up\n")
    src = TableSource(csv, "trade")
    assert [t.side for t in src.events()] == [BUY, SELL, BUY, SELL, SELL]
    assert src.stats.error_kinds == {"bad_side": 1}
    maker = tmp_path / "BTCUSDT-aggTrades.csv"
    maker.write_text("time,price,qty,is_buyer_maker\n1700000000000,10,1,True\n1700000000001,10,2,false\n"
                     "1700000000002,10,2,maybe\n")
    msrc = TableSource(maker, "trade")
    assert [t.side for t in msrc.events()] == [SELL, BUY] and msrc.stats.error_kinds == {"bad_maker": 1}
    plain = tmp_path / "x_trades.csv"
    plain.write_text("ts,price,qty\n1700000000000,10,1\n1700000001000,11,2\n")
    trades = TableSource(plain, "trade").events()
    assert {t.side for t in trades} == {UNKNOWN_SIDE}
    (bar,) = list(bars(trades, 60.0))
    assert math.isnan(bar.buy_volume)
    line = Renderer().render(bar)
    assert " b" not in line and line.endswith("v3 n2")  # no "b0": the buy share is unknown


def test_parquet_float_noise_renders_at_the_data_precision(tmp_path: Path) -> None:
    prices = np.array([0.029499, 0.0295, 0.02951], dtype=np.float32)
    path = tmp_path / "doge_trades.parquet"
    pl.DataFrame({"ts": [1700000000000 + i for i in range(3)], "price": prices,
                  "size": np.array([1500.5, 20, 7.25], dtype=np.float32)}).write_parquet(path)
    trades = TableSource(path, "trade").events()
    assert [(t.px_dp, t.sz_dp) for t in trades] == [(6, 2)] * 3
    lines = render_lines(trades)
    assert lines[0].endswith("trade 0.029499 1500.5") and lines[1].endswith("trade 0.0295 20")
    assert infer_dp([61837.63, 61837.6]) == 2 and infer_dp([float(np.float32(61837.63))], float32=True) == 2
    assert infer_dp([1e-20]) == 12  # capped


def test_columns_flag_maps_fields_and_refuses_unknown() -> None:
    assert parse_columns("ts_event=time, close=Close") == {"ts_event": "time", "close": "Close"}
    with pytest.raises(ValueError, match="unknown field 'closing'"):
        parse_columns("closing=Close")
    with pytest.raises(ValueError, match="FIELD=COLUMN"):
        parse_columns("ts_event")


def test_bar_table_through_open_recorded_with_columns(tmp_path: Path) -> None:
    csv = tmp_path / "es_1m.csv"
    csv.write_text("Date,Open,High,Low,Close,Vol\n2019-11-11 09:30,3080.25,3081,3079.5,3080.75,1200\n")
    (src,) = open_recorded([csv], ReadOptions(columns={"volume": "Vol"}, tz="America/New_York",
                                              instrument="ES"))
    (bar,) = list(src)
    assert (bar.instrument, bar.ts_open, bar.open, bar.high, bar.low, bar.close, bar.volume, bar.px_dp) == (
        "ES", (T0 + 5 * 3600) * S, 3080.25, 3081.0, 3079.5, 3080.75, 1200.0, 2)


def test_pandas_written_tables_read_their_index_as_time_and_their_spacing_as_interval(tmp_path: Path) -> None:
    # pandas' DataFrame.to_csv() writes the DatetimeIndex under an empty header; daily bars skip weekends.
    csv = tmp_path / "GOOG.csv"
    csv.write_text(",Open,High,Low,Close,Volume\n2004-08-19,100,104.06,95.96,100.34,22351900\n"
                   "2004-08-20,101.01,109.08,100.5,108.31,11428600\n2004-08-23,110.76,113.48,109.05,109.4,9137200\n"
                   "2004-08-24,111.24,111.6,103.57,104.87,7631300\n")
    table = TableSource(csv, "bar")
    bars_ = table.events()
    day = 86_400 * S
    assert [b.interval_ns for b in bars_] == [day] * 4
    assert bars_[2].ts_open == bars_[0].ts_open + 4 * day and bars_[2].ts_event == bars_[2].ts_open + day
    assert any("unnamed first column" in n for n in table.notes)
    assert render_lines(bars_)[1] == "2004-08-20T00:00 108.31 +7.97 o+0.67 h+0.77 l-0.51 v11.4M"
    # Parquet from pandas keeps a nameless index as __index_level_0__; hourly spacing, given or read.
    hours = pl.DataFrame({"__index_level_0__": [(T0 + 3600 * i) * S for i in range(3)], "open": [1.0716] * 3,
                          "high": [1.0722] * 3, "low": [1.0708] * 3, "close": [1.07219] * 3, "volume": [1413] * 3})
    hours.with_columns(pl.col("__index_level_0__").cast(pl.Datetime("ns"))).write_parquet(tmp_path / "eurusd.parquet")
    (src,) = open_recorded([tmp_path / "eurusd.parquet"])
    assert [b.interval_ns for b in src] == [3600 * S] * 3
    (given,) = open_recorded([tmp_path / "eurusd.parquet"], ReadOptions(bar_interval_s=60))
    assert {b.interval_ns for b in given} == {60 * S}
    # No column to take times from: the error names the field and the flag.
    (tmp_path / "odd.csv").write_text("when,Open,High,Low,Close,Volume\n1,1,1,1,1,1\n")
    with pytest.raises(TableFormatError, match="ts_event.*--columns"):
        TableSource(tmp_path / "odd.csv", "bar").events()


def test_binance_public_data_reads_without_a_header(tmp_path: Path) -> None:
    # data.binance.vision spot files: no header row; the layout is known by its column count.
    klines = tmp_path / "BTCUSDT-1m-2024-08-08.csv.gz"
    klines.write_bytes(gzip.compress(b"1723075200000,56990.01,57022.50,56975.99,57010.00,12.34567,1723075259999,"
                                     b"703456.1,812,7.1,404000.2,0\n1723075260000,57010.00,57050.00,57001.00,57044.10,"
                                     b"9.5,1723075319999,541000.0,640,3.2,182000.0,0\n"))
    src = open_source(klines)
    first, second = src.events()
    assert (first.venue, first.instrument, first.trades, first.buy_volume, first.interval_ns) == (
        "binance", "BTCUSDT", 812, 7.1, 60 * S)
    assert render_lines([first, second])[1] == "00:01 57044.1 +34.1 h+5.9 l-9 v9.5 n640 b34"
    assert any("Binance public data (klines)" in n for n in src.notes)
    # Spot files from 2025 on stamp microseconds (Binance's public-data changelog): the same bars.
    micro = tmp_path / "BTCUSDT-1m-2025-01-01.csv"
    micro.write_text("1723075200000000,56990.01,57022.50,56975.99,57010.00,12.34567,1723075259999999,"
                     "703456.1,812,7.1,404000.2,0\n")
    (again,) = open_source(micro).events()
    assert (again.ts_event, again.interval_ns, again.close) == (first.ts_event, 60 * S, first.close)
    trades = tmp_path / "ETHUSDT-trades-2024-08-08.csv"
    trades.write_text("123,2512.01,0.5,1256.0,1723075200123,True,True\n124,2512.02,0.25,628.0,1723075200456,False,True\n")
    sold, bought = open_source(trades).events()
    assert (sold.instrument, sold.side, bought.side, bought.ts_event) == ("ETHUSDT", SELL, BUY, 1723075200456 * 10**6)
    agg = tmp_path / "ETHUSDT-aggTrades-2024-08-08.csv"
    agg.write_text("9,2512.01,0.5,123,125,1723075200123,false,true\n")
    (t,) = open_source(agg).events()
    assert (t.price, t.size, t.side) == (2512.01, 0.5, BUY)
    # A headed futures kline file maps its trade count and taker buy volume by name.
    headed = tmp_path / "BTCUSDT-1m-2024-08.csv"
    headed.write_text("open_time,open,high,low,close,volume,close_time,quote_volume,count,taker_buy_volume,"
                      "taker_buy_quote_volume,ignore\n1723075200000,1,2,0.5,1.5,10,1723075259999,15,7,4,6,0\n")
    (bar,) = open_source(headed).events()
    assert (bar.trades, bar.buy_volume) == (7, 4.0)
    # Any other headerless table is refused with what to do, not read with a data row as its header.
    odd = tmp_path / "bars.csv"
    odd.write_text("1723075200000,1,2,0.5,1.5,10\n")
    with pytest.raises(TableFormatError, match="is data, not a header.*add a header row"):
        TableSource(odd, "bar").events()


def test_kraken_downloadable_history_reads_without_a_header(tmp_path: Path) -> None:
    # support.kraken.com's OHLCVT zips (XBTUSD_60.csv: epoch seconds, o, h, l, c, volume, trades) and
    # time & sales (XBTUSD.csv: epoch seconds, price, volume); 7 columns of numbers are not Binance trades.
    ohlcvt = tmp_path / "XBTUSD_60.csv"
    ohlcvt.write_text("1381095200,122.00000,123.50000,121.90000,123.00000,1.50000000,3\n"
                      "1381098800,123.00000,123.00000,122.10000,122.20000,0.75000000,2\n")
    src = open_source(ohlcvt)
    first, second = src.events()
    assert (first.venue, first.instrument, first.interval_ns, first.trades, first.close) == (
        "kraken", "XBTUSD", 3600 * S, 3, 123.0)
    assert first.ts_event == (1381095200 + 3600) * S  # Kraken times a candle by its open
    assert math.isnan(first.buy_volume)  # no side split published: unknown, not "0% bought"
    assert any("Kraken public data (OHLCVT)" in n for n in src.notes)
    sales = tmp_path / "XBTUSD.csv"
    sales.write_text("1381201115,120.00000,0.10000000\n1381201115.5,120.5,0.2\n")
    a, b = open_source(sales).events()
    assert (a.venue, a.instrument, a.price, a.size, a.side, b.ts_event) == (
        "kraken", "XBTUSD", 120.0, 0.1, UNKNOWN_SIDE, 1381201115_500_000_000)
    # The same shape under another name (time, price, size is common) is read, but not credited to Kraken.
    ticks = tmp_path / "eurusd_ticks.csv"
    ticks.write_text("1381201115,1.3550,2\n1381201116,1.3551,1\n")
    src = open_source(ticks)
    a, _ = src.events()
    assert (a.venue, a.instrument, a.price, a.size) == ("file", "eurusd_ticks", 1.355, 2.0)
    assert any("Kraken's trades layout (time, price, size), venue not assumed" in n for n in src.notes)
    # A 7-column table that is neither (no booleans, no epoch seconds) is still refused.
    odd = tmp_path / "odd.csv"
    odd.write_text("1723075200000,1,2,0.5,1.5,10,3\n")
    with pytest.raises(TableFormatError, match="kraken OHLCVT: 7 columns.*add a header row"):
        TableSource(odd, "bar").events()


def test_metatrader_and_european_layouts_read_as_written(tmp_path: Path) -> None:
    # MetaTrader 5's bar export: tabs, <NAMES> in brackets, a dotted year-first date and a time of
    # day in two columns, <VOL> all zero for forex beside the tick count.
    mt = tmp_path / "EURUSD_H1.csv"
    mt.write_text("<DATE>\t<TIME>\t<OPEN>\t<HIGH>\t<LOW>\t<CLOSE>\t<TICKVOL>\t<VOL>\t<SPREAD>\n"
                  "2024.01.02\t00:00:00\t1.10380\t1.10420\t1.10350\t1.10400\t812\t0\t8\n"
                  "2024.01.02\t01:00:00\t1.10400\t1.10500\t1.10390\t1.10480\t1044\t0\t7\n")
    src = open_source(mt)
    first, second = src.events()
    assert first.interval_ns == 3600 * S and first.ts_event == 1704157200 * S  # 2024-01-02 01:00 UTC
    assert (first.instrument, first.open, first.close, first.volume, second.volume) == (
        "EURUSD", 1.1038, 1.104, 812.0, 1044.0)
    assert any("'<TICKVOL>'" in n and "'<VOL>' is all zero" in n for n in src.notes)
    assert any("separated by tabs" in n for n in src.notes)
    # The same export saved as "Unicode text" (UTF-16 with its byte-order mark, Windows line ends).
    u16 = tmp_path / "EURUSD_H1_u16.txt"
    u16.write_text(mt.read_text().replace("\n", "\r\n"), encoding="utf-16", newline="")
    src16 = open_source(u16)
    assert [(b.ts_event, b.close, b.volume) for b in src16.events()] == [
        (b.ts_event, b.close, b.volume) for b in (first, second)]
    assert any("UTF-16 text, cells separated by tabs" in n for n in src16.notes)
    # Excel's "CSV UTF-8" starts with a byte-order mark that must not become part of the first name.
    excel = tmp_path / "SPY.csv"
    excel.write_bytes(b"\xef\xbb\xbfDate,Open,High,Low,Close,Volume\r\n2024-01-02,472.2,473.7,470.5,472.7,123\r\n")
    (spy,) = open_source(excel).events()
    assert (spy.close, spy.volume) == (472.7, 123.0)
    # A real volume is kept when it has one; a mapping always wins.
    stock = tmp_path / "AAPL_D1.csv"
    stock.write_text("<DATE>\t<TIME>\t<OPEN>\t<HIGH>\t<LOW>\t<CLOSE>\t<TICKVOL>\t<VOL>\t<SPREAD>\n"
                     "2024.01.02\t00:00:00\t185.0\t186.0\t184.0\t185.5\t5000\t61000000\t1\n")
    (bar,) = open_source(stock).events()
    assert bar.volume == 61_000_000
    (mapped,) = open_source(stock, ReadOptions(columns={"volume": "<TICKVOL>"})).events()
    assert mapped.volume == 5000
    # A semicolon table with decimal commas (European spreadsheet exports) and separate Date/Time.
    eu = tmp_path / "DAX_M1.csv"
    eu.write_text("Date;Time;Open;High;Low;Close;Volume\n"
                  "2024-03-01;09:00;17700,5;17712,25;17698,0;17710,75;1200\n"
                  "2024-03-01;09:01;17710,75;17715,0;17705,5;17706,0;800\n")
    src = open_source(eu)
    a, b = src.events()
    assert (a.open, a.high, a.close, b.close, a.interval_ns) == (17700.5, 17712.25, 17710.75, 17706.0, 60 * S)
    assert any("semicolons, numbers with a decimal comma" in n for n in src.notes)
    # A first bar of whole numbers does not hide the decimal commas of the bars after it.
    whole = tmp_path / "DAX_D1.csv"
    whole.write_text("Date;Open;High;Low;Close;Volume\n2024-03-01;17700;17712;17698;17710;1200\n"
                     "2024-03-04;17710;17715,5;17705,5;17706,25;800\n")
    assert [b.close for b in open_source(whole).events()] == [17710.0, 17706.25]
    # In a tab table a comma may be a thousands separator: never read as a decimal point.
    thousands = tmp_path / "SPY_D1.tsv"
    thousands.write_text("Date\tOpen\tHigh\tLow\tClose\tVolume\n2024-03-01\t510\t512\t509\t511\t12,345\n")
    with pytest.raises(TableFormatError, match="'Volume' .*not numeric"):
        open_source(thousands).events()
    # MetaTrader 4's history export has no header, and its first row is dates and numbers: refused
    # with what to do, never read with a data row as its header.
    mt4 = tmp_path / "EURUSD60.csv"
    mt4.write_text("2024.01.02,00:00,1.10380,1.10420,1.10350,1.10400,812\n")
    with pytest.raises(TableFormatError, match="is data, not a header"):
        TableSource(mt4, "bar").events()
    # A pipe-separated trades table.
    piped = tmp_path / "es_trades.csv"
    piped.write_text("time|price|size|side\n2024-03-01T14:30:00Z|5100.25|3|B\n")
    (t,) = open_source(piped).events()
    assert (t.price, t.size, t.side) == (5100.25, 3.0, BUY)


def test_vendor_flat_files_keep_their_instruments_and_times(tmp_path: Path) -> None:
    # Polygon's minute aggregates: many tickers in one file, window_start in ns. Read as one
    # instrument, AAPL's and MSFT's bars would interleave into one nonsense series.
    aggs = tmp_path / "2024-03-01.csv.gz"
    aggs.write_bytes(gzip.compress(b"ticker,volume,open,close,high,low,window_start,transactions\n"
                                   b"AAPL,4930,179.55,179.6,179.66,179.52,1709301600000000000,77\n"
                                   b"MSFT,1200,415.1,415.3,415.4,415.0,1709301600000000000,31\n"
                                   b"AAPL,3020,179.6,179.7,179.75,179.58,1709301660000000000,52\n"))
    rows = open_source(aggs).events()
    assert [(b.instrument, b.close, b.trades) for b in rows] == [("AAPL", 179.6, 77), ("MSFT", 415.3, 31),
                                                                   ("AAPL", 179.7, 52)]
    assert rows[0].interval_ns == 60 * S and rows[0].ts_event == (1709301600 + 60) * S
    # OKX's trade history (created_time in ms) and a Databento CSV (side A = sell aggressor, N unknown).
    okx = tmp_path / "BTC-USDT-trades-2024-03-01.csv"
    okx.write_text("instrument_name,trade_id,side,price,size,created_time\n"
                   "BTC-USDT,1,buy,61000.1,0.01,1709251200123\nBTC-USDT,2,sell,61000.0,0.02,1709251200456\n")
    a, b = open_source(okx).events()
    assert (a.instrument, a.side, b.side, a.ts_event) == ("BTC-USDT", BUY, SELL, 1709251200123 * 10**6)
    dbn = tmp_path / "glbx-trades.csv"
    dbn.write_text("ts_recv,ts_event,rtype,publisher_id,instrument_id,action,side,depth,price,size,flags,"
                   "ts_in_delta,sequence,symbol\n"
                   "1709301600000100000,1709301600000000000,0,1,42,T,A,0,5100.25,2,0,100,1,ESH4\n"
                   "1709301600000200000,1709301600000100000,0,1,42,T,N,0,5100.50,1,0,100,2,ESH4\n")
    src = open_source(dbn)
    sold, unknown = src.events()
    assert (sold.instrument, sold.side, unknown.side, src.stats.errors) == ("ESH4", SELL, UNKNOWN_SIDE, 0)
    # Dukascopy's export: 'Gmt time', day-first dotted dates (the format the data proves is asked for).
    duka = tmp_path / "EURUSD_Candlestick_1_Hour_BID_01.01.2024-13.01.2024.csv"
    duka.write_text("Gmt time,Open,High,Low,Close,Volume\n01.01.2024 22:00:00.000,1.10376,1.104,1.1037,1.1039,123.45\n"
                    "13.01.2024 00:00:00.000,1.1039,1.1042,1.1038,1.104,50\n")
    with pytest.raises(TableFormatError, match="day above 12 first: pass --time-format '%d.%m.%Y %H:%M:%S%.f'"):
        open_source(duka).events()
    a, _ = open_source(duka, ReadOptions(time_format="%d.%m.%Y %H:%M:%S%.f")).events()
    assert (a.instrument, a.ts_open) == ("EURUSD", 1704146400 * S)  # 2024-01-01 22:00 UTC


def test_yahoo_float32_text_renders_at_the_prices_own_decimals(tmp_path: Path) -> None:
    # Yahoo's daily CSVs (e.g. arch's S&P 500 data) write float32 prices at 6 decimals.
    csv = tmp_path / "sp500.csv"
    csv.write_text("Date,Open,High,Low,Close,Adj Close,Volume\n"
                   "1/4/1999,1229.22998,1248.810059,1219.099976,1228.099976,1228.099976,877000000\n"
                   "1/5/1999,1228.099976,1246.109985,1228.099976,1244.780029,1244.780029,775000000\n")
    with pytest.raises(TableFormatError, match="%m/%d/%Y"):  # 1/4 or 4/1: asked, never guessed
        TableSource(csv, "bar").events()
    bars_ = TableSource(csv, "bar", time_format="%m/%d/%Y").events()
    assert [b.px_dp for b in bars_] == [2, 2]
    assert render_lines(bars_) == ["1999-01-04T00:00 1228.1 -1.13 h+19.58 l-9 v877M",
                                   "1999-01-05T00:00 1244.78 +16.68 h+1.33 v775M"]
    assert infer_dp([12345.6789, 1.5]) == 4  # real digits past float32's precision are kept


def _capture(path: Path, lines: int) -> bytes:
    body = "".join(f'{i + 1} {{"u":{i},"s":"BTCUSDT","b":"1.{i:02d}","B":"1","a":"2.00","A":"1"}}\n'
                   for i in range(lines))
    data = gzip.compress(body.encode())
    path.write_bytes(data)
    return data


def test_truncated_capture_keeps_the_prefix_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "btcusdt_cut.gz"
    data = _capture(path, 3000)
    path.write_bytes(data[: len(data) // 2])
    src = CaptureSource(path)
    got = list(src)
    assert 0 < len(got) < 3000 and [q.bid_size for q in got[:2]] == [1.0, 1.0]
    assert got[5].bid == 1.05 and got[5].ts_recv == 6
    assert src.stats.error_kinds == {"truncated_file": 1}
    assert "btcusdt_cut.gz" in src.stats.error_samples[0] and f"after line {len(got)}" in src.stats.error_samples[0]
    plain = tmp_path / "ethusdt_plain.gz"
    plain.write_text('1 {"u":1,"s":"ETHUSDT","b":"1","B":"1","a":"2","A":"1"}\n')
    psrc = CaptureSource(plain)
    assert list(psrc) == [] and psrc.stats.error_kinds == {"not_gzip": 1}
    assert "ethusdt_plain.gz: not a gzip capture" in psrc.stats.error_samples[0]


def test_capture_venue_is_sniffed_and_other_formats_named(tmp_path: Path) -> None:
    path = tmp_path / "btcusdt_x.gz"
    _capture(path, 2)
    assert open_source(path).venue == "binance"
    cb = tmp_path / "cb.gz"
    cb.write_bytes(gzip.compress(b'1 {"type":"match","trade_id":1,"price":"1","size":"1","side":"buy"}\n'))
    assert open_source(cb).venue == "coinbase-exchange"
    kr = tmp_path / "kr.gz"
    kr.write_bytes(gzip.compress(b'1 [0,[["5541.2","0.15","1534614057.32","s","l",""]],"trade","XBT/USD"]\n'))
    assert open_source(kr).venue == "kraken-v1"
    odd = tmp_path / "odd.gz"
    odd.write_bytes(gzip.compress(b'1 {"kind":"fill","px":1}\n'))
    with pytest.raises(ValueError, match="odd.gz: not a capture of a supported venue.*first message keys"):
        open_source(odd)
    with pytest.raises(ValueError, match="unknown file format"):
        open_source(tmp_path.joinpath("x.xml").resolve() if tmp_path.joinpath("x.xml").write_text("{}") else "")
    tmp_path.joinpath("x.json").write_text("{}")  # .json: a venue's REST answer (feeds/rest.py), or refused by name
    with pytest.raises(ValueError, match="x.json: not a REST kline/candle answer this reads"):
        list(open_source(tmp_path / "x.json"))


def test_replay_server_serves_the_good_prefix_of_a_cut_capture(tmp_path: Path) -> None:
    from feeds.server import _load

    path = tmp_path / "btcusdt_cut.gz"
    data = _capture(path, 3000)
    path.write_bytes(data[: len(data) // 2])
    damage: list[str] = []
    lines = _load([path], damage)
    assert 0 < len(lines) < 3000 and lines[0].recv_ns == 1
    assert len(damage) == 1 and "btcusdt_cut.gz: gzip stream ends early" in damage[0]


def test_bars_without_volume_read_as_unknown_and_zero_volume_is_warned(tmp_path: Path) -> None:
    """FX brokers export OHLC without volume: read, volume NaN (unknown), said in notes; a volume column of
    zeros is read as written with a warning; a NaN cell in a real volume column is still a refused row."""
    fx = tmp_path / "eurusd_h1.csv"
    fx.write_text("Date,Open,High,Low,Close\n2024-01-02 00:00,1.1040,1.1046,1.1031,1.1038\n"
                  "2024-01-02 01:00,1.1038,1.1052,1.1035,1.1050\n")
    src = TableSource(fx, "auto")
    got = src.events()
    assert len(got) == 2 and src.stats.errors == 0 and all(math.isnan(b.volume) for b in got)
    assert (got[1].close, got[1].interval_ns) == (1.1050, 3600 * 10**9)
    assert any("no volume column" in n and "cannot be answered" in n for n in src.notes)
    assert Renderer().render(got[0]).endswith("v?")  # unknown, not a made-up zero
    zero = tmp_path / "zero.csv"
    zero.write_text("timestamp,open,high,low,close,volume\n1640991660,10,11,9,10,0\n1640991720,10,11,9,10,0\n")
    src = TableSource(zero, "auto")
    assert [b.volume for b in src.events()] == [0.0, 0.0]
    assert any("volume column 'volume' is all zero" in n for n in src.notes)
    nan_cell = tmp_path / "nan.csv"
    nan_cell.write_text("timestamp,open,high,low,close,volume\n1640991660,10,11,9,10,NaN\n1640991720,10,11,9,10,2\n")
    src = TableSource(nan_cell, "auto")
    assert [b.volume for b in src.events()] == [2.0] and src.stats.error_kinds == {"bad_bar": 1}
