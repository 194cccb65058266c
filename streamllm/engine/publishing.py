"""What the core publishes for other threads to read: session records, ready records, counters, events.

Readers (the facade, the server, `stats`) never lock the core: after each command and
each turn, the core's `Publisher` builds immutable `SessionRecord`s for the sessions
marked changed, swaps in the counters, hands the turn's events to the subscription hub
and settles idle waiters. It runs on the core thread only: it reads sessions and entries
mid-turn, which only the core writes, so a record is never torn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from enum import StrEnum

from streamllm.engine.commands import settle
from streamllm.engine.outputs import ReadyRecord, SessionRecord, StandingAnswer
from streamllm.engine.sequence import Session
from streamllm.engine.standing.prepos import Prepositioner, Standing
from streamllm.engine.subscriptions import SubscriptionHub


class EventKind(StrEnum):
    """What a hub event tells subscribers."""

    DATA = "data"  # a session advanced: (session, data_version)
    STANDING = "standing"  # a standing answer changed: (StandingAnswer,)


class Publisher:
    """Records, ready records, counters and events: filled on the core thread, read by any thread."""

    def __init__(self, *, sessions: dict[str, Session], prepos: Prepositioner, hub: SubscriptionHub) -> None:
        self.sessions = sessions  # the core's registry, read here
        self.prepos = prepos
        self.hub = hub
        # Read by other threads without a round trip.
        self.records: dict[str, SessionRecord] = {}
        self.ready_records: dict[tuple[str, str], ReadyRecord] = {}
        self.counters: dict[str, float] = {}
        self._events: list[tuple] = []  # (session, kind, *payload), handed to the hub after each turn
        self._dirty: set[str] = set()  # sessions whose record is rebuilt at the next publish
        self._idle_waiters: list[Future] = []

    # -- what changed this turn ----------------------------------------------------
    def mark(self, session: str) -> None:
        """The session's record is rebuilt at the next publish."""
        self._dirty.add(session)

    def data(self, session: Session) -> None:
        """The session's data version moved: subscribers hear of it."""
        self._events.append((session.name, EventKind.DATA, session.name, session.data_version))
        self._dirty.add(session.name)

    def standing(self, st: Standing, changed: StandingAnswer | None) -> None:
        """A standing answer was set; `changed` (None: same text as before) is pushed when its question pushes."""
        self._dirty.add(st.session.name)
        if changed is not None and st.spec.push:  # push = false: kept for `standing`, told to nobody
            self._events.append((st.session.name, EventKind.STANDING, changed))

    def ready(self, st: Standing) -> None:
        self.ready_records[(st.session.name, st.spec.id)] = st.record

    def drop_ready(self, session: str, question_id: str) -> None:
        self.ready_records.pop((session, question_id), None)

    def drop_evicted(self) -> None:
        """Ready records whose entries were evicted go: the fast path must not answer from them."""
        for st in self.prepos.all():
            if st.record is None:
                self.ready_records.pop((st.session.name, st.spec.id), None)

    def forget(self, session: str) -> None:
        self.records.pop(session, None)
        self._dirty.discard(session)

    # -- publishing ---------------------------------------------------------------
    def wait_idle(self, future: Future) -> None:
        self._idle_waiters.append(future)

    def publish_records(self) -> None:
        for name in self._dirty:
            s = self.sessions.get(name)
            if s is not None:
                sts = self.prepos.standing(name)
                self.records[name] = SessionRecord(s.info(), tuple(st.answer for st in sts if st.answer),
                                                   tuple(st.spec for st in sts))
        self._dirty.clear()

    def publish(self, counters: dict[str, float], idle: Callable[[], bool]) -> None:
        """Records, counters and events out; idle waiters settled when `idle()` says nothing is left."""
        self.publish_records()
        self.counters = counters
        events, self._events = self._events, []
        for session, kind, *payload in events:
            self.hub.publish(session, kind, *payload)
        if self._idle_waiters and idle():
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                settle(fut, result=True)

    def fail_idle_waiters(self, exc: BaseException) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for fut in waiters:
            settle(fut, error=exc)
