"""Bybit v5 public websocket: wire parser and protocol.

One endpoint per product line, wss://stream.bybit.com/v5/public/{spot|linear|inverse}.
Data messages are {"topic": "<name>.<symbol>", "type": "snapshot"|"delta", "ts": ms, "data": ...}:
  publicTrade.S      data[]: T (ms), s, S (Buy|Sell: the taker's), v (size), p, i (trade id), BT
  orderbook.N.S      data: s, b/a [[price, size]], u (update id), seq. A delta's u follows the
                     last by one, else a gap; a snapshot (also resent by Bybit after a fault, or
                     u = 1 after a restart) starts the book again. Size "0" removes a level.
                     orderbook.1 is the way to a spot quote (spot tickers carry no bid/ask).
  tickers.S          linear/inverse: bid1Price, bid1Size, ask1Price, ask1Size, markPrice,
                     indexPrice, fundingRate, nextFundingTime. A delta carries only what
                     changed, so the last values per symbol are kept: a Quote when the top of
                     book changed, a Mark when the mark did. Spot tickers (no bid/ask): control.
  kline.I.S          data[]: start, end, interval (1..720 minutes, D, W; M varies), open, close,
                     high, low, volume, confirm: a Bar once confirm is true.
  allLiquidation.S   data[]: T, s, S (the liquidated position's side: Buy = a long, closed by
                     a sell order), v, p: a Liquidation.
Replies to our ops ({"op": "subscribe"|"ping"|"pong", "success": ...}) are control; a failed
subscribe ends the session. Clients ping with {"op": "ping"} every 20 s. Captures of the API
before v5 (trade.S, orderBookL2_25.S, klineV2.I.S) are read by feeds/bybit_before_v5.py.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.bybit_before_v5 import BeforeV5, kline_bar
from feeds.events import BUY, SELL, Bar, BookDelta, Liquidation, Mark, Trade, decimals
from feeds.validate import nonnegative, positive
from feeds.wire import (
    CountingParser,
    Loads,
    SeqTracker,
    VenueError,
    fast_loads,
    text_quote,
)

VENUE = "bybit"
URLS = {"spot": "wss://stream.bybit.com/v5/public/spot", "linear": "wss://stream.bybit.com/v5/public/linear",
        "inverse": "wss://stream.bybit.com/v5/public/inverse"}
DEFAULT_URL = URLS["spot"]
DEFAULT_CHANNELS = ["publicTrade", "orderbook.1"]
MS = 1_000_000
MIN_NS = 60 * 10**9
NAN = math.nan
_SIDES = {"Buy": BUY, "Sell": SELL}
_KLINE_NS = {"D": 1440 * MIN_NS, "W": 7 * 1440 * MIN_NS}
# Bybit's APIs before v5 (2019-2023: realtime, realtime_public; topics trade.X, orderBookL2_25.X, klineV2.1.X):
# feeds/bybit_before_v5.py reads their trades, books and klines.
OLD_TOPICS = frozenset({"trade", "klineV2", "candle", "instrument_info", "liquidation_v2", "insurance"})


def before_v5(topic: str) -> bool:
    """Whether a topic is one of Bybit's API before v5 (read by feeds/bybit_before_v5.py)."""
    name = topic.partition(".")[0]
    return name in OLD_TOPICS or name.startswith("orderBookL2")


def kline_ns(interval: str) -> int:
    if interval.isdigit():
        return int(interval) * MIN_NS
    if interval in _KLINE_NS:
        return _KLINE_NS[interval]
    raise ValueError(f"kline interval {interval!r}: read are minutes, D and W (months vary in length)")


