"""Kraken spot websocket v2 (wss://ws.kraken.com/v2): wire parser and protocol.

Formats (Kraken "Spot Websocket v2" docs); numbers are JSON numbers, not strings:
  trade   {"channel":"trade","type":"snapshot|update","data":[{"symbol":"MATIC/USD","side":"sell",
           "price":0.5117,"qty":40.0,"ord_type":"market","trade_id":4665906,
           "timestamp":"2023-09-25T07:49:37.708706Z"}]}
  ticker  {"channel":"ticker","type":..,"data":[{"symbol","bid","bid_qty","ask","ask_qty","last",
           "volume","vwap","low","high","change","change_pct"(,"timestamp")}]}
  ohlc    {"channel":"ohlc","type":..,"timestamp":..,"data":[{"symbol","open","high","low","close",
           "trades","volume","vwap","interval_begin","interval"(minutes),"timestamp"}]}
  heartbeat {"channel":"heartbeat"} (every second when otherwise idle); status {"channel":"status",..}
Requests: {"method":"subscribe","params":{"channel":"trade","symbol":["BTC/USD"]},"req_id":1}
-> {"method":"subscribe","result":{..},"success":true|false,"error":"..","time_in":..,"time_out":..}
Keep-alive: {"method":"ping","req_id":n} -> {"method":"pong","req_id":n,..}.
`side` is the taker's side; `trade_id` is sequential per symbol (gap check).
"""

from __future__ import annotations

from typing import Any

from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, Quote, Trade, float_decimals
from feeds.validate import check_bar, nonnegative, positive
from feeds.wire import (
    CountingParser,
    Loads,
    OpenCandles,
    SeqTracker,
    UnsupportedFormat,
    VenueError,
    fast_loads,
    rfc3339_ns,
)

VENUE = "kraken"
DEFAULT_URL = "wss://ws.kraken.com/v2"
_SIDES = {"buy": BUY, "sell": SELL}
MIN_NS = 60 * 1_000_000_000
V1_REFUSAL = ("this looks like Kraken websocket v1 (ws.kraken.com: array messages, 'event' objects); this parser "
              "reads v2. Read v1 captures as venue 'kraken-v1' (a capture's venue is sniffed: feeds/kraken_v1.py)")


class KrakenParser(CountingParser):
    venue = label = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self.seq = SeqTracker(self.stats)
        self._candles = OpenCandles()

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        return self._dispatch(self.loads(raw), ts_recv)

    def _dispatch(self, msg: dict[str, Any], ts_recv: int) -> list[Any]:
        if isinstance(msg, list) or "event" in msg:
            raise UnsupportedFormat(V1_REFUSAL)
        if "method" in msg:
            if msg.get("success") is False:
                raise VenueError(f"kraken {msg['method']} failed: {msg.get('error')}")
            self.stats.aside(f"{msg['method']} reply")
            return []
        channel = msg["channel"]
        out: list[Any] = []
        if channel == "trade":
            for t in msg["data"]:
                sym, tid, p, q = t["symbol"], t["trade_id"], t["price"], t["qty"]
                if msg.get("type") == "update":
                    self.seq.check(sym + "@trade", tid)
                out.append(
                    Trade(VENUE, sym, rfc3339_ns(t["timestamp"]), ts_recv, positive("price", float(p)),
                          positive("size", float(q)),
                          _SIDES.get(t["side"], UNKNOWN_SIDE), tid, float_decimals(p), float_decimals(q))
                )
        elif channel == "ticker":
            for t in msg["data"]:
                b, a, bq, aq = t["bid"], t["ask"], t["bid_qty"], t["ask_qty"]
                ts = rfc3339_ns(t["timestamp"]) if "timestamp" in t else ts_recv
                out.append(
                    Quote(VENUE, t["symbol"], ts, ts_recv, positive("bid", float(b)), nonnegative("bid_size", float(bq)),
                          positive("ask", float(a)), nonnegative("ask_size", float(aq)),
                          max(float_decimals(b), float_decimals(a)),
                          max(float_decimals(bq), float_decimals(aq)))
                )
        elif channel == "ohlc":
            for c in sorted(msg["data"], key=lambda c: c["interval_begin"]):
                out.extend(self._candle(c, ts_recv))
        elif channel in ("heartbeat", "status"):
            self.stats.aside(channel)
        else:
            raise ValueError(f"unknown kraken channel {channel!r}")
        return out

    def _candle(self, c: dict[str, Any], ts_recv: int) -> list[Bar]:
        # Kraken resends the open candle as it fills: emit one once a later candle begins.
        done = self._candles.closed((c["symbol"], int(c["interval"])), c["interval_begin"], c)
        return [] if done is None else [self._bar(done, ts_recv)]

    def _bar(self, c: dict[str, Any], ts_recv: int) -> Bar:
        interval = int(c["interval"]) * MIN_NS
        open_ns = rfc3339_ns(c["interval_begin"])
        o, h, lo, cl = c["open"], c["high"], c["low"], c["close"]
        dp = max(float_decimals(o), float_decimals(h), float_decimals(lo), float_decimals(cl))
        check_bar(float(o), float(h), float(lo), float(cl), float(c["volume"]))
        nan = float("nan")  # no buy/sell split in Kraken's ohlc
        return Bar(VENUE, c["symbol"], open_ns + interval, ts_recv, open_ns, interval, float(o),
                   float(h), float(lo), float(cl), float(c["volume"]), int(c["trades"]), nan, nan,
                   float(c["vwap"]), dp, float_decimals(c["volume"]))


def subscribe_messages(
    symbols: list[str], channels: list[str], ohlc_minutes: int = 1
) -> list[dict[str, Any]]:
    msgs = []
    for i, ch in enumerate(channels, start=1):
        params: dict[str, Any] = {"channel": ch, "symbol": list(symbols)}
        if ch == "ohlc":
            params["interval"] = ohlc_minutes
        msgs.append({"method": "subscribe", "params": params, "req_id": i})
    return msgs


def ping_message(req_id: int) -> dict[str, Any]:
    return {"method": "ping", "req_id": req_id}


DEFAULT_CHANNELS = ["trade", "ticker"]
