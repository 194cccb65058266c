"""Coinbase Exchange ws-feed and Kraken websocket v1: the formats most recorded crypto data is in.

The real captures are cryptofeed's sample data (tests/data/cryptofeed/README.md: recorded
2021-04-17 by its raw-data logger, read here in that logger's own line format). They are
checked against what the venues themselves say in them: every Coinbase trade's aggressor
against the taker side the ticker reports for the same trade id, and every Kraken book
checksum against the book our deltas rebuild.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections import Counter
from pathlib import Path

import pytest

from feeds.capture import CaptureSource, read_capture
from feeds.coinbase_exchange import CoinbaseExchangeParser
from feeds.events import BUY, SELL, Bar, BookDelta, Quote, Trade
from feeds.kraken_v1 import KrakenV1Parser
from feeds.sources import file_format, open_source
from feeds.wire import AuthError, epoch_ns
from tests.books import Book, apply

CRYPTOFEED = Path(__file__).parent / "data" / "cryptofeed"


def _messages(path: Path) -> list[dict | list]:
    """The raw JSON messages of a cryptofeed log, to check our events against."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return [json.loads(line.split(": ", 1)[1]) for line in fh if line[:1].isdigit()]


def test_a_coinbase_ws_feed_log_reads_whole_with_the_aggressor_the_ticker_reports() -> None:
    path = CRYPTOFEED / "COINBASE.ws.28.0.gz"
    src = open_source(path)
    assert src.venue == "coinbase-exchange"
    events = list(src)
    raw = _messages(path)
    kinds = Counter(m["type"] for m in raw)
    got = Counter(type(e) for e in events)
    assert got == {Trade: kinds["match"] + kinds["last_match"], Quote: kinds["ticker"],
                   BookDelta: kinds["snapshot"] + kinds["l2update"]}
    assert src.stats.errors == 0 and src.stats.gaps == 0, src.stats.as_dict()
    assert src.stats.control == kinds["subscriptions"]
    assert {e.venue for e in events} == {"coinbase"}
    # A match's side is the maker's; the ticker names the taker. They must agree on every trade.
    trades = {e.trade_id: e for e in events if isinstance(e, Trade)}
    tickers = [m for m in raw if m["type"] == "ticker" and m.get("trade_id") in trades]
    assert len(tickers) >= 50
    for m in tickers:
        t = trades[m["trade_id"]]
        assert t.side == (BUY if m["side"] == "buy" else SELL), m
        assert t.price == float(m["price"]) and t.size == float(m["last_size"])
    # Trade ids run without holes per product, and times keep all their digits.
    first = next(m for m in raw if m["type"] == "match")
    t = trades[first["trade_id"]]
    assert t.ts_event % 1_000_000 == int(first["time"][20:26]) % 1000 * 1000 and t.instrument == first["product_id"]
    snap = next(e for e in events if isinstance(e, BookDelta))
    assert snap.snapshot and len(snap.bids) > 10 and snap.bids[0][0] > snap.asks[0][0] * 0.5


