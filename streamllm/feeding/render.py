"""Market events -> one compact, deterministic text line each, for a small model to read.

The default tokenizer (SmolLM2) spends one token per digit, so lines carry few digits:

  bar    `23:02 46411 +34 h+5 l-12 v1.83M n210 b58`
         HH:MM of the bar's open (UTC), close at the instrument's precision, change of the
         close since the previous close, then only what is not implied: `o` open offset
         from the previous close (omitted when equal), `h`/`l` the wicks above
         max(open, close) and below min(open, close) (omitted when zero), volume to three
         significant digits with K/M/B units, trade count, buy share of volume in percent
         (each omitted when the source does not know it). An empty interval is written
         `23:03 46411 no trades`, a longer gap `23:03-23:20 46411 no trades`.
  trade  `23:59:01 buy 61837.63 0.02`
  quote  `23:59:01 bid 61837.63 x3.79 ask 61837.64 x1.55`
  book   `23:59:01 book 3 bids 9 asks` (levels changed; a snapshot says `book snapshot`)
  mark   `23:59:01 mark 61840.1 index 61838.5 funding 0.01%` (futures mark price)
  liq    `23:59:01 liquidation sell 61790 0.5` (a forced order; sell: a long was closed)

With `changes="bp"` (a session's `[sessions.render] changes = "bp"`) the change and the
o/h/l offsets are written in basis points of the previous close at two significant
digits (`23:02 46411 +7.3 h+1.1 l-2.6 v1.83M n210 b58`), so BTC at 46,411, EURUSD at
1.07 and a stock at 195 write the same move alike; the close stays at the venue's precision.

The first line of each UTC day carries the date in front, joined to the time as in ISO
8601 (`2024-08-09T00:00 ...`), so no line needs the date yet none is ambiguous, and every
line of a kind has its fields at the same word (series heads read words by index). The renderer is stateful per instrument (the
previous close, the precision seen so far); feed it lines in order, one per session.
Precision: the most decimals the venue has shown for the instrument (trailing zeros of
padded strings such as Binance's "61837.63000000" do not count), or a fixed override.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from feeds.events import BUY, SELL, Bar, BookDelta, Liquidation, Mark, Quote, Trade

NS_PER_DAY = 86_400 * 1_000_000_000
_UNITS = ((1e9, "B"), (1e6, "M"), (1e3, "K"))


def hhmm(ts_ns: int) -> str:
    s = (ts_ns // 1_000_000_000) % 86_400
    return f"{s // 3600:02d}:{s // 60 % 60:02d}"


def hhmmss(ts_ns: int) -> str:
    s = (ts_ns // 1_000_000_000) % 86_400
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def day(ts_ns: int) -> str:
    import datetime as _dt

    return _dt.datetime.fromtimestamp(ts_ns // 1_000_000_000, _dt.UTC).strftime("%Y-%m-%d")


def quantity(x: float, digits: int = 3) -> str:
    """Volume with units at `digits` significant digits: 1834512 -> 1.83M, 12.34567 -> 12.3."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return "?"
    for scale, unit in _UNITS:
        if abs(x) >= scale:
            return _sig(x / scale, digits) + unit
    return _sig(x, digits)


def _sig(x: float, digits: int) -> str:
    mag = math.floor(math.log10(abs(x))) + 1
    dp = max(0, digits - mag)
    text = f"{x:.{dp}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if abs(float(text)) >= 10 ** (mag if mag > 0 else 1) and dp > 0:  # rounding carried a digit
        text = f"{x:.{dp - 1}f}"
    return text


def fixed(x: float, dp: int, trim: bool = True) -> str:
    """x at `dp` decimals; `trim` drops trailing zeros (46377.00 -> 46377: same value, 3 tokens less)."""
    text = f"{x:.{dp}f}"
    if trim and "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text.strip("-0.") == "" else text


def signed(x: float, dp: int, trim: bool = True) -> str:
    text = fixed(x, dp, trim)
    return text if text.startswith("-") else "+" + text


def basis_points(x: float, ref: float) -> str:
    """A move of x from ref in basis points, signed, two significant digits: +34 on 46411 -> +7.3.
    Of |ref|: a rise shows + where prices go below zero too (WTI in April 2020, spreads)."""
    bp = 1e4 * x / abs(ref) if ref else 0.0
    text = _sig(bp, 2) if bp and math.isfinite(bp) else "0"
    return text if text.startswith("-") else "+" + text


@dataclass(slots=True)
class _Inst:
    px_dp: int = 0
    sz_dp: int = 0
    last_close: float | None = None
    interval_ns: int = 0  # bar interval seen on non-empty bars


