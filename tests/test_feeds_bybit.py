"""Bybit v5 public streams: the documented messages, a capture sniffed as Bybit, and the live
adapter against a local server that speaks Bybit's protocol (topics ten a request, op ping)."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import serve

from feeds.adapters import FeedAdapter
from feeds.bybit import BybitParser, kline_ns, subscribe_messages
from feeds.events import BUY, SELL, Bar, BookDelta, Liquidation, Mark, Quote, Trade
from feeds.sources import open_source
from tests.books import Book, apply

S = 1_000_000_000
TRADE = {"topic": "publicTrade.BTCUSDT", "type": "snapshot", "ts": 1672304486868, "data": [
    {"T": 1672304486865, "s": "BTCUSDT", "S": "Buy", "v": "0.001", "p": "16578.50", "L": "PlusTick",
     "i": "20f43950-d8dd-5b31-9112-a178eb6023af", "BT": False}]}


def _book(kind: str, u: int, bids: list[list[str]], asks: list[list[str]]) -> str:
    return json.dumps({"topic": "orderbook.50.BTCUSDT", "type": kind, "ts": 1672304484978, "cts": 1672304484961,
                       "data": {"s": "BTCUSDT", "b": bids, "a": asks, "u": u, "seq": 7961638724}})


def test_bybit_trades_books_and_klines_as_the_docs_write_them() -> None:
    p = BybitParser()
    (t,) = p.parse(json.dumps(TRADE), 1)
    assert isinstance(t, Trade) and (t.side, t.price, t.size, t.ts_event, t.px_dp) == (
        BUY, 16578.5, 0.001, 1_672_304_486_865_000_000, 1)
    assert t.trade_id == "20f43950-d8dd-5b31-9112-a178eb6023af"
    (s,) = p.parse(_book("snapshot", 18521288, [["16493.50", "0.006"]], [["16611.00", "0.029"]]), 2)
    (d,) = p.parse(_book("delta", 18521289, [["16493.50", "0"]], []), 3)
    assert s.snapshot and not d.snapshot and d.bids == [(16493.5, 0.0)] and s.ts_event == 1_672_304_484_961_000_000
    p.parse(_book("delta", 18521295, [], [["16611.00", "0.03"]]), 4)  # five updates were lost
    assert p.stats.gaps == 1 and "BTCUSDT@orderbook.50" in p.stats.gap_samples[0]
    p.parse(_book("snapshot", 1, [["16000", "1"]], [["16001", "1"]]), 5)  # Bybit restarted: u starts over
    p.parse(_book("delta", 2, [], []), 6)
    assert p.stats.gaps == 1
    kline = lambda confirm, close: json.dumps({"topic": "kline.5.BTCUSDT", "type": "snapshot", "ts": 1672324988882,  # noqa: E731
                                               "data": [{"start": 1672324800000, "end": 1672325099999, "interval": "5",
                                                         "open": "16649.5", "close": close, "high": "16677",
                                                         "low": "16608", "volume": "2.081", "turnover": "34666.4005",
                                                         "confirm": confirm, "timestamp": 1672324988882}]})
    assert p.parse(kline(False, "16670"), 7) == []
    (bar,) = p.parse(kline(True, "16677"), 8)
    assert isinstance(bar, Bar) and (bar.close, bar.ts_open, bar.interval_ns, bar.trades) == (
        16677.0, 1_672_324_800_000_000_000, 300 * 10**9, -1)
    assert kline_ns("D") == 86400 * 10**9 and kline_ns("240") == 4 * 3600 * 10**9
    (liq,) = p.parse('{"topic":"allLiquidation.ROSEUSDT","type":"snapshot","ts":1739502303204,"data":[{"T":1739502302929,'
                     '"s":"ROSEUSDT","S":"Sell","v":"20000","p":"0.04499"}]}', 9)
    assert isinstance(liq, Liquidation) and liq.side == BUY  # a short was liquidated: closed by a buy
    for control in ('{"success":true,"ret_msg":"","conn_id":"c","req_id":"","op":"subscribe"}',
                    '{"success":true,"ret_msg":"pong","conn_id":"c","req_id":"","op":"ping"}',
                    '{"req_id":"","op":"pong","args":["1672916271846"],"conn_id":"c"}'):
        assert p.parse(control, 10) == []
    assert p.stats.control == 3 and p.stats.errors == 0


def test_bybit_ticker_deltas_carry_only_what_changed() -> None:
    p = BybitParser()
    snap = {"topic": "tickers.BTCUSDT", "type": "snapshot", "cs": 1, "ts": 1673272861686, "data": {
        "symbol": "BTCUSDT", "tickDirection": "PlusTick", "lastPrice": "17216.00", "markPrice": "17217.33",
        "indexPrice": "17227.36", "fundingRate": "-0.000212", "nextFundingTime": "1673280000000",
        "bid1Price": "17215.50", "bid1Size": "84.489", "ask1Price": "17216.00", "ask1Size": "83.020"}}
    q, m = p.parse(json.dumps(snap), 1)
    assert isinstance(q, Quote) and (q.bid, q.bid_size, q.ask, q.ask_size) == (17215.5, 84.489, 17216.0, 83.02)
    assert isinstance(m, Mark) and (m.mark, m.index, m.funding_rate, m.next_funding_ns) == (
        17217.33, 17227.36, -0.000212, 1_673_280_000_000_000_000)
    (q2,) = p.parse(json.dumps({**snap, "type": "delta", "data": {"symbol": "BTCUSDT", "bid1Size": "80.1"}}), 2)
    assert (q2.bid, q2.bid_size, q2.ask) == (17215.5, 80.1, 17216.0)  # the rest kept from before
    (m2,) = p.parse(json.dumps({**snap, "type": "delta", "data": {"symbol": "BTCUSDT", "markPrice": "17218.00"}}), 3)
    assert isinstance(m2, Mark) and m2.mark == 17218.0 and m2.index == 17227.36
    assert p.parse(json.dumps({**snap, "type": "delta", "data": {"symbol": "BTCUSDT", "volume24h": "1"}}), 4) == []
    spot = {"topic": "tickers.ETHUSDT", "type": "snapshot", "ts": 1, "data": {"symbol": "ETHUSDT", "lastPrice": "1"}}
    assert p.parse(json.dumps(spot), 5) == [] and p.stats.control == 2  # spot tickers: no bid/ask to quote
    # Bad input: named, counted, the stream goes on.
    assert p.parse(json.dumps({**snap, "data": {"symbol": "XRPUSDT"}, "type": "delta"}), 6) == []
    assert p.parse('{"success":false,"ret_msg":"error:handler not found","conn_id":"c","op":"subscribe"}', 7) == []
    assert p.parse(json.dumps({**TRADE, "data": [{**TRADE["data"][0], "S": "None"}]}), 8) == []
    assert p.parse('{"topic":"kline.M.BTCUSDT","type":"snapshot","ts":1,"data":[{"interval":"M","confirm":true,'
                   '"start":1,"open":"1","high":"1","low":"1","close":"1","volume":"1"}]}', 9) == []
    old = '{"topic":"insurance.BTC","data":[{"currency":"BTC","timestamp":"2020-01-13T00:00:00Z","wallet_balance":1}]}'
    assert p.parse(old, 10) == [] and "pre-v5 topic insurance.BTC is not read" in p.stats.error_samples[-1]
    assert p.stats.error_kinds == {"ValueError": 3, "VenueError": 1, "unsupported_format": 1}
    assert "before its snapshot" in p.stats.error_samples[0] and "handler not found" in p.stats.error_samples[1]
    assert math.isnan(BybitParser().parse(json.dumps({**snap, "data": {**snap["data"], "indexPrice": ""}}), 1)[1].index)


def test_klines_before_v5_are_bars_once_confirmed() -> None:
    """klineV2 (inverse contracts, `realtime`: numbers) and candle (USDT, `realtime_public`: volume
    as a string), as Bybit's old docs and cryptofeed show them: start and end in seconds."""
    p = BybitParser()
    inverse = {"topic": "klineV2.1.BTCUSD", "data": [{"start": 1683309060, "end": 1683309120, "open": 29529,
               "close": 29541, "high": 29541, "low": 29528.5, "volume": 184045, "turnover": 6.2314151,
               "confirm": False, "cross_seq": 21539090874, "timestamp": 1683309102077887}],
               "timestamp_e6": 1683309102077887}
    assert p.parse(json.dumps(inverse), 1) == []  # the candle so far: not a bar yet
    (bar,) = p.parse(json.dumps({**inverse, "data": [{**inverse["data"][0], "confirm": True}]}), 2)
    assert (bar.instrument, bar.ts_open, bar.interval_ns, bar.ts_event) == (
        "BTCUSD", 1683309060 * S, 60 * S, 1683309120 * S)
    assert (bar.open, bar.high, bar.low, bar.close, bar.volume, bar.trades, bar.px_dp) == (
        29529, 29541, 29528.5, 29541, 184045, -1, 1)
    usdt = {"topic": "candle.5.BTCUSDT", "data": [{"start": 1667461800, "end": 1667462100, "period": "5",
            "open": 20282, "close": 20280.5, "high": 20282.5, "low": 20280, "volume": "20.753",
            "turnover": "420912.939", "confirm": True, "cross_seq": 19909786084, "timestamp": 1667461837466318}],
            "timestamp_e6": 1667461837466318}
    (bar,) = p.parse(json.dumps(usdt), 3)
    assert (bar.instrument, bar.interval_ns, bar.volume, bar.sz_dp) == ("BTCUSDT", 300 * S, 20.753, 3)
    # Bad input: named, counted, the stream goes on.
    assert p.parse(json.dumps({**usdt, "data": [{**usdt["data"][0], "end": 1667461800}]}), 4) == []
    assert p.parse(json.dumps({**usdt, "data": [{**usdt["data"][0], "low": 20290}]}), 5) == []
    assert "make no interval" in p.stats.error_samples[0] and "bad_bar" in p.stats.error_samples[1]


