"""Kraken Futures v1: a real capture checked against the venue's own ticker and book, the
documented messages, and the live adapter against a local server speaking its protocol."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import serve

from feeds.adapters import FeedAdapter
from feeds.capture import CaptureSource, detect_venue, sniff_venue
from feeds.events import BUY, SELL, BookDelta, Mark, Quote, Trade
from feeds.kraken_futures import KrakenFuturesParser
from feeds.wire import VenueError
from tests.books import Book, apply

CAPTURE = Path(__file__).parent / "data" / "cryptofeed" / "KRAKEN_FUTURES.ws.1.0.gz"
MS = 1_000_000


def test_a_real_capture_agrees_with_the_venues_own_ticker_and_book() -> None:
    """Every ticker_lite's bid and ask equal the top of the book rebuilt from our deltas, and every
    trade's side is the side of the book it took: a buy prints at the best ask."""
    assert detect_venue(CAPTURE) == "kraken-futures"
    src = CaptureSource(CAPTURE, venue="auto")
    books: dict[str, Book] = {}
    quotes = trades = 0
    for ev in src:
        if type(ev) is BookDelta:
            apply(books, ev)
        elif type(ev) is Quote:
            bids, asks = books[ev.instrument]
            assert (ev.bid, ev.ask) == (max(bids), min(asks)), ev
            assert math.isnan(ev.bid_size)  # ticker_lite sends no sizes
            quotes += 1
        elif type(ev) is Trade:
            bids, asks = books[ev.instrument]
            assert ev.price == (min(asks) if ev.side == BUY else max(bids)), ev
            trades += 1
    stats = src.parser.stats
    assert stats.errors == 0 and stats.gaps == 0, (stats.error_samples, stats.gap_samples)
    assert (quotes, trades, len(books)) == (60, 2, 7)
    assert stats.control == 38  # info, 30 subscribed, 7 trade snapshots (history before the connection)


def _trade(seq: int, side: str = "buy", kind: str = "fill", price: float = 32172.5) -> dict[str, Any]:
    return {"feed": "trade", "product_id": "PI_XBTUSD", "uid": f"u{seq}", "side": side, "type": kind, "seq": seq,
            "time": 1626994887000 + seq, "qty": 300.0, "price": price}


def test_kraken_futures_messages_as_the_docs_write_them() -> None:
    p = KrakenFuturesParser()
    read = lambda m: p.parse(json.dumps(m), 7)  # noqa: E731
    assert read({"event": "info", "version": 1}) == []
    assert read({"feed": "heartbeat", "time": 1626994887000}) == []
    t = read(_trade(10, "sell"))
    assert t == [Trade("kraken-futures", "PI_XBTUSD", 1626994887010 * MS, 7, 32172.5, 300.0, SELL, "u10", 1, 0)]
    assert read(_trade(11, kind="block")) == [] and p.stats.skipped == {"block trade": 1}  # negotiated off the book: not a print
    assert read(_trade(12, kind="liquidation"))[0].trade_id == "u12"
    assert read(_trade(15)) and p.stats.gaps == 1 and p.stats.gap_samples == ["PI_XBTUSD@trade: expected 13, got 15"]
    q, m = read({"feed": "ticker", "product_id": "PI_XBTUSD", "time": 1626994887500, "bid": 32170.5, "ask": 32172.0,
                 "bid_size": 1200.0, "ask_size": 30.0, "markPrice": 32171.12, "index": 32165.4,
                 "funding_rate": 1.2e-9, "next_funding_rate_time": 1626998400000})
    assert q == Quote("kraken-futures", "PI_XBTUSD", 1626994887500 * MS, 7, 32170.5, 1200.0, 32172.0, 30.0, 1, 0)
    assert type(m) is Mark and (m.mark, m.index, m.funding_rate, m.next_funding_ns) == (
        32171.12, 32165.4, 1.2e-9, 1626998400000 * MS)
    snap = read({"feed": "book_snapshot", "product_id": "PI_XBTUSD", "timestamp": 1, "seq": 100, "tickSize": None,
                 "bids": [{"price": 32170.5, "qty": 1200.0}], "asks": [{"price": 32172.0, "qty": 30.0}]})[0]
    assert snap.snapshot and snap.bids == [(32170.5, 1200.0)] and snap.last_seq == 100
    up = read({"feed": "book", "product_id": "PI_XBTUSD", "side": "sell", "seq": 101, "price": 32172.0, "qty": 0.0,
               "timestamp": 2})[0]
    assert (up.bids, up.asks, up.snapshot) == ([], [(32172.0, 0.0)], False)
    read({"feed": "book", "product_id": "PI_XBTUSD", "side": "buy", "seq": 103, "price": 1.0, "qty": 1.0, "timestamp": 3})
    assert p.stats.gaps == 2 and p.stats.gap_keys["PI_XBTUSD@book"] == 1
    assert p.stats.errors == 0
    read({"feed": "book", "product_id": "PI_XBTUSD", "side": "buy", "seq": 104, "price": -1.0, "qty": 1.0,
          "timestamp": 4})
    read({"feed": "trades_v2", "product_id": "PI_XBTUSD"})
    assert p.stats.error_kinds == {"bad_price": 1, "ValueError": 1}, p.stats.error_samples


