"""Coinbase Exchange websocket feed (ws-feed, formerly Coinbase Pro / GDAX): wire parser.

The feed behind years of recorded Coinbase data (wss://ws-feed.exchange.coinbase.com, before
2022 wss://ws-feed.pro.coinbase.com). Flat JSON objects keyed by "type":
  match, last_match   trade_id, sequence, maker_order_id, taker_order_id, time, product_id,
                      size, price, side. `side` is the *maker's* order side: "sell" means the
                      taker bought (an up-tick), so the aggressor is the other side.
                      last_match is the latest trade at subscribe time (a reconnect resends it).
  ticker              best_bid, best_ask (best_bid_size, best_ask_size since 2022; older
                      captures have none: NaN), price, last_size, side (the taker's), time
                      (absent from the first ticker after subscribing).
  snapshot            product_id, bids/asks [[price, size], ...] (level2, level2_batch).
  l2update            product_id, time, changes [[side buy|sell, price, new size]]; size "0"
                      removes the level. A size, not a delta.
  heartbeat, subscriptions, status: control. received/open/done/change/activate (the full
  channel's order-by-order events) are read as control: this engine keeps trades and levels.
  error: {"type": "error", "message": ..., "reason": ...}.

Trades are checked for gaps by trade_id, which Coinbase numbers per product without holes; a
trade id at or below one already read (a resent last_match after a reconnect) is dropped. The
`sequence` field is not checked: it counts every order event of the product, so a matches or
ticker subscription sees it jump by design. The docs ask clients to ignore message types they
do not know (new ones are added); they are counted as control.
"""

from __future__ import annotations

from typing import Any

from feeds.events import BUY, SELL, BookDelta, Trade, decimals
from feeds.validate import nonnegative, positive
from feeds.wire import (
    AuthError,
    CountingParser,
    Loads,
    SeqTracker,
    VenueError,
    fast_loads,
    rfc3339_ns,
    text_quote,
)

VENUE = "coinbase"
# The maker's side -> the aggressor's: a resting sell was hit by a buyer.
_AGGRESSOR = {"sell": BUY, "buy": SELL}
_BOOK_SIDES = ("buy", "sell")
ORDER_EVENTS = frozenset({"received", "open", "done", "change", "activate"})
# The feed's data and control types: how a capture is told to be in this format (feeds/capture.py;
# "error" is left out, Advanced Trade sends one too).
TYPES = frozenset({"match", "last_match", "ticker", "l2update", "snapshot", "heartbeat", "subscriptions",
                   "status"}) | ORDER_EVENTS


class CoinbaseExchangeParser(CountingParser):
    venue = VENUE
    label = "coinbase-exchange"

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self.seq = SeqTracker(self.stats)

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self._object(raw)
        kind = msg["type"]
        if kind in ("match", "last_match"):
            return self._match(msg, ts_recv)
        if kind == "ticker":
            b, a = msg["best_bid"], msg["best_ask"]
            bq, aq = msg.get("best_bid_size"), msg.get("best_ask_size")
            ts = rfc3339_ns(msg["time"]) if msg.get("time") else ts_recv
            return [text_quote(VENUE, msg["product_id"], ts, ts_recv, b, bq, a, aq)]
        if kind == "snapshot":
            ts = rfc3339_ns(msg["time"]) if msg.get("time") else ts_recv
            return [BookDelta(VENUE, msg["product_id"], ts, ts_recv, _levels(msg["bids"], "bid"),
                              _levels(msg["asks"], "ask"), 0, 0, True)]
        if kind == "l2update":
            bids: list[tuple[float, float]] = []
            asks: list[tuple[float, float]] = []
            for side, p, q in msg["changes"]:
                if side not in _BOOK_SIDES:
                    raise ValueError(f"l2update change side {side!r} (buy or sell)")
                level = (positive("price", float(p)), nonnegative("size", float(q)))
                (bids if side == "buy" else asks).append(level)
            return [BookDelta(VENUE, msg["product_id"], rfc3339_ns(msg["time"]), ts_recv, bids, asks)]
        if kind == "error":
            text = f"{msg.get('message', '')}" + (f": {msg['reason']}" if msg.get("reason") else "")
            if "auth" in text.lower():
                raise AuthError(f"coinbase refused authentication: {text}")
            raise VenueError(f"coinbase error: {text}")
        self.stats.aside(str(msg.get("type")))  # control, order-level events, and types added since (the docs: ignore them)
        return []

    def _match(self, msg: dict[str, Any], ts_recv: int) -> list[Trade]:
        product, tid = msg["product_id"], int(msg["trade_id"])
        key = product + "@trades"
        prev = self.seq.last.get(key)
        if prev is not None and tid <= prev:
            self.stats.aside("resent last_match")  # already read: last_match resent on a reconnect
            return []
        self.seq.check(key, tid)
        side = _AGGRESSOR.get(msg["side"])
        if side is None:
            raise ValueError(f"match side {msg['side']!r} (buy or sell)")
        p, q = msg["price"], msg["size"]
        return [Trade(VENUE, product, rfc3339_ns(msg["time"]), ts_recv, positive("price", float(p)),
                      positive("size", float(q)), side, tid, decimals(p), decimals(q))]


def _levels(rows: list[list[str]], side: str) -> list[tuple[float, float]]:
    return [(positive(f"{side}_price", float(p)), nonnegative(f"{side}_size", float(q))) for p, q, *_ in rows]

