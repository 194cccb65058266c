"""EngineCore: the single writer. One thread owns sessions, the KV store, entries and compactions.

    callers ──commands──▶ inbox ──▶ [ drain commands → prepare → plan → execute → update → publish ] ─┐
       ▲                                                                                        │
       └──── futures resolved, ReadyRecords / SessionRecords published (immutable, swapped) ◀─────┘

Nothing else touches a block table: the facade (`api.Engine`), the server and the feed
attachments only submit commands and read what the core publishes. The core drains
its inbox between steps (at most `max_commands_per_drain` at a time, so a storm of
commands cannot starve the model), so a command never races a forward pass. The one
exception is `_cut_in`: between two layers of a step of ingest, asks are applied and run
a step of their own on cells the running step does not touch (docs/engine.md).

This file is the thread, the commands, the session registry and the step loop. The rest
is done by components the core builds and owns, each told its dependencies, all on its
thread (mini-sglang's scheduler and its managers are the model):

    EngineCore ─┬─ Publisher   what other threads read: records, ready records, counters, events
                ├─ Answerer    asks waiting and running, entries landing, answers and standing answers
                ├─ Compactor   compaction copies: start, keep moving, preempt, swap; the admission margin
                └─ Admission   sessions admitted by working set; room made when the pool is short
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from streamllm.engine import state as session_state
from streamllm.engine.admission import Admission
from streamllm.engine.answers import Answerer
from streamllm.engine.commands import (
    Ask,
    Call,
    CanAdmit,
    Cancel,
    CloseSession,
    Command,
    EvictState,
    ExportSession,
    ImportSession,
    OpenSession,
    Push,
    Register,
    Stop,
    SwapLearned,
    Unregister,
    WaitIdle,
    settle,
)
from streamllm.engine.compacting import Compactor
from streamllm.engine.compaction import CompactionCopy, CompactionPolicy
from streamllm.engine.kv import BlockTable, KVStore
from streamllm.engine.outputs import (
    EngineStopped,
    ReadyRecord,
    SessionError,
    SessionInfo,
    SessionRecord,
    StalePolicy,
)
from streamllm.engine.prefixes import SharedPrefixes
from streamllm.engine.prompt import PromptLayout
from streamllm.engine.publishing import Publisher
from streamllm.engine.runner import Runner, Work
from streamllm.engine.scheduler import Plan, Scheduler
from streamllm.engine.sequence import (
    AskBranch,
    Branch,
    DecodeBranch,
    EntryBranch,
    Logits,
    SchedClass,
    Sequence,
    Session,
)
from streamllm.engine.standing.prepos import Prepositioner, Standing
from streamllm.engine.stats import StepTimes, core_counters
from streamllm.engine.subscriptions import SubscriptionHub
from streamllm.engine.taps import LINE_SLACK, TapConfig, Word

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from streamllm.config import QuestionSpec
    from streamllm.engine.standing.gate import Gate

log = logging.getLogger("streamllm.engine")


class EngineCore:
    max_commands_per_drain = 256

    def __init__(self, *, model_name: str, tokenizer: PreTrainedTokenizerBase, layout: PromptLayout,
                 store: KVStore, runner: Runner, scheduler: Scheduler, prepos: Prepositioner, hub: SubscriptionHub,
                 policy: CompactionPolicy, branch_cells: int, stale_policy: StalePolicy,
                 taps: TapConfig | None = None, taps_on_open: bool = True, check_every_step: bool = False,
                 working_set_tokens: int = 1024) -> None:
        self.model_name, self.tokenizer, self.layout = model_name, tokenizer, layout
        self.store, self.runner, self.scheduler, self.prepos, self.hub = store, runner, scheduler, prepos, hub
        self.taps = taps or TapConfig()  # the line features sessions keep for series heads (served or learning)
        # An adapter's series heads read every session's lines from its start; without them only a session
        # with a learning question keeps lines, from when the question is registered.
        self.taps_on_open = taps_on_open
        if prepos.learning is not None:  # a finished fit wakes the core to swap its head in between steps
            prepos.learning.wake = lambda: self.submit(SwapLearned())
        self.check_every_step = check_every_step
        self.sessions: dict[str, Session] = {}  # the one registry of open sessions; only the core writes it
        self.prefixes = SharedPrefixes(store)
        self.step_times = StepTimes()
        self.publisher = Publisher(sessions=self.sessions, prepos=prepos, hub=hub)
        self.answerer = Answerer(store=store, prepos=prepos, publisher=self.publisher, tokenizer=tokenizer,
                                 eos_ids=layout.eos_ids, scheduler_config=scheduler.config,
                                 stale_policy=StalePolicy(stale_policy))
        self.compactor = Compactor(store=store, policy=policy, branch_cells=branch_cells, sessions=self.sessions,
                                   prepos=prepos, answerer=self.answerer, publisher=self.publisher,
                                   scheduler_config=scheduler.config, step_times=self.step_times,
                                   shift_keys=runner.model.shift_keys)
        self.admission = Admission(store=store, compactor=self.compactor, prepos=prepos, publisher=self.publisher,
                                   sessions=self.sessions, window_tokens=working_set_tokens,
                                   chunk_tokens=scheduler.config.chunk_tokens)
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Taken from the inbox but not applied yet (past a drain's limit, or left by a cut-in): first in the
        # next drain, in the order they came.
        self._held: collections.deque[Command] = collections.deque()
        self._ask_waiting = False  # submit() saw an Ask: the running step lets it cut in (`_cut_in`)
        self._step_t0 = 0.0  # when the running step started
        self._cut_in_s = 0.0  # wall time the running step lent to cut-ins (its own cost excludes it)
        self._stop = False
        self._shifted = False  # this turn moved cells of a shifting compaction copy: the next turn moves more
        self.stopped = False
        self.failure: BaseException | None = None
        self.commands = self.failed_steps = 0
        self.failing_in_a_row = 0  # failed steps since the last one that succeeded
        self.last_step_error: str | None = None
        self._thread = threading.Thread(target=self._main, name="streamllm-core", daemon=True)

    # -- what other threads read (published, replaced, never mutated by readers) ----
    @property
    def records(self) -> dict[str, SessionRecord]:
        return self.publisher.records

    @property
    def ready_records(self) -> dict[tuple[str, str], ReadyRecord]:
        return self.publisher.ready_records

    @property
    def counters(self) -> dict[str, float]:
        return self.publisher.counters

    @property
    def fast_answers(self) -> int:
        return self.answerer.fast_answers

    @property
    def entry_answers(self) -> int:
        return self.answerer.entry_answers

    @property
    def tap_words(self) -> tuple[Word, ...]:
        return self.taps.words

    # -- the thread ---------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    def submit(self, cmd: Command) -> Future:
        if self.stopped:
            settle(cmd.future, error=self.stopped_error())
            return cmd.future
        self._inbox.put(cmd)
        if isinstance(cmd, Ask):
            self._ask_waiting = True  # after the put: the core that reads it finds the ask in the inbox
        if self.stopped:  # stopped between the check and the put: nobody else will drain it
            self._fail_inbox()
        return cmd.future

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def on_core_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stopped_error(self) -> EngineStopped:
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
            if self.prepos.learning is not None:
                self.prepos.learning.shutdown()
            self._fail_everything(self.stopped_error())
            self._fail_inbox()
            self._publish()

    def _loop(self) -> None:
        while True:
            self._drain(block=not self.has_work(), timeout=self._until_deadline())
            if self._stop:
                return
            self._prepare()
            plan = self.scheduler.schedule(self._sequences())
            if plan:
                self._step(plan)
            self._publish()
            if not plan and not self._shifted and self.has_work():  # blocked on cells: wait for a command or a retry
                self._drain(block=True, timeout=min(0.05, self._until_deadline() or 0.05))

    def _until_deadline(self) -> float | None:
        """Seconds until the earliest ask deadline (an idle core wakes to drop it), or None."""
        deadline = self.answerer.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.perf_counter())

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        if not self._held:
            try:
                self._held.append(self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait())
            except queue.Empty:
                return
        for _ in range(self.max_commands_per_drain):
            if not self._held:
                try:
                    self._held.append(self._inbox.get_nowait())
                except queue.Empty:
                    return
            self._apply(self._held.popleft())
        # The rest waits for the next drain (the model keeps stepping), the held ones first: commands apply
        # in submission order (pushes carry facade-assigned versions).

    def _fail_inbox(self) -> None:
        while self._held:
            settle(self._held.popleft().future, error=self.stopped_error())
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            settle(cmd.future, error=self.stopped_error())

    # -- commands ---------------------------------------------------------------------
    def _apply(self, cmd: Command) -> None:
        self.commands += 1
        try:
            match cmd:
                case Ask():
                    self.answerer.ask(cmd, self.session(cmd.name))
                    return
                case WaitIdle():
                    self.publisher.wait_idle(cmd.future)
                    return
                case Stop():
                    self._stop = True
                    result = None
                case OpenSession():
                    result = self.open_session(cmd.name, cmd.system, cmd.prefix_ids, cmd.max_context, cmd.tenant)
                case CloseSession():
                    result = self.close_session(cmd.name)
                case Push():
                    result = self._push(cmd)
                case Register():
                    result = self._register(cmd)
                case Unregister():
                    result = self._unregister(cmd)
                case Cancel():
                    result = self.answerer.cancel(cmd.ask_id)
                case ExportSession():
                    result = (session_state.export_ready if cmd.only_ready else session_state.export_session)(self, cmd.name)
                case EvictState():
                    result = session_state.evict_session(self, cmd.name)
                case ImportSession():
                    result = session_state.import_session(self, cmd.state, cmd.name, cmd.gates)
                case CanAdmit():
                    result = self.can_admit(cmd.cells)
                case SwapLearned():
                    for st in self.prepos.swap_learned():
                        self.publisher.mark(st.session.name)
                    result = None
                case Call():
                    result = cmd.fn(self)
                case _:
                    raise TypeError(f"unknown command {type(cmd).__name__}")
        except Exception as exc:  # a bad command fails its caller, never the core
            settle(cmd.future, error=exc)
            return
        self.publisher.publish_records()  # what the caller reads next already reflects its command
        settle(cmd.future, result=result)

    def session(self, name: str) -> Session:
        session = self.sessions.get(name)
        if session is None:
            raise SessionError(f"no session named {name!r}; open it first")
        return session

    def open_session(self, name: str, system: str, prefix: list[int], max_context: int,
                     tenant: str = "") -> SessionInfo:
        if name in self.sessions:
            raise SessionError(f"session {name!r} is already open")
        cells = self.admission.working_set(len(prefix), max_context)
        self.admit(name, cells, max_context)
        table = BlockTable(grow_to=max_context)
        computed = self.prefixes.start(table, prefix, tenant)  # the tenant's identical prefix is shared, not recomputed
        self.store.manager.reserve(table, cells)
        session = Session(name, system, prefix, max_context, table, tenant, working_set=cells)
        session.taps = self.taps.new_taps() if self.taps_on_open else None
        session.num_computed = computed
        return self.adopt(session)

    @property
    def admissions_refused(self) -> int:
        return self.admission.refused

    def can_admit(self, cells: int) -> bool:
        """Whether the pool can reserve a working set of `cells` beside the cells kept free (admission.py)."""
        return self.admission.can_admit(cells)

    def admit(self, name: str, cells: int, max_context: int, action: str = "open") -> None:
        """Refuse (AdmissionError, naming what was needed and free) a working set the pool cannot hold."""
        self.admission.admit(name, cells, max_context, action)

    def adopt(self, session: Session) -> SessionInfo:
        """Register a session whose budget is reserved (opened, or restored: `state.import_session`)."""
        self.sessions[session.name] = session
        self.publisher.mark(session.name)
        return session.info()

    def close_session(self, name: str, *, evicting: bool = False) -> None:
        session = self.session(name)
        del self.sessions[name]
        gone = SessionError(f"session {name!r} was closed")
        for st in self.prepos.drop_session(name):
            for br in st.waiters:
                settle(br.future, error=gone)
            self.publisher.drop_ready(name, st.spec.id)
        self.answerer.drop_session(session, gone)
        if not evicting:
            self.hub.drop_session(name)
        self.compactor.forget(name)
        self.store.manager.free(session.table)  # safe: no step is in flight while commands apply
        self.prefixes.forget_unused()
        self.publisher.forget(name)

    def _push(self, cmd: Push) -> int:
        session = self.session(cmd.name)
        first_line = session.lines_cut + len(session.line_ends)
        version = session.append_batch(cmd.ids_per_line, time.monotonic())
        if session.taps is not None and cmd.lines:
            session.taps.note_lines(first_line, cmd.lines)
        if version != cmd.version:  # the facade assigns versions in inbox order: a mismatch is a bug
            raise AssertionError(f"session {cmd.name!r}: core version {version}, acked {cmd.version}")
        if cmd.truths:
            self.prepos.expect(cmd.name, version, cmd.truths)
        for question_id, by_version in (cmd.late_truths or {}).items():
            for earlier, choice in sorted(by_version.items()):
                self.prepos.expect(cmd.name, earlier, {question_id: choice})
        self.compactor.maybe_start(session)
        self.publisher.mark(cmd.name)
        return version

    def _register(self, cmd: Register) -> None:
        self.register_standing(self.session(cmd.name), cmd.spec, cmd.gate, cmd.prompt_ids)
        self.publisher.mark(cmd.name)

    def register_standing(self, session: Session, spec: QuestionSpec, gate: Gate, prompt_ids: list[int]) -> Standing:
        """A standing question on `session` (a register, or a restore); a learning one makes the session
        keep line features if it did not (its lines from now on: a line met mid-way is skipped)."""
        st = self.prepos.register(session, spec, gate, prompt_ids)
        if st.learner is not None:
            if session.taps is None:
                session.taps = self.taps.new_taps()
            session.taps.keep_at_least(st.learner.lines + LINE_SLACK)  # a label that looks back further
        self._keep_numbers_for_readers(session)
        return st

    def _keep_numbers_for_readers(self, session: Session) -> None:
        """The session's lines' own numbers (engine/taps.py) are kept while one of its questions reads
        them: one that learns (its head, its control), or a series head fitted on them (`numbers`)."""
        if session.taps is not None:
            questions = self.prepos.by_session.get(session.name, {}).values()
            session.taps.read_numbers(any(st.learner is not None or getattr(st.gate.head, "numbers", 0)
                                          for st in questions))

    def _unregister(self, cmd: Unregister) -> None:
        session = self.session(cmd.name)
        st = self.prepos.unregister(cmd.name, cmd.question_id)
        self._keep_numbers_for_readers(session)
        self.publisher.drop_ready(cmd.name, cmd.question_id)
        self.answerer.unregistered(st)
        self.publisher.mark(cmd.name)

    # -- planning -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.answerer.has_work() or self.compactor.copies
                    or any(s.pending_tokens for s in self.sessions.values())  # at budget too: not idle
                    or any(st.session.ready and (not st.fresh() or st.computing or st.decoding)
                           for st in self.prepos.all()))

    def _prepare(self) -> None:
        self.answerer.expire(time.perf_counter())
        self._shifted = self.compactor.shift_some()
        self.compactor.swap_caught_up()  # a copy may have nothing to compute (its cut is past the session's data)
        self.compactor.keep_moving()
        self.answerer.start_waiting()
        self.answerer.make_room()
        self.admission.relieve()
        for entry in self.prepos.refresh(keep_free_blocks=self.compactor.blocks_to_go()):
            self.answerer.on_entry_ready(entry, None)  # head-only entries: no forward pass
        self.answerer.reroute_orphaned_waiters()

    def _sequences(self) -> list[Sequence]:
        return [*self.answerer.running, *self.prepos.jobs(), *self.sessions.values(), *self.compactor.copies.values()]

    def _step(self, plan: Plan) -> None:
        # Questions cut into steps of ingest and background work only: a step holding questions is short
        # already, and one arriving during it joins the next step, batched with the others.
        questions = plan.tokens_of(SchedClass.INTERACTIVE)
        cut_ins = not questions and self.scheduler.config.cut_in_share > 0
        self._cut_in_s, self._step_t0 = 0.0, time.perf_counter()
        in_flight = {id(item.seq) for item in plan.items}
        ran = self._execute(plan, (lambda: self._cut_in(in_flight)) if cut_ins else None)
        if not ran:
            return
        self.compactor.swap_caught_up()
        if self.check_every_step:
            self.check_integrity()

    def _execute(self, plan: Plan, between_layers=None) -> bool:
        """Run one plan's forward and apply what it computed; False when the forward failed (its questions
        fail, its data stays pending). between_layers: the outer step's hook (`_cut_in`); a cut-in's own
        step has none."""
        works = [Work(i.seq.table, i.token_ids, i.start_pos, i.want_logits,
                      want_hidden=i.want_logits == Logits.LAST and self.prepos.wants_hidden(i.seq),
                      want_tap=isinstance(i.seq, Session) and i.seq.taps is not None) for i in plan.items]
        t0 = time.perf_counter()
        try:
            logits = self.runner.execute(works, between_layers=between_layers)
        except Exception as exc:  # a failed forward fails its questions, never the engine
            log.exception("forward failed")
            self.failed_steps += 1
            self.failing_in_a_row += 1
            self.last_step_error = repr(exc)
            self._fail_plan(plan, exc)
            return False
        lent = self._cut_in_s if between_layers is not None else 0.0  # the cut-ins' time is not this plan's
        step_s = time.perf_counter() - t0 - lent
        self.failing_in_a_row = 0
        self._update(plan, logits, works)
        self.step_times.record(step_s, plan.num_tokens)
        # What a question arriving now waits for: the forward and its update (a GPU's logits are read there).
        self.scheduler.observe(plan, (time.perf_counter() - t0 - lent) * 1000)
        return True

    def _cut_in(self, in_flight: set[int]) -> None:
        """Between two layers of the running step: asks that came meanwhile are applied, and the questions
        they start run a step of their own now, instead of waiting for the rest of this one.

        The asks are applied in order; pushes among them are held for the next drain (an ask may so be applied
        before a push sent ahead of it, and reads the same either way: a push only queues data, which no
        cut-in computes). The first other command (an open, a close, a registration...) stops it: it and
        everything after it wait for the step, as ever. The cut-in step holds questions alone, none of them
        in the running step; their forks take free cells only (nothing is evicted or compacted, nothing the
        running step reads or writes changes). A session's data in flight is not in yet: a question cutting
        in reads its session as of its last completed line, as it would have before the step."""
        if not self._ask_waiting or self._stop or any(not isinstance(cmd, Push) for cmd in self._held):
            return
        # Fair to the step in flight: the cut-ins so far took at most `cut_in_share` of its own time, plus one
        # latency target's worth (so the first question never waits). Under a storm of questions the two
        # alternate: a question waits for about one question's step of ingest, and ingest keeps its share.
        cfg = self.scheduler.config
        own_s = time.perf_counter() - self._step_t0 - self._cut_in_s
        if self._cut_in_s > cfg.cut_in_share * (own_s + (cfg.step_latency_ms or 40.0) / 1000):
            return
        self._ask_waiting = False
        t0 = time.perf_counter()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Ask):
                self._apply(cmd)
                continue
            self._held.append(cmd)  # applied by the next drain, in the order it came
            if not isinstance(cmd, Push):
                break  # and whatever came after it waits for that drain too
        self.answerer.start_waiting(cutting_in=True)
        plan = self.scheduler.cut_in([b for b in self.answerer.running if id(b) not in in_flight])
        if plan:
            self._execute(plan)  # its answers settle their futures; counters are published after the step
        self._cut_in_s += time.perf_counter() - t0

    def _update(self, plan: Plan, logits: list, works: list[Work]) -> None:
        for item, lg, work in zip(plan.items, logits, works, strict=True):
            seq, n = item.seq, len(item.token_ids)
            if isinstance(seq, Session):
                if work.tap is not None:  # before advance: an entry made at the new version reads these lines
                    seq.tap(work.tap, item.start_pos, item.token_ids)
                had_prefix = seq.ready
                if seq.advance(n):
                    self.publisher.data(seq)
                if seq.ready and not had_prefix:
                    self.prefixes.remember(seq.token_ids, seq.prefix_len, seq.table, seq.tenant)
            elif isinstance(seq, CompactionCopy):
                seq.num_computed += n
            else:
                seq.num_computed += n
                if lg is not None:
                    self.answerer.on_logits(seq, lg, work.hidden)

    def _fail_plan(self, plan: Plan, exc: Exception) -> None:
        for item in plan.items:
            seq = item.seq
            if isinstance(seq, Branch):
                self.answerer.fail_branch(seq, exc)
            else:  # give back the slots; the tokens stay pending and are retried
                self.store.truncate(seq.table, seq.num_computed)

    def _fail_everything(self, exc: Exception) -> None:
        self.answerer.fail_all(exc)
        self.publisher.fail_idle_waiters(exc)

    def _publish(self) -> None:
        self.publisher.publish(core_counters(self), idle=lambda: not self.has_work())

    def check_integrity(self) -> None:
        """Refcounts equal the references held by every table the core owns, and every branch in
        flight holds what its role needs (after every step with `check_every_step`)."""
        tables = [s.table for s in self.sessions.values()]
        tables += self.answerer.tables() + self.compactor.tables() + self.prefixes.tables()
        for st in self.prepos.all():
            tables += [b.table for b in st.branches() if b.table is not None]
        self.store.manager.check_integrity(tables)
        for br in self.answerer.running:
            assert isinstance(br, AskBranch) and br.table is not None, f"running branch without cells: {br.question!r}"
        for st in self.prepos.all():
            assert st.computing is None or isinstance(st.computing, EntryBranch)
            assert st.decoding is None or isinstance(st.decoding, DecodeBranch)
