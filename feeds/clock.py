"""When a bar can close: the venue time up to which every trade has had time to arrive.

Bars are cut on the venue's times (a trade's `ts_event`), but "has this bar ended?" is asked
between trades, on the receiver's clock. The two differ by the network lag and by how far
the local clock is off the venue's: a second or so on an ordinary host (the shared Binance
captures were recorded 1.27 s behind Binance), far more for a capture replayed through a
local server (its trades carry the capture's dates) or a host whose clock is minutes out.
Closing bars on the receive clock counts every trade late in the last two cases, and in the
first gives them whatever grace the host's error happens to be.

So a bar closes when `settled(recv)` passes its end: `recv - lag`, where `lag` is the
largest `ts_recv - ts_event` among the last `window_s` seconds of trades: every trade of
that spread of delays has had time to arrive. The lag is at most `max_grace_s` above the
newest trade's, so one trade stamped long ago (a venue's correction, a stalled connection's
backlog) holds bars open for no more than that. Never below the newest trade's lag, so the
settled time does not pass the venue time the latest trade shows: a lag that keeps growing
(a receiver falling behind, a replay paced slower than recorded) is followed, not cut off.
Windowed, so the grace shrinks again after a burst of slow messages and follows a clock
that drifts.
"""

from __future__ import annotations

from collections import deque


class VenueClock:
    def __init__(self, window_s: float = 10.0, max_grace_s: float = 2.0) -> None:
        if window_s <= 0 or max_grace_s < 0:
            raise ValueError(f"venue clock: need window_s > 0 and max_grace_s >= 0, got {window_s}, {max_grace_s}")
        self.window_ns = round(window_s * 1_000_000_000)
        self.max_grace_ns = round(max_grace_s * 1_000_000_000)
        self._high: deque[tuple[int, int]] = deque()  # (ts_recv, lag), lags decreasing: a rolling maximum
        self.lag_ns: int | None = None  # what `settled` subtracts; None until a trade's venue time is seen

    def observe(self, ts_event: int, ts_recv: int) -> None:
        """One trade's venue and receive times (ns); a trade without a venue time (0) says nothing."""
        if ts_event <= 0 or ts_recv <= 0:
            return
        lag, q = ts_recv - ts_event, self._high
        while q and q[-1][1] <= lag:
            q.pop()
        q.append((ts_recv, lag))
        while q[0][0] < ts_recv - self.window_ns:  # never empties: the newest is inside the window
            q.popleft()
        self.lag_ns = min(q[0][1], lag + self.max_grace_ns)

    def settled(self, ts_recv: int) -> int:
        """The venue time whose trades have all arrived by the time the receiver's clock reads `ts_recv`."""
        return ts_recv if self.lag_ns is None else ts_recv - self.lag_ns
