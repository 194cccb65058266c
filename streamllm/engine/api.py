"""The public Python API (`Engine`): a facade that submits commands to the core.

Callers never touch sessions or cells: each call is validated and tokenized in the
caller's thread, then sent to the single writer (`core.EngineCore`) as a command
whose future it returns or waits on. Two things need no round trip:

- `push` acks at once: the facade assigns the batch's data_version (in the order it
  enqueues, so the core agrees) after the batch is in the ingest log, if one is set;
- the fast path: a standing question whose published `ReadyRecord` is current is
  answered from that record in the caller's thread, in microseconds.

Usable from threads and asyncio alike (`ask_async`); cancelling an `ask_async` task
sends a `Cancel`, and the core frees whatever the question held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from streamllm.config import QuestionSpec
from streamllm.engine.client import EngineClient, EngineHealth
from streamllm.engine.commands import (
    Ask,
    Call,
    CanAdmit,
    Cancel,
    CloseSession,
    EvictState,
    ExportSession,
    ImportSession,
    OpenSession,
    Register,
    Stop,
    Unregister,
    WaitIdle,
)
from streamllm.engine.config import EngineConfig
from streamllm.engine.core import EngineCore
from streamllm.engine.fastpath import fast_answer, find_standing
from streamllm.engine.intake import Intake, _Handle
from streamllm.engine.kv import BlockManager, KVPool, KVStore
from streamllm.engine.outputs import (
    AdmissionError,
    Answer,
    AskTimeout,
    EngineIdentity,
    EngineStopped,
    PushAck,
    SessionError,
    SessionInfo,
    StandingAnswer,
)
from streamllm.engine.passing import run_passing
from streamllm.engine.prompt import DEFAULT_SYSTEM, PromptLayout
from streamllm.engine.runner import Runner
from streamllm.engine.scheduler import Scheduler
from streamllm.engine.standing.gate import Gate
from streamllm.engine.standing.learning import Learning
from streamllm.engine.standing.prepos import Prepositioner
from streamllm.engine.state import SessionState
from streamllm.engine.subscriptions import Subscribable, SubscriptionHub
from streamllm.engine.taps import LINE_SLACK, TapConfig
from streamllm.model.adapter import Adapter, check_adapter, load_adapter, series_width
from streamllm.model.llama import LlamaForward
from streamllm.model.loader import LoadedModel, load_model
from streamllm.model.lora import merged_state_dict

__all__ = ["AdmissionError", "Answer", "AskTimeout", "Engine", "EngineStopped", "PushAck", "SessionError", "SessionInfo",
           "decode_note"]
log = logging.getLogger("streamllm.engine")


def decode_note(stats: Mapping[str, Any]) -> str:
    """How this engine's decode steps run, in words for start-up banners, from `stats()` ("" for the plain
    Python forward on the model's own weights)."""
    if stats.get("native_decode"):
        return "decode steps in native code"
    return "decode steps read 4-bit weight copies" if stats.get("int4_decode") else ""


