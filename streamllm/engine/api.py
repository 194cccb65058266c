"""The public Python API: sessions, pushes and questions over one shared model.

One background thread runs plan -> execute -> update. Callers never touch the model:
`push` tokenizes in the caller's thread, appends under the lock and returns an ack at
once; `ask` enqueues a branch and waits on a future (`ask_async` awaits it), so the
engine is usable from threads and from asyncio alike.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from streamllm.config import QuestionSpec
from streamllm.engine.compaction import Compaction
from streamllm.engine.core import EngineLoop, settle
from streamllm.engine.kv import BlockManager, BlockTable, KVCapacityError, KVPool, KVStore
from streamllm.engine.prepos import Prepositioner, StandingAnswer
from streamllm.engine.runner import Runner
from streamllm.engine.scheduler import Scheduler, SchedulerConfig
from streamllm.engine.sequence import (
    DEFAULT_SYSTEM,
    Answer,
    Branch,
    PromptLayout,
    Session,
    validate_lines,
)
from streamllm.engine.subscriptions import Subscription, SubscriptionHub, watch
from streamllm.model.llama import LlamaForward
from streamllm.model.loader import LoadedModel, load_model


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


def _load_adapter(adapter, model_name: str, model: LlamaForward):
    if adapter is None:
        return None
    from streamllm.model.adapter import Adapter, check_adapter, load_adapter

    loaded = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    check_adapter(loaded, model_name, model.config.hidden_size)
    loaded.heads = [h.to(model.device, model.dtype) for h in loaded.heads]
    return loaded


class Engine(EngineLoop):
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
        compact_at: float = 0.75,
        retain: float = 0.5,
        progress: bool = False,
        ingest_log=None,
        adapter=None,
    ) -> None:
        if stale_policy not in ("wait", "stale"):
            raise ValueError(f"stale_policy must be 'wait' or 'stale', got {stale_policy!r}")
        self.stale_policy = stale_policy
        if not 0 < retain < compact_at <= 1:
            raise ValueError(f"need 0 < retain < compact_at <= 1, got retain={retain}, compact_at={compact_at}")
        self.compact_at, self.retain = compact_at, retain
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
        # A `streamllm tune` adapter dir (or a loaded Adapter): choice heads for the gate.
        self.adapter = _load_adapter(adapter, loaded.name, self.model)
        self.adapter_id = None if self.adapter is None else self.adapter.id
        self.prepos = Prepositioner(self.store, self.layout, self.adapter)
        self.hub = SubscriptionHub()
        self._events: list[tuple] = []  # (session, kind, payload) published after the lock is released
        self.fast_answers = 0
        self._waiting: list[Branch] = []
        self._running: list[Branch] = []
        self._closed: list[Session] = []  # freed by the loop between steps
        self._compactions: dict[str, Compaction] = {}
        self._closed_tables: list[BlockTable] = []
        # Frozen prefixes by their full blocks' token ids -> those blocks (one reference held here).
        self._prefix_blocks: dict[tuple[int, ...], list[int]] = {}
        self.prefix_hits = 0
        self._cv = threading.Condition()
        self._stopped = False
        self.failure: BaseException | None = None  # set if the loop ever dies
        self._busy = False
        self._in_step = False  # a plan is executing outside the lock
        self.steps = 0
        self.step_ms_total = self.step_ms_last = 0.0
        self.step_tokens_last = 0
        self.admissions_refused = 0
        self.questions_answered = 0
        # streamllm.durability.ingest_log.IngestLog: accepted batches are on disk before their ack (None: memory only).
        self.ingest_log = ingest_log
        self._evicted: dict[str, str] = {}  # session -> snapshot path, restored on its next use
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
            self._check_running()
            if name in self.sessions or name in self._evicted:
                raise SessionError(f"session {name!r} is already open")
            if not manager.can_reserve(max_context, keep_free_tokens=self.branch_cells):
                self.admissions_refused += 1
                raise AdmissionError(
                    f"cannot open session {name!r}: it reserves {max_context} cells, the pool has "
                    f"{manager.num_free_blocks * manager.block_size} free and keeps {self.branch_cells} for "
                    "questions; close a session, lower max_context or raise max_cells"
                )
            table = BlockTable()
            shared = self._shared_prefix_blocks(prefix)
            if shared:  # an identical frozen prefix is already computed: share its full blocks
                manager.share(shared)
                table.blocks, table.num_tokens = list(shared), len(shared) * manager.block_size
            manager.reserve(table, max_context)
            session = Session(name, system, prefix, max_context, table)
            session.num_computed = table.num_tokens
            self.prefix_hits += bool(shared)
            self.sessions[name] = session
            self._cv.notify_all()
            info = self._info(session)
        if self.ingest_log is not None:
            self.ingest_log.record_open(name, system, max_context)
        return info

    def close_session(self, name: str) -> None:
        if self._evicted.pop(name, None) is not None:  # its snapshot stays on disk; the session is gone
            if self.ingest_log is not None:
                self.ingest_log.record_close(name)
            return
        self._drop_session(name)
        if self.ingest_log is not None:
            self.ingest_log.record_close(name)

    def _drop_session(self, name: str, *, evicting: bool = False) -> None:
        """Take the session out of the engine and free its cells (an evicted one keeps its subscribers)."""
        with self._cv:
            session = self._session(name)
            session.closing = True
            del self.sessions[name]
            for st in self.prepos.drop_session(name):
                self._waiting.extend(st.waiters)
            for br in [b for b in self._waiting if b.session is session]:
                self._waiting.remove(br)
                settle(br.future, error=SessionError(f"session {name!r} was closed"))
            if not evicting:
                self.hub.drop_session(name)
            job = self._compactions.pop(name, None)
            self._cv.notify_all()
            # An in-flight forward may still write the session's blocks: then the loop frees them after it.
            self._closed.append(session)
            if job is not None:
                self._closed_tables.append(job.table)
            if not self._in_step:
                self._release_closed()

    def push(self, name: str, lines: list[str]) -> PushAck:
        lines = validate_lines(lines)
        if not lines:
            raise ValueError("push at least one line")
        ids_per_line = self.layout.lines_ids(lines)  # tokenized outside the lock
        new_tokens = sum(len(ids) for ids in ids_per_line)
        self._ensure_resident(name)
        if self.ingest_log is None:
            with self._cv:
                self._admit_push(name, new_tokens)
                return self._append(name, ids_per_line, len(lines))
        # With a log, the session's log lock spans version assignment, the log write and the append:
        # the log is in version order, and a batch enters the session only once it is on disk, so a
        # failed write leaves neither an ack nor an unlogged batch behind.
        with self.ingest_log.session_lock(name):
            with self._cv:
                version = self._admit_push(name, new_tokens)
            self.ingest_log.record_push(name, version, lines)  # outside the engine lock: no fsync waits there
            with self._cv:
                ack = self._append(name, ids_per_line, len(lines))
        assert ack.data_version == version, (ack, version)  # pushes to one session are serialized by its log lock
        return ack

    def _append(self, name: str, ids_per_line: list[list[int]], num_lines: int) -> PushAck:
        session = self._session(name)
        version = session.append_batch(ids_per_line)
        self._maybe_compact(session)
        self._cv.notify_all()
        return PushAck(name, version, session.backlog_lines, num_lines)

    def _admit_push(self, name: str, new_tokens: int) -> int:
        """Under the lock: the version a batch of new_tokens will get, or a clear refusal."""
        session = self._session(name)
        if session.num_tokens + new_tokens > session.max_context:
            state = "compaction has not caught up yet" if name in self._compactions else (
                "the batch alone is larger than the session's budget")
            raise KVCapacityError(
                f"session {name!r} would hold {session.num_tokens + new_tokens} tokens, over its "
                f"max_context {session.max_context} ({state}); the batch was not accepted, push it again"
            )
        return session.pushed_version + 1

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
        if self.ingest_log is not None:
            from streamllm.durability.snapshot import question_dict

            self.ingest_log.record_register(name, question_dict(spec))

    def unregister(self, name: str, question_id: str) -> None:
        with self._cv:
            self._session(name)
            st = self.prepos.by_session.get(name, {}).get(question_id)
            self.prepos.unregister(name, question_id)
            if st is not None:  # asks that waited for its entry are answered the cold way
                self._waiting.extend(st.waiters)
                st.waiters.clear()
            self._cv.notify_all()
        if self.ingest_log is not None:
            self.ingest_log.record_unregister(name, question_id)

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
        self._ensure_resident(name)
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

    # -- snapshots (streamllm.durability.snapshot) --------------------------------------
    def snapshot_session(self, name: str, path):
        """Save the session's cells and bookkeeping to `path` (atomic); it keeps running."""
        from streamllm.durability.snapshot import save_session

        self._ensure_resident(name)
        return save_session(self, name, path)

    def restore_session(self, path, name: str | None = None):
        """Open a session from a snapshot (validated first: model, checksum, counts, versions)."""
        from streamllm.durability.snapshot import restore_session

        info = restore_session(self, path, name)
        if self.ingest_log is not None:
            self.ingest_log.record_restore(info.session, path, info.data_version)
        return info

    def evict_session(self, name: str, directory) -> str:
        """Free an idle session's cells: snapshot it to `directory`; its next push or ask restores it."""
        from streamllm.durability.snapshot import evict_session

        return evict_session(self, name, directory)

    def _ensure_resident(self, name: str) -> None:
        if name in self._evicted:
            from streamllm.durability.snapshot import restore_evicted

            restore_evicted(self, name)

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
        """Counters and gauges for /health, /metrics and benchmarks (all numbers but model/device)."""
        m = self.store.manager
        sched = self.scheduler.stats
        with self._cv:
            urgent, idle = self.prepos.entry_jobs()
            pending_tokens = sum(s.pending_tokens for s in self.sessions.values())
            return {
                "model": self.model_name,
                "device": str(self.device),
                "sessions": len(self.sessions),
                "standing_questions": len(self.prepos.all()),
                "questions_waiting": len(self._waiting) + sum(len(st.waiters) for st in self.prepos.all()),
                "questions_running": len(self._running),
                "queue_interactive": len(self._running) + len(urgent),
                "queue_ingest_tokens": pending_tokens,
                "queue_idle": len(idle),
                "ingest_backlog_tokens": pending_tokens,
                "steps": self.steps,
                "step_ms_avg": self.step_ms_total / self.steps if self.steps else 0.0,
                "step_ms_last": self.step_ms_last,
                "step_tokens_last": self.step_tokens_last,
                "tokens_interactive": sched.tokens["interactive"],
                "tokens_ingest": sched.tokens["ingest"],
                "tokens_idle": sched.tokens["idle"],
                "idle_preempted": sched.idle_preempted,
                "blocked_for_cells": sched.blocked,
                "forward_calls": self.runner.forward_calls,
                "tokens_computed": self.runner.tokens_computed,
                "questions_answered": self.questions_answered,
                "fast_answers": self.fast_answers,
                "entries_computed": sum(st.entries_computed for st in self.prepos.all()),
                "entries_evicted": self.prepos.entries_evicted,
                "admissions_refused": self.admissions_refused,
                "compactions": sum(x.compactions for x in self.sessions.values()),
                "compactions_running": len(self._compactions),
                "prefix_cache_hits": self.prefix_hits,
                "cells_total": m.num_blocks * m.block_size,
                "cells_free": m.num_free_blocks * m.block_size,
                "kv_bytes_per_token": self.store.pool.bytes_per_token,
            }

    def check_integrity(self) -> None:
        with self._cv:
            tables = [s.table for s in self.sessions.values()]
            tables += [b.table for b in self._running if b.table is not None]
            tables += [job.table for job in self._compactions.values()]
            tables += [BlockTable(blocks=list(b), num_tokens=len(b) * self.store.block_size)
                       for b in self._prefix_blocks.values()]
            for st in self.prepos.all():
                tables += [b.table for b in (st.computing, st.ready, st.decoding) if b is not None and b.table]
            self.store.manager.check_integrity(tables)

    # -- internals --------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopped:
            reason = f"after an internal error: {self.failure!r}" if self.failure else "(shut down)"
            raise RuntimeError(f"the engine is stopped {reason}")

    def _session(self, name: str) -> Session:
        self._check_running()
        session = self.sessions.get(name)
        if session is None:
            raise SessionError(f"no session named {name!r}; open it first")
        return session

    def _info(self, s: Session) -> SessionInfo:
        return SessionInfo(s.name, s.data_version, s.pushed_version, s.num_tokens, s.num_computed,
                           s.prefix_len, s.max_context, s.backlog_lines, s.lines_ingested)
