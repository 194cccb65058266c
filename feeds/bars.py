"""Time bars from trades (or quotes), closed on time, with explicit empty intervals.

Bars are aligned to multiples of the interval since the epoch and keyed by instrument.
A bar closes when an event of a later interval arrives, or when `advance(now_ns)` says
its end has passed (so a quiet market still closes bars on time). An interval with no
events becomes an explicit bar with `trades == 0` (OHLC = previous close, zero volume);
a run longer than `max_empty` intervals becomes one explicit gap bar spanning the whole
run, so a weekend does not flood a session with thousands of identical lines.

Trades arriving for an interval already closed are counted in `late` and left out of
the bars (never silently: the counter proves it).
Trades without a known aggressor side leave the bar's buy/sell split NaN (unknown), so
the line says nothing about buying instead of "0% bought".
With `source="quotes"` the bar is the OHLC of the mid price, `trades` counts quote
updates and volumes are zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from feeds.events import BUY, SELL, Bar, Quote, Trade


@dataclass(slots=True)
class _Open:
    bucket: int
    open: float
    high: float
    low: float
    close: float
    volume: float = 0.0
    notional: float = 0.0
    count: int = 0
    buy: float = 0.0
    sell: float = 0.0
    unknown: float = 0.0  # volume of trades whose aggressor side the source does not know


@dataclass(slots=True)
class _State:
    venue: str
    px_dp: int
    sz_dp: int
    last_bucket: int  # last interval closed (or emitted empty)
    last_close: float
    cur: _Open | None = None


class BarAggregator:
    def __init__(
        self,
        interval_s: float,
        source: str = "trades",
        clock: str = "event",
        max_empty: int = 60,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"bar interval must be positive, got {interval_s}")
        if source not in ("trades", "quotes"):
            raise ValueError(f"bar source must be 'trades' or 'quotes', got {source!r}")
        if clock not in ("event", "recv"):
            raise ValueError(f"bar clock must be 'event' or 'recv', got {clock!r}")
        self.interval_ns = round(interval_s * 1_000_000_000)
        self.source = source
        self.by_recv = clock == "recv"
        self.max_empty = max_empty
        self.states: dict[str, _State] = {}
        self.late = 0
        self.ignored = 0

    def update(self, ev: Any) -> list[Bar]:
        """Feed one event; returns the bars it closed (maybe none)."""
        if self.source == "trades":
            if type(ev) is not Trade:
                self.ignored += 1
                return []
            price, size, side, dp, sdp = ev.price, ev.size, ev.side, ev.px_dp, ev.sz_dp
        else:
            if type(ev) is not Quote:
                self.ignored += 1
                return []
            price, size, side, sdp = (ev.bid + ev.ask) / 2, 0.0, 0, ev.sz_dp
            dp = ev.px_dp + (round(price * 10**ev.px_dp, 6) % 1 != 0)  # a half tick needs a digit
        ts = ev.ts_recv if self.by_recv else ev.ts_event
        bucket = ts // self.interval_ns
        st = self.states.get(ev.instrument)
        out: list[Bar] = []
        if st is None:
            st = self.states[ev.instrument] = _State(ev.venue, dp, sdp, bucket - 1, price)
        elif bucket <= st.last_bucket:
            self.late += 1
            return out
        st.px_dp, st.sz_dp = max(st.px_dp, dp), max(st.sz_dp, sdp)
        cur = st.cur
        if cur is not None and bucket != cur.bucket:
            out.append(self._close(ev.instrument, st, ev.ts_recv))
            cur = None
        if cur is None:
            out.extend(self._empty_until(ev.instrument, st, bucket, ev.ts_recv))
            cur = st.cur = _Open(bucket, price, price, price, price)
        if price > cur.high:
            cur.high = price
        if price < cur.low:
            cur.low = price
        cur.close = price
        cur.count += 1
        if size:
            cur.volume += size
            cur.notional += price * size
            if side == BUY:
                cur.buy += size
            elif side == SELL:
                cur.sell += size
            else:
                cur.unknown += size
        return out

    def advance(self, now_ns: int) -> list[Bar]:
        """Close every bar (and empty interval) that ended at or before `now_ns`."""
        upto = now_ns // self.interval_ns  # intervals < upto have ended
        out: list[Bar] = []
        for inst, st in self.states.items():
            if st.cur is not None and st.cur.bucket < upto:
                out.append(self._close(inst, st, now_ns))
            if st.cur is None:
                out.extend(self._empty_until(inst, st, upto, now_ns))
        return out

    def flush(self) -> list[Bar]:
        """Close the open bars as they are (end of a replay)."""
        out: list[Bar] = []
        for inst, st in self.states.items():
            if st.cur is not None:
                out.append(self._close(inst, st, (st.cur.bucket + 1) * self.interval_ns))
        return out

    def _close(self, inst: str, st: _State, ts_recv: int) -> Bar:
        c = st.cur
        assert c is not None
        iv = self.interval_ns
        vwap = c.notional / c.volume if c.volume else c.close
        # A side split with unknown sides in it would be a made-up number: NaN says "unknown".
        buy, sell = (c.buy, c.sell) if not c.unknown else (math.nan, math.nan)
        bar = Bar(st.venue, inst, (c.bucket + 1) * iv, ts_recv, c.bucket * iv, iv, c.open, c.high,
                  c.low, c.close, c.volume, c.count, buy, sell, vwap, st.px_dp, st.sz_dp)
        st.cur = None
        st.last_bucket = c.bucket
        st.last_close = c.close
        return bar

    def _empty_until(self, inst: str, st: _State, bucket: int, ts_recv: int) -> list[Bar]:
        """Explicit bars for the intervals strictly between the last closed one and `bucket`."""
        first, n = st.last_bucket + 1, bucket - st.last_bucket - 1
        if n <= 0:
            return []
        iv, px = self.interval_ns, st.last_close
        st.last_bucket = bucket - 1
        spans = [(first + i, 1) for i in range(n)] if n <= self.max_empty else [(first, n)]
        return [
            Bar(st.venue, inst, (b + k) * iv, ts_recv, b * iv, k * iv, px, px, px, px, 0.0, 0, 0.0, 0.0, px,
                st.px_dp, st.sz_dp)
            for b, k in spans
        ]


def bars(events: Iterable[Any], interval_s: float, source: str = "trades") -> Iterator[Bar]:
    """All bars of a finite stream, the last (partial) ones included."""
    agg = BarAggregator(interval_s, source)
    for ev in events:
        yield from agg.update(ev)
    yield from agg.flush()


def merge_bars(run: Sequence[Bar]) -> Bar:
    """Consecutive bars of one instrument as one: first open, extreme high and low, last close,
    summed volume and sides, volume-weighted VWAP (the last close when nothing traded). Trade
    counts add up where any bar traded; otherwise the run keeps its least (0: empty, -1: unknown)."""
    first, last = run[0], run[-1]
    volume = sum(b.volume for b in run)
    return replace(
        last, ts_open=first.ts_open, interval_ns=last.ts_event - first.ts_open, open=first.open,
        high=max(b.high for b in run), low=min(b.low for b in run), volume=volume,
        trades=sum(max(b.trades, 0) for b in run) if any(b.trades > 0 for b in run) else min(b.trades for b in run),
        buy_volume=sum(b.buy_volume for b in run), sell_volume=sum(b.sell_volume for b in run),
        vwap=sum(b.vwap * b.volume for b in run) / volume if volume else last.close)