class Engine(Intake, Subscribable, EngineClient):
    """One core thread serving every session on one model (`EngineClient`)."""

    def __init__(
        self,
        model: str | LoadedModel = "smollm2-135m",
        config: EngineConfig | None = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        adapter=None,
        ingest_log=None,
        progress: bool = False,
    ) -> None:
        config = config if config is not None else EngineConfig()
        self.config = config
        self.stale_policy = config.stale_policy
        loaded = model if isinstance(model, LoadedModel) else load_model(model, progress=progress)
        self._model_name = loaded.name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = loaded.tokenizer
        self.layout = PromptLayout(loaded.tokenizer)
        # Built on a thread that ends (engine/passing.py): the OpenMP workers a thread's big torch ops
        # leave behind would slow every op of the core's steps for as long as that thread lives.
        self.adapter, self.model, store = run_passing(self._build, loaded, adapter, dtype, config)
        self.adapter_id = None if self.adapter is None else self.adapter.id
        self.default_max_context = config.max_context
        self.hub = SubscriptionHub()
        # Lines each session keeps for series heads: an entry reads the lines up to its fork point,
        # and ingest may have computed a few updates past it by the time the entry is ready.
        # Live learning (engine/standing/learning.py) reads the same features: the adapter's layer and words when it
        # has series heads, else the learning config's, kept only by sessions with a learning question.
        lines = self.adapter.tap_lines if self.adapter is not None else 0
        learn = config.learning
        tap_layer = self.adapter.tap_layer if self.adapter is not None else None
        words = self.adapter.tap_words if lines else learn.words
        learning = None
        if learn.enabled:
            tap_layer = learn.layer_for(self.model.num_layers, tap_layer)
            learning = Learning(learn, layer=tap_layer, words=tuple(words), device=self.device)
        kept = max(lines, learn.lines if learn.enabled else 0)
        taps = TapConfig.for_heads(self.tokenizer, kept + LINE_SLACK if kept else 0, words if kept else ())
        self.core = EngineCore(
            model_name=self._model_name, tokenizer=self.tokenizer, layout=self.layout, store=store,
            runner=Runner(self.model, store, tap_layer=tap_layer), scheduler=Scheduler(store.manager, config.scheduler),
            prepos=Prepositioner(store, self.layout.eos_ids, head_entries=config.head_entries, learning=learning),
            hub=self.hub, policy=config.compaction, branch_cells=config.reserved_branch_cells,
            stale_policy=config.stale_policy, taps=taps, taps_on_open=bool(lines),
            check_every_step=config.check_integrity_every_step, working_set_tokens=config.working_set_tokens)
        # streamllm.durability.ingest_log.IngestLog: accepted batches are on disk before their ack.
        self._ingest_log = ingest_log
        self._lock = threading.Lock()  # the facade's own registry (names, acked versions); never core state
        self._handles: dict[str, _Handle] = {}
        self._ask_ids = itertools.count(1)
        self._fast_answers = self._entry_answers = 0
        self._identity: EngineIdentity | None = None
        self.core.start()

    def _build(self, loaded: LoadedModel, adapter, dtype, config: EngineConfig):
        """(adapter, model, store): what the core computes with."""
        # A `streamllm tune` adapter dir (or a loaded Adapter): choice heads the gate decides with,
        # and/or a LoRA merged into the weights here (no per-step cost).
        adapter = _load_adapter(adapter, loaded)
        weights = loaded.state_dict
        if adapter is not None and adapter.lora:
            weights = merged_state_dict(loaded, adapter.path)
        model = LlamaForward(loaded.config, weights, device=self.device, dtype=dtype)
        if adapter is not None:  # hidden states come back fp32
            adapter.heads = [h.to(model.device, torch.float32) for h in adapter.heads]
        num_blocks = max(1, config.max_cells // config.block_size)
        store = KVStore(
            BlockManager(num_blocks, config.block_size, grow_blocks=max(1, config.growth_cells // config.block_size)),
            KVPool(model.num_layers, num_blocks * config.block_size, model.num_kv_heads, model.head_dim,
                   dtype=model.dtype, device=self.device),
        )
        return adapter, model, store

    @property
    def model_name(self) -> str:
        return self._model_name

    def prefix_tokens(self, system: str = DEFAULT_SYSTEM) -> int:
        return len(self.layout.prefix_ids(system))

    def identity(self) -> EngineIdentity:
        """What this engine's cells are valid for (snapshots are checked against it)."""
        if self._identity is None:
            m = self.model
            arch = {"name": self.model_name, "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                    "head_dim": m.head_dim, "vocab": m.vocab_size, "dtype": str(m.dtype),
                    "config": m.config.to_dict() if hasattr(m.config, "to_dict") else str(m.config)}
            h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
            with self.layout.lock:
                h.update(json.dumps(sorted(self.tokenizer.get_vocab().items())).encode())
            self._identity = EngineIdentity(
                self.model_name, h.hexdigest(), str(self.store.pool.k.dtype).removeprefix("torch."), self.adapter_id,
                m.num_layers, m.num_kv_heads, m.head_dim, series_width(m.config.hidden_size, len(self.core.tap_words)))
        return self._identity

    @property
    def ingest_log(self):
        """The ingest log accepted batches are written to before their ack, or None."""
        return self._ingest_log

    def attach_log(self, ingest_log) -> None:
        """Write every accepted record to `ingest_log` from now on (recovery attaches it after replaying it)."""
        self._ingest_log = ingest_log

    # -- views for tests and benches (read after wait_idle; mutate only through `call`) ------------
    @property
    def sessions(self):
        return self.core.sessions

    @property
    def store(self) -> KVStore:
        return self.core.store

    @property
    def runner(self) -> Runner:
        return self.core.runner

    @property
    def prepos(self) -> Prepositioner:
        return self.core.prepos

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def fast_answers(self) -> int:
        return self._fast_answers + self.core.fast_answers

    # -- sessions ---------------------------------------------------------
    def open_session(self, name: str, system: str = DEFAULT_SYSTEM, *, max_context: int | None = None,
                     tenant: str = "") -> SessionInfo:
        if not isinstance(name, str) or not name:
            raise ValueError("session name must be a non-empty string")
        max_context = max_context or self.default_max_context
        prefix = self.layout.prefix_ids(system)
        if len(prefix) >= max_context:
            raise ValueError(f"system prompt is {len(prefix)} tokens, more than max_context {max_context}")
        with self._log_lock(name):
            with self._lock:
                if name in self._handles:
                    raise SessionError(f"session {name!r} is already open")
            info = self._wait(OpenSession(name, system, prefix, max_context, tenant))
            with self._lock:
                self._handles[name] = _Handle(max_context, len(prefix), 0, 0)
            if self.ingest_log is not None:
                try:
                    self.ingest_log.record_open(name, system, max_context, tenant)
                except BaseException:  # not logged: not open either (a push to it could never be recovered)
                    with self._lock:
                        self._handles.pop(name, None)
                    self.core.submit(CloseSession(name)).result()
                    raise
        return info

    def close_session(self, name: str) -> None:
        with self._log_lock(name):
            with self._lock:
                if self._handles.pop(name, None) is None:
                    raise SessionError(f"no session named {name!r}; open it first")
                future = self.core.submit(CloseSession(name))
            future.result()
            if self.ingest_log is not None:
                self.ingest_log.record_close(name)

    def session_info(self, name: str) -> SessionInfo:
        with self._lock:
            pushed = self._handle(name).pushed_version
        record = self.core.records.get(name)
        if record is None:
            raise SessionError(f"no session named {name!r}; open it first")
        # The facade acks pushes before the core applies them: its pushed_version is the truth.
        return dataclasses.replace(record.info, pushed_version=pushed)

    def list_sessions(self) -> list[SessionInfo]:
        """Every open session."""
        return [r.info for r in list(self.core.records.values())]

    # -- standing questions -------------------------------------------------
    def register(self, name: str, spec: QuestionSpec) -> None:
        """Make `spec` a standing question of the session: pre-positioned after every batch."""
        gate, prompt = self._gate(spec)
        self._submit(name, Register(name, spec, gate, prompt)).result()
        if self.ingest_log is not None:
            self.ingest_log.record_register(name, spec.to_dict())

    def unregister(self, name: str, question_id: str) -> None:
        self._submit(name, Unregister(name, question_id)).result()
        if self.ingest_log is not None:
            self.ingest_log.record_unregister(name, question_id)

    def _gate(self, spec: QuestionSpec) -> tuple[Gate, list[int]]:
        with self.layout.lock:  # the gate encodes choices with the shared tokenizer
            gate = Gate.for_question(spec, self.tokenizer)
        if self.adapter is not None and spec.choices:
            gate.head = self.adapter.head_for(spec.text, spec.choices)
        return gate, self.layout.question_ids(spec.text)

    def standing(self, name: str) -> list[StandingAnswer]:
        """The current standing answers of a session (those computed so far)."""
        self._known(name)
        record = self.core.records.get(name)
        return list(record.standing) if record else []

    def calibration(self) -> dict[str, dict[str, dict]]:
        """Live figures of labelled standing questions, {session: {question_id: summary}}
        (engine/standing/calibration.py), as of their latest answers."""
        out: dict[str, dict[str, dict]] = {}
        for name, record in list(self.core.records.items()):
            scored = {a.question_id: a.calibration for a in record.standing if a.calibration}
            if scored:
                out[name] = scored
        return out

    def standing_questions(self, name: str) -> list[QuestionSpec]:
        self._known(name)
        record = self.core.records.get(name)
        return list(record.questions) if record else []

    # -- questions --------------------------------------------------------
    def submit_ask(self, name: str, question: str, *, max_tokens: int | None = None, stop: list[str] | None = None,
                   min_version: int | None = None, return_logits: bool = False, on_text=None,
                   deadline_s: float | None = None) -> Future:
        """Ask a question; a standing question (by id or text) takes the fast or entry path.
        max_tokens is capped at MAX_ASK_TOKENS; deadline_s (default `EngineConfig.ask_timeout_s`)
        bounds how long it may take before it is dropped with `AskTimeout`."""
        t0 = time.perf_counter()
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if deadline_s is None:
            deadline_s = self.config.ask_timeout_s
        elif isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not deadline_s > 0:
            raise ValueError(f"deadline_s must be a number of seconds > 0 (or None for the engine's), got {deadline_s!r}")
        with self._lock:
            pushed = self._handle(name).pushed_version
        if min_version is not None and min_version > pushed:
            raise ValueError(f"min_version {min_version} is ahead of session {name!r} ({pushed} pushed)")
        record = self.core.records.get(name)
        spec = find_standing(record.questions if record else (), question)
        if spec is not None:
            ready = self.core.ready_records.get((name, spec.id))
            answer = fast_answer(ready, spec, record.info.data_version, min_version or 0, max_tokens,
                                 return_logits, self.stale_policy, self.layout.eos_ids, t0, stop)
            if answer is not None:
                with self._lock:
                    if answer.path == "fast":
                        self._fast_answers += 1
                    else:
                        self._entry_answers += 1
                future: Future = Future()
                future.set_result(answer)
                return future
        prompt = [] if spec is not None else self.layout.question_ids(question)
        cmd = Ask(next(self._ask_ids), name, question, prompt, max_tokens, list(stop or []), min_version or 0,
                  return_logits, spec.id if spec is not None else None, on_text=on_text, t_start=t0,
                  deadline_s=deadline_s)
        future = self._submit(name, cmd)
        future.add_done_callback(lambda f, ask_id=cmd.ask_id: f.cancelled() and self.core.submit(Cancel(ask_id)))
        return future

    # -- a session's whole state (snapshots, eviction, moves: streamllm.durability) -------------
    def submit_export(self, name: str, *, only_ready: bool = False) -> Future:
        """Have the core copy the session's cells and bookkeeping between two steps; the future resolves
        to a `SessionState` (the session keeps running). only_ready: to None, not an error, when the
        session is not open or its frozen prefix is not computed yet (checkpoints)."""
        if not only_ready:
            with self._lock:
                self._handle(name)
        return self.core.submit(ExportSession(name, only_ready))

    def export_session(self, name: str) -> SessionState:
        """The session's cells and bookkeeping as plain data (on the CPU); it keeps running."""
        return self.submit_export(name).result()

    def evict_state(self, name: str) -> SessionState:
        """Export the session and drop it, freeing its cells; `SessionError` while it has work someone waits
        on (pending ingest, questions, compaction, a decode a subscriber hears: engine/state.py busy_reasons);
        background work nobody waits on is dropped and redone after the restore. Its subscriptions stay attached: they hear it
        again once `import_session` brings it back under its name. Nothing is written to the ingest log."""
        with self._log_lock(name):  # no push between its version and its enqueue
            with self._lock:
                handle = self._handle(name)
                del self._handles[name]  # from now on the name is unknown here, as the core will have it
            try:
                return self._wait(EvictState(name))
            except BaseException:
                with self._lock:  # refused (busy): it stays, as it was
                    self._handles[name] = handle
                raise

    def import_session(self, state: SessionState, name: str) -> SessionInfo:
        """Open `name` from an exported state (its cells, versions and standing questions);
        `AdmissionError` when its budget cannot be had, `SessionError` when the name is open."""
        gates = [(spec, *self._gate(spec)) for spec in state.questions]
        with self._lock:
            if name in self._handles:
                raise SessionError(f"session {name!r} is already open; close it or restore under another name")
        info = self._wait(ImportSession(state, name, gates))
        with self._lock:
            self._handles[name] = _Handle(info.max_context, info.prefix_tokens, info.pushed_version,
                                          info.lines_ingested + info.backlog_lines)
        return info

    def working_set(self, max_context: int | None = None, prefix_tokens: int | None = None) -> int:
        """Cells a session is admitted for (engine/admission.py): its prefix (the default system prompt's
        unless given) and its newest data, at most max_context (the engine's default unless given)."""
        prefix = self.prefix_tokens() if prefix_tokens is None else prefix_tokens
        return self.core.admission.working_set(prefix, max_context or self.default_max_context)

    def can_admit(self, cells: int) -> bool:
        """Whether a session whose working set is `cells` would be admitted now (the core's own rule)."""
        return bool(self._wait(CanAdmit(cells)))

    # -- the core -----------------------------------------------------------
    def call(self, fn, timeout: float | None = None):
        """Run fn(core) on the core thread between steps and return its result: tests and benches only.

        Called from the core thread itself (a subscriber or future callback), fn runs at once."""
        if self.core.on_core_thread():
            return fn(self.core)
        return self.core.submit(Call(fn)).result(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending (all pushed data ingested, no question in flight)."""
        try:
            return bool(self.core.submit(WaitIdle()).result(timeout))
        except FutureTimeout:
            return False

    def check_integrity(self) -> None:
        self.call(lambda core: core.check_integrity())

    def shutdown(self) -> None:
        if not self.core.stopped:
            with contextlib.suppress(EngineStopped):
                self.core.submit(Stop())
        self.core.join(timeout=30)

    @property
    def failure(self) -> BaseException | None:
        return self.core.failure

    def health(self) -> EngineHealth:
        failure = self.core.failure
        log_failure = self.ingest_log.failure if self.ingest_log is not None else None  # durability/ingest_log.py
        return EngineHealth(not self.core.stopped, None if failure is None else repr(failure), self.core.failed_steps,
                            log_failure, self.core.failing_in_a_row, self.core.last_step_error)

    def stats(self) -> dict:
        """Counters and gauges for /health, /metrics and benchmarks (all numbers but model/device/dtype)."""
        out: dict[str, Any] = {"model": self.model_name, "device": str(self.device),
                               "dtype": self.model.dtype_choice.name, "adapter": self.adapter_id or ""}
        out.update(self.core.counters)
        out["fast_answers"] = self.fast_answers
        out["entry_answers"] = self._entry_answers + self.core.entry_answers
        out["core_alive"] = int(not self.core.stopped)
        out["native_decode"] = int(self.model.native_decode)  # decode steps run in native code (model/native.py)
        out["int4_decode"] = int(self.model.int4_decode)  # one-row steps read 4-bit weight copies (model/int4.py)
        return out

    # -- internals --------------------------------------------------------
    def _wait(self, cmd):
        return self.core.submit(cmd).result()

    def _submit(self, name: str, cmd) -> Future:
        """Submit a command on an open session (SessionError, raised here, for an unknown one)."""
        with self._lock:
            self._handle(name)
            return self.core.submit(cmd)

    def _handle(self, name: str) -> _Handle:
        """Under self._lock."""
        if self.core.stopped:
            raise self.core.stopped_error()
        h = self._handles.get(name)
        if h is None:
            raise SessionError(f"no session named {name!r}; open it first")
        return h

    def _known(self, name: str) -> None:
        with self._lock:
            self._handle(name)

    def _log_lock(self, name: str):
        return self.ingest_log.session_lock(name) if self.ingest_log is not None else contextlib.nullcontext()


def _load_adapter(adapter, model: LoadedModel):
    if adapter is None:
        return None
    out = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    check_adapter(out, model.name, model.config.hidden_size, model.config.num_hidden_layers)
    return out
