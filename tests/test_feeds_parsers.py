"""Wire parsers: shared Binance captures, doc messages of the other venues, bad input."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from feeds.alpaca import AlpacaParser
from feeds.binance import BinanceParser
from feeds.coinbase import CoinbaseParser
from feeds.events import BUY, SELL, Bar, BookDelta, Quote, Trade, read_parquet, write_parquet
from feeds.kraken import KrakenParser
from feeds.wire import AuthError, rfc3339_ns, stdlib_loads

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CAPTURES = sorted((DATA / "binance-spot").glob("*.gz")) if DATA.exists() else []
needs_data = pytest.mark.skipif(not CAPTURES, reason=f"shared captures not found at {DATA}")

_KIND = {"trade": Trade, "bookTicker": Quote, "depth@100ms": BookDelta}


@needs_data
@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_binance_capture_counts_match_lines_per_stream(path: Path) -> None:
    parser = BinanceParser(symbol_hint=path.name.split("_")[0])
    expected: Counter[type] = Counter()
    got: Counter[type] = Counter()
    with gzip.open(path, "rb") as fh:
        for line in fh:
            recv, _, raw = line.rstrip(b"\n").partition(b" ")
            msg = json.loads(raw)
            expected[_KIND[msg["stream"].split("@", 1)[1]] if "stream" in msg else BookDelta] += 1
            for ev in parser.parse(raw, int(recv)):
                got[type(ev)] += 1
    assert parser.stats.errors == 0, parser.stats.error_samples
    assert got == expected
    assert parser.stats.gaps == 0, parser.stats.gap_samples


def test_binance_raw_and_combined_envelopes_and_doc_payloads() -> None:
    p = BinanceParser()
    trade = {"e": "trade", "E": 1672515782136, "s": "BNBBTC", "t": 12345, "p": "0.001", "q": "100",
             "T": 1672515782136, "m": True, "M": True}
    (a,) = p.parse(json.dumps(trade), 5)
    (b,) = p.parse(json.dumps({"stream": "bnbbtc@trade", "data": trade}), 5)
    assert a == b and a.side == SELL and a.price == 0.001 and a.px_dp == 3 and a.ts_event == 1672515782136 * 10**6
    agg = {"e": "aggTrade", "E": 1672515782136, "s": "BNBBTC", "a": 12345, "p": "0.001", "q": "100",
           "f": 100, "l": 105, "T": 1672515782136, "m": False, "M": True}
    (t,) = p.parse(json.dumps(agg), 5)
    assert t.side == BUY and t.trade_id == 12345
    (q,) = p.parse('{"u":400900217,"s":"BNBUSDT","b":"25.35190000","B":"31.21000000","a":"25.36520000","A":"40.66000000"}', 7)
    assert (q.bid, q.ask, q.px_dp, q.ts_event) == (25.3519, 25.3652, 4, 7)
    kline = {"e": "kline", "E": 1672515782136, "s": "BNBBTC", "k": {
        "t": 1672515780000, "T": 1672515839999, "s": "BNBBTC", "i": "1m", "f": 100, "L": 200,
        "o": "0.0010", "c": "0.0020", "h": "0.0025", "l": "0.0010", "v": "1000", "n": 100,
        "x": True, "q": "1.0000", "V": "500", "Q": "0.500", "B": "123456"}}
    (bar,) = p.parse(json.dumps(kline), 9)
    assert (bar.open, bar.high, bar.low, bar.close, bar.volume, bar.trades) == (0.001, 0.0025, 0.001, 0.002, 1000, 100)
    assert bar.buy_volume == 500 and bar.sell_volume == 500 and bar.vwap == pytest.approx(0.001)
    assert bar.interval_ns == 60 * 10**9
    kline["k"]["x"] = False
    assert p.parse(json.dumps(kline), 9) == []
    depth = {"e": "depthUpdate", "E": 1672515782136, "s": "BNBBTC", "U": 157, "u": 160,
             "b": [["0.0024", "10"]], "a": [["0.0026", "100"]]}
    (d,) = p.parse(json.dumps(depth), 9)
    assert d.bids == [(0.0024, 10.0)] and d.asks == [(0.0026, 100.0)] and (d.first_seq, d.last_seq) == (157, 160)
    depth.update(U=165, u=170)
    p.parse(json.dumps(depth), 10)
    assert p.stats.gaps == 1 and "expected 161, got 165" in p.stats.gap_samples[0]
    assert p.parse('{"result":null,"id":1}', 1) == [] and p.stats.control >= 1
    assert p.stats.errors == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"stream":"btcusdt@trade","data":{"e":"trade","E":1,"s":"BTCUSDT","t":1,"p":"1.0"',  # truncated
        b"not json at all",
        b'{"e":"trade","s":"BTCUSDT"}',  # missing fields
        b'{"e":"mystery"}',
        b'{"u":1,"s":"X","b":"abc","B":"1","a":"2","A":"1"}',  # bad number
        b'{"code":2,"msg":"Invalid request"}',
        b"[]",
    ],
)
def test_binance_malformed_counted_not_raised(raw: bytes) -> None:
    p = BinanceParser()
    assert p.parse(raw, 1) == []
    assert p.stats.errors == 1 and p.stats.error_samples


def test_stdlib_and_orjson_agree() -> None:
    raw = '{"stream":"ethusdt@trade","data":{"e":"trade","E":1,"s":"ETHUSDT","t":9,"p":"2683.81000000","q":"0.0040","T":2,"m":false,"M":true}}'
    assert BinanceParser().parse(raw, 3) == BinanceParser(loads=stdlib_loads).parse(raw, 3)


def test_rfc3339_keeps_nanoseconds() -> None:
    assert rfc3339_ns("1970-01-01T00:00:01.000000001Z") == 1_000_000_001
    assert rfc3339_ns("2023-02-09T20:19:35.39625135Z") % 10**9 == 396251350
    assert rfc3339_ns("2021-02-22T19:15:00Z") == 1614021300 * 10**9
    assert rfc3339_ns("2021-02-22T20:15:00+01:00") == 1614021300 * 10**9


# --- Coinbase Advanced Trade (messages from the channel docs) ---

CB_TRADES = {"channel": "market_trades", "client_id": "", "timestamp": "2023-02-09T20:19:35.39625135Z",
             "sequence_num": 0, "events": [{"type": "snapshot", "trades": [
                 {"trade_id": "000000000", "product_id": "ETH-USD", "price": "1260.01", "size": "0.3",
                  "side": "BUY", "time": "2019-08-14T20:42:27.265Z"}]}]}
CB_TICKER = {"channel": "ticker", "client_id": "", "timestamp": "2023-02-09T20:30:37.167359596Z",
             "sequence_num": 1, "events": [{"type": "snapshot", "tickers": [
                 {"type": "ticker", "product_id": "BTC-USD", "price": "21932.98", "volume_24_h": "16038.28770938",
                  "low_24_h": "21835.29", "high_24_h": "23011.18", "low_52_w": "15460", "high_52_w": "48240",
                  "price_percent_chg_24_h": "-4.15775596190603", "best_bid": "21931.98",
                  "best_bid_quantity": "8000.21000000", "best_ask": "21933.98",
                  "best_ask_quantity": "8038.07770938"}]}]}
CB_L2 = {"channel": "l2_data", "client_id": "", "timestamp": "2023-02-09T20:32:50.714964855Z",
         "sequence_num": 2, "events": [{"type": "snapshot", "product_id": "BTC-USD", "updates": [
             {"side": "bid", "event_time": "1970-01-01T00:00:00Z", "price_level": "21921.73", "new_quantity": "0.06317902"},
             {"side": "offer", "event_time": "1970-01-01T00:00:00Z", "price_level": "21921.74", "new_quantity": "0.2"}]}]}
CB_HEARTBEAT = {"channel": "heartbeats", "client_id": "", "timestamp": "2023-06-23T20:31:26.122969572Z",
                "sequence_num": 3, "events": [{"current_time": "2023-06-23 20:31:56.121961769 +0000 UTC m=+91717.525857105",
                                               "heartbeat_counter": "3049"}]}


def _candles(seq: int, start: str, close: str) -> dict:
    return {"channel": "candles", "client_id": "", "timestamp": "2023-06-09T20:19:35.39625135Z",
            "sequence_num": seq, "events": [{"type": "update", "candles": [
                {"start": start, "high": "1870", "low": "1867.72", "open": "1867.72", "close": close,
                 "volume": "0.20269406", "product_id": "ETH-USD"}]}]}


def test_coinbase_channels() -> None:
    p = CoinbaseParser()
    (t,) = p.parse(json.dumps(CB_TRADES), 1)
    assert (t.instrument, t.price, t.size, t.side, t.trade_id) == ("ETH-USD", 1260.01, 0.3, BUY, "000000000")
    assert t.ts_event == rfc3339_ns("2019-08-14T20:42:27.265Z")
    (q,) = p.parse(json.dumps(CB_TICKER), 1)
    assert (q.bid, q.ask, q.bid_size, q.px_dp) == (21931.98, 21933.98, 8000.21, 2)
    (b,) = p.parse(json.dumps(CB_L2), 1)
    assert b.snapshot and b.bids == [(21921.73, 0.06317902)] and b.asks == [(21921.74, 0.2)]
    assert p.parse(json.dumps(CB_HEARTBEAT), 1) == []
    assert p.parse(json.dumps(_candles(4, "1688998200", "1867.72")), 1) == []
    assert p.parse(json.dumps(_candles(5, "1688998200", "1868.00")), 1) == []  # same candle, filling
    (bar,) = p.parse(json.dumps(_candles(6, "1688998500", "1869")), 1)
    assert bar.ts_open == 1688998200 * 10**9 and bar.close == 1868.0 and bar.interval_ns == 300 * 10**9
    assert p.stats.errors == 0 and p.stats.gaps == 0
    p.parse(json.dumps({**CB_HEARTBEAT, "sequence_num": 9}), 1)
    assert p.stats.gaps == 1


def test_coinbase_errors() -> None:
    p = CoinbaseParser()
    assert p.parse('{"type":"error","message":"failure to subscribe"}', 1) == []
    assert p.stats.errors == 1
    with pytest.raises(AuthError, match="authentication"):
        p.parse('{"type":"error","message":"authentication failure"}', 1)


# --- Kraken v2 (messages from the channel docs) ---

def test_kraken_channels() -> None:
    p = KrakenParser()
    trade = {"channel": "trade", "type": "update", "data": [
        {"symbol": "MATIC/USD", "side": "sell", "price": 0.5117, "qty": 40.0, "ord_type": "market",
         "trade_id": 4665906, "timestamp": "2023-09-25T07:49:37.708706Z"}]}
    (t,) = p.parse(json.dumps(trade), 1)
    assert (t.price, t.size, t.side, t.px_dp, t.trade_id) == (0.5117, 40.0, SELL, 4, 4665906)
    ticker = {"channel": "ticker", "type": "snapshot", "data": [
        {"symbol": "ALGO/USD", "bid": 0.10025, "bid_qty": 740.0, "ask": 0.10036, "ask_qty": 1361.44813783,
         "last": 0.10035, "volume": 997038.98383185, "vwap": 0.10148, "low": 0.09979, "high": 0.10285,
         "change": -0.00017, "change_pct": -0.17}]}
    (q,) = p.parse(json.dumps(ticker), 11)
    assert (q.bid, q.ask, q.px_dp, q.ts_event) == (0.10025, 0.10036, 5, 11)
    ohlc = {"channel": "ohlc", "type": "update", "timestamp": "2023-10-04T16:26:30.524394914Z", "data": [
        {"symbol": "MATIC/USD", "open": 0.5624, "high": 0.5628, "low": 0.5622, "close": 0.5627, "trades": 12,
         "volume": 30927.68066226, "vwap": 0.5626, "interval_begin": "2023-10-04T16:25:00.000000000Z",
         "interval": 5, "timestamp": "2023-10-04T16:30:00.000000Z"}]}
    assert p.parse(json.dumps(ohlc), 1) == []
    ohlc["data"][0]["interval_begin"] = "2023-10-04T16:30:00.000000000Z"
    (bar,) = p.parse(json.dumps(ohlc), 1)
    assert bar.trades == 12 and bar.vwap == 0.5626 and bar.interval_ns == 300 * 10**9
    assert p.parse('{"channel":"heartbeat"}', 1) == []
    ack = {"method": "subscribe", "result": {"channel": "ticker", "snapshot": True, "symbol": "ALGO/USD"},
           "success": True, "time_in": "2023-09-25T09:04:31.742599Z", "time_out": "2023-09-25T09:04:31.742648Z"}
    assert p.parse(json.dumps(ack), 1) == []
    assert p.stats.errors == 0
    trade["data"][0]["trade_id"] = 4665910
    p.parse(json.dumps(trade), 2)
    assert p.stats.gaps == 1
    p.parse('{"method":"subscribe","success":false,"error":"Currency pair not supported"}', 1)
    assert p.stats.errors == 1 and "not supported" in p.stats.error_samples[0]


# --- Alpaca v2 (messages from the real-time docs) ---

def test_alpaca_flow_and_batches() -> None:
    p = AlpacaParser()
    assert p.parse('[{"T":"success","msg":"connected"}]', 1) == [] and p.connected
    assert p.parse('[{"T":"success","msg":"authenticated"}]', 1) == [] and p.authenticated
    p.parse('[{"T":"subscription","trades":["AAPL"],"quotes":["AMD","CLDR"],"bars":["*"]}]', 1)
    assert p.subscription["quotes"] == ["AMD", "CLDR"]
    batch = [
        {"T": "t", "i": 96921, "S": "AAPL", "x": "D", "p": 126.55, "s": 1, "t": "2021-02-22T15:51:44.208Z",
         "c": ["@", "I"], "z": "C"},
        {"T": "q", "S": "AMD", "bx": "U", "bp": 87.66, "bs": 1, "ax": "Q", "ap": 87.68, "as": 4,
         "t": "2021-02-22T15:51:45.335689322Z", "c": ["R"], "z": "C"},
        {"T": "b", "S": "SPY", "o": 388.985, "h": 389.13, "l": 388.975, "c": 389.12, "v": 49378,
         "t": "2021-02-22T19:15:00Z", "n": 461, "vw": 389.062639},
        {"T": "q", "S": "AMD"},  # broken item inside a batch: counted, the rest survive
    ]
    t, q, b = p.parse(json.dumps(batch), 1)
    assert isinstance(t, Trade) and t.price == 126.55 and t.ts_event == rfc3339_ns("2021-02-22T15:51:44.208Z")
    assert isinstance(q, Quote) and (q.bid, q.ask, q.ts_event % 10**9) == (87.66, 87.68, 335689322)
    assert isinstance(b, Bar) and b.px_dp == 3 and b.trades == 461 and b.ts_event - b.ts_open == 60 * 10**9
    assert p.stats.errors == 1
    with pytest.raises(AuthError, match="402"):
        p.parse('[{"T":"error","code":402,"msg":"auth failed"}]', 1)
    p.parse('[{"T":"error","code":405,"msg":"symbol limit exceeded"}]', 1)
    assert p.stats.errors == 2


def test_parquet_round_trip(tmp_path: Path) -> None:
    p = BinanceParser()
    q = p.parse('{"u":1,"s":"BTCUSDT","b":"61837.63000000","B":"3.78826000","a":"61837.64000000","A":"1.5"}', 5)
    d = p.parse('{"e":"depthUpdate","E":1,"s":"BTCUSDT","U":2,"u":3,"b":[["1.5","2"]],"a":[]}', 6)
    for evs in (q, d):
        write_parquet(evs, tmp_path / "x.parquet")
        assert read_parquet(tmp_path / "x.parquet", type(evs[0])) == evs


def test_the_newer_parsers_name_the_older_formats_and_the_venue_that_reads_them() -> None:
    cb = CoinbaseParser()
    match = {"type": "match", "trade_id": 10, "sequence": 50, "maker_order_id": "a", "taker_order_id": "b",
             "time": "2014-11-07T08:19:27.028459Z", "product_id": "BTC-USD", "size": "5.23512", "price": "400.23",
             "side": "sell"}
    assert cb.parse(json.dumps(match), 1) == []
    assert cb.stats.error_kinds == {"unsupported_format": 1}
    assert "Coinbase Exchange (ws-feed" in cb.stats.error_samples[0] and "'coinbase-exchange'" in \
        cb.stats.error_samples[0]
    kr = KrakenParser()
    assert kr.parse('[0,[["5541.20000","0.15850568","1534614057.321597","s","l",""]],"trade","XBT/USD"]', 1) == []
    assert kr.parse('{"event":"heartbeat"}', 1) == []
    assert kr.stats.error_kinds == {"unsupported_format": 2}
    assert "Kraken websocket v1" in kr.stats.error_samples[0] and "'kraken-v1'" in kr.stats.error_samples[0]
