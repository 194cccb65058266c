"""Kraken websocket v1 (wss://ws.kraken.com, before /v2): wire parser for recorded captures.

Most recorded Kraken data is in this format. Data messages are arrays,
[channelID, payload, ..., channelName, pair], with numbers as strings and times as
seconds since the epoch ("1618678142.557535"); pairs are written as v1 wrote them
(XBT/USD, where v2 says BTC/USD):
  trade    [[price, volume, time, side b|s (the taker's), orderType m|l, misc], ...]
  spread   [bid, ask, time(, bidVolume, askVolume: since 2020; older captures have none: NaN)]
  ticker   {"a": [price, wholeLotVolume, lotVolume], "b": [...], ...}: no time (ts_recv)
  ohlc-N   [time, etime, open, high, low, close, vwap, volume, count] for the N-minute candle
           ending at etime, resent as it fills: a Bar is emitted once a later candle begins.
  book-N   snapshot {"as": [[price, volume, time], ...], "bs": [...]}; updates {"a": [...]}
           and/or {"b": [...]} (two payloads when both sides changed), levels
           [price, volume, time(, "r" republished)], volume "0" removes, "c" a checksum.
Objects with "event" are control (heartbeat, systemStatus, subscriptionStatus, pong), except a
subscriptionStatus with status "error" or an "error" event, which end the session. v1 trades
have no id: trade_id is "" and no gap check is possible.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.events import BUY, SELL, Bar, BookDelta, Trade, decimals
from feeds.validate import check_bar, nonnegative, positive
from feeds.wire import (
    CountingParser,
    Loads,
    OpenCandles,
    VenueError,
    epoch_ns,
    fast_loads,
    text_quote,
)

VENUE = "kraken"
MIN_NS = 60 * 1_000_000_000
NAN = math.nan
_SIDES = {"b": BUY, "s": SELL}


class KrakenV1Parser(CountingParser):
    venue = VENUE
    label = "kraken-v1"

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self._candles = OpenCandles()

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self.loads(raw)
        if isinstance(msg, dict):
            event = msg["event"]
            if event == "error" or msg.get("status") == "error":
                raise VenueError(f"kraken {event}: {msg.get('errorMessage', msg)}")
            self.stats.aside(str(event))
            return []
        if not isinstance(msg, list) or len(msg) < 4:
            raise ValueError("kraken v1 data messages are [channelID, payload, ..., channelName, pair]")
        channel, pair, payloads = msg[-2], msg[-1], msg[1:-2]
        if not isinstance(channel, str) or not isinstance(pair, str):
            raise ValueError(f"kraken v1 message ends [..., channelName, pair], got {msg[-2:]!r}")
        if channel == "trade":
            return [self._trade(pair, t, ts_recv) for t in payloads[0]]
        if channel == "spread":
            s = payloads[0]
            b, a = s[0], s[1]
            bq, aq = (s[3], s[4]) if len(s) >= 5 else (None, None)
            return [text_quote(VENUE, pair, epoch_ns(s[2]), ts_recv, b, bq, a, aq)]
        if channel == "ticker":
            t = payloads[0]
            (b, _, bq), (a, _, aq) = t["b"][:3], t["a"][:3]
            return [text_quote(VENUE, pair, ts_recv, ts_recv, b, bq, a, aq)]
        if channel.startswith("ohlc-"):
            return self._candle(pair, int(channel[5:]), payloads[0], ts_recv)
        if channel.startswith("book-"):
            return [self._book(pair, payloads, ts_recv)]
        raise ValueError(f"unknown kraken v1 channel {channel!r}")

    def _trade(self, pair: str, t: list[Any], ts_recv: int) -> Trade:
        p, q, when, side = t[0], t[1], t[2], t[3]
        if side not in _SIDES:
            raise ValueError(f"trade side {side!r} (b or s)")
        return Trade(VENUE, pair, epoch_ns(when), ts_recv, positive("price", float(p)), positive("size", float(q)),
                     _SIDES[side], "", decimals(p), decimals(q))

    def _book(self, pair: str, payloads: list[Any], ts_recv: int) -> BookDelta:
        bids: list[tuple[float, float]] = []
        asks: list[tuple[float, float]] = []
        snapshot = "as" in payloads[0] or "bs" in payloads[0]
        latest = 0
        for part in payloads:
            for key, levels in part.items():
                if key in ("b", "bs", "a", "as"):
                    rows = bids if key[0] == "b" else asks
                    for lv in levels:
                        rows.append((positive("price", float(lv[0])), nonnegative("size", float(lv[1]))))
                        latest = max(latest, epoch_ns(lv[2]))
                elif key != "c":
                    raise ValueError(f"book payload key {key!r} (as/bs, a/b, c)")
        return BookDelta(VENUE, pair, latest or ts_recv, ts_recv, bids, asks, 0, 0, snapshot)

    def _candle(self, pair: str, minutes: int, c: list[Any], ts_recv: int) -> list[Bar]:
        done = self._candles.closed((pair, minutes), epoch_ns(c[1]), c)  # keyed by its end: etime
        return [] if done is None else [self._bar(pair, minutes, done, ts_recv)]

    def _bar(self, pair: str, minutes: int, c: list[Any], ts_recv: int) -> Bar:
        _, end, o, h, lo, cl, vwap, v, count = c[:9]
        interval = minutes * MIN_NS
        close_ns = epoch_ns(end)
        check_bar(float(o), float(h), float(lo), float(cl), float(v))
        dp = max(decimals(o), decimals(h), decimals(lo), decimals(cl))
        return Bar(VENUE, pair, close_ns, ts_recv, close_ns - interval, interval, float(o), float(h), float(lo),
                   float(cl), float(v), int(count), NAN, NAN, float(vwap), dp, decimals(v))
