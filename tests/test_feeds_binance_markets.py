"""Binance spot and futures messages built from the docs, checked value by value."""

from __future__ import annotations

import json
import math

import pytest

from feeds.binance import BinanceParser
from feeds.events import SELL, Liquidation, Mark, Quote, Trade
from streamllm.feeding.render import Renderer

MS = 1_000_000
SPOT_TICKER = {"u": 400900217, "s": "BNBUSDT", "b": "25.35190000", "B": "31.21000000", "a": "25.36520000",
               "A": "40.66000000"}
FUT_TICKER = {"e": "bookTicker", "u": 400900217, "E": 1568014460893, "T": 1568014460891, "s": "BNBUSDT",
              "b": "25.35190000", "B": "31.21000000", "a": "25.36520000", "A": "40.66000000"}


def _depth(U: int, u: int, pu: int | None = None, s: str = "BTCUSDT") -> str:
    d = {"e": "depthUpdate", "E": 1571889248277, "T": 1571889248276, "s": s, "U": U, "u": u,
         "b": [["7403.89", "0.002"]], "a": [["7405.96", "3.340"]]}
    if pu is not None:
        d["pu"] = pu
    return json.dumps({"stream": s.lower() + "@depth@100ms", "data": d})


@pytest.mark.parametrize("market", ["spot", "usdm", "coinm"])
def test_book_ticker_with_and_without_times(market: str) -> None:
    p = BinanceParser(market=market)
    (q,) = p.parse(json.dumps(SPOT_TICKER), 77)
    assert type(q) is Quote
    assert (q.instrument, q.bid, q.bid_size, q.ask, q.ask_size) == ("BNBUSDT", 25.3519, 31.21, 25.3652, 40.66)
    assert (q.ts_event, q.ts_recv, q.px_dp, q.sz_dp) == (77, 77, 4, 2)  # no time given: the receive time
    (f,) = p.parse(json.dumps({"stream": "bnbusdt@bookTicker", "data": FUT_TICKER}), 99)
    assert (f.bid, f.ask, f.ts_event, f.ts_recv) == (25.3519, 25.3652, 1568014460891 * MS, 99)  # T, not E
    (e,) = p.parse(json.dumps({k: v for k, v in FUT_TICKER.items() if k != "T"}), 99)
    assert e.ts_event == 1568014460893 * MS  # only E: E
    assert p.stats.errors == 0


def test_futures_depth_chains_through_pu_and_spot_rule_refuses_it() -> None:
    fut = BinanceParser(market="usdm", symbol_hint="btcusdt")
    fut.parse('{"lastUpdateId":1000,"E":1,"T":1,"bids":[["7403.8","1"]],"asks":[["7406","1"]]}', 1)
    assert fut.parse(_depth(900, 950, 890), 2)[0].first_seq == 900  # older than the snapshot: no gap
    fut.parse(_depth(990, 1010, 980), 3)  # spans lastUpdateId 1000: the bridge
    fut.parse(_depth(1017, 1030, 1010), 4)  # ids jump (futures), pu chains: no gap
    fut.parse(_depth(1031, 1044, 1030), 5)
    assert fut.stats.gaps == 0 and fut.stats.errors == 0
    fut.parse(_depth(1060, 1070, 1050), 6)  # pu 1050 != 1044: one update lost
    assert fut.stats.gaps == 1 and "expected 1044, got 1050" in fut.stats.gap_samples[0]
    (d,) = fut.parse(_depth(1071, 1080, 1070), 7)
    assert (d.bids, d.asks, d.ts_event, d.last_seq) == ([(7403.89, 0.002)], [(7405.96, 3.34)], 1571889248276 * MS, 1080)
    assert fut.stats.gaps == 1
    # The same stream read as spot would count every update a gap: refused, naming the market.
    spot = BinanceParser(market="spot")
    assert spot.parse(_depth(1017, 1030, 1010), 4) == []
    assert spot.stats.errors == 1 and "--market usdm or coinm" in spot.stats.error_samples[0]


def test_spot_depth_rule_unchanged() -> None:
    p = BinanceParser(symbol_hint="bnbbtc")
    p.parse('{"lastUpdateId":160,"bids":[],"asks":[]}', 1)
    p.parse(_depth(157, 165, s="BNBBTC"), 2)  # U <= 161 <= u: bridges the snapshot
    p.parse(_depth(166, 170, s="BNBBTC"), 3)
    assert p.stats.gaps == 0
    p.parse(_depth(175, 180, s="BNBBTC"), 4)
    assert p.stats.gaps == 1 and "expected 171, got 175" in p.stats.gap_samples[0]