class BybitParser(CountingParser):
    venue = label = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        super().__init__(loads)
        self.seq = SeqTracker(self.stats)
        self._tickers: dict[str, dict[str, Any]] = {}  # symbol -> the last value of every ticker field
        self._old = BeforeV5(VENUE)  # recorded data of the API before v5

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self._object(raw)
        if "topic" not in msg:
            if "op" in msg or "request" in msg:  # a reply to our op (before v5: the op under "request")
                if msg.get("success") is False:
                    op = msg.get("op") or msg["request"].get("op")
                    raise VenueError(f"bybit {op} failed: {msg.get('ret_msg', '')}")
                self.stats.aside("op reply")
                return []
            raise ValueError(f"a bybit message has a topic or an op, got keys {sorted(msg)[:6]}")
        name, _, symbol = msg["topic"].partition(".")
        data = msg["data"]
        if name == "publicTrade":
            return [self._trade(t, ts_recv) for t in data]
        if name == "orderbook":
            depth, _, symbol = symbol.partition(".")
            return [self._book(f"{symbol}@orderbook.{depth}", msg, ts_recv)]
        if name == "tickers":
            return self._ticker(msg["type"], data, int(msg["ts"]) * MS, ts_recv)
        if name == "kline":
            symbol = symbol.partition(".")[2]  # kline.<interval>.<symbol>: each kline says its interval
            return [self._bar(symbol, k, ts_recv) for k in data if k["confirm"] is True]
        if name in ("allLiquidation", "liquidation"):
            rows = data if isinstance(data, list) else [data]
            return [self._liquidation(r, ts_recv) for r in rows]
        if before_v5(msg["topic"]):
            return self._old.read(name, symbol, msg, ts_recv)
        raise ValueError(f"unknown bybit topic {msg['topic']!r}")

    def _trade(self, t: dict[str, Any], ts_recv: int) -> Trade:
        side = _SIDES.get(t["S"])
        if side is None:
            raise ValueError(f"trade side {t['S']!r} (Buy or Sell)")
        p, q = t["p"], t["v"]
        return Trade(VENUE, t["s"], int(t["T"]) * MS, ts_recv, positive("price", float(p)), positive("size", float(q)),
                     side, t["i"], decimals(p), decimals(q))

    def _book(self, key: str, msg: dict[str, Any], ts_recv: int) -> BookDelta:
        d = msg["data"]
        u = int(d["u"])
        snapshot = msg["type"] == "snapshot"
        if snapshot:
            self.seq.last.pop(key, None)  # a (re)sent snapshot starts the book again
        self.seq.check(key, u)
        bids = [(positive("price", float(p)), nonnegative("size", float(q))) for p, q in d["b"]]
        asks = [(positive("price", float(p)), nonnegative("size", float(q))) for p, q in d["a"]]
        ts = int(msg.get("cts") or msg["ts"]) * MS
        return BookDelta(VENUE, d["s"], ts, ts_recv, bids, asks, u, u, snapshot)

    def _ticker(self, kind: str, d: dict[str, Any], ts: int, ts_recv: int) -> list[Any]:
        sym = d["symbol"]
        last = self._tickers.get(sym)
        if kind == "snapshot" or last is None:
            if kind != "snapshot":
                raise ValueError(f"tickers delta for {sym} before its snapshot")
            last = self._tickers[sym] = {}
        before = dict(last)
        last.update(d)
        out: list[Any] = []
        if "bid1Price" in last and "ask1Price" in last:
            top = ("bid1Price", "bid1Size", "ask1Price", "ask1Size")
            if any(last.get(k) != before.get(k) for k in top):
                b, bq, a, aq = (str(last.get(k, "0")) for k in top)
                out.append(text_quote(VENUE, sym, ts, ts_recv, b, bq, a, aq))
        if "markPrice" in last and any(last.get(k) != before.get(k) for k in ("markPrice", "indexPrice", "fundingRate")):
            m = str(last["markPrice"])
            index, rate = last.get("indexPrice"), last.get("fundingRate")
            out.append(Mark(VENUE, sym, ts, ts_recv, positive("mark", float(m)),
                            float(index) if index not in (None, "") else NAN,
                            float(rate) if rate not in (None, "") else NAN,
                            int(last.get("nextFundingTime") or 0) * MS, decimals(m)))
        if not out:
            self.stats.aside("ticker without a change we keep")  # nothing we keep changed (spot tickers carry no bid/ask)
        return out

    def _bar(self, symbol: str, k: dict[str, Any], ts_recv: int) -> Bar:
        return kline_bar(VENUE, symbol, int(k["start"]) * MS, kline_ns(str(k["interval"])), k, ts_recv)

    def _liquidation(self, r: dict[str, Any], ts_recv: int) -> Liquidation:
        position = _SIDES.get(r["S"])
        if position is None:
            raise ValueError(f"liquidation side {r['S']!r} (Buy or Sell)")
        p, q = r["p"], r["v"]
        return Liquidation(VENUE, r["s"], int(r["T"]) * MS, ts_recv, positive("price", float(p)),
                           positive("size", float(q)), -position, decimals(p), decimals(q))


def subscribe_messages(symbols: list[str], channels: list[str]) -> list[dict[str, Any]]:
    """Topics '<channel>.<symbol>', at most 10 a request (Bybit's limit on spot)."""
    topics = [f"{ch}.{s}" for ch in channels for s in symbols]
    return [{"op": "subscribe", "args": topics[i:i + 10]} for i in range(0, len(topics), 10)]


def ping_message() -> dict[str, Any]:
    return {"op": "ping"}
