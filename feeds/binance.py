"""Binance websocket (spot, USDⓈ-M and COIN-M futures): wire parser and protocol.

Formats (Binance "WebSocket Streams" docs of each market): payloads arrive raw on
`/ws/<stream>` or wrapped as `{"stream": "<name>", "data": <payload>}` on `/stream?streams=...`.
  trade        {"e":"trade","E":ms,"s":"BNBBTC","t":id,"p":"0.001","q":"100","T":ms,"m":true,"M":true}
  aggTrade     {"e":"aggTrade","E":ms,"s":..,"a":id,"p":..,"q":..,"f":id,"l":id,"T":ms,"m":..(,"M")}
  bookTicker   spot {"u":id,"s":..,"b":"25.35","B":"31.21","a":"25.36","A":"40.66"}  (no time)
               futures {"e":"bookTicker","u":id,"E":ms,"T":ms,"s":..,"b","B","a","A"}
  kline        {"e":"kline","E":ms,"s":..,"k":{"t","T","s","i","f","L","o","c","h","l","v","n","x","q","V","Q","B"}}
  depthUpdate  spot {"e":"depthUpdate","E":ms,"s":..,"U":first,"u":last,"b":[[p,q]..],"a":[[p,q]..]}
               futures adds "T":ms and "pu": the previous event's `u`
  markPriceUpdate (futures) {"e":"markPriceUpdate","E":ms,"s":..,"p":mark,"i":index,"P":..,"r":funding,"T":next}
  forceOrder   (futures) {"e":"forceOrder","E":ms,"o":{"s","S":"SELL","o","f","q","p","ap","X","l","z","T"}}
  REST snapshot {"lastUpdateId":id(,"E","T"),"bids":[[p,q]..],"asks":[[p,q]..]}  (captures embed one)
`m` true means the buyer was the maker, i.e. the aggressor sold. Times: `T` (the matching
engine's) when given, else `E`, else the receive time (spot bookTicker).

Depth gaps follow each market's documented sync (feeds/books.py `DepthSync`). Spot: each
update starts where the last ended (`U == last u + 1`; after a snapshot, updates with
`u <= lastUpdateId` are dropped and the first kept spans it, `U <= lastUpdateId + 1 <= u`).
Futures: each update names the previous one (`pu == last u`; after a snapshot `u < lastUpdateId`
is dropped and `U <= lastUpdateId <= u`), and ids are not contiguous, so the spot rule would
call every update a gap. The spanning update may arrive before the snapshot line (the stream
is buffered while the snapshot is fetched): it is the bridge then, not a gap. A futures-only
message on a spot parser (or `pu` on spot depth) is refused as a counted error that says
to pass `--market usdm` or `coinm`; nothing is guessed.
Control: `{"method":"SUBSCRIBE","params":[..],"id":1}` -> `{"result":null,"id":1}`;
errors `{"code":2,"msg":"..."}` or `{"error":{"code":..,"msg":..},"id":..}`.
Keep-alive: the server pings every 20 s (futures: 3 min) and `websockets` answers pings itself.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.books import DepthSync
from feeds.events import BUY, SELL, Bar, BookDelta, Liquidation, Mark, Quote, Trade, decimals
from feeds.validate import BadValue, check_bar, flag, nonnegative, positive
from feeds.wire import CountingParser, Loads, SeqTracker, VenueError, fast_loads

VENUE = "binance"
MARKETS = ("spot", "usdm", "coinm")
URLS = {
    "spot": "wss://stream.binance.com:9443/stream",
    "usdm": "wss://fstream.binance.com/stream",
    "coinm": "wss://dstream.binance.com/stream",
}
DEFAULT_URL = URLS["spot"]
MS = 1_000_000
INF = math.inf


def _levels(rows: list[list[str]], side: str) -> list[tuple[float, float]]:
    out = [(float(p), float(q)) for p, q in rows]
    for px, sz in out:
        if not (0.0 < px < INF and 0.0 <= sz < INF):
            positive(side + ".price", px)
            nonnegative(side + ".size", sz)
    return out


class BinanceParser(CountingParser):
    """Binance messages of one market -> events; depth and trade ids are checked per symbol."""

    venue = label = VENUE

    def __init__(
        self, loads: Loads = fast_loads, symbol_hint: str = "", closed_klines_only: bool = True,
        market: str = "spot",
    ) -> None:
        if market not in MARKETS:
            raise ValueError(f"binance market {market!r}: one of {', '.join(MARKETS)}")
        super().__init__(loads)
        self.market = market
        self.futures = market != "spot"
        self.seq = SeqTracker(self.stats)
        self.closed_klines_only = closed_klines_only
        self._last_symbol = symbol_hint.upper()
        self.depth = DepthSync(self.futures, self.stats)

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        msg = self.loads(raw)
        return self._dispatch(msg.get("data", msg) if "stream" in msg else msg, ts_recv)

    def _futures_only(self, what: str) -> None:
        if not self.futures:
            raise ValueError(f"{what} is a futures message: pass --market usdm or coinm (parsing as spot)")

    def _dispatch(self, d: dict[str, Any], ts_recv: int) -> list[Any]:
        e = d.get("e")
        if e is None:
            if "b" in d and "u" in d:
                return [self._book_ticker(d, ts_recv)]
            if "lastUpdateId" in d:
                return [self._snapshot(d, ts_recv)]
            if "result" in d and "id" in d:
                self.stats.aside("subscription reply")
                return []
            if "code" in d or "error" in d:
                err = d.get("error", d)
                raise VenueError(f"binance error {err.get('code')}: {err.get('msg')}")
            raise ValueError("unknown binance payload")
        if e == "trade" or e == "aggTrade":
            s = d["s"]
            self._last_symbol = s
            tid = d["t"] if e == "trade" else d["a"]
            self.seq.check(f"{s}@{e}", tid)
            p, q, m = d["p"], d["q"], d["m"]
            px, sz = float(p), float(q)
            # Inlined checks: this is the hot path (see feeds.validate for the rules).
            if not (0.0 < px < INF and 0.0 < sz < INF and (m is True or m is False)):
                positive("price", px), positive("size", sz), flag("m", m)
            return [Trade(VENUE, s, d["T"] * MS, ts_recv, px, sz, SELL if m else BUY, tid, decimals(p), decimals(q))]
        if e == "depthUpdate":
            return [self._depth(d, ts_recv)]
        if e == "bookTicker":
            return [self._book_ticker(d, ts_recv)]
        if e == "kline":
            return self._kline(d, ts_recv)
        if e == "markPriceUpdate":
            self._futures_only(e)
            p, idx, r = d["p"], d.get("i"), d.get("r")
            return [Mark(VENUE, d["s"], d["E"] * MS, ts_recv, positive("mark", float(p)),
                         positive("index", float(idx)) if idx not in (None, "") else math.nan,
                         float(r) if r not in (None, "") else math.nan, int(d.get("T") or 0) * MS,
                         decimals(p))]
        if e == "forceOrder":
            self._futures_only(e)
            o = d["o"]
            p = o["ap"] if o.get("ap") not in (None, "", "0", "0.00") else o["p"]
            q = o.get("z") or o["q"]
            side = {"BUY": BUY, "SELL": SELL}.get(o["S"])
            if side is None:
                raise BadValue("S", o["S"], "must be BUY or SELL")
            return [Liquidation(VENUE, o["s"], int(o.get("T") or d["E"]) * MS, ts_recv,
                                positive("price", float(p)), positive("size", float(q)), side,
                                decimals(p), decimals(q))]
        raise ValueError(f"unknown binance event type {e!r}")

    def _book_ticker(self, d: dict[str, Any], ts_recv: int) -> Quote:
        s = d["s"]
        self._last_symbol = s
        b, a, bq, aq = d["b"], d["a"], d["B"], d["A"]
        ms = d.get("T") or d.get("E")
        ts = ms * MS if ms else ts_recv
        fb, fa, fbq, faq = float(b), float(a), float(bq), float(aq)
        if not (0.0 < fb < INF and 0.0 < fa < INF and 0.0 <= fbq < INF and 0.0 <= faq < INF):
            positive("bid", fb), nonnegative("bid_size", fbq), positive("ask", fa), nonnegative("ask_size", faq)
        return Quote(VENUE, s, ts, ts_recv, fb, fbq, fa, faq, max(decimals(b), decimals(a)),
                     max(decimals(bq), decimals(aq)))

    def _depth(self, d: dict[str, Any], ts_recv: int) -> BookDelta:
        s = d["s"]
        self._last_symbol = s
        first, last = d["U"], d["u"]
        if "pu" in d and not self.futures:
            self._futures_only("depthUpdate with 'pu'")
        self.depth.update(s, first, last, d["pu"] if self.futures else None)
        ms = d.get("T") or d["E"]
        return BookDelta(VENUE, s, ms * MS, ts_recv, _levels(d["b"], "bids"), _levels(d["a"], "asks"), first, last)

    def _snapshot(self, d: dict[str, Any], ts_recv: int) -> BookDelta:
        if not self._last_symbol:
            raise ValueError("depth snapshot without a symbol (pass symbol_hint)")
        last = d["lastUpdateId"]
        s = self._last_symbol
        self.depth.snapshot(s, last)
        ms = d.get("T") or d.get("E")
        ts = ms * MS if ms else ts_recv
        return BookDelta(VENUE, s, ts, ts_recv, _levels(d["bids"], "bids"), _levels(d["asks"], "asks"),
                         last, last, snapshot=True)

    def _kline(self, d: dict[str, Any], ts_recv: int) -> list[Any]:
        k = d["k"]
        if self.closed_klines_only and not flag("x", k["x"]):
            self.stats.aside("unclosed kline")
            return []
        s = k["s"]
        o, h, lo, c, v = k["o"], k["h"], k["l"], k["c"], k["v"]
        fo, fh, fl, fc, vol = float(o), float(h), float(lo), float(c), float(v)
        check_bar(fo, fh, fl, fc, vol)
        buy = float(k["V"])
        vwap = float(k["q"]) / vol if vol else fc
        close_ns = (k["T"] + 1) * MS  # T is the last ms inside the bar
        open_ns = k["t"] * MS
        dp = max(decimals(o), decimals(h), decimals(lo), decimals(c))
        return [Bar(VENUE, s, close_ns, ts_recv, open_ns, close_ns - open_ns, fo, fh, fl, fc, vol, int(k["n"]),
                    buy, vol - buy, vwap, dp, decimals(v))]


def stream_names(symbols: list[str], channels: list[str]) -> list[str]:
    """('btcusdt', ['trade','bookTicker','depth@100ms']) -> ['btcusdt@trade', ...]."""
    return [f"{s.lower()}@{c}" for s in symbols for c in channels]


def subscribe_message(symbols: list[str], channels: list[str], req_id: int = 1) -> dict[str, Any]:
    return {"method": "SUBSCRIBE", "params": stream_names(symbols, channels), "id": req_id}


def subscribe_messages(symbols: list[str], channels: list[str], batch: int | None = None) -> list[dict[str, Any]]:
    """The SUBSCRIBE messages of one connection: `batch` (SUBSCRIBE_BATCH) streams each, ids 1, 2, ... (sent
    SUBSCRIBE_GAP_S apart)."""
    names = stream_names(symbols, channels)
    batch = batch or SUBSCRIBE_BATCH
    return [{"method": "SUBSCRIBE", "params": names[i:i + batch], "id": i // batch + 1}
            for i in range(0, len(names), batch)]


# Binance spot "WebSocket Streams" (developers.binance.com/docs/binance-spot-api-docs/web-socket-streams) and
# the USDⓈ-M / COIN-M "Websocket Market Streams" pages: "a single connection can listen to a maximum of 1024
# streams", and a connection may send 5 (spot; futures: 10) messages a second, or it is disconnected. A market
# of many symbols needs ceil(symbols x channels / 1024) connections (feeds/adapters.py `connection_shards`).
# No limit on the params of one SUBSCRIBE is documented; client libraries batch a few hundred a request, so a
# connection subscribes SUBSCRIBE_BATCH streams a message, one message every SUBSCRIBE_GAP_S (4 a second).
MAX_STREAMS_PER_CONNECTION = 1024
SUBSCRIBE_BATCH = 200
SUBSCRIBE_GAP_S = 0.25


def stream_symbol(instrument: str) -> str:
    """How a stream name spells an instrument: BTCUSDT -> btcusdt."""
    return instrument.lower()


def _dp(value: float, dp: int) -> str:
    return f"{value:.{max(dp, 0)}f}"


def trade_message(trade: Trade) -> dict[str, Any]:
    """A Trade in Binance's combined-stream form (what `BinanceParser` reads back to the same Trade)."""
    ms = trade.ts_event // MS
    return {"stream": f"{stream_symbol(trade.instrument)}@trade",
            "data": {"e": "trade", "E": ms, "s": trade.instrument, "t": trade.trade_id,
                     "p": _dp(trade.price, trade.px_dp), "q": _dp(trade.size, trade.sz_dp), "T": ms,
                     "m": trade.side == SELL, "M": True}}


