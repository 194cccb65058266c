"""What the core publishes for other threads to read, and the integrity check tests call.

Readers (the facade, the server, `stats`) never lock the core: after each command and
each turn, the core builds immutable `SessionRecord`s and counters and *replaces* the
dicts others read, then hands out events and settles idle waiters. This runs on the core
thread only: it reads sessions, entries and block tables mid-turn, which only the core
writes, so a snapshot is never torn. `check_integrity` runs there too (`Engine.call`).
"""

from __future__ import annotations

from streamllm.engine.commands import settle
from streamllm.engine.outputs import SessionInfo, SessionRecord
from streamllm.engine.sequence import ASK, DECODE, ENTRY, Session
from streamllm.engine.stats import core_counters


class Publishing:
    """The publishing half of EngineCore (a base class: it shares the core's state)."""

    def info(self, s: Session) -> SessionInfo:
        return SessionInfo(s.name, s.data_version, s.pushed_version, s.num_tokens, s.num_computed,
                           s.prefix_len, s.max_context, s.backlog_lines, s.lines_ingested, s.compactions)

    def _publish(self) -> None:
        self._publish_records()
        self.counters = core_counters(self)
        events, self.events = self.events, []
        for session, kind, *payload in events:
            self.hub.publish(session, kind, *payload)
        if self._idle_waiters and not self.has_work():
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                settle(fut, result=True)

    def _publish_records(self) -> None:
        for name in self._dirty:
            s = self.sessions.get(name)
            if s is not None:
                sts = self.prepos.standing(name)
                self.records[name] = SessionRecord(self.info(s), tuple(st.answer for st in sts if st.answer),
                                                   tuple(st.spec for st in sts))
        self._dirty.clear()

    def check_integrity(self) -> None:
        """Refcounts equal the references held by every table the core owns, and every branch in
        flight holds what its role needs (after every step with `check_every_step`)."""
        tables = [s.table for s in self.sessions.values()]
        tables += [b.table for b in self.running + self.waiting if b.table is not None]
        tables += [job.table for job in self.compactions.values()]
        tables += self.prefixes.tables()
        for st in self.prepos.all():
            tables += [b.table for b in st.branches() if b.table is not None]
        self.store.manager.check_integrity(tables)
        for br in self.running:
            assert br.kind == ASK and br.table is not None, f"running branch without cells: {br.question!r}"
        for st in self.prepos.all():
            assert st.computing is None or st.computing.kind == ENTRY
            assert st.decoding is None or st.decoding.kind == DECODE