def test_a_bybit_capture_is_sniffed(tmp_path: Path) -> None:
    path = tmp_path / "bybit_BTCUSDT.gz"
    path.write_bytes(gzip.compress(b'5 {"success":true,"ret_msg":"","conn_id":"c","req_id":"","op":"subscribe"}\n'
                                   b'6 ' + json.dumps(TRADE).encode() + b"\n"))
    src = open_source(path)
    assert src.venue == "bybit" and [type(e) for e in src] == [Trade] and src.stats.control == 1
    old = tmp_path / "bybit_2021.gz"  # the realtime_public API of 2021, as cryptofeed recorded it
    old.write_bytes(gzip.compress(b'1 {"success":true,"ret_msg":"","conn_id":"38cf0ac3","request":{"op":"subscribe",'
                                  b'"args":["trade.BCHUSDT"]}}\n'))
    assert open_source(old).venue == "bybit"


@pytest.mark.parametrize("name, products", [("BYBIT.ws.26.0.gz", {"BTCUSD", "EOSUSD"}),
                                            ("BYBIT.ws.25.0.gz", {"BCHUSDT", "XTZUSDT"})])
def test_a_real_capture_before_v5_trades_on_the_side_of_the_book_it_says(name: str, products: set[str]) -> None:
    """cryptofeed's 2021 captures of the inverse (`realtime`) and USDT (`realtime_public`) endpoints: in the
    venue's time order, a taker buy prints at or above the best ask of the book our deltas rebuild, a taker
    sell at or below the best bid (a few inside the spread: the book is sent in 100 ms batches)."""
    src = open_source(Path(__file__).parent / "data" / "cryptofeed" / name)
    events = sorted(src, key=lambda e: (e.ts_event, type(e) is Trade))
    assert src.venue == "bybit" and src.stats.errors == 0, src.stats.error_samples
    books: dict[str, Book] = {}
    agree = against = trades = 0
    for ev in events:
        if type(ev) is BookDelta:
            bids, asks = apply(books, ev)
            assert not bids or not asks or max(bids) < min(asks), ev  # never a crossed book
        elif type(ev) is Trade:
            trades += 1
            bids, asks = books.get(ev.instrument, ({}, {}))
            if bids and asks:
                agree += ev.price >= min(asks) if ev.side == BUY else ev.price <= max(bids)
                against += ev.price <= max(bids) if ev.side == BUY else ev.price >= min(asks)
    assert set(books) == products and against == 0
    assert agree >= 0.9 * trades and trades > 40


