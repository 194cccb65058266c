"""Venues' REST kline/candle answers, saved as JSON, read as bars by the live parsers (feeds/rest.py).
Each sample is shaped exactly as the venue's REST docs show their answer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from feeds.events import Bar
from feeds.sources import ReadOptions, open_source
from streamllm.cli import main

S = 1_000_000_000
MIN = 60 * S


def _save(tmp_path: Path, name: str, doc: object, saved_at_s: float | None = None) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    if saved_at_s is not None:
        os.utime(path, (saved_at_s, saved_at_s))
    return path


def _bars(path: Path, **opts: object) -> tuple[object, list[Bar]]:
    src = open_source(path, ReadOptions(**opts))
    return src, list(src)


def _ohlcv(b: Bar) -> tuple:
    return (b.open, b.high, b.low, b.close, b.volume)


def test_kraken_rest_ohlc(tmp_path: Path) -> None:
    doc = {"error": [], "result": {"XXBTZUSD": [
        [1688671200, "30306.1", "30306.2", "30305.7", "30305.7", "30306.1", "3.39243896", 23],
        [1688671260, "30304.5", "30304.5", "30300.0", "30300.0", "30300.2", "4.42996871", 18],
        [1688671320, "30300.3", "30300.4", "30291.4", "30291.4", "30294.7", "2.13024789", 25],
        [1688671380, "30291.8", "30295.1", "30291.8", "30295.0", "30293.8", "1.01836275", 9]],
        "last": 1688671320}}
    src, bars = _bars(_save(tmp_path, "kraken_ohlc.json", doc))
    assert src.venue == "kraken" and src.stats.errors == 0
    assert len(bars) == 3  # the last entry is the frame not yet committed (Kraken's docs): held back
    first = bars[0]
    assert (first.instrument, first.ts_open, first.interval_ns, first.ts_event) == (
        "XXBTZUSD", 1688671200 * S, MIN, 1688671260 * S)
    assert _ohlcv(first) == (30306.1, 30306.2, 30305.7, 30305.7, 3.39243896)
    assert (first.vwap, first.trades) == (30306.1, 23) and bars[2].close == 30291.4
    assert src.stats.control_kinds == {"open candle (the newest; Kraken: not yet committed)": 1}
    err = {"error": ["EQuery:Unknown asset pair"], "result": {}}
    with pytest.raises(ValueError, match="kraken answered with an error: \\['EQuery:Unknown asset pair'\\]"):
        _bars(_save(tmp_path, "bad.json", err))


def test_binance_rest_klines(tmp_path: Path) -> None:
    rows = [[1499040000000, "0.01634790", "0.80000000", "0.01575800", "0.01577100", "148976.11427815", 1499040059999,
             "2434.19055334", 308, "1756.87402397", "28.46694368", "0"],
            [1499040060000, "0.01577100", "0.01600000", "0.01570000", "0.01590000", "1000.00000000", 1499040119999,
             "15.90000000", 12, "400.00000000", "6.36000000", "0"]]
    # Saved at 1499040100 s: the second kline (closing at ...119999 ms) was still open then.
    src, bars = _bars(_save(tmp_path, "bnbbtc_1m.json", rows, saved_at_s=1499040100), instrument="BNBBTC")
    assert src.venue == "binance" and src.stats.errors == 0 and len(bars) == 1
    (b,) = bars
    assert (b.instrument, b.ts_open, b.interval_ns, b.trades) == ("BNBBTC", 1499040000000 * 10**6, MIN, 308)
    assert _ohlcv(b) == (0.0163479, 0.8, 0.015758, 0.015771, 148976.11427815)
    assert b.buy_volume == 1756.87402397 and b.vwap == pytest.approx(2434.19055334 / 148976.11427815)
    assert src.stats.control_kinds == {"unclosed kline": 1}
    _, both = _bars(_save(tmp_path, "bnbbtc_later.json", rows))  # saved now: both closed; symbol from the name
    assert [x.instrument for x in both] == ["BNBBTC", "BNBBTC"] and both[1].close == 0.0159


def test_bybit_rest_kline(tmp_path: Path) -> None:
    doc = {"retCode": 0, "retMsg": "OK", "result": {"symbol": "BTCUSD", "category": "inverse", "list": [
        ["1670608800000", "17071", "17073", "17027", "17055.5", "268611", "15.74462667"],
        ["1670605200000", "17071.5", "17071.5", "17061", "17071", "4177", "0.24469757"],
        ["1670601600000", "17086.5", "17088", "16978", "17071.5", "6356", "0.37288112"]]},
        "retExtInfo": {}, "time": 1672025956592}
    src, bars = _bars(_save(tmp_path, "bybit_kline.json", doc, saved_at_s=1670610000))  # before the newest closed
    assert src.venue == "bybit" and src.stats.errors == 0
    assert [b.ts_open for b in bars] == [1670601600 * S, 1670605200 * S]  # oldest first; newest still open
    assert all(b.instrument == "BTCUSD" and b.interval_ns == 60 * MIN for b in bars)
    assert _ohlcv(bars[0]) == (17086.5, 17088.0, 16978.0, 17071.5, 6356.0)
    assert src.stats.control_kinds == {"unclosed kline": 1}
    bad = {"retCode": 10001, "retMsg": "params error", "result": {}}
    with pytest.raises(ValueError, match="bybit answered with an error: 10001 params error"):
        _bars(_save(tmp_path, "bad.json", bad))


def test_okx_rest_candles(tmp_path: Path) -> None:
    doc = {"code": "0", "msg": "", "data": [
        ["1597026443085", "3.721", "3.743", "3.677", "3.708", "8422410", "22698348.04828491", "12698348.04828491", "0"],
        ["1597026383085", "3.731", "3.799", "3.494", "3.72", "24912403", "67632347.24399722", "37632347.24399722", "1"]]}
    src, bars = _bars(_save(tmp_path, "BTC-USDT_1m.json", doc))
    assert src.venue == "okx" and src.stats.errors == 0
    (b,) = bars  # confirm "0": the newest is still filling
    assert (b.instrument, b.ts_open, b.interval_ns) == ("BTC-USDT", 1597026383085 * 10**6, MIN)
    assert _ohlcv(b) == (3.731, 3.799, 3.494, 3.72, 24912403.0)
    assert src.stats.control_kinds == {"unclosed kline": 1}


def test_coinbase_rest_candles(tmp_path: Path) -> None:
    doc = {"candles": [
        {"start": "1639508170", "low": "140.21", "high": "140.30", "open": "140.25", "close": "140.30", "volume": "1200"},
        {"start": "1639508110", "low": "140.10", "high": "140.25", "open": "140.12", "close": "140.25", "volume": "900"},
        {"start": "1639508050", "low": "140.21", "high": "140.21", "open": "140.21", "close": "140.21", "volume": "56437345"}]}
    src, bars = _bars(_save(tmp_path, "x.json", doc), instrument="ETH-USD")
    assert src.venue == "coinbase" and src.stats.errors == 0
    assert [b.ts_open for b in bars] == [1639508050 * S, 1639508110 * S]  # the newest held, as the live feed does
    first = bars[0]
    assert (first.instrument, first.interval_ns, first.ts_event) == ("ETH-USD", MIN, 1639508110 * S)  # ONE_MINUTE
    assert _ohlcv(first) == (140.21, 140.21, 140.21, 140.21, 56437345.0) and math.isnan(first.vwap)


def test_rest_answers_no_adapter_reads_are_refused_by_name(tmp_path: Path, capsys) -> None:
    exchange = [[1415398768, 0.32, 4.2, 0.35, 4.2, 12.3]]  # Coinbase Exchange: [time, low, high, open, close, volume]
    path = _save(tmp_path, "cb.json", exchange)
    assert main(["inspect", str(path), "--tokenizer", "none"]) == 2
    assert "Coinbase Exchange's REST candles" in capsys.readouterr().err
    assert main(["inspect", str(_save(tmp_path, "odd.json", {})), "--tokenizer", "none"]) == 2
    assert "not a REST kline/candle answer this reads" in capsys.readouterr().err


def test_inspect_reads_a_rest_answer(tmp_path: Path, capsys) -> None:
    doc = {"error": [], "result": {"XXBTZUSD": [
        [1688671200, "30306.1", "30306.2", "30305.7", "30305.7", "30306.1", "3.39243896", 23],
        [1688671260, "30304.5", "30304.5", "30300.0", "30300.0", "30300.2", "4.42996871", 18]], "last": 1688671260}}
    out = tmp_path / "r.json"
    assert main(["inspect", str(_save(tmp_path, "ohlc.json", doc)), "--tokenizer", "none", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert (rep["format"], rep["venue"], rep["events"]) == ("RestSource", "kraken", 1)
    assert rep["first_ts"] == 1688671200 * S and rep["last_ts"] == 1688671260 * S
    assert "open candle" in capsys.readouterr().out
