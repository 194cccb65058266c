"""OKX websocket v5 (public market data): wire parser and protocol.

Data messages are {"arg": {"channel": ..., "instId": ...}, "data": [...]} (books add
"action": snapshot|update), numbers and millisecond times as strings:
  trades, trades-all  data[]: instId, tradeId, px, sz, side (the taker's), ts
  tickers             data[]: instId, bidPx, bidSz, askPx, askSz, last, ts ("" sides: no quote)
  bbo-tbt             data[]: bids/asks [[px, sz, "0", orders]] (the top level), ts: a Quote
  books, books5, books50-l2-tbt, books-l2-tbt
                      data[]: bids/asks [[px, sz, "0", orders]], ts, checksum (CRC32 of the
                      top 25 levels), seqId and prevSeqId since 2023. books5 sends the whole
                      top 5 each time (no "action": a snapshot). Size "0" removes a level.
  candle1s .. candle1W(utc)
                      data[]: [ts, o, h, l, c, vol, volCcy, volCcyQuote, confirm]; a Bar
                      once confirm is "1" (captures from before the field existed: once the
                      next candle starts). Candles are served on /ws/v5/business since 2023.
  mark-price          data[]: instId, markPx, ts: a Mark
Events: {"event": "subscribe" | "unsubscribe" | "notice" | "channel-conn-count", ...} are
control; {"event": "error", "code", "msg"} ends the session. The server closes a connection
that is silent for 30 s: clients send the text "ping" and get "pong" (not JSON).

A book update whose prevSeqId is not the seqId last read for its instrument is a gap.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.events import BUY, SELL, Bar, BookDelta, Mark, Quote, Trade, decimals
from feeds.validate import check_bar, nonnegative, positive
from feeds.wire import CountingParser, Loads, OpenCandles, VenueError, fast_loads, text_quote

VENUE = "okx"
DEFAULT_URL = "wss://ws.okx.com:8443/ws/v5/public"
DEFAULT_CHANNELS = ["trades", "tickers"]
MS = 1_000_000
NAN = math.nan
_SIDES = {"buy": BUY, "sell": SELL}
_UNIT_NS = {"s": 10**9, "m": 60 * 10**9, "H": 3600 * 10**9, "D": 86400 * 10**9, "W": 7 * 86400 * 10**9}
_BOOKS = frozenset({"books", "books5", "books50-l2-tbt", "books-l2-tbt"})
_CONTROL_EVENTS = frozenset({"subscribe", "unsubscribe", "notice", "channel-conn-count", "login"})


def candle_ns(channel: str) -> int:
    """'candle1m' -> 60 s in ns; 'candle4Hutc' -> 4 h. Months have no fixed length: refused."""
    spec = channel[len("candle"):].removesuffix("utc")
    count, unit = spec[:-1], spec[-1:]
    if not count.isdigit() or unit not in _UNIT_NS:
        raise ValueError(f"candle channel {channel!r}: intervals read are N s/m/H/D/W (months vary in length)")
    return int(count) * _UNIT_NS[unit]


class OkxParser(CountingParser):
    venue = label = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self._seq: dict[str, int] = {}  # instId@channel -> last seqId
        self._candles = OpenCandles()  # captures from before `confirm`

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        if raw in ("pong", b"pong"):  # the answer to our ping, in text
            self.stats.aside("pong")
            return []
        msg = self._object(raw)
        if "event" in msg:
            if msg["event"] == "error":
                raise VenueError(f"okx error {msg.get('code', '')}: {msg.get('msg', '')}")
            if msg["event"] not in _CONTROL_EVENTS:
                raise ValueError(f"unknown okx event {msg['event']!r}")
            self.stats.aside(f"{msg['event']} reply")
            return []
        channel, inst = msg["arg"]["channel"], msg["arg"].get("instId", "")
        out: list[Any] = []
        if channel in ("trades", "trades-all"):
            for t in msg["data"]:
                p, q, side = t["px"], t["sz"], _SIDES.get(t["side"])
                if side is None:
                    raise ValueError(f"trade side {t['side']!r} (buy or sell)")
                out.append(Trade(VENUE, t["instId"], int(t["ts"]) * MS, ts_recv, positive("price", float(p)),
                                 positive("size", float(q)), side, t["tradeId"], decimals(p), decimals(q)))
        elif channel == "tickers":
            for t in msg["data"]:
                if t["bidPx"] and t["askPx"]:  # an instrument without both sides has no quote to give
                    out.append(self._quote(t["instId"], t["bidPx"], t["bidSz"], t["askPx"], t["askSz"], t["ts"],
                                           ts_recv))
        elif channel == "bbo-tbt":
            for d in msg["data"]:
                if d["bids"] and d["asks"]:
                    (b, bq, *_), (a, aq, *_) = d["bids"][0], d["asks"][0]
                    out.append(self._quote(inst, b, bq, a, aq, d["ts"], ts_recv))
        elif channel in _BOOKS:
            snapshot = msg.get("action", "snapshot") == "snapshot"
            for d in msg["data"]:
                out.append(self._book(inst, channel, d, snapshot, ts_recv))
        elif channel.startswith("candle"):
            interval = candle_ns(channel)
            for c in sorted(msg["data"], key=lambda c: int(c[0])):
                out.extend(self._candle(inst, channel, interval, c, ts_recv))
        elif channel == "mark-price":
            for m in msg["data"]:
                p = m["markPx"]
                out.append(Mark(VENUE, m["instId"], int(m["ts"]) * MS, ts_recv, positive("mark", float(p)), NAN, NAN,
                                0, decimals(p)))
        else:
            raise ValueError(f"unknown okx channel {channel!r}")
        return out

    def _quote(self, inst: str, b: str, bq: str, a: str, aq: str, ts: str, ts_recv: int) -> Quote:
        return text_quote(VENUE, inst, int(ts) * MS, ts_recv, b, bq, a, aq)

    def _book(self, inst: str, channel: str, d: dict[str, Any], snapshot: bool, ts_recv: int) -> BookDelta:
        seq, prev = d.get("seqId"), d.get("prevSeqId")
        if seq is not None:
            key = f"{inst}@{channel}"
            last = self._seq.get(key)
            if not snapshot and last is not None and prev is not None and prev != last:
                self.stats.gap(key, last, prev)
            self._seq[key] = seq
        bids = [(positive("price", float(p)), nonnegative("size", float(q))) for p, q, *_ in d["bids"]]
        asks = [(positive("price", float(p)), nonnegative("size", float(q))) for p, q, *_ in d["asks"]]
        return BookDelta(VENUE, inst, int(d["ts"]) * MS, ts_recv, bids, asks, seq or 0, seq or 0, snapshot)

    def _candle(self, inst: str, channel: str, interval: int, c: list[str], ts_recv: int) -> list[Bar]:
        if len(c) >= 9:  # confirm: "1" once the candle is closed
            return [self._bar(inst, interval, c, ts_recv)] if c[8] == "1" else []
        done = self._candles.closed((inst, channel), int(c[0]), c)  # older captures: closed once the next starts
        return [] if done is None else [self._bar(inst, interval, done, ts_recv)]

    def _bar(self, inst: str, interval: int, c: list[str], ts_recv: int) -> Bar:
        ts, o, h, lo, cl, v = c[:6]
        check_bar(float(o), float(h), float(lo), float(cl), float(v))
        open_ns = int(ts) * MS
        dp = max(decimals(o), decimals(h), decimals(lo), decimals(cl))
        return Bar(VENUE, inst, open_ns + interval, ts_recv, open_ns, interval, float(o), float(h), float(lo),
                   float(cl), float(v), -1, NAN, NAN, NAN, dp, decimals(v))


# OKX v5 "WebSocket API / Subscribe" (okx.com/docs-v5/en/#overview-websocket-subscribe): "the total length of
# multiple channels cannot exceed 64 KB" in one request (older pages said 4096 bytes), and a connection may send
# 480 subscribe/unsubscribe/login requests an hour. The args of one connection go in as few requests as fit
# under half the documented length: a few requests even for a whole market, far under the hourly limit.
MAX_SUBSCRIBE_BYTES = 32 * 1024


def subscribe_message(symbols: list[str], channels: list[str]) -> dict[str, Any]:
    return {"op": "subscribe", "args": [{"channel": ch, "instId": s} for ch in channels for s in symbols]}


def subscribe_messages(symbols: list[str], channels: list[str],
                       max_bytes: int = MAX_SUBSCRIBE_BYTES) -> list[dict[str, Any]]:
    """subscribe_message's args split into requests of at most `max_bytes` of JSON each."""
    out: list[dict[str, Any]] = []
    args: list[dict[str, str]] = []
    size = 0
    for arg in subscribe_message(symbols, channels)["args"]:
        arg_bytes = len(arg["channel"]) + len(arg["instId"]) + 30  # {"channel":"..","instId":".."},
        if args and size + arg_bytes > max_bytes - 32:  # room for {"op":"subscribe","args":[]}
            out.append({"op": "subscribe", "args": args})
            args, size = [], 0
        args.append(arg)
        size += arg_bytes
    if args:
        out.append({"op": "subscribe", "args": args})
    return out


PING = "ping"  # a text frame: OKX answers "pong", and closes a connection silent for 30 s