def test_coinbase_ws_feed_messages_as_the_docs_write_them() -> None:
    p = CoinbaseExchangeParser()
    match = {"type": "match", "trade_id": 10, "sequence": 50, "maker_order_id": "a", "taker_order_id": "b",
             "time": "2014-11-07T08:19:27.028459Z", "product_id": "BTC-USD", "size": "5.23512", "price": "400.23",
             "side": "sell"}
    (t,) = p.parse(json.dumps(match), 1)
    assert (t.side, t.trade_id, t.px_dp, t.sz_dp) == (BUY, 10, 2, 5)  # a resting sell was lifted
    assert p.parse(json.dumps({**match, "type": "last_match"}), 2) == []  # resent on reconnect: dropped
    (t2,) = p.parse(json.dumps({**match, "trade_id": 13, "side": "buy"}), 3)
    assert t2.side == SELL and p.stats.gaps == 1 and "BTC-USD@trades" in p.stats.gap_samples[0]
    # A ticker from before 2022 has no sizes, and the first after subscribing has no time.
    (q,) = p.parse('{"type":"ticker","sequence":1,"product_id":"BTC-USD","price":"8500","best_bid":"8500",'
                   '"best_ask":"8500.01"}', 7)
    assert (q.bid, q.ask, q.ts_event, q.px_dp) == (8500.0, 8500.01, 7, 2) and math.isnan(q.bid_size)
    (q2,) = p.parse('{"type":"ticker","product_id":"ETH-USD","best_bid":"1","best_bid_size":"2.5","best_ask":"1.1",'
                    '"best_ask_size":"3","time":"2022-01-01T00:00:00.5Z"}', 8)
    assert (q2.bid_size, q2.ask_size, q2.ts_event) == (2.5, 3.0, 1_640_995_200_500_000_000)
    (d,) = p.parse('{"type":"l2update","product_id":"BTC-USD","time":"2019-08-14T20:42:27.265Z",'
                   '"changes":[["buy","10101.80000000","0.162567"],["sell","10102.5","0"]]}', 9)
    assert d.bids == [(10101.8, 0.162567)] and d.asks == [(10102.5, 0.0)] and not d.snapshot
    for control in ('{"type":"heartbeat","sequence":90,"last_trade_id":20,"product_id":"BTC-USD",'
                    '"time":"2014-11-07T08:19:28.464459Z"}', '{"type":"received","order_id":"x"}',
                    '{"type":"auction","product_id":"BTC-USD"}'):
        assert p.parse(control, 10) == []
    assert p.stats.control == 4 and p.stats.errors == 0
    # Bad input is counted, named, and the stream goes on.
    assert p.parse('{"type":"l2update","product_id":"X","time":"2019-08-14T20:42:27Z","changes":[["bid","1","1"]]}',
                   11) == []
    assert p.parse(json.dumps({**match, "trade_id": 14, "price": "-1"}), 12) == []
    assert p.parse('{"type":"error","message":"Failed to subscribe","reason":"FOO-BAR is not a valid product"}',
                   13) == []
    assert p.stats.error_kinds == {"ValueError": 1, "bad_price": 1, "VenueError": 1}
    assert "FOO-BAR is not a valid product" in p.stats.error_samples[2]
    with pytest.raises(AuthError):
        p.parse('{"type":"error","message":"authentication failure"}', 14)


def _kraken_checksum(bids: dict[float, float], asks: dict[float, float], px_dp: int) -> int:
    """Kraken v1's book checksum: CRC32 over the top 10 asks (low to high) then bids (high to low),
    each level's price and volume with the point and leading zeros removed."""
    def part(price: float, size: float) -> str:
        return f"{price:.{px_dp}f}".replace(".", "").lstrip("0") + f"{size:.8f}".replace(".", "").lstrip("0")

    text = "".join(part(p, asks[p]) for p in sorted(asks)[:10]) + "".join(
        part(p, bids[p]) for p in sorted(bids, reverse=True)[:10])
    return zlib.crc32(text.encode())


def test_a_kraken_v1_book_log_rebuilds_to_every_checksum_kraken_sent() -> None:
    path = CRYPTOFEED / "KRAKEN.ws.50.0.gz"
    src = open_source(path)
    assert src.venue == "kraken-v1"
    raw = [m for m in _messages(path) if isinstance(m, list)]
    deltas = list(src)
    assert len(deltas) == len(raw) and src.stats.errors == 0
    books: dict[str, Book] = {}
    px_dp = {m[-1]: len(m[1]["as"][0][0].split(".")[1]) for m in raw if "as" in m[1]}
    checked = 0
    for d, m in zip(deltas, raw, strict=True):
        assert isinstance(d, BookDelta) and d.instrument == m[-1]
        bids, asks = apply(books, d)
        if d.snapshot:
            continue
        for side in (bids, asks):
            for extra in sorted(side, reverse=side is asks)[:-1000] if len(side) > 1000 else []:
                del side[extra]  # a depth-1000 book keeps its best 1000 levels
        sent = next((p["c"] for p in m[1:-2] if "c" in p), None)
        if sent is not None:
            assert _kraken_checksum(bids, asks, px_dp[d.instrument]) == int(sent), (checked, m)
            checked += 1
    assert checked >= 150


