"""Bybit's public websocket before v5 (2019-2023): the topics its recorded data is in.

Two endpoints, wss://stream.bybit.com/realtime (inverse contracts, BTCUSD) and
.../realtime_public (USDT perpetuals, BTCUSDT), with numbers as JSON numbers on the first and
often as strings on the second:
  trade.S            data[]: trade_time_ms, symbol, side (Buy|Sell: the taker's), size, price, trade_id
  orderBookL2_25.S   levels {price, symbol, id, side, size}, keyed by id. snapshot: data is the
  orderBookL2_200.S  levels (realtime) or {"order_book": levels} (realtime_public); delta: data
                     {"delete": [...], "update": [...], "insert": [...]}, a deleted level's size 0
                     (its price from the delete, or from the id it was inserted under).
                     timestamp_e6: microseconds.
  klineV2.I.S        data[]: start, end (seconds), open, close, high, low, volume, turnover,
  candle.I.S         confirm, cross_seq, timestamp (us); candle (realtime_public) adds period.
                     A Bar once confirm is true, over [start, end): its length is the bar's.
Subscribe replies carry the op under "request". instrument_info, liquidation and insurance are
not read: each such message is an `unsupported_format` error naming its topic, and the stream
goes on.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.events import BUY, SELL, Bar, BookDelta, Trade, number_decimals
from feeds.validate import check_bar, nonnegative, positive
from feeds.wire import UnsupportedFormat

MS = 1_000_000
S = 1_000_000_000
NAN = math.nan
_SIDES = {"Buy": BUY, "Sell": SELL}
READ = ("trade", "orderBookL2_25", "orderBookL2_200", "klineV2", "candle")


class BeforeV5:
    """The pre-v5 topics of one connection or capture: the book levels' prices by id per symbol."""

    def __init__(self, venue: str) -> None:
        self.venue = venue
        self._prices: dict[str, dict[Any, float]] = {}

    def read(self, name: str, symbol: str, msg: dict[str, Any], ts_recv: int) -> list[Any]:
        if name == "trade":
            return [self._trade(t, ts_recv) for t in msg["data"]]
        if name in ("orderBookL2_25", "orderBookL2_200"):
            return [self._book(symbol, msg, ts_recv)]
        if name in ("klineV2", "candle"):
            symbol = symbol.partition(".")[2]  # <name>.<interval>.<symbol>
            return [self._bar(symbol, k, ts_recv) for k in msg["data"] if k["confirm"] is True]
        raise UnsupportedFormat(f"Bybit's pre-v5 topic {name}.{symbol} is not read (read are {', '.join(READ)})")

    def _trade(self, t: dict[str, Any], ts_recv: int) -> Trade:
        side = _SIDES.get(t["side"])
        if side is None:
            raise ValueError(f"trade side {t['side']!r} (Buy or Sell)")
        p, q = t["price"], t["size"]
        return Trade(self.venue, t["symbol"], int(t["trade_time_ms"]) * MS, ts_recv, positive("price", float(p)),
                     positive("size", float(q)), side, str(t.get("trade_id", "")), number_decimals(p), number_decimals(q))

    def _bar(self, symbol: str, k: dict[str, Any], ts_recv: int) -> Bar:
        start, end = int(k["start"]), int(k["end"])
        if not 0 < start < end:
            raise ValueError(f"{symbol} kline start {start} and end {end} (seconds) make no interval")
        return kline_bar(self.venue, symbol, start * S, (end - start) * S, k, ts_recv)

    def _book(self, symbol: str, msg: dict[str, Any], ts_recv: int) -> BookDelta:
        data = msg["data"]
        snapshot = msg["type"] == "snapshot"
        prices = self._prices.setdefault(symbol, {})
        bids: list[tuple[float, float]] = []
        asks: list[tuple[float, float]] = []
        if snapshot:
            prices.clear()
            changed = [(lv, False) for lv in (data["order_book"] if isinstance(data, dict) else data)]
        else:
            changed = [(lv, True) for lv in data["delete"]] + [(lv, False) for lv in data["update"] + data["insert"]]
        for lv, deleted in changed:
            side = lv["side"]
            if side not in _SIDES:
                raise ValueError(f"book side {side!r} (Buy or Sell)")
            if "price" in lv:
                price = prices[lv["id"]] = positive("price", float(lv["price"]))
            elif lv["id"] in prices:
                price = prices[lv["id"]]
            else:
                raise ValueError(f"{symbol} book level id {lv['id']!r} has no price and was never inserted")
            size = 0.0 if deleted else nonnegative("size", float(lv["size"]))
            if deleted:
                prices.pop(lv["id"], None)
            (bids if side == "Buy" else asks).append((price, size))
        seq = int(msg.get("cross_seq") or 0)
        ts = int(msg.get("timestamp_e6") or 0) * 1000 or ts_recv
        return BookDelta(self.venue, symbol, ts, ts_recv, bids, asks, seq, seq, snapshot)


def kline_bar(venue: str, symbol: str, open_ns: int, interval_ns: int, k: dict[str, Any], ts_recv: int) -> Bar:
    """A closed kline of either API (open, high, low, close, volume: strings or numbers) as a Bar."""
    o, h, lo, c, v = k["open"], k["high"], k["low"], k["close"], k["volume"]
    check_bar(float(o), float(h), float(lo), float(c), float(v))
    dp = max(number_decimals(x) for x in (o, h, lo, c))
    return Bar(venue, symbol, open_ns + interval_ns, ts_recv, open_ns, interval_ns, float(o), float(h), float(lo),
               float(c), float(v), -1, NAN, NAN, NAN, dp, number_decimals(v))