@dataclass
class Renderer:
    """Stateful line renderer. `precision` fixes (price, size) decimals per instrument."""

    with_symbol: bool = False
    precision: dict[str, tuple[int, int]] = field(default_factory=dict)
    volume_digits: int = 3
    changes: str = "price"  # or "bp": moves in basis points of the previous close
    _inst: dict[str, _Inst] = field(default_factory=dict, repr=False)
    _last_day: int | None = field(default=None, repr=False)

    def render(self, ev: Any) -> str:
        kind = type(ev)
        if kind is Bar:
            return self.bar(ev)
        if kind is Trade:
            return self.trade(ev)
        if kind is Quote:
            return self.quote(ev)
        if kind is BookDelta:
            return self.book(ev)
        if kind is Mark:
            return self.mark(ev)
        if kind is Liquidation:
            return self.liquidation(ev)
        raise TypeError(f"render: no line format for {kind.__name__}")

    def _state(self, ev: Any, px_dp: int, sz_dp: int) -> _Inst:
        st = self._inst.get(ev.instrument)
        if st is None:
            st = self._inst[ev.instrument] = _Inst()
        fixed_dp = self.precision.get(ev.instrument)
        if fixed_dp is not None:
            st.px_dp, st.sz_dp = fixed_dp
        else:
            st.px_dp, st.sz_dp = max(st.px_dp, px_dp), max(st.sz_dp, sz_dp)
        return st

    def _head(self, ev: Any, ts: int, clock: str) -> str:
        d = ts // NS_PER_DAY
        head = clock
        if d != self._last_day:
            self._last_day = d
            head = f"{day(ts)}T{clock}"
        return f"{head} {ev.instrument}" if self.with_symbol else head

    def bar(self, b: Bar) -> str:
        st = self._state(b, b.px_dp, b.sz_dp)
        dp = st.px_dp
        prev = b.open if st.last_close is None else st.last_close
        st.last_close = b.close
        minute = 60 * 1_000_000_000
        clock = hhmm if b.ts_open % minute == 0 and b.interval_ns % minute == 0 else hhmmss
        head = self._head(b, b.ts_open, clock(b.ts_open))
        if b.trades == 0:
            # A run of empty intervals merged into one bar shows its end too.
            span = f"-{clock(b.ts_event)}" if st.interval_ns and b.interval_ns > st.interval_ns else ""
            return f"{head}{span} {fixed(b.close, dp)} no trades"
        st.interval_ns = b.interval_ns if not st.interval_ns else min(st.interval_ns, b.interval_ns)
        move = (lambda x: basis_points(x, prev)) if self.changes == "bp" else (lambda x: signed(x, dp))
        parts = [head, fixed(b.close, dp), move(b.close - prev)]
        if fixed(b.open, dp) != fixed(prev, dp):
            parts.append("o" + move(b.open - prev))
        top, bottom = max(b.open, b.close), min(b.open, b.close)
        if fixed(b.high - top, dp) != "0":
            parts.append("h" + move(b.high - top))
        if fixed(bottom - b.low, dp) != "0":
            parts.append("l" + move(b.low - bottom))
        parts.append("v" + quantity(b.volume, self.volume_digits))
        if b.trades > 0:
            parts.append(f"n{b.trades}")
        if b.volume > 0 and math.isfinite(b.buy_volume):
            parts.append(f"b{round(100 * b.buy_volume / b.volume)}")
        return " ".join(parts)

    def trade(self, t: Trade) -> str:
        st = self._state(t, t.px_dp, t.sz_dp)
        side = "buy" if t.side == BUY else "sell" if t.side == SELL else "trade"
        return f"{self._head(t, t.ts_event, hhmmss(t.ts_event))} {side} {fixed(t.price, st.px_dp)} {fixed(t.size, st.sz_dp)}"

    def quote(self, q: Quote) -> str:
        st = self._state(q, q.px_dp, q.sz_dp)
        dp, sdp = st.px_dp, st.sz_dp
        if not (math.isfinite(q.bid_size) and math.isfinite(q.ask_size)):  # sizes unknown: left out
            return f"{self._head(q, q.ts_event, hhmmss(q.ts_event))} bid {fixed(q.bid, dp)} ask {fixed(q.ask, dp)}"
        return (f"{self._head(q, q.ts_event, hhmmss(q.ts_event))} bid {fixed(q.bid, dp)} x{fixed(q.bid_size, sdp)}"
                f" ask {fixed(q.ask, dp)} x{fixed(q.ask_size, sdp)}")

    def book(self, d: BookDelta) -> str:
        head = self._head(d, d.ts_event, hhmmss(d.ts_event))
        what = "book snapshot" if d.snapshot else "book"
        return f"{head} {what} {len(d.bids)} bids {len(d.asks)} asks"


    def mark(self, m: Mark) -> str:
        st = self._state(m, m.px_dp, 0)
        parts = [self._head(m, m.ts_event, hhmmss(m.ts_event)), "mark", fixed(m.mark, st.px_dp)]
        if math.isfinite(m.index):
            parts += ["index", fixed(m.index, st.px_dp)]
        if math.isfinite(m.funding_rate):
            parts += ["funding", fixed(100 * m.funding_rate, 4) + "%"]
        return " ".join(parts)

    def liquidation(self, q: Liquidation) -> str:
        st = self._state(q, q.px_dp, q.sz_dp)
        side = "buy" if q.side == BUY else "sell"
        return (f"{self._head(q, q.ts_event, hhmmss(q.ts_event))} liquidation {side} {fixed(q.price, st.px_dp)}"
                f" {fixed(q.size, st.sz_dp)}")


def render_lines(events: Any, **kw: Any) -> list[str]:
    """Render a finite stream with a fresh renderer (examples, tests)."""
    r = Renderer(**kw)
    return [r.render(ev) for ev in events]
