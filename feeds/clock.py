"""When a bar can close: the venue time up to which every trade has had time to arrive.

Bars are cut on the venue's times (a trade's `ts_event`), but "has this bar ended?" is asked
between trades, on the receiver's clock. The two differ by the network lag and by how far
the local clock is off the venue's: a second or so on an ordinary host (the shared Binance
captures were recorded 1.27 s behind Binance), far more for a capture replayed through a
local server (its trades carry the capture's dates) or a host whose clock is minutes out.
Closing bars on the receive clock counts every trade late in the last two cases, and in the
first gives them whatever grace the host's error happens to be.

The venue's clock is modelled as running at `rate` venue seconds per receive second (1 live;
a replay paced at 0.25x runs at 0.25), so a trade's lag is how far its time falls behind that
line. A bar closes when `settled(recv)` passes its end: the line at `recv`, less the largest
lag among the last `window_s` seconds of trades: every trade of that spread of delays has had
time to arrive. The lag is at most `max_grace_s` above the newest trade's, so one trade
stamped long ago (a venue's correction, a stalled connection's backlog) holds bars open for
no more than that. Never below the newest trade's lag, so the settled time does not pass the
venue time the latest trade shows: a lag that keeps growing (a receiver falling behind) is
followed, not cut off. Windowed, so the grace shrinks again after a burst of slow messages and
follows a clock that drifts.

`rate` is measured over the last `rate_window_s` (and kept at most 1, so a replay paced
faster than recorded closes its bars no sooner than live). Between trades, as a live feed's
quiet ticks ask, the settled time moves at that rate: a silent market's last bar closes on
time, while a slowed replay's does not close before its trades arrive. Measured against the
wall rate instead, a slowed replay's lags would grow with every second, swamping the spread
of delays the grace is there to cover.

A trade stamped more than `max_ahead_s` past both the settled time and its own receive time
is `ahead`: one bad time would otherwise settle everything before it at once, closing the bars
up to it and counting every trade after it late until the venue's clock got there (an hour of
trades for a time an hour out). The caller holds such a trade back and lets the next one
decide: ahead too, and the venue's clock stepped (a host clock corrected); back in line, and it
was one bad time (`feeding/attach.py`). Past the receive time too, because a venue's trades
come after they happen: the first live trade after a subscription's snapshot of old trades
(Coinbase's `last_match`, a quiet market's minutes-old history) is far past a clock set by
that history, but not past its receive time, and must not wait for the next trade.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class VenueClock:
    def __init__(
        self, window_s: float = 10.0, max_grace_s: float = 2.0, rate_window_s: float = 60.0, max_ahead_s: float = 10.0
    ) -> None:
        if window_s <= 0 or max_grace_s < 0 or rate_window_s <= 0 or max_ahead_s <= max_grace_s:
            raise ValueError(
                "venue clock: need window_s > 0, max_grace_s >= 0, rate_window_s > 0 and max_ahead_s > max_grace_s,"
                f" got {window_s}, {max_grace_s}, {rate_window_s}, {max_ahead_s}"
            )
        self.max_ahead_ns = round(max_ahead_s * 1_000_000_000)
        self.window_ns = round(window_s * 1_000_000_000)
        self.max_grace_ns = round(max_grace_s * 1_000_000_000)
        self.rate_window_ns = round(rate_window_s * 1_000_000_000)
        self.rate = 1.0
        self.lag_ns: int | None = None  # what `settled` subtracts from the line; None until a venue time is seen
        self._origin = (0, 0)  # (ts_recv, venue time) the line runs through: at rate 1, lag = recv - event
        self._trades: deque[tuple[int, int]] = deque()  # (ts_recv, ts_event) of the window, to re-measure lags
        self._high: deque[tuple[int, int]] = deque()  # (ts_recv, lag), lags decreasing: a rolling maximum
        # (ts_recv, newest venue time so far) a second or more apart, for the rate: a trade stamped
        # long ago does not bend it, one stamped ahead only lifts it to the cap.
        self._marks: deque[tuple[int, int]] = deque()
        self._venue_high = 0

    def observe(self, ts_event: int, ts_recv: int) -> None:
        """One trade's venue and receive times (ns); a trade without a venue time (0) says nothing."""
        if ts_event <= 0 or ts_recv <= 0:
            return
        if self.lag_ns is None:
            self._origin = (ts_recv, ts_recv)  # near the data: ns since 1970 lose digits in a float
        trades = self._trades
        trades.append((ts_recv, ts_event))
        while trades[0][0] < ts_recv - self.window_ns:
            trades.popleft()
        rate, q = self._measure_rate(ts_recv, ts_event), self._high
        news: Iterable[tuple[int, int]] = ((ts_recv, ts_event),)
        if abs(rate - self.rate) > 0.01:  # a new line: the window's lags re-measured against it
            self._origin = (ts_recv, self._line(ts_recv))  # continuous: the settled time does not jump
            self.rate, news = rate, list(trades)
            q.clear()
        for r, e in news:
            lag = self._lag(r, e)
            while q and q[-1][1] <= lag:
                q.pop()
            q.append((r, lag))
        while q[0][0] < ts_recv - self.window_ns:  # never empties: the newest is inside the window
            q.popleft()
        self.lag_ns = min(q[0][1], lag + self.max_grace_ns)

    def settled(self, ts_recv: int) -> int:
        """The venue time whose trades have all arrived by the time the receiver's clock reads `ts_recv`."""
        if self.lag_ns is None:
            return ts_recv
        return self._line(ts_recv) - self.lag_ns

    def ahead(self, ts_event: int, ts_recv: int) -> bool:
        """Is a trade stamped further past the settled time, and past its receive time, than either can be off?"""
        if self.lag_ns is None or ts_event <= 0:
            return False
        return ts_event - max(self.settled(ts_recv), ts_recv) > self.max_ahead_ns

    def _line(self, ts_recv: int) -> int:
        r0, e0 = self._origin
        return e0 + round((ts_recv - r0) * self.rate)

    def _lag(self, ts_recv: int, ts_event: int) -> int:
        return self._line(ts_recv) - ts_event

    def _measure_rate(self, ts_recv: int, ts_event: int) -> float:
        """Re-measured once a second, when a mark is laid: a rate is a slow thing."""
        marks, venue = self._marks, max(ts_event, self._venue_high)
        self._venue_high = venue
        if marks and ts_recv - marks[-1][0] < 1_000_000_000:
            return self.rate
        marks.append((ts_recv, venue))
        while len(marks) > 2 and marks[1][0] <= ts_recv - self.rate_window_ns:
            marks.popleft()
        span = ts_recv - marks[0][0]
        if span < 1_000_000_000:  # a burst's jitter, not a rate; over a few seconds it may read a
            return self.rate  # live feed as slower than it is, which only closes bars later
        rate = max(0.0, (venue - marks[0][1]) / span)
        return 1.0 if rate > 0.97 else rate  # within a live feed's jitter of the wall rate
