"""Recent bar closes per session, for the page's price chart.

The service sees every line pushed through it (websocket pushes and the feeds it runs)
and keeps, per session, a bounded ring of (time, close) parsed from rendered bar lines
(`HH:MM[:SS] CLOSE ...`, the first line of a day dated `YYYY-MM-DDTHH:MM`; see
streamllm/feeding/render.py). Lines that are not bars (trades, quotes, summaries) are
skipped. Feeds run in their own threads, so the book takes a lock.
"""

from __future__ import annotations

import calendar
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
                if year is not None:
                    ring.day = calendar.timegm((int(year), int(month), int(mday), 0, 0, 0))
                t = ring.day + int(hh) * 3600 + int(mm) * 60 + int(ss or 0)
                if t < ring.last - 3600:  # the clock wrapped past midnight without a dated line
                    ring.day += DAY
                    t += DAY
                ring.last = t
                ring.closes.append((float(t), float(close)))
                ring.count += 1
                found += 1
        return found

    def bars(self, session: str) -> tuple[list[tuple[float, float]], int]:
        """(the ring's (time, close) pairs, oldest first; bar lines seen in total)."""
        with self._lock:
            ring = self._rings.get(session)
            return ([], 0) if ring is None else (list(ring.closes), ring.count)

    def forget(self, session: str) -> None:
        with self._lock:
            self._rings.pop(session, None)


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
