"""Recent bar closes per session, for the page's price chart.

The service sees every line pushed through it (websocket pushes and the feeds it runs)
and keeps, per session, a bounded ring of (time, close) parsed from rendered bar lines
(`HH:MM[:SS] CLOSE ...`, the first line of a day dated `YYYY-MM-DDTHH:MM`; see
streamllm/feeding/render.py). Lines that are not bars (trades, quotes, summaries) are
skipped. Feeds run in their own threads, so the book takes a lock.

`record` runs after a push was logged and acknowledged, so it never raises: a line that
looks like a bar but cannot be charted (an impossible date or time, a close that is not a
finite number) is skipped and counted (`unchartable`), never turned into an error reply
for a batch the engine already holds.
"""

from __future__ import annotations

import calendar
import math
import re
import threading
from collections import deque
from dataclasses import dataclass, field

DEFAULT_BARS = 600
_BAR = re.compile(r"(?:(\d{4})-(\d\d)-(\d\d)[T ])?(\d\d):(\d\d)(?::(\d\d))?(?:-[\d:]+)? (-?\d+(?:\.\d+)?)(?= |$)")
DAY = 86_400


@dataclass(slots=True)
class _Ring:
    closes: deque[tuple[float, float]]
    day: int = 0  # unix seconds of the current line date's midnight (0: undated, shown as 1970-01-01)
    last: float = -1.0
    count: int = 0  # bar lines seen, ever
    unchartable: int = 0  # bar-like lines skipped: impossible date or time, close not a finite number


@dataclass(slots=True)
class BarBook:
    size: int = DEFAULT_BARS
    _rings: dict[str, _Ring] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, session: str, lines: list[str]) -> int:
        """Parse bar lines of a push into the session's ring; returns how many were bars."""
        found = 0
        with self._lock:
            ring = self._rings.get(session)
            for line in lines:
                m = _BAR.match(line) if isinstance(line, str) else None
                if m is None:
                    continue
                if ring is None:
                    ring = self._rings[session] = _Ring(deque(maxlen=self.size))
                year, month, mday, hh, mm, ss, close = m.groups()
                day = _midnight(year, month, mday) if year is not None else ring.day
                price = float(close)
                if day is None or int(hh) > 23 or int(mm) > 59 or int(ss or 0) > 60 or not math.isfinite(price):
                    ring.unchartable += 1
                    continue
                ring.day = day
                t = ring.day + int(hh) * 3600 + int(mm) * 60 + int(ss or 0)
                if t < ring.last - 3600:  # the clock wrapped past midnight without a dated line
                    ring.day += DAY
                    t += DAY
                ring.last = t
                ring.closes.append((float(t), price))
                ring.count += 1
                found += 1
        return found

    def bars(self, session: str) -> tuple[list[tuple[float, float]], int]:
        """(the ring's (time, close) pairs, oldest first; bar lines seen in total)."""
        with self._lock:
            ring = self._rings.get(session)
            return ([], 0) if ring is None else (list(ring.closes), ring.count)

    def unchartable(self, session: str) -> int:
        """Bar-like lines of the session skipped because they could not be charted."""
        with self._lock:
            ring = self._rings.get(session)
            return 0 if ring is None else ring.unchartable

    def forget(self, session: str) -> None:
        with self._lock:
            self._rings.pop(session, None)


def _midnight(year: str, month: str, mday: str) -> int | None:
    """Unix seconds of a line date's midnight; None for a date no calendar has (2024-02-30, 2024-13-01)."""
    y, m, d = int(year), int(month), int(mday)
    if not (y >= 1 and 1 <= m <= 12 and 1 <= d <= calendar.monthrange(y, m)[1]):
        return None
    return calendar.timegm((y, m, d, 0, 0, 0))


class TapSink:
    """An attachment's sink: pushes to the engine, then records the pushed bars for the page."""

    def __init__(self, engine, book: BarBook) -> None:
        self.engine = engine
        self.book = book

    def push(self, session: str, lines: list[str], **kw):
        ack = self.engine.push(session, lines, **kw)
        self.book.record(session, lines)
        return ack

    def backlog(self, session: str) -> int:
        return self.engine.backlog(session)
