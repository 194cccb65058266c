"""The public Python API: sessions, pushes and questions over one shared model.

One background thread runs plan -> execute -> update. Callers never touch the model:
`push` tokenizes in the caller's thread, appends under the lock and returns an ack at
once; `ask` enqueues a branch and waits on a future (`ask_async` awaits it), so the
engine is usable from threads and from asyncio alike.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from streamllm.kv import BlockManager, BlockTable, KVCapacityError, KVPool, KVStore
from streamllm.model.llama import LlamaForward
from streamllm.model.loader import LoadedModel, load_model
from streamllm.prepos import Prepositioner, Standing, StandingAnswer
from streamllm.questions import QuestionSpec
from streamllm.runner import Runner, Work
from streamllm.scheduler import INGEST, Plan, Scheduler, SchedulerConfig
from streamllm.session import DEFAULT_SYSTEM, Answer, Branch, PromptLayout, Session, validate_lines
from streamllm.subscriptions import Subscription, SubscriptionHub, watch

log = logging.getLogger("streamllm.engine")


class SessionError(KeyError):
    """Unknown, duplicate or closed session."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class AdmissionError(RuntimeError):
    """The KV pool cannot reserve the cells a new session asks for."""


@dataclass(slots=True)
class PushAck:
    session: str
    data_version: int  # the version this batch becomes once ingested
    queue_depth: int  # lines accepted but not yet ingested, this batch included
    lines: int


@dataclass(slots=True)
class SessionInfo:
    name: str
    data_version: int
    pushed_version: int
    num_tokens: int
    num_computed: int
    prefix_tokens: int
    max_context: int
    backlog_lines: int
    lines_ingested: int


