"""The engine thread: plan -> execute -> update, and how results become answers.

`EngineLoop` is the half of `Engine` that runs on the background thread (and the
answer-from-entry logic that callers also use for the fast path). It shares the
engine's state and lock; `engine.py` holds the public API.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from streamllm.engine.compaction import Compaction
from streamllm.engine.gate import match_choice
from streamllm.engine.kv import KVCapacityError
from streamllm.engine.prepos import Standing
from streamllm.engine.runner import Work
from streamllm.engine.scheduler import INGEST, Plan
from streamllm.engine.sequence import Answer, Branch, Session

log = logging.getLogger("streamllm.engine")


def settle(future: Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolve a caller's future unless the caller gave up on it (a cancelled asyncio task)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class EngineLoop:
    """Mixin of Engine: everything that runs between two steps of the model."""

    def _ask_standing(self, st: Standing, br: Branch) -> None:
        """Under the lock: answer from the entry if it is current, else wait for it (or go stale)."""
        if st.ready is not None and st.ready.data_version >= br.min_version:
            self._answer_from_entry(st, br)
        elif st.ready is not None and self.stale_policy == "stale":
            br.stale = True
            self._answer_from_entry(st, br)
        else:
            st.waiters.append(br)
            self._cv.notify_all()

    def _answer_from_entry(self, st: Standing, br: Branch) -> None:
        """Fast path when the gate fires and the answer is one decision; else decode from the entry."""
        decision = self.prepos.decide(st)
        br.confidence = decision.gap
        br.path = "fast" if decision.fired else "entry"
        if decision.fired and (st.spec.choices or br.max_tokens == 1 or decision.token_id in self.layout.eos_ids):
            br.data_version = st.ready.data_version
            br.first_logits = st.ready_logits if br.keep_logits else None
            br.finish_reason = "stop"
            self.fast_answers += 1
            text = decision.answer if st.spec.choices else self.tokenizer.decode([decision.token_id],
                                                                                 skip_special_tokens=True)
            settle(br.future, result=self._answer(br, text, 0))
            return
        self.prepos.fork_from_entry(st, br)
        br.prepaid = br.num_computed
        if not br.keep_logits:
            br.first_logits = None
        first = self.prepos.first_token(st, decision)
        self._running.append(br)
        self._on_token(br, first)
        self._cv.notify_all()

    def _has_work(self) -> bool:
        return bool(self._running or self._compactions or any(self._can_start(b) for b in self._waiting)
                    or any(s.pending_tokens for s in self.sessions.values())
                    or any(st.session.ready and (not st.fresh() or st.computing or st.decoding)
                           for st in self.prepos.all()))

    def _waiters_without_entries(self) -> None:
        """Asks waiting on an entry that cannot be computed (no cells) go the cold way."""
        for st in self.prepos.all():
            if st.waiters and st.session.ready and st.computing is None and not st.fresh():
                for br in st.waiters:
                    br.standing = None
                self._waiting.extend(st.waiters)
                st.waiters.clear()

    def _can_start(self, br: Branch) -> bool:
        s = br.session
        return s.ready and s.data_version >= br.min_version

    def _start_waiting(self) -> None:
        for br in [b for b in self._waiting if self._can_start(b)]:
            s = br.session
            try:
                br.table = self._fork_evicting(s, s.version_length(s.data_version))
            except KVCapacityError as exc:
                if not self._running:  # nothing will free cells: fail instead of waiting forever
                    self._waiting.remove(br)
                    settle(br.future, error=exc)
                continue
            br.base_len = s.version_length(s.data_version)
            br.data_version = s.data_version
            self._waiting.remove(br)
            self._running.append(br)

    def _fork_evicting(self, session: Session, length: int):
        """Fork for a question; under pressure, idle sessions' entries (recomputable) go first."""
        try:
            return self.store.fork(session.table, length)
        except KVCapacityError:
            busy = {b.session.name for b in self._running} | {session.name}
            if not self.prepos.evict_idle_entries(busy):
                raise
            return self.store.fork(session.table, length)

    def _make_room_for_questions(self) -> None:
        """A question whose next chunk does not fit evicts idle entries; if even that cannot
        make room, it fails with a clear error instead of waiting forever."""
        manager, chunk = self.store.manager, self.scheduler.config.chunk_tokens
        for br in list(self._running):
            need = min(len(br.pending_ids), chunk)
            if need == 0 or manager.can_append(br.table, need):
                continue
            busy = {b.session.name for b in self._running}
            self.prepos.evict_idle_entries(busy)  # idle sessions' entries first, then anyone's
            if not manager.can_append(br.table, need):
                self.prepos.evict_idle_entries(set())
            if manager.can_append(br.table, need) or len(self._running) > 1:
                continue  # room made, or another question will finish and free its cells
            self._running.remove(br)
            manager.free(br.table)
            br.table = None
            settle(br.future, error=KVCapacityError(
                f"question on {br.session.name!r} needs {need} more cells and the pool has "
                f"{manager.num_free_blocks * manager.block_size} free after evicting idle entries; "
                "raise max_cells or ask a shorter question"))

    def _loop(self) -> None:
        try:
            self._run_steps()
        except BaseException as exc:  # a bug in bookkeeping: stop loudly, never hang callers
            log.exception("engine loop stopped")
            with self._cv:
                self.failure = exc
                self._stopped = True
                self._fail_all(RuntimeError(f"engine stopped after an internal error: {exc!r}"))

    def _run_steps(self) -> None:
        while True:
            with self._cv:
                self._release_closed()
                while not self._stopped and not self._has_work():
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                    self._release_closed()
                if self._stopped:
                    self._fail_all(RuntimeError("engine shut down"))
                    return
                self._busy = True
                self._start_waiting()
                self._make_room_for_questions()
                self.prepos.refresh()
                self._waiters_without_entries()
                urgent, idle = self.prepos.entry_jobs()
                idle = list(self._compactions.values()) + idle
                plan = self.scheduler.schedule(self._running + urgent, list(self.sessions.values()), idle)
                self._in_step = bool(plan)
            if not plan:
                with self._cv:  # blocked on memory: wait for a close or a finished branch
                    self._cv.wait(0.05)
                continue
            t_step = time.perf_counter()
            try:
                works = [Work(i.table, i.token_ids, i.start_pos, i.want_logits,
                              want_hidden=self.prepos.wants_hidden(i.owner)) for i in plan.items]
                logits = self.runner.execute(works)
            except Exception as exc:  # a failed step fails its questions, never the engine
                log.exception("forward failed")
                with self._cv:
                    self._in_step = False
                    self._fail_plan(plan, exc)
                continue
            step_ms = (time.perf_counter() - t_step) * 1000
            with self._cv:
                self._in_step = False
                self._update(plan, logits, [w.hidden for w in works])
                self._swap_compactions()
                self.steps += 1
                self.step_ms_total += step_ms
                self.step_ms_last = step_ms
                self.step_tokens_last = plan.num_tokens
                events, self._events = self._events, []
            for session, kind, *payload in events:
                self.hub.publish(session, kind, *payload)

    def _update(self, plan: Plan, logits: list, hidden: list | None = None) -> None:
        hidden = hidden or [None] * len(plan.items)
        for item, lg, hd in zip(plan.items, logits, hidden, strict=True):
            if item.kind == INGEST:
                session: Session = item.owner
                before = session.data_version
                had_prefix = session.ready
                session.advance(len(item.token_ids))
                if session.ready and not had_prefix:
                    self._remember_prefix(session)
                if session.data_version != before:
                    self._events.append((session.name, "data", session.name, session.data_version))
                continue
            if isinstance(item.owner, Compaction):
                item.owner.num_computed += len(item.token_ids)
                continue
            br: Branch = item.owner
            br.num_computed += len(item.token_ids)
            if lg is None:
                continue
            if br.purpose == "entry":
                self._on_entry_ready(br, lg.clone(), hd)
                continue
            if br.keep_logits and br.first_logits is None:
                br.first_logits = lg.clone()
            self._on_token(br, int(torch.argmax(lg)))
        self._cv.notify_all()

    def _prefix_key(self, prefix: list[int]) -> tuple[int, ...]:
        full = len(prefix) // self.store.block_size * self.store.block_size
        return tuple(prefix[:full])

    def _shared_prefix_blocks(self, prefix: list[int]) -> list[int]:
        key = self._prefix_key(prefix)
        return self._prefix_blocks.get(key, []) if key else []

    def _remember_prefix(self, session: Session) -> None:
        """Once a frozen prefix is computed, later sessions with the same one share its full blocks."""
        key = self._prefix_key(session.token_ids[: session.prefix_len])
        if not key or key in self._prefix_blocks:
            return
        blocks = session.table.blocks[: len(key) // self.store.block_size]
        self.store.manager.share(blocks)
        self._prefix_blocks[key] = blocks

    def _forget_unused_prefixes(self) -> None:
        """Drop cached prefixes no session holds any more (only the cache's reference is left)."""
        for key, blocks in list(self._prefix_blocks.items()):
            if all(self.store.manager.refcount[b] == 1 for b in blocks):
                self.store.manager.release(blocks)
                del self._prefix_blocks[key]

    def _maybe_compact(self, session: Session) -> None:
        """Under the lock, after a push: start a compacted copy once the session passes compact_at."""
        if session.name in self._compactions or session.num_tokens < self.compact_at * session.max_context:
            return
        keep = int(self.retain * session.max_context) - session.prefix_len
        cut = session.compaction_cut(keep)
        if cut is not None:
            self._compactions[session.name] = Compaction(session, cut)

    def _swap_compactions(self) -> None:
        """Under the lock, between steps: swap in every copy that has caught up."""
        for name, job in list(self._compactions.items()):
            if not job.caught_up():
                continue
            session = job.session
            del self._compactions[name]
            old = session.table
            session.apply_compaction(job.cut, job.table, job.num_computed)
            self.store.manager.free(old)  # branches forked from it hold their own references
            try:
                self.store.manager.reserve(session.table, session.max_context)
            except KVCapacityError:
                log.warning("session %s: compacted, but could not re-reserve its full budget", name)
            self._maybe_compact(session)  # pushes that arrived meanwhile may call for the next one

    def _on_entry_ready(self, entry: Branch, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        st = self.prepos.on_entry_ready(entry, logits, hidden)
        if st is None:
            return
        waiters, st.waiters = st.waiters, []
        for br in waiters:
            if entry.data_version >= br.min_version:
                self._answer_from_entry(st, br)
            else:
                st.waiters.append(br)
        decision = self.prepos.decide(st)
        if decision.fired and st.spec.choices:
            self._standing_changed(st, decision.answer, "fast", decision.gap, entry.data_version)
        elif st.spec.push:
            self.prepos.release(st.decoding)  # an older decode is superseded by this fresher entry
            dec = Branch(st.session, st.spec.text, st.prompt_ids, st.spec.max_tokens, [], None,
                         purpose="decode", standing=st, confidence=decision.gap, path="entry")
            try:
                self.prepos.fork_from_entry(st, dec)
            except KVCapacityError:
                st.decoding = None
                return
            dec.prepaid = dec.num_computed
            st.decoding = dec
            self._on_token(dec, self.prepos.first_token(st, decision))
        else:  # nobody is pushed this answer: keep the gate's view for snapshots
            text = decision.answer or ""
            self._standing_changed(st, text, "fast" if decision.fired else "gate", decision.gap, entry.data_version)

    def _standing_changed(self, st: Standing, text: str, path: str, confidence: float, version: int) -> None:
        changed = self.prepos.set_answer(st, text.strip(), path, confidence, version)
        if changed is not None:
            self._events.append((st.session.name, "standing", changed))

    def _on_token(self, br: Branch, token: int) -> None:
        if token in self.layout.eos_ids:
            br.finish_reason = "stop"
            return self._finish(br)
        br.generated.append(token)
        text = self.tokenizer.decode(br.generated, skip_special_tokens=True)
        for s in br.stop:
            cut = text.find(s)
            if cut >= 0:
                br.finish_reason, text = "stop", text[:cut]
                br.text = text
                return self._finish(br)
        br.text = text
        choices = br.standing.spec.choices if br.standing is not None else ()
        choice = match_choice(text, choices) if choices else None
        if choice is not None:  # a choice question is answered once the model names a choice
            br.finish_reason, br.text = "stop", choice
            return self._finish(br)
        if len(br.generated) >= br.max_tokens:
            br.finish_reason = "length"
            self._finish(br)

    def _finish(self, br: Branch) -> None:
        if br.table is not None:
            self.store.manager.free(br.table)
            br.table = None
        if br.purpose == "decode":
            st: Standing = br.standing
            if st.decoding is br:
                st.decoding = None
                self._standing_changed(st, br.text, "entry", br.confidence, br.data_version)
            return
        if br in self._running:
            self._running.remove(br)
        self.questions_answered += 1
        settle(br.future, result=self._answer(br, br.text.strip(), br.num_computed - br.prepaid))

    def _answer(self, br: Branch, text: str, tokens_computed: int) -> Answer:
        latency = (time.perf_counter() - br.t_start) * 1000
        return Answer(br.session.name, br.question, text, list(br.generated), br.data_version, tokens_computed,
                      latency, path=br.path, confidence=br.confidence, stale=br.stale,
                      finish_reason=br.finish_reason, logits=br.first_logits)

    def _fail_plan(self, plan: Plan, exc: Exception) -> None:
        for item in plan.items:
            if item.kind == INGEST or isinstance(item.owner, Compaction):
                # give back the slots; the tokens stay pending and are retried
                self.store.truncate(item.table, item.owner.num_computed)
                continue
            br: Branch = item.owner
            if br.table is not None:
                self.store.manager.free(br.table)
                br.table = None
            if br.purpose == "ask" and br in self._running:
                self._running.remove(br)
                settle(br.future, error=exc)
            elif br.standing is not None:  # entries and decodes are recomputed on the next refresh
                st: Standing = br.standing
                if st.computing is br:
                    st.computing = None
                if st.decoding is br:
                    st.decoding = None
        self._cv.notify_all()

    def _fail_all(self, exc: Exception) -> None:
        for st in self.prepos.all():
            self._waiting.extend(st.waiters)
            st.waiters.clear()
        for br in self._waiting + self._running:
            if not br.future.done():
                settle(br.future, error=exc)
        self._waiting.clear()
        self._running.clear()
        self._busy = False
        self._cv.notify_all()

    def _release_closed(self) -> None:
        for session in self._closed:
            self.store.manager.free(session.table)
        for table in self._closed_tables:
            self.store.manager.free(table)
        if self._closed:
            self._forget_unused_prefixes()
        self._closed.clear()
        self._closed_tables.clear()

