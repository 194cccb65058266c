"""Binance spot websocket: wire parser and protocol (subscribe, keep-alive).

Formats (Binance spot "WebSocket Streams" docs): payloads arrive raw on `/ws/<stream>`
or wrapped as `{"stream": "<name>", "data": <payload>}` on `/stream?streams=...`.
  trade        {"e":"trade","E":ms,"s":"BNBBTC","t":id,"p":"0.001","q":"100","T":ms,"m":true,"M":true}
  aggTrade     {"e":"aggTrade","E":ms,"s":..,"a":id,"p":..,"q":..,"f":id,"l":id,"T":ms,"m":..,"M":..}
  bookTicker   {"u":id,"s":..,"b":"25.35","B":"31.21","a":"25.36","A":"40.66"}  (no timestamp)
  kline        {"e":"kline","E":ms,"s":..,"k":{"t","T","s","i","f","L","o","c","h","l","v","n","x","q","V","Q","B"}}
  depthUpdate  {"e":"depthUpdate","E":ms,"s":..,"U":first,"u":last,"b":[[p,q]..],"a":[[p,q]..]}
  REST snapshot {"lastUpdateId":id,"bids":[[p,q]..],"asks":[[p,q]..]}  (captures embed one)
`m` true means the buyer was the maker, i.e. the aggressor sold.
Control: `{"method":"SUBSCRIBE","params":[..],"id":1}` -> `{"result":null,"id":1}`;
errors `{"code":2,"msg":"..."}` or `{"error":{"code":..,"msg":..},"id":..}`.
Keep-alive: the server pings every 20 s and drops a client that does not pong within a
minute; `websockets` answers pings itself, so no application-level ping is needed.
"""

from __future__ import annotations

from typing import Any

from feeds.events import BUY, SELL, Bar, BookDelta, Quote, Trade, decimals
from feeds.wire import Loads, ParseStats, SeqTracker, VenueError, fast_loads

VENUE = "binance"
DEFAULT_URL = "wss://stream.binance.com:9443/stream"
MS = 1_000_000


def _levels(rows: list[list[str]]) -> list[tuple[float, float]]:
    return [(float(p), float(q)) for p, q in rows]


class BinanceParser:
    """Binance spot messages -> events. Depth and trade ids are checked for gaps per symbol."""

    venue = VENUE

    def __init__(
        self, loads: Loads = fast_loads, symbol_hint: str = "", closed_klines_only: bool = True
    ) -> None:
        self.loads = loads
        self.stats = ParseStats()
        self.seq = SeqTracker(self.stats)
        self.closed_klines_only = closed_klines_only
        self._last_symbol = symbol_hint.upper()

    def parse(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        self.stats.messages += 1
        try:
            msg = self.loads(raw)
            data = msg.get("data", msg) if "stream" in msg else msg
            out = self._dispatch(data, ts_recv, raw)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, VenueError) as exc:
            self.stats.error(f"binance {type(exc).__name__} {exc}", raw)
            return []
        self.stats.events += len(out)
        return out

    def _dispatch(self, d: dict[str, Any], ts_recv: int, raw: str | bytes) -> list[Any]:
        e = d.get("e")
        if e is None:
            if "b" in d and "u" in d:
                return [self._book_ticker(d, ts_recv)]
            if "lastUpdateId" in d:
                return [self._snapshot(d, ts_recv)]
            if "result" in d and "id" in d:
                self.stats.control += 1
                return []
            if "code" in d or "error" in d:
                err = d.get("error", d)
                raise VenueError(f"binance error {err.get('code')}: {err.get('msg')}")
            raise ValueError("unknown binance payload")
        if e == "trade":
            s = d["s"]
            self._last_symbol = s
            t = d["t"]
            self.seq.check(s + "@trade", t)
            p, q = d["p"], d["q"]
            return [
                Trade(VENUE, s, d["T"] * MS, ts_recv, float(p), float(q), SELL if d["m"] else BUY,
                      t, decimals(p), decimals(q))
            ]
        if e == "depthUpdate":
            s = d["s"]
            self._last_symbol = s
            first, last = d["U"], d["u"]
            self.seq.check(s + "@depth", first, last)
            return [BookDelta(VENUE, s, d["E"] * MS, ts_recv, _levels(d["b"]), _levels(d["a"]), first, last)]
        if e == "aggTrade":
            s = d["s"]
            self._last_symbol = s
            self.seq.check(s + "@aggTrade", d["a"])
            p, q = d["p"], d["q"]
            return [
                Trade(VENUE, s, d["T"] * MS, ts_recv, float(p), float(q), SELL if d["m"] else BUY,
                      d["a"], decimals(p), decimals(q))
            ]
        if e == "kline":
            return self._kline(d, ts_recv)
        raise ValueError(f"unknown binance event type {e!r}")

    def _book_ticker(self, d: dict[str, Any], ts_recv: int) -> Quote:
        s = d["s"]
        self._last_symbol = s
        b, a, bq, aq = d["b"], d["a"], d["B"], d["A"]
        return Quote(VENUE, s, ts_recv, ts_recv, float(b), float(bq), float(a), float(aq),
                     max(decimals(b), decimals(a)), max(decimals(bq), decimals(aq)))

    def _snapshot(self, d: dict[str, Any], ts_recv: int) -> BookDelta:
        if not self._last_symbol:
            raise ValueError("depth snapshot without a symbol (pass symbol_hint)")
        last = d["lastUpdateId"]
        key = self._last_symbol + "@depth"
        self.seq.last[key] = max(last, self.seq.last.get(key, last))
        return BookDelta(VENUE, self._last_symbol, ts_recv, ts_recv, _levels(d["bids"]),
                         _levels(d["asks"]), last, last, snapshot=True)

    def _kline(self, d: dict[str, Any], ts_recv: int) -> list[Any]:
        k = d["k"]
        if self.closed_klines_only and not k["x"]:
            self.stats.control += 1
            return []
        s = k["s"]
        o, h, lo, c, v = k["o"], k["h"], k["l"], k["c"], k["v"]
        vol, buy = float(v), float(k["V"])
        vwap = float(k["q"]) / vol if vol else float(c)
        close_ns = (k["T"] + 1) * MS  # T is the last ms inside the bar
        open_ns = k["t"] * MS
        dp = max(decimals(o), decimals(h), decimals(lo), decimals(c))
        return [
            Bar(VENUE, s, close_ns, ts_recv, open_ns, close_ns - open_ns, float(o), float(h),
                float(lo), float(c), vol, int(k["n"]), buy, vol - buy, vwap, dp, decimals(v))
        ]


def stream_names(symbols: list[str], channels: list[str]) -> list[str]:
    """('btcusdt', ['trade','bookTicker','depth@100ms']) -> ['btcusdt@trade', ...]."""
    return [f"{s.lower()}@{c}" for s in symbols for c in channels]


def subscribe_message(symbols: list[str], channels: list[str], req_id: int = 1) -> dict[str, Any]:
    return {"method": "SUBSCRIBE", "params": stream_names(symbols, channels), "id": req_id}


DEFAULT_CHANNELS = ["trade", "bookTicker", "depth@100ms"]