def test_kraken_v1_trade_and_ticker_logs_read_whole() -> None:
    trades = list(open_source(CRYPTOFEED / "KRAKEN.ws.48.0"))
    raw = [m for m in _messages(CRYPTOFEED / "KRAKEN.ws.48.0") if isinstance(m, list)]
    want = [(m[-1], row) for m in raw for row in m[1]]
    assert len(trades) == len(want) >= 8
    for t, (pair, row) in zip(trades, want, strict=True):
        assert (t.instrument, t.price, t.size, t.ts_event) == (pair, float(row[0]), float(row[1]), epoch_ns(row[2]))
        assert t.side == (BUY if row[3] == "b" else SELL) and t.trade_id == ""
    ticker = open_source(CRYPTOFEED / "KRAKEN.ws.49.0")
    quotes = list(ticker)
    assert quotes and all(isinstance(q, Quote) and q.bid < q.ask for q in quotes)
    assert ticker.stats.errors == 0 and ticker.stats.control > 10  # systemStatus, subscriptionStatus, heartbeats


def test_kraken_v1_spread_ohlc_and_errors_as_the_docs_write_them() -> None:
    p = KrakenV1Parser()
    (old,) = p.parse('[0,["5698.40000","5700.00000","1542057299.545897"],"spread","XBT/USD"]', 1)
    (new,) = p.parse('[0,["5698.40000","5700.00000","1542057299.545897","1.01234567","0.98765432"],"spread",'
                     '"XBT/USD"]', 2)
    assert math.isnan(old.bid_size) and (new.bid_size, new.ask_size, new.ts_event) == (
        1.01234567, 0.98765432, 1_542_057_299_545_897_000)
    candle = ["1542057314.748456", "1542057360.000000", "3586.70000", "3586.70000", "3586.60000", "3586.60000",
              "3586.68894", "0.03373000", 2]
    ohlc = lambda c: json.dumps([42, c, "ohlc-1", "XBT/USD"])  # noqa: E731
    assert p.parse(ohlc(candle), 3) == []
    filled = [*candle[:3], "3587.00000", candle[4], "3587.00000", *candle[6:8], 3]
    assert p.parse(ohlc(filled), 4) == []  # the same candle, resent as it fills
    (bar,) = p.parse(ohlc(["1542057361.0", "1542057420.000000", "3587.0", "3587.0", "3587.0", "3587.0", "3587.0",
                           "0.1", 1]), 5)
    assert isinstance(bar, Bar) and (bar.close, bar.trades, bar.interval_ns) == (3587.0, 3, 60 * 10**9)
    assert bar.ts_open == 1_542_057_300 * 10**9 and bar.ts_event == 1_542_057_360 * 10**9
    (both,) = p.parse('[1234,{"a":[["5541.30000","2.50700000","1534614248.456738"]]},{"b":[["5541.20000",'
                      '"1.52900000","1534614248.765567","r"]],"c":"974942666"},"book-10","XBT/USD"]', 6)
    assert both.asks == [(5541.3, 2.507)] and both.bids == [(5541.2, 1.529)] and not both.snapshot
    assert both.ts_event == 1_534_614_248_765_567_000
    assert p.parse('{"event":"subscriptionStatus","status":"error","errorMessage":"Currency pair not supported '
                   'XBT/ABC","pair":"XBT/ABC"}', 7) == []
    assert p.parse('[0,[["1","1","1534614057.3","x","l",""]],"trade","XBT/USD"]', 8) == []
    assert p.parse('[0,{},"openOrders","XBT/USD"]', 9) == []
    assert p.stats.error_kinds == {"VenueError": 1, "ValueError": 2}
    assert "Currency pair not supported" in p.stats.error_samples[0]


def test_cryptofeed_logs_are_captures_with_their_own_lines(tmp_path: Path) -> None:
    assert file_format(Path("KRAKEN.ws.48.0")) == "capture" and file_format(Path("x.ws.1.0.gz")) == "capture"
    log = tmp_path / "COINBASE.ws.3.0"
    log.write_bytes(b'wss://ws-feed.pro.coinbase.com <-> 1618677816.8434298\n'
                    b'wss://ws-feed.pro.coinbase.com <- 1618677817.020616: {"type":"subscribe"}\n'
                    b'1618677817.0618958: {"type":"subscriptions","channels":[]}\n'
                    b'not a line\n'
                    b'1618677817.5: {"type":"heartbeat"}\n\n\n')
    seen: list[str] = []
    got = list(read_capture(log, on_error=lambda kind, text, raw: seen.append(kind)))
    assert [t for t, _ in got] == [1_618_677_817_061_895_800, 1_618_677_817_500_000_000] and seen == ["bad_line"]
    src = CaptureSource(log, venue="auto")
    assert src.venue == "coinbase-exchange" and list(src) == []
    assert src.stats.control == 2 and src.stats.error_kinds == {"bad_line": 1}