def test_an_old_book_delete_finds_its_price_by_id() -> None:
    p = BybitParser()
    snap = {"topic": "orderBookL2_25.BTCUSD", "type": "snapshot", "cross_seq": 5, "timestamp_e6": 1618677786558146,
            "data": [{"price": "60604.00", "symbol": "BTCUSD", "id": 606040000, "side": "Buy", "size": 7},
                     {"price": "60604.50", "symbol": "BTCUSD", "id": 606045000, "side": "Sell", "size": 3}]}
    (s,) = p.parse(json.dumps(snap), 1)
    assert s.snapshot and (s.bids, s.asks, s.ts_event, s.last_seq) == ([(60604.0, 7.0)], [(60604.5, 3.0)],
                                                                        1618677786558146000, 5)
    delta = {"topic": "orderBookL2_25.BTCUSD", "type": "delta", "cross_seq": 6, "timestamp_e6": 1618677786600000,
             "data": {"delete": [{"symbol": "BTCUSD", "id": 606040000, "side": "Buy"}], "update": [],
                      "insert": [{"price": "60605.00", "symbol": "BTCUSD", "id": 606050000, "side": "Sell", "size": 2}]}}
    (d,) = p.parse(json.dumps(delta), 2)
    assert (d.bids, d.asks, d.snapshot) == ([(60604.0, 0.0)], [(60605.0, 2.0)], False)
    assert p.parse(json.dumps(delta), 3) == [] and "never inserted" in p.stats.error_samples[-1]


