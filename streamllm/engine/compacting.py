"""The core's `Compactor`: keeps sessions inside their budgets by starting, preempting and swapping copies.

    push / swap ──▶ maybe_start: policy says start, the pool holds it ──▶ copies[name]
    each turn ───▶ shift_some: a shifting copy moves its next chunk of cells (no forward pass)
    each turn ───▶ keep_moving: a session at budget must move (preempt, recut, or log once)
    each step ───▶ swap_caught_up: a copy caught up ──▶ becomes the session's table, old one freed

The copy itself and the policy (when to start, what to keep) are `compaction.py`; this
is the core-side half. It runs on the core thread only, between steps: it forks, frees
and reserves block tables and swaps a session's table, and the core is their one writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from streamllm.engine.answers import Answerer
from streamllm.engine.compaction import CompactionCopy, CompactionPolicy, copy_size
from streamllm.engine.kv import BlockTable, KVCapacityError, KVStore
from streamllm.engine.publishing import Publisher
from streamllm.engine.scheduler import SchedulerConfig
from streamllm.engine.sequence import Session
from streamllm.engine.standing.prepos import Prepositioner
from streamllm.engine.stats import StepTimes

log = logging.getLogger("streamllm.engine")

SHIFT_CHUNK = 512  # tokens a shifting copy moves in one turn between steps


class Compactor:
    """Compaction copies in flight, and the cells admission keeps free so that one can always start."""

    def __init__(self, *, store: KVStore, policy: CompactionPolicy, branch_cells: int, sessions: dict[str, Session],
                 prepos: Prepositioner, answerer: Answerer, publisher: Publisher,
                 scheduler_config: SchedulerConfig, step_times: StepTimes,
                 shift_keys: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> None:
        self.store = store
        self.policy = policy
        self.branch_cells = branch_cells  # cells kept free for questions and entries
        self.sessions = sessions  # the core's registry, read here
        self.prepos = prepos
        self.answerer = answerer
        self.publisher = publisher
        self.scheduler_config = scheduler_config  # its background floor sets a copy's pace, its chunk a copy's next step
        self.step_times = step_times
        self.copies: dict[str, CompactionCopy] = {}  # session -> its copy in flight
        self.stuck: set[str] = set()  # sessions at their budget with no room for a copy (logged once)
        self.deferred = 0  # copies not started for want of cells (retried each turn)
        self.preempted = 0
        self.tokens_computed = 0  # tokens copies computed (swapped in or preempted): what compaction cost
        self.tokens_shifted = 0  # tokens copies moved without a forward pass (`CompactionPolicy.method` "shift")
        # "shift": the model's key turn (LlamaForward.shift_keys); None: copies recompute their lines
        self.shift_keys = shift_keys if policy.method == "shift" else None

    def keep_free(self, max_context: int) -> int:
        """Cells an admission leaves free beside every session's reservation: the cells kept for
        questions, or a compaction copy of the largest session at its budget, whichever is more.

        Questions and copies take turns with these cells: idle entries are evicted for a copy and
        questions finish. Without room for one copy, a session at its budget could never move."""
        largest = max([max_context, *(s.max_context for s in self.sessions.values())])
        return self.policy.keep_free(self.branch_cells, largest)

    def blocks_to_go(self) -> int:
        """Blocks the copies in flight still need (entries leave them free)."""
        return self.store.manager.blocks_for(sum(c.cells_to_go() for c in self.copies.values()))

    def tables(self) -> list[BlockTable]:
        return [c.table for c in self.copies.values()]

    def maybe_start(self, session: Session) -> None:
        """Start a copy of `session` when the policy calls for one and the pool can hold it."""
        if session.name in self.copies or not session.ready:
            return
        copy_rate = self.scheduler_config.background_floor / max(self.step_times.s_ema, 1e-3)
        if not self.policy.should_start(session, copy_rate):
            return
        self.start(session, self.policy.keep_tokens(session))

    def start(self, session: Session, keep_tokens: int) -> bool:
        """Start a copy of `session` keeping its newest keep_tokens of data, when the pool holds it
        (the policy's copies above; admission's under pressure, admission.py)."""
        if session.name in self.copies or not session.ready:
            return False
        cut = session.compaction_cut(keep_tokens)
        if cut is None:
            return False
        # A copy takes cells from the free pool until its swap frees the old table: start one only
        # when the pool can hold it beside the copies in flight (else retry each turn). Starting
        # them all at once under pressure left every copy half built and every session stuck.
        manager = self.store.manager
        need = manager.blocks_for(copy_size(session, cut)) - session.prefix_len // manager.block_size
        need += sum(manager.blocks_needed(c.table, c.cells_to_go()) for c in self.copies.values())
        if manager.num_free_blocks < need:
            self.deferred += 1
            return False
        # The copy starts on the session's own prefix blocks: shared, not recomputed, not duplicated.
        table = self.store.fork(session.table, session.prefix_len)
        copy = CompactionCopy(session, cut, table, num_computed=session.prefix_len, shifts=self.shift_keys is not None)
        self.copies[session.name] = copy
        self.stuck.discard(session.name)
        self._shift(copy)  # a short copy is whole at once, and swaps in before the next step
        return True

    def shift_some(self) -> bool:
        """Between two steps: move the next chunk of every shifting copy; whether any moved."""
        return any([self._shift(copy) for copy in self.copies.values()])

    def _shift(self, copy: CompactionCopy) -> bool:
        """Move up to SHIFT_CHUNK of the cells `copy`'s session computed past the cut, keys turned to their
        new positions, values as they are (nothing when the pool has no room: `keep_moving` sees it blocked)."""
        n = min(copy.to_shift(), SHIFT_CHUNK)  # 0 for a copy that recomputes
        if n <= 0 or self.copy_blocked(copy):
            return False
        session, manager, pool = copy.session, self.store.manager, self.store.pool
        done = copy.num_computed - session.prefix_len  # tokens moved so far
        manager.append(copy.table, n)
        src = manager.slots(session.table, copy.cut + done, copy.cut + done + n).to(pool.k.device)
        dst = manager.slots(copy.table, copy.num_computed, copy.num_computed + n).to(pool.k.device)
        pool.v.index_copy_(2, dst, pool.v.index_select(2, src))
        pool.k.index_copy_(2, dst, self.shift_keys(pool.k.index_select(2, src), session.prefix_len - copy.cut))
        copy.num_computed += n
        self.tokens_shifted += n
        return True

    def forget(self, name: str) -> None:
        """A session closed: its copy (if any) goes, unpreempted."""
        self.stuck.discard(name)
        if name in self.copies:
            self.drop(name, preempted=False)

    def copy_blocked(self, copy: CompactionCopy) -> bool:
        """Whether `copy` has cells to compute or move and the pool cannot take its next chunk."""
        if copy.shifts:
            need = min(copy.to_shift(), SHIFT_CHUNK)
        else:
            need = min(len(copy.pending_ids), self.scheduler_config.chunk_tokens)
        return bool(need) and not self.store.manager.can_append(copy.table, need)

    def _stalled_at_budget(self) -> list[Session]:
        """Sessions at their budget whose copy cannot start or cannot take its next chunk (copies
        are (re)started here first, when they fit)."""
        stalled = []
        for session in self.sessions.values():
            if not session.at_budget:
                continue
            if session.name not in self.copies:
                self.maybe_start(session)
            copy = self.copies.get(session.name)
            if copy is None or self.copy_blocked(copy):
                stalled.append(session)
        return stalled

    def keep_moving(self) -> None:
        """A session at its budget ingests nothing until its copy swaps in: make sure one can.

        Recomputable work gives way, cheapest first: idle entries, then (when no question in
        flight will give cells back and no session at budget is moving) other compaction copies,
        as vLLM and nano-vllm preempt requests when blocks run out: their cells are freed and they
        are started again, one at a time, when they fit. The oldest copy at budget is kept; if it
        still cannot move, its cut predates its session filling up, and it is cut afresh: a copy
        started at budget needs at most `retain` x max_context cells, which admission keeps free.
        Anything still stuck is logged (once) and counted, never dropped: its pushes stay pending."""
        stalled = self._stalled_at_budget()
        if not stalled:
            self._preempt_blocked_early_copies()
            return
        if self.prepos.evict_idle_entries(set(), computing=True):
            self.publisher.drop_evicted()
            stalled = self._stalled_at_budget()
        if not stalled or self.answerer.will_free_cells():
            return  # questions (and entries they wait for) give their cells back when they finish
        at_budget = [c for c in self.copies.values() if c.session.at_budget]
        if any(not self.copy_blocked(c) for c in at_budget):
            return  # one is moving: its swap gives cells back
        keep = at_budget[0] if at_budget else None
        for name, copy in list(self.copies.items()):
            if copy is not keep:
                self.drop(name)
        if keep is not None and self.copy_blocked(keep):
            session = keep.session
            if session.compaction_cut(self.policy.keep_tokens(session)) != keep.cut:
                self.drop(session.name)
        manager = self.store.manager
        for session in self._stalled_at_budget():  # nothing left to give way: say so, once
            if session.name not in self.stuck:
                self.stuck.add(session.name)
                log.error("session %s is at its budget of %d cells and the pool has %d free, not enough for "
                          "a compaction copy (up to %d): its pushes wait, accepted, until cells free up; close "
                          "a session or raise max_cells", session.name, session.max_context,
                          manager.num_free_blocks * manager.block_size, self.policy.copy_cells(session.max_context))

    def _preempt_blocked_early_copies(self) -> None:
        """A copy started before its session filled up grows as the session computes. If the pool
        runs dry meanwhile and the feed goes quiet, its session never reaches its budget (so the
        rescue above never runs) and the copy would wait for cells forever, the engine never idle.
        When nothing will give cells back (no question, no other copy moving), such copies are
        preempted: cheap to redo, and `maybe_start` starts one afresh, with a fresh cut, once
        the pool holds it (or the session reaches its budget, where entries give way to it)."""
        blocked = [c for c in self.copies.values() if self.copy_blocked(c)]
        if not blocked or len(blocked) < len(self.copies) or self.answerer.will_free_cells():
            return  # a copy moving (its swap frees cells) or a question running will give cells back
        for copy in blocked:
            self.drop(copy.session.name)

    def drop(self, name: str, preempted: bool = True) -> None:
        """Preempt a compaction copy: its cells go back to the pool; it is started again when it fits."""
        job = self.copies.pop(name)
        self.tokens_computed += job.tokens_computed()
        self.store.manager.free(job.table)
        self.preempted += preempted

    def swap_caught_up(self) -> None:
        for name, job in list(self.copies.items()):
            if not job.caught_up():
                continue
            session = job.session
            del self.copies[name]
            self.tokens_computed += job.tokens_computed()
            old, version = session.table, session.data_version
            session.apply_compaction(job.cut, job.table, job.num_computed)
            if session.data_version != version:
                self.publisher.data(session)
            self.store.manager.free(old)  # asks forked from it hold their own references until they end
            self.prepos.rebase(name)
            session.table.grow_to = session.max_context  # the copy's table is the session's now: it grows as it did
            try:
                self.store.manager.reserve(session.table, session.working_set)
            except KVCapacityError:
                log.warning("session %s: compacted, but could not re-reserve its working set", name)
            self.publisher.mark(name)
            self.maybe_start(session)  # pushes that arrived meanwhile may call for the next one
