"""Live venues beyond our four through cryptofeed (optional: `pip install streamllm[cryptofeed]`).

cryptofeed normalizes ~40 exchanges' websockets into its own types; this adapter maps those
into our events, so `feed = "cryptofeed:KRAKEN_FUTURES"` (symbols in cryptofeed's form,
`BTC-USD-PERP`) reaches any exchange it supports without a parser of ours. Our own parsers
stay for the four venues whose raw captures we record and replay: cryptofeed hands us
normalized objects, not the wire bytes a capture keeps.

  cryptofeed Trade        -> Trade (side buy/sell; no side: unknown)
  Ticker (bid, ask)       -> Quote with sizes unknown (NaN: rendered without sizes)
  Candle (closed ones)    -> Bar (trades count when given, else -1; side split unknown)
  Liquidation             -> Liquidation
  Funding                 -> Mark (mark price, no index, funding rate, next funding time)
Values are Decimals: their exponent is the precision the exchange sent. Impossible values
are counted errors, as in every parser (`adapter.stats`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

from feeds.events import (
    BUY,
    SELL,
    UNKNOWN_SIDE,
    Bar,
    Liquidation,
    Mark,
    Quote,
    Trade,
    float_decimals,
)
from feeds.validate import BadValue, check_bar, error_kind, positive
from feeds.wire import ParseStats

CHANNELS = ("trades", "ticker", "candles", "liquidations", "funding")
_SIDES = {"buy": BUY, "sell": SELL}
NAN = math.nan


def _need() -> Any:
    try:
        import cryptofeed
    except ImportError as exc:
        raise ImportError("feed 'cryptofeed:EXCHANGE' needs the optional extra: pip install 'streamllm[cryptofeed]'") \
            from exc
    return cryptofeed


def _dp(x: Any) -> int:
    if isinstance(x, Decimal):
        exp = x.normalize().as_tuple().exponent
        return max(0, -exp) if isinstance(exp, int) else 0
    return float_decimals(float(x))


def _ns(ts: float | None, fallback: int) -> int:
    # Through the float's shortest decimal: 1700000000.25 * 1e9 in floats is ...249999872.
    return fallback if ts is None else int(Decimal(repr(float(ts))).scaleb(9).to_integral_value())


def normalize(obj: Any, ts_recv: int) -> list[Any]:
    """One cryptofeed object -> our events (raises BadValue/ValueError on impossible values)."""
    kind = type(obj).__name__
    venue = str(obj.exchange).lower()
    if kind == "Trade":
        px, sz = positive("price", float(obj.price)), positive("size", float(obj.amount))
        return [Trade(venue, obj.symbol, _ns(obj.timestamp, ts_recv), ts_recv, px, sz,
                      _SIDES.get(str(obj.side).lower(), UNKNOWN_SIDE), obj.id if obj.id is not None else "",
                      _dp(obj.price), _dp(obj.amount))]
    if kind == "Ticker":
        bid, ask = positive("bid", float(obj.bid)), positive("ask", float(obj.ask))
        return [Quote(venue, obj.symbol, _ns(obj.timestamp, ts_recv), ts_recv, bid, NAN, ask, NAN,
                      max(_dp(obj.bid), _dp(obj.ask)), 0)]
    if kind == "Candle":
        if not obj.closed:
            return []
        o, h, lo, c, v = (float(x) for x in (obj.open, obj.high, obj.low, obj.close, obj.volume))
        check_bar(o, h, lo, c, v)
        start, stop = _ns(obj.start, 0), _ns(obj.stop, 0)
        interval = max(1, round((stop - start) / 1e9)) * 1_000_000_000  # stop is the interval's last instant
        dp = max(_dp(x) for x in (obj.open, obj.high, obj.low, obj.close))
        return [Bar(venue, obj.symbol, start + interval, ts_recv, start, interval, o, h, lo, c, v,
                    -1 if obj.trades is None else int(obj.trades), NAN, NAN, NAN, dp, _dp(obj.volume))]
    if kind == "Liquidation":
        side = _SIDES.get(str(obj.side).lower())
        if side is None:
            raise BadValue("side", obj.side, "must be buy or sell")
        return [Liquidation(venue, obj.symbol, _ns(obj.timestamp, ts_recv), ts_recv,
                            positive("price", float(obj.price)), positive("size", float(obj.quantity)), side,
                            _dp(obj.price), _dp(obj.quantity))]
    if kind == "Funding":
        mark = positive("mark", float(obj.mark_price)) if obj.mark_price is not None else NAN
        if math.isnan(mark):
            raise BadValue("mark", None, "is missing")
        nxt = _ns(obj.next_funding_time, 0) if obj.next_funding_time else 0
        return [Mark(venue, obj.symbol, _ns(obj.timestamp, ts_recv), ts_recv, mark, NAN,
                     float(obj.rate) if obj.rate is not None else NAN, nxt, _dp(obj.mark_price))]
    raise ValueError(f"cryptofeed {kind} is not mapped to an event")


class CryptofeedAdapter:
    """One cryptofeed FeedHandler for one exchange; `events()` yields our events."""

    def __init__(self, exchange: str, symbols: list[str], channels: list[str] | None = None,
                 max_queue: int = 10_000) -> None:
        cf = _need()
        from cryptofeed.exchanges import EXCHANGE_MAP

        self.exchange = exchange.upper()
        if self.exchange not in EXCHANGE_MAP:
            raise ValueError(f"cryptofeed has no exchange {exchange!r}; one of {', '.join(sorted(EXCHANGE_MAP))}")
        if not symbols:
            raise ValueError(f"cryptofeed:{exchange}: no symbols to subscribe")
        self.channels = list(channels or ("trades", "ticker"))
        bad = [c for c in self.channels if c not in CHANNELS]
        if bad:
            raise ValueError(f"cryptofeed channels {bad}: one of {', '.join(CHANNELS)}")
        self.symbols = list(symbols)
        self.stats = ParseStats()
        self._cf = cf
        self._feed_cls = EXCHANGE_MAP[self.exchange]
        self._queue: asyncio.Queue[Any] = asyncio.Queue(max_queue)

    async def _on(self, obj: Any, receipt_timestamp: float | None = None) -> None:
        self.stats.messages += 1
        try:
            events = normalize(obj, time.time_ns())
        except (ValueError, TypeError, AttributeError) as exc:
            self.stats.error(f"cryptofeed {type(exc).__name__} {exc}", str(obj)[:120], error_kind(exc))
            return
        self.stats.events += len(events)
        for ev in events:
            if self._queue.full():  # the consumer lags: drop the oldest, counted
                self._queue.get_nowait()
                self.stats.error("cryptofeed queue full: oldest event dropped", "", "dropped")
            self._queue.put_nowait(ev)

    async def events(self) -> AsyncIterator[Any]:
        from cryptofeed import FeedHandler

        handler = FeedHandler(config={"log": {"disabled": True}, "uvloop": False})
        handler.add_feed(self._feed_cls(symbols=self.symbols, channels=self.channels,
                                        callbacks={ch: self._on for ch in self.channels}))
        handler.run(start_loop=False, install_signal_handlers=False)
        try:
            while True:
                yield await self._queue.get()
        finally:
            await handler.stop_async()