def test_the_bybit_adapter_subscribes_in_tens_and_pings() -> None:
    symbols = [f"S{i}USDT" for i in range(6)]
    seen: list[Any] = []

    async def venue(ws: Any) -> None:
        for _ in range(2):  # 12 topics: two requests
            req = json.loads(await ws.recv())
            seen.append(req)
            await ws.send(json.dumps({"success": True, "ret_msg": "", "conn_id": "c", "op": "subscribe"}))
        seen.append(json.loads(await ws.recv()))
        await ws.send('{"success":true,"ret_msg":"pong","conn_id":"c","op":"ping"}')
        await ws.send(json.dumps({**TRADE, "data": [{**TRADE["data"][0], "S": "Sell", "s": "S1USDT"}]}))
        await ws.close()

    async def run() -> list[Any]:
        async with serve(venue, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            adapter = FeedAdapter("bybit", symbols, url=f"ws://127.0.0.1:{port}", ping_s=0.2, max_reconnects=0)
            return [ev async for ev in adapter.events()]

    events = asyncio.run(asyncio.wait_for(run(), 20))
    assert [len(r["args"]) for r in seen[:2]] == [10, 2] and seen[:2] == subscribe_messages(symbols, ["publicTrade",
                                                                                                      "orderbook.1"])
    assert seen[2] == {"op": "ping"}
    assert [(e.instrument, e.side) for e in events] == [("S1USDT", SELL)] and isinstance(events[0], Trade)
    assert all(isinstance(e, Trade | BookDelta) for e in events)