class Engine:
    def __init__(
        self,
        model: str | LoadedModel = "smollm2-135m",
        *,
        device: str | None = None,
        max_cells: int = 65536,
        block_size: int = 16,
        max_context: int = 8192,
        step_tokens: int = 256,
        chunk_tokens: int = 128,
        branch_cells: int | None = None,
        stale_policy: str = "wait",
        progress: bool = False,
    ) -> None:
        if stale_policy not in ("wait", "stale"):
            raise ValueError(f"stale_policy must be 'wait' or 'stale', got {stale_policy!r}")
        self.stale_policy = stale_policy
        loaded = model if isinstance(model, LoadedModel) else load_model(model, progress=progress)
        self.model_name = loaded.name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = loaded.tokenizer
        self.layout = PromptLayout(loaded.tokenizer)
        self.model = LlamaForward(loaded.config, loaded.state_dict, device=self.device)
        num_blocks = max(1, max_cells // block_size)
        self.store = KVStore(
            BlockManager(num_blocks, block_size),
            KVPool(self.model.num_layers, num_blocks * block_size, self.model.num_kv_heads, self.model.head_dim,
                   dtype=self.model.dtype, device=self.device),
        )
        self.runner = Runner(self.model, self.store)
        self.scheduler = Scheduler(self.store.manager, SchedulerConfig(step_tokens, chunk_tokens))
        self.default_max_context = max_context
        # Cells kept free for branches (questions, entries); sessions cannot reserve them.
        self.branch_cells = branch_cells if branch_cells is not None else max(4 * block_size, max_cells // 8)
        self.sessions: dict[str, Session] = {}
        self.prepos = Prepositioner(self.store, self.layout)
        self.hub = SubscriptionHub()
        self._events: list[tuple] = []  # (session, kind, payload) published after the lock is released
        self.fast_answers = 0
        self._waiting: list[Branch] = []
        self._running: list[Branch] = []
        self._closed: list[Session] = []  # freed by the loop between steps
        self._cv = threading.Condition()
        self._stopped = False
        self._busy = False
        self._in_step = False  # a plan is executing outside the lock
        self.steps = 0
        self.questions_answered = 0
        self._thread = threading.Thread(target=self._loop, name="streamllm-engine", daemon=True)
        self._thread.start()

    # -- sessions ---------------------------------------------------------
    def open_session(self, name: str, system: str = DEFAULT_SYSTEM, *, max_context: int | None = None) -> SessionInfo:
        if not isinstance(name, str) or not name:
            raise ValueError("session name must be a non-empty string")
        max_context = max_context or self.default_max_context
        prefix = self.layout.prefix_ids(system)
        if len(prefix) >= max_context:
            raise ValueError(f"system prompt is {len(prefix)} tokens, more than max_context {max_context}")
        manager = self.store.manager
        with self._cv:
            if name in self.sessions:
                raise SessionError(f"session {name!r} is already open")
            spare_blocks = manager.num_free_blocks - manager.blocks_for(max_context)
            if spare_blocks < manager.blocks_for(self.branch_cells):
                raise AdmissionError(
                    f"cannot open session {name!r}: it reserves {max_context} cells, the pool has "
                    f"{manager.num_free_blocks * manager.block_size} free and keeps {self.branch_cells} for "
                    "questions; close a session, lower max_context or raise max_cells"
                )
            table = BlockTable()
            manager.reserve(table, max_context)
            session = Session(name, system, prefix, max_context, table)
            self.sessions[name] = session
            self._cv.notify_all()
            return self._info(session)

    def close_session(self, name: str) -> None:
        with self._cv:
            session = self._session(name)
            session.closing = True
            del self.sessions[name]
            for st in self.prepos.drop_session(name):
                self._waiting.extend(st.waiters)
            for br in [b for b in self._waiting if b.session is session]:
                self._waiting.remove(br)
                br.future.set_exception(SessionError(f"session {name!r} was closed"))
            self.hub.drop_session(name)
            self._cv.notify_all()
            # An in-flight forward may still write the session's blocks: then the loop frees them after it.
            self._closed.append(session)
            if not self._in_step:
                self._release_closed()

    def push(self, name: str, lines: list[str]) -> PushAck:
        lines = validate_lines(lines)
        ids_per_line = self.layout.lines_ids(lines)  # tokenized outside the lock
        new_tokens = sum(len(ids) for ids in ids_per_line)
        with self._cv:
            session = self._session(name)
            if session.num_tokens + new_tokens > session.max_context:
                raise KVCapacityError(
                    f"session {name!r} would hold {session.num_tokens + new_tokens} tokens, over its "
                    f"max_context {session.max_context}; the batch was not accepted"
                )
            version = session.append_batch(ids_per_line)
            self._cv.notify_all()
            return PushAck(name, version, session.backlog_lines, len(lines))

    def backlog(self, name: str) -> int:
        with self._cv:
            return self._session(name).backlog_lines

    def session_info(self, name: str) -> SessionInfo:
        with self._cv:
            return self._info(self._session(name))

    def list_sessions(self) -> list[SessionInfo]:
        with self._cv:
            return [self._info(s) for s in self.sessions.values()]

    # -- standing questions -------------------------------------------------
    def register(self, name: str, spec: QuestionSpec) -> None:
        """Make `spec` a standing question of the session: pre-positioned after every batch."""
        with self._cv:
            self.prepos.register(self._session(name), spec)
            self._cv.notify_all()

    def unregister(self, name: str, question_id: str) -> None:
        with self._cv:
            self._session(name)
            st = self.prepos.by_session.get(name, {}).get(question_id)
            self.prepos.unregister(name, question_id)
            if st is not None:  # asks that waited for its entry are answered the cold way
                self._waiting.extend(st.waiters)
                st.waiters.clear()
            self._cv.notify_all()

    def standing(self, name: str) -> list[StandingAnswer]:
        """The current standing answers of a session (those computed so far)."""
        with self._cv:
            self._session(name)
            return [st.answer for st in self.prepos.standing(name) if st.answer is not None]

    def standing_questions(self, name: str) -> list[QuestionSpec]:
        with self._cv:
            self._session(name)
            return [st.spec for st in self.prepos.standing(name)]

    def subscribe(self, name: str, callback) -> Subscription:
        """callback(StandingAnswer) on the engine thread whenever a standing answer changes."""
        with self._cv:
            self._session(name)
        return self.hub.add(name, "standing", callback)

    def subscribe_data(self, name: str, callback) -> Subscription:
        """callback(session, data_version) on the engine thread whenever a batch is ingested."""
        with self._cv:
            self._session(name)
        return self.hub.add(name, "data", callback)

    def watch(self, name: str):
        """Async iterator of a session's standing-answer changes."""
        with self._cv:
            self._session(name)
        return watch(self.hub, name, "standing")

    # -- questions --------------------------------------------------------
    def submit_ask(
        self,
        name: str,
        question: str,
        *,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        min_version: int | None = None,
        return_logits: bool = False,
    ) -> Future:
        """Ask a question; a standing question (by id or text) takes the fast or entry path."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        future: Future = Future()
        with self._cv:
            session = self._session(name)
            if min_version is not None and min_version > session.pushed_version:
                raise ValueError(f"min_version {min_version} is ahead of session {name!r} ({session.pushed_version} pushed)")
            st = self.prepos.find(name, question)
            if st is not None:
                br = Branch(session, st.spec.text, st.prompt_ids, max_tokens or st.spec.max_tokens, list(stop or []),
                            future, min_version=max(min_version or 0, session.data_version),
                            keep_logits=return_logits, standing=st)
                self._ask_standing(st, br)
                return future
        prompt = self.layout.question_ids(question)  # tokenized outside the lock
        with self._cv:
            session = self._session(name)
            br = Branch(session, question, prompt, max_tokens or 16, list(stop or []), future,
                        min_version=min_version or 0, keep_logits=return_logits)
            self._waiting.append(br)
            self._cv.notify_all()
        return future

    def ask(self, name: str, question: str, *, timeout: float | None = None, **kw) -> Answer:
        """Answer `question` on the session's newest ingested data (or min_version=, waiting for it)."""
        return self.submit_ask(name, question, **kw).result(timeout)

    async def ask_async(self, name: str, question: str, **kw) -> Answer:
        return await asyncio.wrap_future(self.submit_ask(name, question, **kw))

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
            br.future.set_result(self._answer(br, st.spec.choices and decision.answer or
                                              self.tokenizer.decode([decision.token_id], skip_special_tokens=True), 0))
            return
        self.prepos.fork_from_entry(st, br)
        br.prepaid = br.num_computed
        if not br.keep_logits:
            br.first_logits = None
        first = decision.token_id if decision.fired else int(torch.argmax(st.ready_logits))
        self._running.append(br)
        self._on_token(br, first)
        self._cv.notify_all()

    # -- lifecycle --------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending (all pushed data ingested, no question in flight)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._has_work() or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def stats(self) -> dict:
        m = self.store.manager
        with self._cv:
            return {
                "model": self.model_name,
                "device": str(self.device),
                "sessions": len(self.sessions),
                "questions_waiting": len(self._waiting),
                "questions_running": len(self._running),
                "ingest_backlog_tokens": sum(s.pending_tokens for s in self.sessions.values()),
                "steps": self.steps,
                "forward_calls": self.runner.forward_calls,
                "tokens_computed": self.runner.tokens_computed,
                "questions_answered": self.questions_answered,
                "cells_total": m.num_blocks * m.block_size,
                "cells_free": m.num_free_blocks * m.block_size,
                "kv_bytes_per_token": self.store.pool.bytes_per_token,
            }

    def check_integrity(self) -> None:
        with self._cv:
            tables = [s.table for s in self.sessions.values()]
            tables += [b.table for b in self._running if b.table is not None]
            for st in self.prepos.all():
                tables += [b.table for b in (st.computing, st.ready, st.decoding) if b is not None and b.table]
            self.store.manager.check_integrity(tables)

    # -- internals --------------------------------------------------------
    def _session(self, name: str) -> Session:
        session = self.sessions.get(name)
        if session is None:
            raise SessionError(f"no session named {name!r}; open it first")
        return session

    def _info(self, s: Session) -> SessionInfo:
        return SessionInfo(s.name, s.data_version, s.pushed_version, s.num_tokens, s.num_computed,
                           s.prefix_len, s.max_context, s.backlog_lines, s.lines_ingested)

    def _has_work(self) -> bool:
        return bool(self._running or any(self._can_start(b) for b in self._waiting)
                    or any(s.pending_tokens for s in self.sessions.values())
                    or any(st.session.ready and (not st.fresh() or st.computing or st.decoding)
                           for st in self.prepos.all()))

    def _waiters_without_entries(self) -> None:
        """Asks waiting on an entry that cannot be computed (no cells) go the cold way."""
        for st in self.prepos.all():
            if st.waiters and st.computing is None and not st.fresh():
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
                br.table = self.store.fork(s.table, s.version_length(s.data_version))
            except KVCapacityError as exc:
                if not self._running:  # nothing will free cells: fail instead of waiting forever
                    self._waiting.remove(br)
                    br.future.set_exception(exc)
                continue
            br.base_len = s.version_length(s.data_version)
            br.data_version = s.data_version
            self._waiting.remove(br)
            self._running.append(br)

    def _loop(self) -> None:
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
                self.prepos.refresh()
                self._waiters_without_entries()
                urgent, idle = self.prepos.entry_jobs()
                plan = self.scheduler.schedule(self._running + urgent, list(self.sessions.values()), idle)
                self._in_step = bool(plan)
            if not plan:
                with self._cv:  # blocked on memory: wait for a close or a finished branch
                    self._cv.wait(0.05)
                continue
            try:
                logits = self.runner.execute(
                    [Work(i.table, i.token_ids, i.start_pos, i.want_logits) for i in plan.items]
                )
            except Exception as exc:  # a failed step fails its questions, never the engine
                log.exception("forward failed")
                with self._cv:
                    self._in_step = False
                    self._fail_plan(plan, exc)
                continue
            with self._cv:
                self._in_step = False
                self._update(plan, logits)
                self.steps += 1
                events, self._events = self._events, []
            for session, kind, *payload in events:
                self.hub.publish(session, kind, *payload)

    def _update(self, plan: Plan, logits: list) -> None:
        for item, lg in zip(plan.items, logits, strict=True):
            if item.kind == INGEST:
                session: Session = item.owner
                before = session.data_version
                session.advance(len(item.token_ids))
                if session.data_version != before:
                    self._events.append((session.name, "data", session.name, session.data_version))
                continue
            br: Branch = item.owner
            br.num_computed += len(item.token_ids)
            if lg is None:
                continue
            if br.purpose == "entry":
                self._on_entry_ready(br, lg.clone())
                continue
            if br.keep_logits and br.first_logits is None:
                br.first_logits = lg.clone()
            self._on_token(br, int(torch.argmax(lg)))
        self._cv.notify_all()

    def _on_entry_ready(self, entry: Branch, logits: torch.Tensor) -> None:
        st = self.prepos.on_entry_ready(entry, logits)
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
            self._on_token(dec, decision.token_id if decision.fired else int(torch.argmax(logits)))
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
        br.future.set_result(self._answer(br, br.text.strip(), br.num_computed - br.prepaid))

    def _answer(self, br: Branch, text: str, tokens_computed: int) -> Answer:
        latency = (time.perf_counter() - br.t_start) * 1000
        return Answer(br.session.name, br.question, text, list(br.generated), br.data_version, tokens_computed,
                      latency, path=br.path, confidence=br.confidence, stale=br.stale,
                      finish_reason=br.finish_reason, logits=br.first_logits)

    def _fail_plan(self, plan: Plan, exc: Exception) -> None:
        for item in plan.items:
            if item.kind == INGEST:  # give back the slots; the tokens stay pending and are retried
                self.store.truncate(item.table, item.owner.num_computed)
                continue
            br: Branch = item.owner
            if br.table is not None:
                self.store.manager.free(br.table)
                br.table = None
            if br.purpose == "ask" and br in self._running:
                self._running.remove(br)
                br.future.set_exception(exc)
            elif br.standing is not None:  # entries and decodes are recomputed on the next refresh
                st: Standing = br.standing if br.purpose == "decode" else None
                for owner in self.prepos.all():
                    if owner.computing is br:
                        owner.computing = None
                if st is not None and st.decoding is br:
                    st.decoding = None
        self._cv.notify_all()

    def _fail_all(self, exc: Exception) -> None:
        for st in self.prepos.all():
            self._waiting.extend(st.waiters)
            st.waiters.clear()
        for br in self._waiting + self._running:
            if not br.future.done():
                br.future.set_exception(exc)
        self._waiting.clear()
        self._running.clear()
        self._busy = False
        self._cv.notify_all()

    def _release_closed(self) -> None:
        for session in self._closed:
            self.store.manager.free(session.table)
        self._closed.clear()
