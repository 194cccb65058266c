"""A replica's outgoing events, numbered, for the front door's long-poll (`Replica.events`).

The engine publishes standing-answer changes and ingested data versions on its core
thread; the journal appends them (cheap: a lock and a deque) and wakes the pollers.
`since(after, timeout)` returns everything after sequence number `after`, waiting up
to `timeout` for something new. The journal is bounded: a poller that fell further
behind than it holds gets `gap=True` and resynchronizes from the standing snapshots.
Each replica incarnation has its own id: after a restart numbering starts again.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    session: str
    kind: str  # "standing" (args: (StandingAnswer,)) | "data" (args: (session, data_version))
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class EventBatch:
    incarnation: str
    next_seq: int  # pass it back as `after`
    events: tuple[Event, ...]
    gap: bool  # events between `after` and the first one returned were dropped from the journal


class EventJournal:
    def __init__(self, maxlen: int = 100_000) -> None:
        self.incarnation = uuid.uuid4().hex
        self._events: collections.deque[Event] = collections.deque(maxlen=maxlen)
        self._seq = 0
        self._cond = threading.Condition()

    def append(self, session: str, kind: str, *args: Any) -> None:
        with self._cond:
            self._seq += 1
            self._events.append(Event(self._seq, session, kind, args))
            self._cond.notify_all()

    def since(self, after: int, timeout: float) -> EventBatch:
        with self._cond:
            if self._seq <= after:
                self._cond.wait_for(lambda: self._seq > after, timeout)
            first = self._events[0].seq if self._events else self._seq + 1
            gap = after + 1 < first and after < self._seq
            newer = min(self._seq - after, len(self._events)) if self._seq > after else 0
            out = tuple(itertools.islice(reversed(self._events), newer))[::-1]
            return EventBatch(self.incarnation, max(after, self._seq), out, gap)

    def of(self, session: str) -> list[Event]:
        """Every event of one session still in the journal (tests compare deliveries with it)."""
        with self._cond:
            return [e for e in self._events if e.session == session]
