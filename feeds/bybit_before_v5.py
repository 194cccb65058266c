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
Subscribe replies carry the op under "request". Klines (klineV2, candle), instrument_info,
liquidation and insurance are not read: each such message is an `unsupported_format` error
naming its topic, and the stream goes on.
"""

from __future__ import annotations

from typing import Any

from feeds.events import BUY, SELL, BookDelta, Trade, number_decimals
from feeds.validate import nonnegative, positive
from feeds.wire import UnsupportedFormat

MS = 1_000_000
_SIDES = {"Buy": BUY, "Sell": SELL}
READ = ("trade", "orderBookL2_25", "orderBookL2_200")


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
        raise UnsupportedFormat(f"Bybit's pre-v5 topic {name}.{symbol} is not read (read are {', '.join(READ)})")

    def _trade(self, t: dict[str, Any], ts_recv: int) -> Trade:
        side = _SIDES.get(t["side"])
        if side is None:
            raise ValueError(f"trade side {t['side']!r} (Buy or Sell)")
        p, q = t["price"], t["size"]
        return Trade(self.venue, t["symbol"], int(t["trade_time_ms"]) * MS, ts_recv, positive("price", float(p)),
                     positive("size", float(q)), side, str(t.get("trade_id", "")), number_decimals(p), number_decimals(q))

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