def test_agg_trade_mark_price_and_force_order() -> None:
    p = BinanceParser(market="usdm")
    agg = {"e": "aggTrade", "E": 123456789, "s": "BTCUSDT", "a": 5933014, "p": "0.001", "q": "100",
           "f": 100, "l": 105, "T": 123456785, "m": True}
    (t,) = p.parse(json.dumps(agg), 9)
    assert type(t) is Trade
    assert (t.price, t.size, t.side, t.trade_id, t.ts_event, t.ts_recv) == (0.001, 100.0, SELL, 5933014, 123456785 * MS, 9)
    mark = {"e": "markPriceUpdate", "E": 1562305380000, "s": "BTCUSDT", "p": "11794.15000000",
            "i": "11784.62659091", "P": "11784.25641265", "r": "0.00038167", "T": 1562306400000}
    (m,) = p.parse(json.dumps(mark), 10)
    assert type(m) is Mark
    assert (m.mark, m.index, m.funding_rate, m.ts_event, m.next_funding_ns, m.px_dp) == (
        11794.15, 11784.62659091, 0.00038167, 1562305380000 * MS, 1562306400000 * MS, 2)
    force = {"e": "forceOrder", "E": 1568014460893, "o": {
        "s": "BTCUSDT", "S": "SELL", "o": "LIMIT", "f": "IOC", "q": "0.014", "p": "9910", "ap": "9910.5",
        "X": "FILLED", "l": "0.014", "z": "0.014", "T": 1568014460890}}
    (liq,) = p.parse(json.dumps(force), 11)
    assert type(liq) is Liquidation
    assert (liq.price, liq.size, liq.side, liq.ts_event, liq.px_dp, liq.sz_dp) == (
        9910.5, 0.014, SELL, 1568014460890 * MS, 1, 3)
    assert p.stats.errors == 0
    r = Renderer()
    assert r.render(m) == "2019-07-05T05:43:00 mark 11794.15 index 11784.63 funding 0.0382%"
    assert r.render(liq) == "2019-09-09T07:34:20 liquidation sell 9910.5 0.014"
    spot = BinanceParser()
    assert spot.parse(json.dumps(mark), 1) == [] and "--market usdm" in spot.stats.error_samples[0]


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("p", "-1.5", "bad_price"), ("p", "0", "bad_price"), ("p", "NaN", "bad_price"), ("p", "inf", "bad_price"),
    ("q", "0", "bad_size"), ("q", "-3", "bad_size"), ("m", "false", "bad_m"), ("m", 0, "bad_m"),
])
def test_impossible_trade_values_are_counted_by_field(field: str, value: object, kind: str) -> None:
    p = BinanceParser()
    trade = {"e": "trade", "E": 1, "s": "BTCUSDT", "t": 1, "p": "100.5", "q": "0.1", "T": 1, "m": True}
    assert p.parse(json.dumps({**trade, field: value}), 1) == []
    assert p.stats.errors == 1 and p.stats.error_kinds == {kind: 1}
    assert kind.removeprefix("bad_") + "=" in p.stats.error_samples[0]


def test_impossible_quote_and_kline_values() -> None:
    p = BinanceParser()
    assert p.parse(json.dumps({**SPOT_TICKER, "b": "0"}), 1) == []
    assert p.parse(json.dumps({**SPOT_TICKER, "A": "-1"}), 1) == []
    kline = {"t": 0, "T": 59999, "s": "X", "i": "1m", "o": "10", "c": "11", "h": "12", "l": "9", "v": "5",
             "n": 3, "x": True, "q": "50", "V": "2"}
    for bad in ({"h": "8"}, {"c": "13"}, {"v": "nan"}, {"l": "-1"}):
        assert p.parse(json.dumps({"e": "kline", "E": 1, "s": "X", "k": {**kline, **bad}}), 1) == []
    assert p.stats.error_kinds == {"bad_bid": 1, "bad_ask_size": 1, "bad_bar": 4}
    (bar,) = p.parse(json.dumps({"e": "kline", "E": 1, "s": "X", "k": kline}), 1)
    assert (bar.open, bar.high, bar.low, bar.close, bar.buy_volume) == (10, 12, 9, 11, 2)
    assert not math.isnan(bar.vwap)


def test_live_adapter_and_recorder_take_the_market() -> None:
    from feeds.adapters import FeedAdapter

    a = FeedAdapter("binance", ["btcusdt"], market="usdm")
    assert a.url == "wss://fstream.binance.com/stream" and a.parser.market == "usdm"
    assert "markPrice@1s" in a.channels and "forceOrder" in a.channels
    assert FeedAdapter("binance", ["btcusd_perp"], market="coinm").url == "wss://dstream.binance.com/stream"
    assert FeedAdapter("binance", ["btcusdt"]).parser.market == "spot"
    with pytest.raises(ValueError, match="for binance, not kraken"):
        FeedAdapter("kraken", ["BTC/USD"], market="usdm")
