"""The core's `Admission`: which sessions the pool takes, and how it makes room when it is short.

A session is admitted by its *working set*, not its max_context (`working_set`): its frozen
prefix and the newest `EngineConfig.working_set_tokens` of data. Admission reserves exactly
that, in one run (engine/kv.py), beside the cells kept free for branches and one compaction
copy (`Compactor.keep_free`), so

    sum of admitted working sets + keep_free <= the pool         (never overcommitted)

and a session never waits for cells inside its working set. Past it a session grows as
its lines arrive, in runs of `grow_blocks`, from what the pool has beyond keep_free, up
to its max_context, where compaction cuts it back as before.

When the pool is short (a session cannot take its next chunk, an open or restore was refused,
or no entry can move: `_entry_short`) `relieve`, once per turn of the core, makes room, cheapest
first (for entries, fresh ready entries stay: evicting one to compute another would churn):

    1. runs reserved past a session's working set and not filled yet go back;
    2. idle entries are evicted (recomputed when next needed);
    3. idle sessions go to disk: the shortfall is published (`cells_wanted` in stats) and a
       `ResidentEngine` with auto_evict spills idle sessions (furthest next push first), which
       come back on their next push or ask (durability/resident.py);
    4. after `grace_s` still short: the session furthest past its working set compacts down
       to it (a compaction copy of its newest window), one such copy at a time.

Nothing is dropped silently: compaction counts what it cuts (tokens_dropped), pushes that
wait for cells stay accepted, and a refused open says what it needed and what was free.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from streamllm.engine.outputs import AdmissionError

if TYPE_CHECKING:
    from streamllm.engine.compacting import Compactor
    from streamllm.engine.kv import KVStore
    from streamllm.engine.publishing import Publisher
    from streamllm.engine.sequence import Session
    from streamllm.engine.standing.prepos import Prepositioner


def working_set(prefix_len: int, max_context: int, window_tokens: int) -> int:
    """Cells a session is admitted for and always holds: its frozen prefix plus the newest
    window_tokens of data, never more than its max_context.

    What its questions read decides the window: a question decided by a series head reads the
    states of its session's last K lines (kept beside the cells, engine/taps.py), and the lines
    those states come from attend to the window before them; a free-text question reads the
    whole context, which grows past the window while the pool has room. Entries and asks take
    branch cells and a compaction copy its copy cells from the pool's keep_free, shared by all
    sessions, so neither is counted per session."""
    return max(1, min(max_context, prefix_len + window_tokens))


class Admission:
    """Admission by working set, and making room under pressure (core thread only)."""

    def __init__(self, *, store: KVStore, compactor: Compactor, prepos: Prepositioner, publisher: Publisher,
                 sessions: dict[str, Session], window_tokens: int, chunk_tokens: int, grace_s: float = 0.25) -> None:
        self.store = store
        self.compactor = compactor
        self.prepos = prepos
        self.publisher = publisher
        self.sessions = sessions  # the core's registry, read here
        self.window_tokens = window_tokens
        self.chunk_tokens = chunk_tokens  # the most a session's next step takes (what a blocked one needs)
        self.grace_s = grace_s  # how long idle sessions may go to disk before a busy one compacts
        self.refused = 0
        self.cells_wanted = 0  # cells the pool was short of at the last turn (0: not short)
        self.pressure_compactions = 0
        self._short_since: float | None = None
        self._refused_room: tuple[int, float] | None = None  # (free blocks a refused admission needed, when)
        self._copy_for: str | None = None  # the session a pressure copy is running for
        self._made_room_for_copy = False  # idle entries gave way to a pressure copy in this shortage

    def working_set(self, prefix_len: int, max_context: int) -> int:
        return working_set(prefix_len, max_context, self.window_tokens)

    def keep_free(self, max_context: int) -> int:
        """Cells kept free beside every working set (questions, entries, one compaction copy)."""
        return self.compactor.keep_free(max_context)

    def can_admit(self, cells: int, max_context: int | None = None) -> bool:
        """Whether the pool can reserve `cells` (a working set) beside the cells kept free and the cells
        sessions are owed (a session that could not re-reserve its working set after a compaction)."""
        m = self.store.manager
        keep = self.keep_free(max_context or cells) + self.cells_owed()
        return m.can_reserve(cells, keep_free_tokens=keep)

    def admit(self, name: str, cells: int, max_context: int, action: str = "open") -> None:
        """Refuse (AdmissionError) a working set of `cells` the pool cannot hold now, after giving back
        what costs nothing (runs past working sets, idle entries); the caller reserves it (one run)."""
        manager = self.store.manager
        if not self.can_admit(cells, max_context):
            self._give_back_free()
        if not self.can_admit(cells, max_context):
            self.refused += 1
            keep = self.keep_free(max_context)
            free = manager.num_free_blocks * manager.block_size
            beyond = self.cells_past_working_sets()
            if beyond:  # grown sessions hold it: make room for the next try (spills, then compaction)
                self._refused_room = (manager.blocks_for(cells) + manager.blocks_for(keep), time.monotonic())
            held = (f"; sessions hold {beyond} cells past their working sets, given back under pressure "
                    "(retry shortly)" if beyond else "")
            raise AdmissionError(
                f"cannot {action} session {name!r}: its working set needs {cells} cells, the pool has {free} "
                f"free and keeps {keep} free for questions and compaction copies{held}; close a session, "
                "lower max_context or working_set_tokens, or raise max_cells")
        manager.keep_free = manager.blocks_for(self.keep_free(max_context))

    def cells_owed(self) -> int:
        """Cells of their working sets that sessions do not hold (taken back when the pool has them)."""
        m = self.store.manager
        return m.block_size * sum(max(0, m.blocks_for(s.working_set) - len(s.table.blocks) - len(s.table.reserved))
                                  for s in self.sessions.values())

    def cells_past_working_sets(self) -> int:
        """Cells sessions hold (filled or reserved) beyond their working sets."""
        m = self.store.manager
        return m.block_size * sum(max(0, len(s.table.blocks) + len(s.table.reserved) - m.blocks_for(s.working_set))
                                  for s in self.sessions.values())

    # -- pressure ---------------------------------------------------------------------
    def relieve(self) -> None:
        """Once per turn: measure how short the pool is and make room in the order above."""
        short = self._short_blocks()
        # What the sessions blocked on growth wait for, also once room is made: new entries leave it.
        self.prepos.held_blocks = self.store.manager.keep_free + short if short else 0
        if short and self._give_back_free(entries=self._short_since is None):  # entries: once an episode
            short = self._short_blocks()
        for_entries = not short and self._entry_short() > 0  # no session waits, but no entry can move
        if for_entries:
            # Fresh entries stay: evicting one to compute another frees nothing for long (and a pool
            # too small for every entry would churn). Stale ones go: their replacements are what waits.
            if self._give_back_free(entries=False) + self.prepos.evict_idle_entries(set(), stale_only=True):
                self.publisher.drop_evicted()
            short = self._entry_short()
        self.cells_wanted = short * self.store.manager.block_size
        if not short:
            self._short_since = None
            self._made_room_for_copy = False
            return
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since >= self.grace_s:
            if (for_entries and not self._made_room_for_copy and self._copy_for not in self.compactor.copies
                    and self._past_working_sets()):
                self._give_back_free()  # room for the copy, which makes room that lasts (once an episode)
                self._made_room_for_copy = True
            self._compact_the_largest()

    def _short_blocks(self) -> int:
        """Blocks sessions blocked on growth need beyond what they may take, or that a refused
        admission needed (for a few seconds: its caller retries)."""
        m = self.store.manager
        short = 0
        ample = m.num_free_blocks - m.keep_free > m.blocks_for(self.chunk_tokens)  # no session's next chunk can block
        for s in () if ample else self.sessions.values():  # (so the loop costs nothing while there is room)
            held = len(s.table.blocks) + len(s.table.reserved)
            if held < m.blocks_for(s.working_set) and m.blocks_for(s.working_set) - held <= m.num_free_blocks:
                m.reserve(s.table, s.working_set)  # owed since a compaction swap found the pool short
            n = min(s.pending_tokens, s.max_context - s.num_computed, self.chunk_tokens)
            if n > 0 and not m.can_append(s.table, n):
                short += m.blocks_needed(s.table, n) - m.available_to(s.table)
        if self._refused_room is not None:
            need, since = self._refused_room
            if m.num_free_blocks >= need or time.monotonic() - since > 10.0 or not self.cells_past_working_sets():
                self._refused_room = None
            else:
                short = max(short, need - m.num_free_blocks)
        return short

    def _entry_short(self) -> int:
        """Blocks the pool lacks for one entry to move when none can: the entry computing that
        `Answerer.make_room` keeps (it preempts the others), or with none computing, the smallest
        entry waiting to start. 0 while an entry can move, or a question or standing decode in flight
        will give cells back: entries are background work, and wait for those."""
        m, prepos = self.store.manager, self.prepos
        free = m.num_free_blocks
        if free - m.keep_free > m.blocks_for(self.chunk_tokens):  # room for any entry's next chunk
            return 0
        needs = [m.blocks_needed(e.table, min(len(e.pending_ids), self.chunk_tokens))
                 for e in prepos.computing() if e.pending_ids]
        if not needs:
            to_go = self.compactor.blocks_to_go()
            needs = [to_go + prepos.start_blocks(st) for st in prepos.all()
                     if st.computing is None and st.session.ready and not st.fresh()]
        if not needs or min(needs) <= free or self.compactor.answerer.running or any(
                st.decoding is not None for st in prepos.all()) or any(
                not self.compactor.copy_blocked(c) for c in self.compactor.copies.values()):
            # a copy moving frees its session's old cells
            return 0
        return min(needs) - free

    def _give_back_free(self, entries: bool = True) -> int:
        """Steps 1 and 2: unfilled runs past working sets, then idle entries; returns blocks freed.
        Entries go once per episode of pressure: they are recomputed when stale, and evicting them
        every turn would only churn; compaction (step 4) is what ends a lasting shortage."""
        m = self.store.manager
        freed = sum(m.trim(s.table, s.working_set) for s in self.sessions.values() if s.table.reserved)
        if entries:
            evicted = self.prepos.evict_idle_entries(set(), computing=True)
            if evicted:
                self.publisher.drop_evicted()
            freed += evicted
        return freed

    def _compact_the_largest(self) -> None:
        """Step 4: one session past its working set compacts down to it (one such copy at a time)."""
        if self._copy_for is not None and self._copy_for in self.compactor.copies:
            return
        self._copy_for = None
        for session in self._past_working_sets():
            keep = min(session.working_set - session.prefix_len, self.compactor.policy.keep_tokens(session))
            if self.compactor.start(session, keep):
                self._copy_for = session.name
                self.pressure_compactions += 1
                return

    def _past_working_sets(self) -> list[Session]:
        """Sessions a block or more past their working sets, furthest first (what step 4 may compact)."""
        bs = self.store.manager.block_size
        past = [(s.num_computed - s.working_set, s) for s in self.sessions.values()
                if s.ready and s.name not in self.compactor.copies and s.num_computed - s.working_set >= bs]
        return [s for _, s in sorted(past, key=lambda p: -p[0])]
