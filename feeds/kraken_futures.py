"""Kraken Futures websocket v1 (wss://futures.kraken.com/ws/v1): wire parser and protocol.

Kraken's derivatives venue speaks its own protocol, not Kraken spot's. Messages are JSON
objects keyed by "feed", with numbers as JSON numbers and times in milliseconds:
  trade            product_id, uid, side (the taker's), type, seq, time, qty, price
  trade_snapshot   {"trades": [...]}: the product's last trades, newest first, sent on subscribe
  book_snapshot    timestamp, seq, bids/asks [{"price", "qty"}]
  book             one level: side (buy = bids), seq, price, qty (0 removes), timestamp
  ticker_lite      bid, ask (no sizes: NaN), no time (ts_recv)
  ticker           bid, ask, bid_size, ask_size, time, markPrice, index, funding_rate,
                   next_funding_rate_time: a Quote and a Mark
  heartbeat        time: control
Control messages carry "event": info, subscribed, unsubscribed; "error" and "alert"
(a refused request) end the session.

Trades of type fill and liquidation are the market's prints; block trades (negotiated off the
book), assignments and terminations (a contract's settlement) are not, and are left out of
the events (counted in `stats.skipped`, which inspect shows). Products are named as the venue writes them (PI_XBTUSD, a
perpetual; FI_XBTUSD_210924, a future expiring 2021-09-24; PF_ the multi-collateral ones).

Both sequences are per product and step by one: a `book` whose seq is not the last one plus
one is a gap (a snapshot starts over), and so is a trade's. A trade_snapshot on the first
subscription is history from before the connection and is dropped; on a reconnect its trades
newer than the last one read are the ones the disconnect missed, and are emitted in order.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.events import BUY, SELL, BookDelta, Mark, Trade, float_decimals
from feeds.validate import nonnegative, positive
from feeds.wire import CountingParser, Loads, VenueError, fast_loads, text_quote

VENUE = "kraken-futures"
DEFAULT_URL = "wss://futures.kraken.com/ws/v1"
DEFAULT_CHANNELS = ["trade", "ticker"]
MS = 1_000_000
NAN = math.nan
_SIDES = {"buy": BUY, "sell": SELL}
PRINTS = frozenset({"fill", "liquidation"})
_CONTROL_EVENTS = frozenset({"info", "subscribed", "unsubscribed"})


class KrakenFuturesParser(CountingParser):
    venue = label = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self._book_seq: dict[str, int] = {}
        self._trade_seq: dict[str, int] = {}

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self._object(raw)
        if "event" in msg:
            event = msg["event"]
            if event in ("error", "alert"):
                raise VenueError(f"kraken futures {event}: {msg.get('message', msg)}")
            if event not in _CONTROL_EVENTS:
                raise ValueError(f"unknown kraken futures event {event!r}")
            self.stats.aside(f"{event} reply" if event in ("subscribed", "unsubscribed") else str(event))
            return []
        feed = msg["feed"]
        if feed == "heartbeat":
            self.stats.aside("heartbeat")
            return []
        inst = msg["product_id"]
        if feed == "trade":
            return self._trades(inst, [msg], ts_recv)
        if feed == "trade_snapshot":
            last = self._trade_seq.get(inst)
            if last is None:  # history from before the connection: where the sequence starts
                self._trade_seq[inst] = max((t["seq"] for t in msg["trades"]), default=0)
                self.stats.aside("trade history before the connection")
                return []
            missed = sorted((t for t in msg["trades"] if t["seq"] > last), key=lambda t: t["seq"])
            return self._trades(inst, missed, ts_recv)  # what a reconnect missed
        if feed == "book_snapshot":
            self._book_seq[inst] = msg["seq"]
            return [BookDelta(VENUE, inst, int(msg["timestamp"]) * MS, ts_recv, _levels(msg["bids"]), _levels(msg["asks"]),
                              msg["seq"], msg["seq"], True)]
        if feed == "book":
            return [self._book(inst, msg, ts_recv)]
        if feed == "ticker_lite":
            return [text_quote(VENUE, inst, ts_recv, ts_recv, msg["bid"], None, msg["ask"], None)]
        if feed == "ticker":
            ts = int(msg["time"]) * MS if msg.get("time") else ts_recv
            out: list[Any] = [text_quote(VENUE, inst, ts, ts_recv, msg["bid"], msg.get("bid_size"), msg["ask"],
                                         msg.get("ask_size"))]
            if (mark := msg.get("markPrice")) is not None:
                index, rate = msg.get("index"), msg.get("funding_rate")
                out.append(Mark(VENUE, inst, ts, ts_recv, positive("mark", float(mark)),
                                NAN if index is None else positive("index", float(index)),
                                NAN if rate is None else float(rate), int(msg.get("next_funding_rate_time") or 0) * MS,
                                float_decimals(mark)))
            return out
        raise ValueError(f"unknown kraken futures feed {feed!r}")

    def _trades(self, inst: str, trades: list[dict[str, Any]], ts_recv: int) -> list[Trade]:
        out = []
        for t in trades:
            seq, last = t["seq"], self._trade_seq.get(inst)
            if last is not None and seq != last + 1:
                if seq <= last:  # already read (a resent trade)
                    continue
                self.stats.gap(f"{inst}@trade", last + 1, seq)
            self._trade_seq[inst] = seq
            if t["type"] not in PRINTS:  # block, assignment, termination: not market prints
                self.stats.skip(f"{t['type']} trade")
                continue
            side = _SIDES.get(t["side"])
            if side is None:
                raise ValueError(f"trade side {t['side']!r} (buy or sell)")
            p, q = t["price"], t["qty"]
            out.append(Trade(VENUE, inst, int(t["time"]) * MS, ts_recv, positive("price", float(p)), positive("size", float(q)),
                             side, t["uid"], float_decimals(p), float_decimals(q)))
        return out

    def _book(self, inst: str, msg: dict[str, Any], ts_recv: int) -> BookDelta:
        seq, last = msg["seq"], self._book_seq.get(inst)
        if last is not None and seq != last + 1:
            self.stats.gap(f"{inst}@book", last + 1, seq)
        self._book_seq[inst] = seq
        level = [(positive("price", float(msg["price"])), nonnegative("size", float(msg["qty"])))]
        side = msg["side"]
        if side not in _SIDES:
            raise ValueError(f"book side {side!r} (buy or sell)")
        bids, asks = (level, []) if side == "buy" else ([], level)
        return BookDelta(VENUE, inst, int(msg["timestamp"]) * MS, ts_recv, bids, asks, seq, seq)


def _levels(levels: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(positive("price", float(lv["price"])), nonnegative("size", float(lv["qty"]))) for lv in levels]


def subscribe_messages(symbols: list[str], channels: list[str]) -> list[dict[str, Any]]:
    """One subscribe per feed, plus the heartbeat feed (a message a minute keeps a quiet connection
    from looking dead)."""
    return [{"event": "subscribe", "feed": ch, "product_ids": symbols} for ch in channels] + [
        {"event": "subscribe", "feed": "heartbeat"}]