def test_a_trade_snapshot_is_history_on_connect_and_the_missed_trades_on_a_reconnect() -> None:
    p = KrakenFuturesParser()
    snapshot = lambda seqs: json.dumps({"feed": "trade_snapshot", "product_id": "PI_XBTUSD",  # noqa: E731
                                        "trades": [_trade(s) for s in seqs]})
    assert p.parse(snapshot([9, 8, 7]), 1) == []  # before the connection: not the live stream
    assert [t.trade_id for t in p.parse(json.dumps(_trade(10)), 2)] == ["u10"]
    got = p.parse(snapshot([13, 12, 11, 10, 9]), 3)  # reconnected after 10: 11-13 were missed
    assert [t.trade_id for t in got] == ["u11", "u12", "u13"] and p.stats.gaps == 0
    assert p.parse(json.dumps(_trade(13)), 4) == []  # resent: already read


@pytest.mark.parametrize("event", ["error", "alert"])
def test_a_refused_request_ends_the_session(event: str) -> None:
    with pytest.raises(VenueError, match="Invalid product id"):
        KrakenFuturesParser()._read(json.dumps({"event": event, "message": "Invalid product id"}), 0)


def test_kraken_v1_and_futures_are_told_apart() -> None:
    assert sniff_venue(b'{"event":"info","version":1}') == "kraken-futures"
    assert sniff_venue(b'{"feed":"book","product_id":"PI_ETHUSD","side":"sell","seq":1}') == "kraken-futures"
    assert sniff_venue(b'{"connectionID":1,"event":"systemStatus","status":"online","version":"1.7.3"}') == "kraken-v1"


def test_the_kraken_futures_adapter_subscribes_and_streams() -> None:
    seen: list[dict[str, Any]] = []

    async def venue(ws: Any) -> None:
        await ws.send('{"event":"info","version":1}')
        for _ in range(3):
            seen.append(json.loads(await ws.recv()))
        await ws.send('{"event":"subscribed","feed":"trade","product_ids":["PI_XBTUSD"]}')
        await ws.send(json.dumps({"feed": "trade_snapshot", "product_id": "PI_XBTUSD", "trades": [_trade(9)]}))
        await ws.send(json.dumps(_trade(10, "sell")))
        await ws.close()

    async def run() -> tuple[list[Any], FeedAdapter]:
        async with serve(venue, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            adapter = FeedAdapter("kraken-futures", ["PI_XBTUSD"], url=f"ws://127.0.0.1:{port}", max_reconnects=0)
            return [ev async for ev in adapter.events()], adapter

    events, adapter = asyncio.run(asyncio.wait_for(run(), 20))
    assert seen == [{"event": "subscribe", "feed": "trade", "product_ids": ["PI_XBTUSD"]},
                    {"event": "subscribe", "feed": "ticker", "product_ids": ["PI_XBTUSD"]},
                    {"event": "subscribe", "feed": "heartbeat"}]
    assert [(e.trade_id, e.side) for e in events] == [("u10", SELL)]
    assert Counter(type(e).__name__ for e in events) == {"Trade": 1}
    assert adapter.parser.stats.control == 3 and adapter.parser.stats.errors == 0


def test_a_config_session_on_kraken_futures_subscribes_its_product() -> None:
    from streamllm.config import parse_config
    from streamllm.feeding.wiring import group_feeds, parse_feed_override

    config = parse_config({"sessions": [{"name": "xbt", "instrument": "PI_XBTUSD", "feed": "kraken-futures"},
                                        {"name": "eth", "instrument": "PF_ETHUSD",
                                         "feed": "kraken-futures:wss://demo-futures.kraken.com/ws/v1"}]})
    assert [(s.feed.kind, s.feed.symbols, s.feed.url) for s in config.sessions] == [
        ("kraken-futures", ("PI_XBTUSD",), ""),
        ("kraken-futures", ("PF_ETHUSD",), "wss://demo-futures.kraken.com/ws/v1")]
    assert len(group_feeds(config, None)) == 2  # two endpoints: two connections
    assert parse_feed_override("kraken-futures").kind == "kraken-futures"


def test_the_capture_replayed_through_the_adapter_is_read_alike() -> None:
    """The real capture served on loopback (feeds/server.py, sent after the client's first message) and read
    by the live adapter gives the events reading the file gives, but for their receive times."""
    import dataclasses

    from feeds.server import ReplayServer

    def key(ev: Any) -> Any:  # receive times (and ticker_lite's times, which are receive times) differ
        return dataclasses.replace(ev, ts_recv=0, ts_event=0 if type(ev) is Quote else ev.ts_event)

    expected = [key(ev) for ev in CaptureSource(CAPTURE, venue="auto")]

    async def run() -> list[Any]:
        async with ReplayServer([CAPTURE], venue="kraken-futures") as server:
            adapter = FeedAdapter("kraken-futures", ["PI_XBTUSD"], url=server.url, max_reconnects=0)
            return [key(ev) async for ev in adapter.events()]

    assert asyncio.run(asyncio.wait_for(run(), 30)) == expected
