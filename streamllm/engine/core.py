"""EngineCore: the single writer. One thread owns sessions, the KV store, entries and compactions.

    callers ──commands──▶ inbox ──▶ [ drain commands → prepare → plan → execute → update → publish ] ─┐
       ▲                                                                                        │
       └──── futures resolved, ReadyRecords / SessionRecords published (immutable, swapped) ◀─────┘

Nothing else touches a block table: the facade (`api.Engine`), the server and the feed
attachments only submit commands and read what the core publishes. The core drains
its inbox between steps (at most `max_commands_per_drain` at a time, so a storm of
commands cannot starve the model), so a command never races a forward pass.

This file is the thread, the commands and the step loop. The core's other roles are base
classes sharing its state, on its thread: answering (entries, decoding, the gate) in
`answers.Answering`, keeping sessions inside their budgets in `compacting.Compacting`, and
what other threads read in `publishing.Publishing`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from streamllm.engine.answers import Answering
from streamllm.engine.commands import (
    Ask,
    Call,
    Cancel,
    CloseSession,
    Command,
    OpenSession,
    Push,
    Register,
    Stop,
    Unregister,
    WaitIdle,
    settle,
)
from streamllm.engine.compacting import Compacting
from streamllm.engine.compaction import CompactionCopy, CompactionPolicy
from streamllm.engine.kv import BlockTable
from streamllm.engine.outputs import (
    AdmissionError,
    EngineStopped,
    SessionError,
    SessionInfo,
    SessionRecord,
)
from streamllm.engine.prefixes import SharedPrefixes
from streamllm.engine.publishing import Publishing
from streamllm.engine.runner import Work
from streamllm.engine.scheduler import Plan
from streamllm.engine.sequence import ASK, Branch, Session
from streamllm.engine.taps import LineTaps

log = logging.getLogger("streamllm.engine")


class EngineCore(Answering, Compacting, Publishing):
    max_commands_per_drain = 256

    def __init__(self, *, model_name: str, tokenizer: Any, layout: Any, store: Any, runner: Any, scheduler: Any,
                 prepos: Any, hub: Any, policy: CompactionPolicy, branch_cells: int, stale_policy: str,
                 check_every_step: bool = False) -> None:
        self.model_name, self.tokenizer, self.layout = model_name, tokenizer, layout
        self.store, self.runner, self.scheduler, self.prepos, self.hub = store, runner, scheduler, prepos, hub
        self.policy, self.branch_cells, self.stale_policy = policy, branch_cells, stale_policy
        self.check_every_step = check_every_step
        self.line_taps = 0  # lines of features each session keeps for series heads (0: none served)
        self.tap_words: tuple[int | str, ...] = ()  # the words whose last token each line's features add
        self.word_starts: frozenset[int] = frozenset()  # the tokenizer's word-start ids (with tap_words)
        self.word_texts: tuple[str, ...] | None = None  # its token texts (with prefix words)
        self.sessions: dict[str, Session] = {}
        self.running: list[Branch] = []  # asks being prefilled or decoded
        self.waiting: list[Branch] = []  # asks waiting for their data version or for cells
        self.compactions: dict[str, CompactionCopy] = {}
        self.prefixes = SharedPrefixes(store)
        self.events: list[tuple] = []  # (session, kind, *payload), published after each update
        self._idle_waiters: list[Future] = []
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._held: Command | None = None  # taken from the inbox past a drain's limit; first in the next one
        self._stop = False
        self.stopped = False
        self.failure: BaseException | None = None
        # Published for other threads (replaced, never mutated): read without a round trip.
        self.records: dict[str, SessionRecord] = {}
        self.ready_records: dict[tuple[str, str], Any] = {}
        self.counters: dict[str, float] = {}
        self._dirty: set[str] = set()
        self.steps = self.questions_answered = self.fast_answers = self.entry_answers = 0
        self.admissions_refused = self.commands = self.failed_steps = self.compactions_deferred = 0
        self.compactions_preempted = 0
        self.stuck: set[str] = set()  # sessions at their budget with no room for a copy (logged once)
        self.step_ms_total = self.step_ms_last = 0.0
        self.step_tokens_last = 0
        self._step_s_ema = 0.05
        self._thread = threading.Thread(target=self._main, name="streamllm-core", daemon=True)

    # -- the thread ---------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    def submit(self, cmd: Command) -> Future:
        if self.stopped:
            settle(cmd.future, error=self._stopped_error())
            return cmd.future
        self._inbox.put(cmd)
        if self.stopped:  # stopped between the check and the put: nobody else will drain it
            self._fail_inbox()
        return cmd.future

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _stopped_error(self) -> EngineStopped:
        why = f"after an internal error: {self.failure!r}" if self.failure else "(shut down)"
        return EngineStopped(f"the engine is stopped {why}")

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in bookkeeping: stop loudly, never hang callers
            log.exception("engine core stopped")
            self.failure = exc
        finally:
            self.stopped = True
            self._fail_everything(self._stopped_error())
            self._fail_inbox()
            self._publish()

    def _loop(self) -> None:
        while True:
            self._drain(block=not self.has_work())
            if self._stop:
                return
            self._prepare()
            plan = self.scheduler.schedule(self._sequences())
            if plan:
                self._step(plan)
            self._publish()
            if not plan and self.has_work():  # blocked on cells: wait for a command or a retry
                self._drain(block=True, timeout=0.05)

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        cmd, self._held = self._held, None
        try:
            if cmd is None:
                cmd = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        for _ in range(self.max_commands_per_drain):
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
        # The rest waits for the next drain (the model keeps stepping). Held here, not put back at
        # the tail: commands apply in submission order (pushes carry facade-assigned versions).
        self._held = cmd

    def _fail_inbox(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            settle(held.future, error=self._stopped_error())
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            settle(cmd.future, error=self._stopped_error())

    # -- commands ---------------------------------------------------------------------
    def _apply(self, cmd: Command) -> None:
        self.commands += 1
        try:
            match cmd:
                case Ask():
                    self._ask(cmd)
                    return
                case WaitIdle():
                    self._idle_waiters.append(cmd.future)
                    return
                case Stop():
                    self._stop = True
                    result = None
                case OpenSession():
                    result = self.open_session(cmd.name, cmd.system, cmd.prefix_ids, cmd.max_context)
                case CloseSession():
                    result = self.close_session(cmd.name)
                case Push():
                    result = self._push(cmd)
                case Register():
                    result = self._register(cmd)
                case Unregister():
                    result = self._unregister(cmd)
                case Cancel():
                    result = self._cancel(cmd.ask_id)
                case Call():
                    result = cmd.fn(self)
                case _:
                    raise TypeError(f"unknown command {type(cmd).__name__}")
        except Exception as exc:  # a bad command fails its caller, never the core
            settle(cmd.future, error=exc)
            return
        self._publish_records()  # what the caller reads next already reflects its command
        settle(cmd.future, result=result)

    def session(self, name: str) -> Session:
        session = self.sessions.get(name)
        if session is None:
            raise SessionError(f"no session named {name!r}; open it first")
        return session

    def open_session(self, name: str, system: str, prefix: list[int], max_context: int) -> SessionInfo:
        if name in self.sessions:
            raise SessionError(f"session {name!r} is already open")
        manager = self.store.manager
        keep = self.admission_keep_free(max_context)
        if not manager.can_reserve(max_context, keep_free_tokens=keep):
            self.admissions_refused += 1
            raise AdmissionError(
                f"cannot open session {name!r}: it reserves {max_context} cells, the pool has "
                f"{manager.num_free_blocks * manager.block_size} free and keeps {keep} free for questions "
                "and compaction copies; close a session, lower max_context or raise max_cells")
        table = BlockTable()
        computed = self.prefixes.start(table, prefix)  # an identical frozen prefix is shared, not recomputed
        manager.reserve(table, max_context)
        session = Session(name, system, prefix, max_context, table)
        session.taps = self.new_taps()
        session.num_computed = computed
        self.sessions[name] = session
        self._dirty.add(name)
        return self.info(session)

    def close_session(self, name: str, *, evicting: bool = False) -> None:
        session = self.session(name)
        del self.sessions[name]
        self.stuck.discard(name)
        gone = SessionError(f"session {name!r} was closed")
        for st in self.prepos.drop_session(name):
            for br in st.waiters:
                settle(br.future, error=gone)
            self.ready_records.pop((name, st.spec.id), None)
        for br in [b for b in self.waiting + self.running if b.session is session]:
            self._drop_ask(br, gone)
        if not evicting:
            self.hub.drop_session(name)
        if name in self.compactions:
            self._drop_copy(name, preempted=False)
        self.store.manager.free(session.table)  # safe: no step is in flight while commands apply
        self.prefixes.forget_unused()
        self.records.pop(name, None)

    def _push(self, cmd: Push) -> int:
        session = self.session(cmd.name)
        version = session.append_batch(cmd.ids_per_line, time.monotonic())
        if version != cmd.version:  # the facade assigns versions in inbox order: a mismatch is a bug
            raise AssertionError(f"session {cmd.name!r}: core version {version}, acked {cmd.version}")
        if cmd.truths:
            self.prepos.expect(cmd.name, version, cmd.truths)
        self._maybe_compact(session)
        self._dirty.add(cmd.name)
        return version

    def _register(self, cmd: Register) -> None:
        self.prepos.register(self.session(cmd.name), cmd.spec, cmd.gate, cmd.prompt_ids)
        self._dirty.add(cmd.name)

    def _unregister(self, cmd: Unregister) -> None:
        self.session(cmd.name)
        st = self.prepos.unregister(cmd.name, cmd.question_id)
        self.ready_records.pop((cmd.name, cmd.question_id), None)
        for br in st.waiters:  # asks that waited for its entry are answered the cold way
            br.standing = None
            self.waiting.append(br)
        st.waiters.clear()
        self._dirty.add(cmd.name)

    def _cancel(self, ask_id: int) -> bool:
        for br in self.waiting + self.running + [b for st in self.prepos.all() for b in st.waiters]:
            if br.ask_id == ask_id:
                self._drop_ask(br, None)
                return True
        return False  # already answered: nothing to do

    def _drop_ask(self, br: Branch, error: BaseException | None) -> None:
        for where in (self.waiting, self.running):
            if br in where:
                where.remove(br)
        if br.standing is not None and br in br.standing.waiters:
            br.standing.waiters.remove(br)
        if br.table is not None:
            self.store.manager.free(br.table)
            br.table = None
        if error is not None:
            settle(br.future, error=error)
        elif br.future is not None:
            br.future.cancel()

    # -- planning -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.compactions or any(self._can_start(b) for b in self.waiting)
                    or any(s.pending_tokens for s in self.sessions.values())  # at budget too: not idle
                    or any(st.session.ready and (not st.fresh() or st.computing or st.decoding)
                           for st in self.prepos.all()))

    def _prepare(self) -> None:
        self._swap_compactions()  # a copy may have nothing to compute (its cut is past the session's data)
        self._keep_compactions_moving()
        self._start_waiting()
        self._make_room_for_questions()
        manager = self.store.manager
        copies = manager.blocks_for(sum(c.cells_to_go() for c in self.compactions.values()))
        for entry in self.prepos.refresh(keep_free_blocks=copies):  # head-only entries: no forward pass
            self._on_entry_ready(entry, None)
        self._waiters_without_entries()

    def _sequences(self) -> list:
        return [*self.running, *self.prepos.jobs(), *self.sessions.values(), *self.compactions.values()]

    def _step(self, plan: Plan) -> None:
        works = [Work(i.seq.table, i.token_ids, i.start_pos, i.want_logits,
                      want_hidden=i.want_logits == "last" and self.prepos.wants_hidden(i.seq),
                      want_tap=isinstance(i.seq, Session) and i.seq.taps is not None) for i in plan.items]
        t0 = time.perf_counter()
        try:
            logits = self.runner.execute(works)
        except Exception as exc:  # a failed forward fails its questions, never the engine
            log.exception("forward failed")
            self.failed_steps += 1
            self._fail_plan(plan, exc)
            return
        step_s = time.perf_counter() - t0
        self._update(plan, logits, works)
        self._swap_compactions()
        self.steps += 1
        self.step_ms_total += step_s * 1000
        self.step_ms_last, self.step_tokens_last = step_s * 1000, plan.num_tokens
        self._step_s_ema += 0.1 * (step_s - self._step_s_ema)
        if self.check_every_step:
            self.check_integrity()

    def new_taps(self) -> LineTaps | None:
        """A session's line features for the adapter's series heads (None when none are served)."""
        return LineTaps(self.line_taps, self.tap_words, self.word_starts, self.word_texts) if self.line_taps else None

    def _update(self, plan: Plan, logits: list, works: list[Work]) -> None:
        for item, lg, work in zip(plan.items, logits, works, strict=True):
            seq, n = item.seq, len(item.token_ids)
            if isinstance(seq, Session):
                if work.tap is not None:  # before advance: an entry made at the new version reads these lines
                    seq.tap(work.tap, item.start_pos, item.token_ids)
                had_prefix = seq.ready
                if seq.advance(n):
                    self.events.append((seq.name, "data", seq.name, seq.data_version))
                    self._dirty.add(seq.name)
                if seq.ready and not had_prefix:
                    self.prefixes.remember(seq.token_ids, seq.prefix_len, seq.table)
            elif isinstance(seq, CompactionCopy):
                seq.num_computed += n
            else:
                seq.num_computed += n
                if lg is not None:
                    self.on_logits(seq, lg, work.hidden)

    def _fail_plan(self, plan: Plan, exc: Exception) -> None:
        for item in plan.items:
            seq = item.seq
            if not isinstance(seq, Branch):  # give back the slots; the tokens stay pending and are retried
                self.store.truncate(seq.table, seq.num_computed)
                continue
            if seq.kind == ASK:
                self._drop_ask(seq, exc)
                continue
            self.prepos.release(seq)  # entries and decodes are recomputed on the next refresh
            st = seq.standing
            if st.computing is seq:
                st.computing = None
            if st.decoding is seq:
                st.decoding = None

    def _fail_everything(self, exc: Exception) -> None:
        for st in self.prepos.all():
            self.waiting.extend(st.waiters)
            st.waiters.clear()
        for br in self.waiting + self.running:
            settle(br.future, error=exc)
        self.waiting.clear()
        self.running.clear()
        for fut in self._idle_waiters:
            settle(fut, error=exc)
        self._idle_waiters.clear()
