"""Coinbase Advanced Trade websocket: wire parser and protocol.

Every message shares one envelope (Advanced Trade "WebSocket Channels" docs):
  {"channel": "...", "client_id": "", "timestamp": "2023-02-09T20:19:35.39625135Z",
   "sequence_num": 0, "events": [...]}
  market_trades  events[].trades[]: trade_id, product_id, price, size, side (BUY/SELL), time
  ticker         events[].tickers[]: product_id, price, best_bid, best_bid_quantity, best_ask, ...
  candles        events[].candles[]: start (unix s, string), high, low, open, close, volume, product_id
  l2_data        events[]: type snapshot|update, product_id, updates[]: side (bid|offer),
                 event_time, price_level, new_quantity (a size, not a delta; "0" removes)
  heartbeats     events[]: current_time, heartbeat_counter
  subscriptions  events[]: subscriptions {channel: [product ids]}
Errors: {"type": "error", "message": "..."}. `sequence_num` counts every message on the
connection, so one gap check covers all channels. Subscribe within 5 s of connecting, one
message per channel: {"type":"subscribe","product_ids":[..],"channel":"level2","jwt":".."};
channels without updates close after 60-90 s unless `heartbeats` is subscribed too.
Candles are 5-minute and are resent as they fill: a candle is emitted as a Bar once a later
one for the same product starts.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.coinbase_exchange import TYPES as EXCHANGE_TYPES
from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, BookDelta, Trade, decimals
from feeds.validate import check_bar, positive
from feeds.wire import (
    AuthError,
    CountingParser,
    Loads,
    OpenCandles,
    SeqTracker,
    UnsupportedFormat,
    VenueError,
    fast_loads,
    rfc3339_ns,
    text_quote,
)

VENUE = "coinbase"
DEFAULT_URL = "wss://advanced-trade-ws.coinbase.com"
CANDLE_NS = 300 * 1_000_000_000
_SIDES = {"BUY": BUY, "SELL": SELL}
_CONTROL_NAMES = {"heartbeats": "heartbeat", "subscriptions": "subscription reply", "status": "status"}
NAN = math.nan
# Coinbase Exchange ws-feed messages (flat, keyed by "type") are another parser's: say which.
EXCHANGE_REFUSAL = ("this looks like Coinbase Exchange (ws-feed: messages keyed by 'type', no 'channel'); this "
                    "parser reads Advanced Trade. Read ws-feed captures as venue 'coinbase-exchange' (a capture's "
                    "venue is sniffed: feeds/coinbase_exchange.py)")


class CoinbaseParser(CountingParser):
    venue = label = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self.seq = SeqTracker(self.stats)
        self._candles = OpenCandles()

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self._object(raw)
        if msg.get("type") == "error":
            text = str(msg.get("message", ""))
            if "auth" in text.lower():
                raise AuthError(f"coinbase refused authentication: {text}")
            raise VenueError(f"coinbase error: {text}")
        if "sequence_num" in msg:
            # Coinbase numbers messages per connection from 0: a reconnect restarts it.
            seq = msg["sequence_num"]
            if seq == 0:
                self.seq.reset()
            self.seq.check("connection", seq)
        return self._dispatch(msg, ts_recv)

    def _dispatch(self, msg: dict[str, Any], ts_recv: int) -> list[Any]:
        if "channel" not in msg and msg.get("type") in EXCHANGE_TYPES:
            raise UnsupportedFormat(EXCHANGE_REFUSAL)
        channel = msg["channel"]
        ts_msg = rfc3339_ns(msg["timestamp"])
        out: list[Any] = []
        if channel == "market_trades":
            for ev in msg["events"]:
                for t in ev["trades"]:
                    p, q = t["price"], t["size"]
                    out.append(
                        Trade(VENUE, t["product_id"], rfc3339_ns(t["time"]), ts_recv, positive("price", float(p)),
                              positive("size", float(q)),
                              _SIDES.get(t["side"], UNKNOWN_SIDE), t["trade_id"], decimals(p), decimals(q))
                    )
        elif channel in ("ticker", "ticker_batch"):
            for ev in msg["events"]:
                for t in ev["tickers"]:
                    b, a = t["best_bid"], t["best_ask"]
                    bq, aq = t.get("best_bid_quantity", "0"), t.get("best_ask_quantity", "0")
                    out.append(text_quote(VENUE, t["product_id"], ts_msg, ts_recv, b, bq, a, aq))
        elif channel == "l2_data":
            for ev in msg["events"]:
                bids: list[tuple[float, float]] = []
                asks: list[tuple[float, float]] = []
                for u in ev["updates"]:
                    side = u["side"]
                    level = (float(u["price_level"]), float(u["new_quantity"]))
                    if side == "bid":
                        bids.append(level)
                    elif side in ("offer", "ask"):
                        asks.append(level)
                    else:
                        raise ValueError(f"l2_data update side {side!r}")
                out.append(BookDelta(VENUE, ev["product_id"], ts_msg, ts_recv, bids, asks,
                                     msg["sequence_num"], msg["sequence_num"], ev["type"] == "snapshot"))
        elif channel == "candles":
            for ev in msg["events"]:
                for c in sorted(ev["candles"], key=lambda c: int(c["start"])):
                    out.extend(self._candle(c, ts_recv))
        elif channel in ("heartbeats", "subscriptions", "status"):
            self.stats.aside(_CONTROL_NAMES[channel])
        else:
            raise ValueError(f"unknown coinbase channel {channel!r}")
        return out

    def _candle(self, c: dict[str, Any], ts_recv: int) -> list[Bar]:
        done = self._candles.closed(c["product_id"], int(c["start"]), c)
        return [] if done is None else [self._bar(done, ts_recv)]

    def _bar(self, c: dict[str, Any], ts_recv: int) -> Bar:
        o, h, lo, cl, v = c["open"], c["high"], c["low"], c["close"], c["volume"]
        open_ns = int(c["start"]) * 1_000_000_000
        dp = max(decimals(o), decimals(h), decimals(lo), decimals(cl))
        check_bar(float(o), float(h), float(lo), float(cl), float(v))
        # The candles channel gives no trade count, side split or VWAP: -1 and NaN say "unknown".
        return Bar(VENUE, c["product_id"], open_ns + CANDLE_NS, ts_recv, open_ns, CANDLE_NS,
                   float(o), float(h), float(lo), float(cl), float(v), -1, NAN, NAN, NAN, dp, decimals(v))


def subscribe_messages(
    products: list[str], channels: list[str], jwt: str | None = None
) -> list[dict[str, Any]]:
    """One subscribe per channel, plus heartbeats so quiet channels stay open."""
    chans = list(channels) + ([] if "heartbeats" in channels else ["heartbeats"])
    msgs = []
    for ch in chans:
        m: dict[str, Any] = {"type": "subscribe", "product_ids": list(products), "channel": ch}
        if jwt:
            m["jwt"] = jwt
        msgs.append(m)
    return msgs


DEFAULT_CHANNELS = ["market_trades", "ticker"]
