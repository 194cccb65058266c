"""Summary lines: what a lagging session gets for a run of pending lines (feeding/attach.py).

While ingest lags, an attachment's pending lines are coalesced per instrument into one line:
    bars    the run's bars merged into one bar (OHLCV combined) with `(N bars to HH:MM)`;
            a run of empty bars stays a `no trades` gap line
    events  `HH:MM:SS-HH:MM:SS summary 812 trades 61830.1-61850 last 61845 v12.3 b55;
            344 quotes last bid 61844.99 ask 61845; 90 book updates`
"""

from __future__ import annotations

from typing import Any

from feeds.bars import merge_bars
from feeds.events import BUY, Bar, BookDelta, Quote, Trade
from streamllm.feeding.render import Renderer, fixed, hhmm, hhmmss, quantity

MINUTE_NS = 60 * 1_000_000_000


def bar_summary(renderer: Renderer, bars: list[Bar]) -> str:
    """Consecutive bars of one instrument as one line."""
    first, last = bars[0], bars[-1]
    merged = merge_bars(bars)
    line = renderer.bar(merged)
    clock = hhmm if last.ts_event % MINUTE_NS == 0 and first.interval_ns % MINUTE_NS == 0 else hhmmss
    return line if merged.trades == 0 else f"{line} ({len(bars)} bars to {clock(last.ts_event)})"


def event_summary(renderer: Renderer, inst: str, evs: list[Any]) -> str:
    """Consecutive events of one instrument as one line: trades, quotes, book updates and bars counted."""
    trades = [e for e in evs if type(e) is Trade]
    quotes = [e for e in evs if type(e) is Quote]
    books = sum(1 for e in evs if type(e) is BookDelta)
    bars_ = [e for e in evs if type(e) is Bar]
    head = f"{hhmmss(evs[0].ts_event)}-{hhmmss(evs[-1].ts_event)}"
    if renderer.with_symbol:
        head += f" {inst}"
    parts = []
    if trades:
        dp = max(t.px_dp for t in trades)
        vol = sum(t.size for t in trades)
        buy = sum(t.size for t in trades if t.side == BUY)
        known = all(t.side != 0 for t in trades)  # else the buy share is unknown, not low
        lo, hi = min(t.price for t in trades), max(t.price for t in trades)
        parts.append(f"{len(trades)} trades {fixed(lo, dp)}-{fixed(hi, dp)} last {fixed(trades[-1].price, dp)}"
                     f" v{quantity(vol)}" + (f" b{round(100 * buy / vol)}" if vol > 0 and known else ""))
    if quotes:
        q = quotes[-1]
        parts.append(f"{len(quotes)} quotes last bid {fixed(q.bid, q.px_dp)} ask {fixed(q.ask, q.px_dp)}")
    if books:
        parts.append(f"{books} book updates")
    if bars_:
        parts.append(f"{len(bars_)} bars last close {fixed(bars_[-1].close, bars_[-1].px_dp)}")
    return f"{head} summary " + "; ".join(parts)