def kline_message(bar: Bar, interval: str = "1m") -> dict[str, Any]:
    """A closed Bar as a Binance kline on `<symbol>@kline_<interval>` (buy volume and quote volume from the
    bar's side split and VWAP where it has them)."""
    open_ms, close_ms = bar.ts_open // MS, (bar.ts_open + bar.interval_ns) // MS - 1
    buy = bar.buy_volume if math.isfinite(bar.buy_volume) else 0.0
    vwap = bar.vwap if math.isfinite(bar.vwap) else bar.close
    k = {"t": open_ms, "T": close_ms, "s": bar.instrument, "i": interval, "f": 0, "L": 0,
         "o": _dp(bar.open, bar.px_dp), "c": _dp(bar.close, bar.px_dp), "h": _dp(bar.high, bar.px_dp),
         "l": _dp(bar.low, bar.px_dp), "v": _dp(bar.volume, bar.sz_dp), "n": max(bar.trades, 0), "x": True,
         "q": f"{bar.volume * vwap:.8f}", "V": _dp(buy, bar.sz_dp), "Q": f"{buy * vwap:.8f}", "B": "0"}
    return {"stream": f"{stream_symbol(bar.instrument)}@kline_{interval}",
            "data": {"e": "kline", "E": close_ms + 1, "s": bar.instrument, "k": k}}


DEFAULT_CHANNELS = ["trade", "bookTicker", "depth@100ms"]
FUTURES_CHANNELS = ["aggTrade", "bookTicker", "depth@100ms", "markPrice@1s", "forceOrder"]
