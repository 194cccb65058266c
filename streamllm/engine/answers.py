"""The core's `Answerer`: turns questions and logits into answers (core thread only).

    ask ─┬─ standing, entry current ──▶ answer from the entry: gate fired → fast; a choice
         │                               question → its best choice; else decode from the entry
         ├─ standing, entry coming ───▶ waits on the Standing, answered when the entry lands
         └─ ad hoc / no entry ────────▶ waiting → forked at its data version → prefill → decode

A question with choices is always answered with one of them: the gate rejects choices
whose first tokens collide at registration, so the first token (scored over each
choice's spellings) names the choice on every path, and no free decode can wander off.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from streamllm.config.limits import MAX_ASK_TOKENS
from streamllm.engine.commands import Ask, settle
from streamllm.engine.fastpath import decoded_for
from streamllm.engine.kv import BlockTable, KVCapacityError, KVStore
from streamllm.engine.outputs import (
    Answer,
    AnswerPath,
    AskTimeout,
    DecodedAnswer,
    FinishReason,
    StalePolicy,
)
from streamllm.engine.publishing import Publisher
from streamllm.engine.scheduler import SchedulerConfig
from streamllm.engine.sequence import (
    AskBranch,
    Branch,
    DecodeBranch,
    DecodingBranch,
    EntryBranch,
    Session,
)
from streamllm.engine.standing.prepos import Prepositioner, Standing, is_final

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


DEFAULT_ASK_TOKENS = 16  # an ask that names no max_tokens and inherits none


def _path(fired: bool) -> AnswerPath:
    return AnswerPath.FAST if fired else AnswerPath.ENTRY


class Answerer:
    """Asks waiting and running, entries landing, and the answers (and standing answers) they make."""

    def __init__(self, *, store: KVStore, prepos: Prepositioner, publisher: Publisher,
                 tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], scheduler_config: SchedulerConfig,
                 stale_policy: StalePolicy) -> None:
        self.store = store
        self.prepos = prepos
        self.publisher = publisher
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.scheduler_config = scheduler_config  # its chunk size: what a question's next step needs
        self.stale_policy = stale_policy
        self.running: list[AskBranch] = []  # asks being prefilled or decoded
        self.waiting: list[AskBranch] = []  # asks waiting for their data version or for cells
        self.questions_answered = self.fast_answers = self.entry_answers = 0
        self.preemptions = self.timed_out = 0

    # -- asks in ------------------------------------------------------------------
    def ask(self, cmd: Ask, session: Session) -> None:
        st = self.prepos.by_session.get(session.name, {}).get(cmd.standing_id) if cmd.standing_id else None
        if cmd.standing_id and st is None:  # unregistered since the facade looked: ask it cold
            cmd.standing_id = None
        spec = st.spec if st is not None else None
        # One cap wherever max_tokens comes from: the ask, or a standing question's spec it inherits.
        max_tokens = min(cmd.max_tokens or (spec.max_tokens if spec else DEFAULT_ASK_TOKENS), MAX_ASK_TOKENS)
        br = AskBranch(session, cmd.question, st.prompt_ids if st else cmd.prompt_ids,
                       max_tokens=max_tokens, stop=list(cmd.stop),
                       future=cmd.future, min_version=cmd.min_version,
                       choices=(st.gate if st and spec.choices else cmd.choices), standing=st, on_text=cmd.on_text,
                       t_start=cmd.t_start or time.perf_counter(), keep_logits=cmd.keep_logits, ask_id=cmd.ask_id,
                       deadline_s=cmd.deadline_s)
        if st is None:
            self.waiting.append(br)
            return
        br.min_version = max(br.min_version, session.data_version)
        if st.ready is not None and st.ready.data_version >= br.min_version:
            self._answer_from_entry(st, br)
        elif st.ready is not None and self.stale_policy == StalePolicy.STALE:
            br.stale = True
            self._answer_from_entry(st, br)
        else:
            st.waiters.append(br)

    def unregistered(self, st: Standing) -> None:
        """Asks that waited for an unregistered question's entry are answered the cold way."""
        for br in st.waiters:
            br.standing = None
            self.waiting.append(br)
        st.waiters.clear()

    def cancel(self, ask_id: int) -> bool:
        for br in self.waiting + self.running + [b for st in self.prepos.all() for b in st.waiters]:
            if br.ask_id == ask_id:
                self.drop(br, None)
                return True
        return False  # already answered: nothing to do

    def drop(self, br: AskBranch, error: BaseException | None) -> None:
        """Take an ask out of every queue and free its cells; fail its future with `error` (None: cancel it)."""
        for where in (self.waiting, self.running):
            if br in where:
                where.remove(br)
        if br.standing is not None and br in br.standing.waiters:
            br.standing.waiters.remove(br)
        self._free(br)
        if error is not None:
            settle(br.future, error=error)
        elif br.future is not None:
            br.future.cancel()

    def drop_session(self, session: Session, error: BaseException) -> None:
        for br in [b for b in self.waiting + self.running if b.session is session]:
            self.drop(br, error)

    def fail_all(self, exc: BaseException) -> None:
        for st in self.prepos.all():
            self.waiting.extend(st.waiters)
            st.waiters.clear()
        for br in self.waiting + self.running:
            settle(br.future, error=exc)
        self.waiting.clear()
        self.running.clear()

    # -- before a step ---------------------------------------------------------------
    def can_start(self, br: AskBranch) -> bool:
        return br.session.ready and br.session.data_version >= br.min_version

    def has_work(self) -> bool:
        return bool(self.running) or any(self.can_start(b) for b in self.waiting)

    def asks_on(self, session: Session) -> bool:
        return any(b.session is session for b in self.running + self.waiting)

    def will_free_cells(self) -> bool:
        """Questions in flight, standing decodes, or entries someone waits for: they give cells back."""
        return bool(self.running) or any(st.decoding or (st.computing and st.waiters) for st in self.prepos.all())

    def tables(self) -> list[BlockTable]:
        return [b.table for b in self.running + self.waiting if b.table is not None]

    def start_waiting(self, *, cutting_in: bool = False) -> None:
        """Fork waiting asks whose data version is in. A preempted ask goes first: it restarts once
        nothing else runs, or once the pool holds all it still needs. While it waits, only asks whose
        whole need fits beside the running ones start (backfilling, as batch schedulers do): they can
        neither block nor be blocked, and give their cells back before the preempted ask could use
        them, so a short question is not held behind a long one that filled the pool.

        cutting_in: while a step runs (EngineCore._cut_in), only asks that were never preempted and whose
        fork fits the free cells start; nothing is evicted (the running step may hold what would go)."""
        head_waits = False
        for br in [b for b in self.waiting if self.can_start(b)]:
            if cutting_in:
                if br.preempted or head_waits:
                    head_waits = True  # an older ask waits for cells: none overtakes it mid-step
                    continue
                s = br.session
                try:
                    table = self.store.fork(s.table, s.version_length(s.data_version))
                except KVCapacityError:
                    head_waits = True
                    continue
                self._start(br, table, s.data_version)
                continue
            if br.preempted and self.running and not self._fits_whole(br):
                head_waits = True
                continue
            if head_waits and not self._fits_whole(br):
                continue
            s = br.session
            # A preempted ask resumes at the data version its tokens came from while the session holds it
            # (a compaction may have cut it away meanwhile: then at the newest, which its answer reports).
            version = br.data_version if br.preempted and br.data_version >= s.version_base else s.data_version
            try:
                table = self._fork_evicting(s, s.version_length(version))
            except KVCapacityError as exc:
                if not self.running:  # nothing will free cells: fail instead of waiting forever
                    self.waiting.remove(br)
                    settle(br.future, error=exc)
                continue
            self._start(br, table, version)

    def _start(self, br: AskBranch, table: BlockTable, version: int) -> None:
        """A waiting ask runs from `table`, its session forked at `version`."""
        br.table, br.base_len, br.data_version = table, br.session.version_length(version), version
        self.waiting.remove(br)
        self.running.append(br)

    def _fits_whole(self, br: AskBranch) -> bool:
        """Whether the free cells hold everything `br` still needs (its fork's tail, its tokens, its
        decode) beside all the running asks still need: restarted, it cannot block them or be blocked."""
        manager = self.store.manager
        running = sum(manager.blocks_needed(r.table, len(r.pending_ids) + r.max_tokens - len(r.generated))
                      for r in self.running)
        mine = manager.blocks_for(manager.block_size + len(br.ids) + br.max_tokens - len(br.generated))
        return running + mine <= manager.num_free_blocks

    def _fork_evicting(self, session: Session, length: int) -> BlockTable:
        """Fork for a question; under pressure, idle sessions' entries (recomputable) go first, then every
        entry nobody waits for, computing ones too: background work never keeps a question out."""
        try:
            return self.store.fork(session.table, length)
        except KVCapacityError:
            busy = {b.session.name for b in self.running} | {session.name}
            if not (self.prepos.evict_idle_entries(busy) or self.prepos.evict_idle_entries(set(), computing=True)):
                raise
            self.publisher.drop_evicted()
            return self.store.fork(session.table, length)

    def make_room(self) -> None:
        """Room for questions first, then for entries (`_make_room_for_entries`): the pool never deadlocks."""
        self._make_room_for_asks()
        self._make_room_for_entries()

    def _make_room_for_asks(self) -> None:
        """Running questions whose next chunk does not fit evict idle entries first. Then, so that the
        pool never deadlocks:

          one question running, still blocked  -> it fails (KVCapacityError): nothing else will free cells
          every running question blocked, and
          no other work able to give cells back -> the newest is preempted (vLLM v1): its cells are
                                                   freed, it waits first in line and is recomputed later

        The oldest running question is never preempted, so it finishes or, alone, fails: no livelock."""
        blocked = [br for br in self.running if not self._can_step(br)]
        if not blocked:
            return
        self.prepos.evict_idle_entries({b.session.name for b in self.running})
        if any(not self._can_step(br) for br in blocked):
            self.prepos.evict_idle_entries(set())
        self.publisher.drop_evicted()
        blocked = [br for br in blocked if not self._can_step(br)]
        if not blocked:
            return
        if len(self.running) == 1:
            br = blocked[0]
            self.drop(br, KVCapacityError(
                f"question on {br.session.name!r} needs {self._next_chunk(br)} more cells and the pool has "
                f"{self._free_cells()} free after evicting idle entries, with no other question running; "
                "raise max_cells (or branch_cells) or ask a shorter question"))
            return
        if len(blocked) < len(self.running) or self._others_can_step():
            return  # a question or a standing entry/decode still moves: it will finish and free cells
        if self.prepos.evict_idle_entries(set(), computing=True):  # entries nobody waits for: recomputable
            self.publisher.drop_evicted()
            if any(self._can_step(br) for br in self.running):
                return
        self._preempt(max(self.running, key=lambda b: b.ask_id))

    def _make_room_for_entries(self) -> None:
        """Entries computing take turns as questions do. When every one is blocked on cells and nothing
        in flight will give cells back (no question running: its own rule above makes room; no standing
        decode able to move), the newest are preempted, one at a time, until the oldest can move: their
        cells are freed and `refresh` starts them again, at the newest data, once the pool holds a whole
        entry beside the others. Newest: nobody waits for it, then least computed, then last in order.
        The oldest is never preempted, so it lands; alone and still blocked, it is the pool's shortage
        (`Admission.relieve`: unfilled runs, idle entries, idle sessions to disk, then compaction)."""
        entries = [e for e in self.prepos.computing() if e.pending_ids]
        if len(entries) < 2 or self.running or any(self._can_step(e) for e in entries):
            return
        if any(st.decoding is not None and st.decoding.table is not None and self._can_step(st.decoding)
               for st in self.prepos.all()):
            return
        while len(entries) > 1 and not any(self._can_step(e) for e in entries):
            newest = max(range(len(entries)), key=lambda i: (not entries[i].standing.waiters,
                                                             -entries[i].num_computed, i))
            self.prepos.preempt(entries.pop(newest))

    def _next_chunk(self, br: AskBranch) -> int:
        return min(len(br.pending_ids), self.scheduler_config.chunk_tokens)

    def _can_step(self, seq: Branch) -> bool:
        need = min(len(seq.pending_ids), self.scheduler_config.chunk_tokens)
        return need == 0 or seq.table is None or self.store.manager.can_append(seq.table, need)

    def _others_can_step(self) -> bool:
        """Whether an entry someone waits for or a standing decode can still move (and so will give its
        cells back); entries nobody waits for are background work, evicted before a question is preempted."""
        return any(job.table is not None and job.pending_ids and self._can_step(job)
                   and (isinstance(job, DecodeBranch) or job.standing.waiters) for job in self.prepos.jobs())

    def _free_cells(self) -> int:
        return self.store.manager.num_free_blocks * self.store.manager.block_size

    def _preempt(self, br: AskBranch) -> None:
        """Free `br`'s cells and put it first in line; it keeps what it generated and recomputes its
        prompt and those tokens on top of the session when it starts again (vLLM v1's preemption)."""
        self.running.remove(br)
        self._free(br)
        br.num_computed = br.prepaid = 0
        br.standing = None  # off the entry it may have come from: recomputed on the session itself
        br.preempted += 1
        self.preemptions += 1
        self.waiting.insert(0, br)
        self.waiting.sort(key=lambda b: (0, b.ask_id) if b.preempted else (1, 0))  # preempted first, oldest first

    def expire(self, now: float) -> None:
        """Drop every ask past its deadline (AskTimeout, saying how long it waited and where it was)."""
        for br in self._in_flight():
            deadline = br.deadline
            if deadline is not None and now >= deadline:
                self.timed_out += 1
                self.drop(br, AskTimeout(
                    f"question on {br.session.name!r} ran past its deadline of {br.deadline_s:g} s "
                    f"(waited {now - br.t_start:.1f} s) while {self._where(br)}; it was dropped"))

    def next_deadline(self) -> float | None:
        """The earliest deadline of any ask in flight (an idle core wakes for it), or None."""
        return min((d for br in self._in_flight() if (d := br.deadline) is not None), default=None)

    def _in_flight(self) -> list[AskBranch]:
        """Every ask not answered yet: waiting for an entry, for its data or cells, or running."""
        return [br for st in self.prepos.all() for br in st.waiters] + self.waiting + self.running

    def _where(self, br: AskBranch) -> str:
        s, free = br.session, self._free_cells()
        if br in self.running:
            if br.preempted and br.num_computed < len(br.ids):
                where = f"recomputing after preemption ({br.num_computed} of {len(br.ids)} tokens)"
            elif br.num_computed < len(br.prompt_ids):
                where = f"prefilling ({br.num_computed} of {len(br.prompt_ids)} prompt tokens)"
            else:
                where = f"decoding ({len(br.generated)} of {br.max_tokens} tokens)"
            return where + ("" if self._can_step(br) else f", blocked on cells ({free} free)")
        if br not in self.waiting:
            return f"waiting for its standing question's entry (the session is at data version {s.data_version})"
        if not s.ready:
            return "waiting for the session's system prompt to be computed"
        if s.data_version < br.min_version:
            return (f"waiting for data version {br.min_version} (the session is at {s.data_version}, "
                    f"{s.pending_tokens} tokens still to ingest)")
        if br.preempted:
            return f"waiting for cells after preemption ({free} free, preempted {br.preempted} times)"
        return f"waiting to start ({free} cells free)"

    def reroute_orphaned_waiters(self) -> None:
        """Asks waiting on an entry that cannot be computed (no cells) go the cold way."""
        for st in self.prepos.all():
            if st.waiters and st.session.ready and st.computing is None and not st.fresh():
                for br in st.waiters:
                    br.standing = None
                self.waiting.extend(st.waiters)
                st.waiters.clear()

    # -- results of a step ------------------------------------------------------------
    def on_logits(self, br: Branch, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        if isinstance(br, EntryBranch):
            self.on_entry_ready(br, logits.clone(), hidden)
            return
        assert isinstance(br, DecodingBranch)
        if isinstance(br, AskBranch) and br.keep_logits and br.first_logits is None:
            br.first_logits = logits.clone()
        if br.choices is not None and not br.generated and isinstance(br, AskBranch):  # the first token names the choice
            d = br.choices.decide(logits)
            br.confidence, br.choice_probs = d.gap, d.probs
            br.text, br.finish_reason = d.answer, FinishReason.STOP
            self._finish(br)
            return
        self._on_token(br, int(torch.argmax(logits)))

    def fail_branch(self, br: Branch, exc: Exception) -> None:
        """A failed forward fails an ask; entries and decodes are recomputed on the next refresh."""
        if isinstance(br, AskBranch):
            self.drop(br, exc)
            return
        self.prepos.release(br)
        st = br.standing
        if st.computing is br:
            st.computing = None
        if st.decoding is br:
            st.decoding = None

    def on_entry_ready(self, entry: EntryBranch, logits: torch.Tensor | None, hidden: torch.Tensor | None = None) -> None:
        st = self.prepos.on_entry_ready(entry, logits, hidden)
        if st is None:
            return
        self.publisher.ready(st)
        waiters, st.waiters = st.waiters, []
        for br in waiters:
            if entry.data_version >= br.min_version:
                self._answer_from_entry(st, br)
            else:
                st.waiters.append(br)
        rec = st.record
        if st.spec.choices:  # a choice question's answer is its ready record on every path (`answers_alone`):
            self.prepos.release(entry)  # nothing reads the entry's cells again, so they go back now
        if rec.final:
            self._standing_changed(st, rec.text, _path(rec.fired), rec.confidence, rec.data_version, rec.choices)
        elif st.spec.push:
            self.prepos.release(st.decoding)  # an older decode is superseded by this fresher entry
            dec = DecodeBranch(st.session, st.spec.text, st.prompt_ids, max_tokens=min(st.spec.max_tokens, MAX_ASK_TOKENS),
                               standing=st, confidence=rec.confidence, path=_path(rec.fired))
            try:
                self.prepos.fork_from_entry(st, dec)
            except KVCapacityError:
                st.decoding = None
                return
            dec.prepaid = dec.num_computed
            st.decoding = dec
            self._on_token(dec, rec.token_id)
        else:  # nobody is pushed this answer: keep the gate's view (its first token, fired or not: the
            # record is not final) for snapshots and `standing`, as path GATE, never a whole answer's path
            self._standing_changed(st, rec.text, AnswerPath.GATE, rec.confidence, rec.data_version)

    def _answer_from_entry(self, st: Standing, br: AskBranch) -> None:
        """Final from the gate's view (fast, or a choice question's best choice); else decode from the entry."""
        rec = st.record
        br.confidence, br.choice_probs = rec.confidence, rec.choices
        br.path = _path(rec.fired)
        br.data_version = rec.data_version
        if is_final(rec, st.spec, br.max_tokens, self.eos_ids):
            br.first_logits = rec.logits if br.keep_logits else None
            br.finish_reason = FinishReason.STOP
            self.fast_answers += rec.fired
            self.entry_answers += not rec.fired
            self.questions_answered += 1
            answer = self._answer(br, rec.text, 0)
            answer.warming_up, answer.warming_up_reason = rec.warming_up is not None, rec.warming_up
            settle(br.future, result=answer)
            return
        decoded = decoded_for(rec, st.spec, br.max_tokens, br.stop)
        if decoded is not None:  # decoded whole from this entry already: the same greedy decode, no step
            br.first_logits = rec.logits if br.keep_logits else None
            br.generated, br.finish_reason = list(decoded.tokens), decoded.finish_reason
            self.fast_answers += rec.fired
            self.entry_answers += not rec.fired
            self.questions_answered += 1
            settle(br.future, result=self._answer(br, decoded.text, 0))
            return
        try:
            self.prepos.fork_from_entry(st, br)
        except KVCapacityError as exc:
            settle(br.future, error=exc)
            return
        br.prepaid = br.num_computed
        if not br.keep_logits:
            br.first_logits = None
        self.running.append(br)
        self._on_token(br, rec.token_id)

    def _standing_changed(self, st: Standing, text: str, path: AnswerPath, confidence: float, version: int,
                          choices: dict[str, float] | None = None) -> None:
        self.publisher.standing(st, self.prepos.set_answer(st, text.strip(), path, confidence, version, choices))

    def _on_token(self, br: DecodingBranch, token: int) -> None:
        if token in self.eos_ids:
            br.finish_reason = FinishReason.STOP
            return self._finish(br)
        br.generated.append(token)
        before = br.text
        text = self.tokenizer.decode(br.generated, skip_special_tokens=True)
        for s in br.stop:
            cut = text.find(s)
            if cut >= 0:
                br.finish_reason, br.text = FinishReason.STOP, text[:cut]
                self._emit(br, before)
                return self._finish(br)
        br.text = text
        self._emit(br, before)
        if len(br.generated) >= br.max_tokens:
            br.finish_reason = FinishReason.LENGTH
            self._finish(br)

    @staticmethod
    def _emit(br: DecodingBranch, before: str) -> None:
        if not isinstance(br, AskBranch) or br.on_text is None:
            return
        if br.text.startswith(before) and len(br.text) > len(before):
            try:
                br.on_text(br.text[len(before):])
            except Exception:  # a broken stream consumer never stops the engine
                br.on_text = None

    def _free(self, br: Branch) -> None:
        if br.table is not None:
            self.store.manager.free(br.table)
            br.table = None

    def _keep_decoded(self, br: DecodingBranch) -> None:
        """A whole answer decoded from the entry its standing question's record holds (the standing
        decode, or an ask with the question's max_tokens and no stop strings) is published with that
        record, so later asks at its data_version are answered from it without a step (fastpath.py)."""
        st = br.standing
        rec = st.record if st is not None else None
        if (rec is None or rec.decoded is not None or rec.data_version != br.data_version or br.stop
                or not br.prepaid or br.max_tokens != min(st.spec.max_tokens, MAX_ASK_TOKENS)):
            return
        st.record = replace(rec, decoded=DecodedAnswer(br.text.strip(), tuple(br.generated), br.finish_reason,
                                                       br.max_tokens))
        self.publisher.ready(st)

    def _finish(self, br: DecodingBranch) -> None:
        self._free(br)
        self._keep_decoded(br)
        if isinstance(br, DecodeBranch):
            st = br.standing
            if st.decoding is br:
                st.decoding = None
                self._standing_changed(st, br.text, br.path, br.confidence, br.data_version)
            return
        assert isinstance(br, AskBranch)
        if br in self.running:
            self.running.remove(br)
        self.questions_answered += 1
        settle(br.future, result=self._answer(br, br.text.strip(), br.num_computed - br.prepaid))

    @staticmethod
    def _answer(br: AskBranch, text: str, tokens_computed: int) -> Answer:
        latency = (time.perf_counter() - br.t_start) * 1000
        return Answer(br.session.name, br.question, text, list(br.generated), br.data_version, tokens_computed,
                      latency, path=br.path, confidence=br.confidence, stale=br.stale,
                      finish_reason=br.finish_reason, logits=br.first_logits, choices=br.choice_probs)
