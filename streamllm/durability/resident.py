"""`ResidentEngine`: an `Engine` whose idle sessions can live on disk, restored on use.

    evict_session(name)   the engine exports the idle session and frees its cells (EvictState);
                          its snapshot is written to SPILL/<name>.safetensors; the name stays open
    push / ask / register / unregister / export / snapshot on an evicted session
                          restore it first (the snapshot read back, ImportSession), then run
    open / restore refused for want of cells (AdmissionError), with auto_evict=True
                          evict resident sessions, the one whose next use is furthest first (see
                          below), skipping busy ones (work someone waits on, or their session or log
                          lock held: a push between its version and its enqueue), until the request
                          fits; then retry. Background work nobody waits on (an entry computing, a
                          standing decode nobody subscribed to) is dropped, and redone on restore
    the pool short while sessions grow (the engine's `cells_wanted` in stats, engine/admission.py),
    or sessions on disk and no room for `restore_room` of them to come back, with auto_evict=True
                          a watcher thread spills idle sessions the same way until what was wanted
                          is freed: the engine then need not compact a busy session to make room,
                          and a restore finds its room without waiting for an eviction; each comes
                          back on its next push (its next bar) or ask

Which session goes first: the one whose next use is predicted furthest away. A session fed at a
steady pace (bars) is next used one push interval (a running mean of its gaps) after its last
push (due now when late, until two gaps have passed); any other, or one that stopped, is expected
to stay idle about as long as it has been (so the least recently used goes first, as LRU).
Under bars arriving round robin LRU is the worst order (the least recently used session is the
one whose bar comes next: every bar would restore a session); this order evicts the session
that was just fed, so only the sessions beyond the pool's share come back from disk. Sessions
whose standing answers are still being made for their newest data go after all others: evicting
one drops that work, and its subscribers would hear of that bar only after its next push.

An ask of a choice question on a session on disk is answered from the standing answers it left
with (the engine's fast path would answer the same: nothing arrived since, or it would be back);
other asks restore it.

Built only on the engine's public methods. Every call that touches one session runs under
that session's lock, so an eviction never slips between the residency check and the call:
a push or ask that races an eviction waits for it, then restores the session. An evicted
session is listed and described (`session_info`, `standing`, `standing_questions`) as it
was when evicted, without reading the disk; `close_session` deletes its snapshot. An ask on
an evicted session returns its future at once and restores in a worker thread, so an event
loop calling `submit_ask` never waits on the disk. Subscriptions are this object's own,
relayed from the engine from the first one on, so they stay attached across evictions.
A spill file is a cache of a live session, written without fsync: the ingest log (and its
checkpoints) is what a crash recovers from, for sessions on disk as for resident ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamllm.config import QuestionSpec
from streamllm.durability.files import make_dirs
from streamllm.durability.snapshot import (
    SnapshotError,
    SnapshotInfo,
    load_snapshot,
    restore_session,
    save_session,
    snapshot_path,
    snapshot_state,
    write_state,
)
from streamllm.engine.api import Engine
from streamllm.engine.client import EngineClient, EngineHealth
from streamllm.engine.commands import settle
from streamllm.engine.fastpath import find_standing
from streamllm.engine.outputs import (
    AdmissionError,
    Answer,
    AnswerPath,
    EngineIdentity,
    EngineStopped,
    FinishReason,
    PushAck,
    SessionError,
    SessionInfo,
    StandingAnswer,
)
from streamllm.engine.passing import PassingWorker
from streamllm.engine.prompt import DEFAULT_SYSTEM
from streamllm.engine.state import SessionState
from streamllm.engine.subscriptions import Subscription, SubscriptionHub

__all__ = ["ResidentEngine"]
log = logging.getLogger("streamllm.durability")


@dataclass(slots=True)
class _Evicted:
    """A session on disk: its snapshot and what it showed when it left the pool."""

    path: Path
    info: SessionInfo
    standing: list[StandingAnswer] = field(default_factory=list)
    questions: list[QuestionSpec] = field(default_factory=list)


def _answer_on_disk(ev: _Evicted, question: str, min_version: int, t0: float) -> Answer | None:
    """What the engine's fast path would answer, from an evicted session's standing answers, or None.

    Only a choice question's: its answer is the choice the gate's view picked, fired or not (the fast
    path answers it alone at any max_tokens and stop strings), and what the session showed when it
    left is current: a push restores it first, so nothing arrived since. A free-text answer's tokens are
    not kept, nor the logits: those asks restore the session."""
    spec = find_standing(ev.questions, question)
    if spec is None or not spec.choices:
        return None
    got = next((a for a in ev.standing if a.question_id == spec.id), None)
    if (got is None or got.path not in (AnswerPath.FAST, AnswerPath.ENTRY) or got.data_version < min_version
            or got.data_version != ev.info.pushed_version):
        return None
    return Answer(got.session, spec.text, got.text, [], got.data_version, 0, (time.perf_counter() - t0) * 1000,
                  path=got.path, confidence=got.confidence, finish_reason=FinishReason.STOP, choices=got.choices,
                  warming_up=got.warming_up, warming_up_reason=got.warming_up_reason)


class ResidentEngine(EngineClient):
    """`EngineClient` over one `Engine`, with idle sessions evicted to `spill_dir` and restored on use.

    spill_dir: where evicted sessions' snapshots go (needed by `evict_session` and auto_evict).
    auto_evict: when an open or a restore is refused for want of cells, evict idle sessions (furthest
    next use first) and retry; and while the pool is short of cells as sessions grow, spill idle
    sessions (checked every watch_s seconds). settle_s: while every candidate is busy, how long to keep
    trying them again (every 0.25 s) before the open or restore is refused. restore_room: while
    sessions are on disk, the watcher keeps room for this many of them to come back (0: it spills
    only when the engine is short). Owns `engine`:
    `shutdown` stops it."""

    def __init__(self, engine: Engine, spill_dir: str | Path | None = None, *, auto_evict: bool = False,
                 settle_s: float = 2.0, watch_s: float = 0.1, restore_room: int = 0) -> None:
        if auto_evict and spill_dir is None:
            raise ValueError("auto_evict needs a spill_dir to evict sessions to")
        self.engine = engine
        self.spill_dir = make_dirs(spill_dir) if spill_dir is not None else None
        self.auto_evict, self.settle_s = auto_evict, settle_s
        self._lock = threading.Lock()  # the registry below; never held across an engine call that waits
        self._evicted: dict[str, _Evicted] = {}
        self._session_locks: dict[str, threading.RLock] = {}
        self._last_used: dict[str, float] = {}  # session -> monotonic time of its last push, ask or open
        self._last_push: dict[str, float] = {}  # session -> monotonic time of its last push
        self._push_gap: dict[str, float] = {}  # session -> running mean of the gaps between its pushes (s)
        self.restore_room = restore_room
        self._room = threading.Lock()  # one make_room at a time
        self._room_waiters = 0  # make_rooms waiting for `_room` (under `_lock`)
        self._room_turn = 0  # +1 each time a turn under `_room` evicted something
        self.watch_s = watch_s
        self._stop_watch = threading.Event()
        self._hub = SubscriptionHub()
        self._forwards: dict[str, list[Subscription]] = {}  # the engine's subscriptions relaying to _hub
        # Threads that end with their job (engine/passing.py): a restore's tensor copies would leave an
        # OpenMP pool behind that slows the core's every step while the thread lives.
        self._workers = PassingWorker("streamllm-restore", max_workers=4)
        self.spill_threads = 4
        self._spillers = PassingWorker("streamllm-spill", max_workers=self.spill_threads)
        self._stopped = False
        self.auto_evictions = self.auto_restores = self.auto_evict_refusals = self.pressure_spills = 0
        self.evictions_dropped_work = 0  # evictions that dropped background work nobody waited on
        self.answered_on_disk = 0  # asks answered from an evicted session's standing answers (no restore)
        self._watcher = None
        if auto_evict:
            self._watcher = threading.Thread(target=self._watch_pressure, name="streamllm-spill", daemon=True)
            self._watcher.start()

    # -- identity -----------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def prefix_tokens(self, system: str = DEFAULT_SYSTEM) -> int:
        return self.engine.prefix_tokens(system)

    def identity(self) -> EngineIdentity:
        return self.engine.identity()

    @property
    def ingest_log(self) -> Any:
        return self.engine.ingest_log

    def attach_log(self, ingest_log: Any) -> None:
        self.engine.attach_log(ingest_log)

    # -- sessions -----------------------------------------------------------------
    def open_session(self, name: str, system: str = DEFAULT_SYSTEM, *,
                     max_context: int | None = None, tenant: str = "") -> SessionInfo:
        with self._session(name):
            if self._evicted_entry(name) is not None:
                raise SessionError(f"session {name!r} is already open")
            info = self._with_room(lambda: self.engine.open_session(name, system, max_context=max_context,
                                                                    tenant=tenant),
                                   lambda: self.engine.working_set(max_context, self.engine.prefix_tokens(system)),
                                   name)
            self._last_used[name] = time.monotonic()
            self._forward(name)
            return info

    def close_session(self, name: str) -> None:
        with self._session(name):
            gone = self._evicted_entry(name)
            if gone is None:
                self.engine.close_session(name)
            else:
                log = self.engine.ingest_log
                with log.session_lock(name) if log is not None else contextlib.nullcontext():
                    with self._lock:
                        del self._evicted[name]
                    gone.path.unlink(missing_ok=True)
                    if log is not None:
                        log.record_close(name)
            for sub in self._forwards.pop(name, []):
                sub.close()
            self._hub.drop_session(name)
            for known in (self._last_used, self._last_push, self._push_gap):
                known.pop(name, None)

    def session_info(self, name: str) -> SessionInfo:
        return self._peek(name, lambda ev: ev.info, self.engine.session_info)

    def list_sessions(self) -> list[SessionInfo]:
        """Every open session, resident or on disk (as it was when evicted)."""
        with self._lock:  # an eviction registers before the engine drops it, a restore leaves after it is back
            evicted = {name: ev.info for name, ev in self._evicted.items()}
            resident = self.engine.list_sessions()
        return [i for i in resident if i.name not in evicted] + list(evicted.values())

    def backlog(self, name: str) -> int:
        return self._peek(name, lambda ev: 0, self.engine.backlog)  # only idle sessions are evicted

    # -- data ---------------------------------------------------------------------
    def push(self, name: str, lines: list[str], *, source: tuple[str, int] | None = None,
             truths: dict[str, str] | None = None, late_truths: dict[str, dict[int, str]] | None = None) -> PushAck:
        with self._session(name):
            self._resident(name)
            ack = self.engine.push(name, lines, source=source, truths=truths, late_truths=late_truths)
            now = self._last_used[name] = time.monotonic()
            last = self._last_push.get(name)
            if last is not None:
                gap = self._push_gap.get(name)
                self._push_gap[name] = now - last if gap is None else 0.75 * gap + 0.25 * (now - last)
            self._last_push[name] = now
            return ack

    # -- standing questions -------------------------------------------------------
    def register(self, name: str, spec: QuestionSpec) -> None:
        with self._session(name):
            self._resident(name)
            self.engine.register(name, spec)

    def unregister(self, name: str, question_id: str) -> None:
        with self._session(name):
            self._resident(name)
            self.engine.unregister(name, question_id)

    def standing(self, name: str) -> list[StandingAnswer]:
        return self._peek(name, lambda ev: list(ev.standing), self.engine.standing)

    def standing_questions(self, name: str) -> list[QuestionSpec]:
        return self._peek(name, lambda ev: list(ev.questions), self.engine.standing_questions)

    def calibration(self) -> dict[str, dict[str, dict]]:
        out = self.engine.calibration()
        with self._lock:
            evicted = {name: ev.standing for name, ev in self._evicted.items()}
        for name, standing in evicted.items():
            scored = {a.question_id: a.calibration for a in standing if a.calibration}
            if scored:
                out[name] = scored
        return out

    # -- asks ---------------------------------------------------------------------
    def submit_ask(self, name: str, question: str, *, max_tokens: int | None = None,
                   stop: list[str] | None = None, min_version: int | None = None,
                   return_logits: bool = False, on_text: Callable[[str], None] | None = None,
                   deadline_s: float | None = None) -> Future:
        """A resident session is asked at once (no lock: the engine refuses an ask once an eviction has
        started, and that refusal sends it the slow way); a session on disk returns its future at once
        and is restored and asked in a worker thread."""
        kw: dict[str, Any] = {"max_tokens": max_tokens, "stop": stop, "min_version": min_version,
                              "return_logits": return_logits, "on_text": on_text, "deadline_s": deadline_s}
        ev = self._evicted_entry(name)
        if ev is not None and not return_logits and on_text is None:
            answer = _answer_on_disk(ev, question, min_version or 0, time.perf_counter())
            if answer is not None:
                self.answered_on_disk += 1
                future: Future = Future()
                future.set_result(answer)
                return future
        if ev is None:
            try:
                future = self.engine.submit_ask(name, question, **kw)
            except SessionError:
                if self._evicted_entry(name) is None:  # not open at all
                    raise
            else:
                self._last_used[name] = time.monotonic()
                return future
        lock = self._session(name)
        outer: Future = Future()

        def restore_and_ask() -> None:
            if outer.cancelled():
                return
            try:
                if self._stopped:  # queued behind a shutdown: fail it as the engine fails its own
                    raise EngineStopped("the engine is stopped (shut down)")
                with lock:
                    self._resident(name)
                    inner = self.engine.submit_ask(name, question, **kw)
                self._last_used[name] = time.monotonic()
            except BaseException as exc:
                settle(outer, error=exc)
                return
            _chain(inner, outer)

        self._workers.submit(restore_and_ask)
        return outer

    # -- events -------------------------------------------------------------------
    def subscribe(self, name: str, callback: Callable[[StandingAnswer], None]) -> Subscription:
        return self._subscribe(name, "standing", callback)

    def subscribe_data(self, name: str, callback: Callable[[str, int], None]) -> Subscription:
        return self._subscribe(name, "data", callback)

    def _subscribe(self, name: str, kind: str, callback: Callable) -> Subscription:
        self.session_info(name)  # SessionError for a session neither resident nor on disk
        sub = self._hub.add(name, kind, callback)
        self._forward(name)  # resident: relay now; on disk: its restore does
        return sub

    def _forward(self, name: str) -> None:
        """Relay the engine's events of `name` to this object's subscribers (once, from the first one on; they
        survive evictions). A session nobody subscribed to has no relay: the engine then knows that nobody
        hears its standing decodes, and an eviction may drop them."""
        if not (self._hub.has(name, "standing") or self._hub.has(name, "data")):
            return
        with self._lock:
            if name in self._forwards:
                return
        try:
            subs = [self.engine.subscribe(name, lambda answer: self._hub.publish(name, "standing", answer)),
                    self.engine.subscribe_data(name, lambda *args: self._hub.publish(name, "data", *args))]
        except SessionError:  # not resident right now: its restore relays it
            return
        with self._lock:
            if name not in self._forwards:
                self._forwards[name] = subs
                return
        for sub in subs:  # another thread relayed it first
            sub.close()

    # -- operations ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = self.engine.stats()
        with self._lock:
            out["sessions_evicted"] = len(self._evicted)
        out.update({"auto_evictions": self.auto_evictions, "auto_restores": self.auto_restores,
                    "auto_evict_refusals": self.auto_evict_refusals, "pressure_spills": self.pressure_spills,
                    "evictions_dropped_work": self.evictions_dropped_work,
                    "answered_on_disk": self.answered_on_disk})
        return out

    def health(self) -> EngineHealth:
        return self.engine.health()

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.engine.wait_idle(timeout)

    def shutdown(self) -> None:
        self._stopped = True
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        self.engine.shutdown()
        self._workers.shutdown(wait=True, cancel_futures=False)  # queued restores fail their asks with EngineStopped
        self._spillers.shutdown(wait=True, cancel_futures=False)

    # -- snapshots and eviction ---------------------------------------------------
    def evicted(self) -> dict[str, str]:
        """Sessions on disk now: name -> snapshot path."""
        with self._lock:
            return {name: str(ev.path) for name, ev in self._evicted.items()}

    def evict_session(self, name: str) -> str:
        """Free an idle session's cells: snapshot it to the spill folder; its next use restores it.
        `SnapshotError` while someone waits on its work (pending ingest, questions, compaction, a decode a
        subscriber hears); background work nobody waits on is dropped and redone after the restore."""
        with self._session(name):
            ev = self._evicted_entry(name)
            return str(ev.path) if ev is not None else self._evict(name)

    def snapshot_session(self, name: str, path: str | Path) -> SnapshotInfo:
        """Save the session's cells and bookkeeping to `path` (atomic); it keeps running."""
        with self._session(name):
            self._resident(name)
            return save_session(self.engine, name, path)

    def restore_session(self, path: str | Path, name: str | None = None) -> SnapshotInfo:
        """Open a session from a snapshot (validated first: model, checksum, counts, versions); logged
        in the ingest log when there is one."""
        return restore_session(self, path, name)

    def export_session(self, name: str) -> SessionState:
        with self._session(name):
            self._resident(name)
            return self.engine.export_session(name)

    def submit_export(self, name: str, *, only_ready: bool = False) -> Future:
        """As `Engine.submit_export`; a session on disk exports as None with only_ready (its snapshot and
        its log already hold it). Takes no session lock: checkpoints call it under the log's lock."""
        if only_ready and self._evicted_entry(name) is not None:
            done: Future = Future()
            done.set_result(None)
            return done
        if not only_ready and self._evicted_entry(name) is not None:
            return self._workers.submit(self.export_session, name)
        return self.engine.submit_export(name, only_ready=only_ready)

    def import_session(self, state: SessionState, name: str) -> SessionInfo:
        """Open `name` from an exported state; under pressure (auto_evict) idle sessions make room."""
        with self._session(name):
            if self._evicted_entry(name) is not None:
                raise SessionError(f"session {name!r} is already open; close it or restore under another name")
            info = self._import(state, name)
            self._last_used[name] = time.monotonic()
            self._forward(name)
            return info

    def can_admit(self, cells: int) -> bool:
        return self.engine.can_admit(cells)

    # -- internals ------------------------------------------------------------------
    def _session(self, name: str) -> threading.RLock:
        with self._lock:
            lock = self._session_locks.get(name)
            if lock is None:
                lock = self._session_locks[name] = threading.RLock()
            return lock

    def _evicted_entry(self, name: str) -> _Evicted | None:
        with self._lock:
            return self._evicted.get(name)

    def _peek(self, name: str, evicted: Callable[[_Evicted], Any], resident: Callable[[str], Any]) -> Any:
        """Read without restoring: from the registry when on disk, else from the engine."""
        ev = self._evicted_entry(name)
        if ev is not None:
            return evicted(ev)
        try:
            return resident(name)
        except SessionError:  # evicted between the two looks
            ev = self._evicted_entry(name)
            if ev is None:
                raise
            return evicted(ev)

    def _resident(self, name: str) -> None:
        """Under the session's lock: bring it back from disk if it is there."""
        ev = self._evicted_entry(name)
        if ev is None:
            return
        state = snapshot_state(load_snapshot(self.engine, ev.path))
        self._import(state, name)
        with self._lock:
            del self._evicted[name]
        ev.path.unlink(missing_ok=True)
        self.auto_restores += 1
        self._forward(name)

    def _import(self, state: SessionState, name: str) -> SessionInfo:
        meta = state.meta
        return self._with_room(lambda: self.engine.import_session(state, name),
                               lambda: max(self.engine.working_set(int(meta["max_context"]), int(meta["prefix_len"])),
                                           int(meta["num_computed"])), name)

    def _with_room(self, call: Callable[[], Any], cells: Callable[[], int], name: str) -> Any:
        """call() (an open or import); refused for want of cells, idle sessions make room and it is tried
        again, for up to settle_s: an open on another thread may take the room made here before the retry."""
        give_up, retried = time.monotonic() + self.settle_s, False
        while True:
            try:
                return call()
            except AdmissionError:  # memory pressure
                if (retried and time.monotonic() > give_up) or not self._make_room(cells(), {name}):
                    raise
                retried = True

    def _watch_pressure(self) -> None:
        """With auto_evict: while the pool is short of cells (sessions growing past their working sets,
        the engine's `cells_wanted`), spill idle sessions, furthest next use first. A thread of its own
        that reads published figures: a push never waits for it, and pressure that shows up after the
        last push is still seen."""
        while not self._stop_watch.wait(self.watch_s):
            try:
                short = int(self.engine.stats().get("cells_wanted", 0)) or self._restore_shortfall()
                if short > 0 and self._spill(short, set()):
                    self.engine.wait_idle(timeout=self.watch_s)  # let the core see the room before looking again
            except EngineStopped:
                return
            except Exception:  # a figure or an eviction failing must not end the watch
                log.exception("spilling sessions for pool pressure failed; trying again")

    def _restore_shortfall(self) -> int:
        """Cells to spill so that `restore_room` sessions on disk could come back now (0 when they can, or
        none is on disk): the largest of them, times restore_room."""
        if not self.restore_room:
            return 0
        with self._lock:
            infos = [ev.info for ev in self._evicted.values()]
        if not infos:
            return 0
        need = max(max(self.engine.working_set(i.max_context, i.prefix_tokens), i.num_computed) for i in infos)
        return 0 if self.engine.can_admit(need * self.restore_room) else need

    def _victims(self, names) -> list[str]:
        """`names` in eviction order: the furthest predicted next use first (see the module docstring)."""
        now = time.monotonic()

        def next_use(name: str) -> float:
            gap = self._push_gap.get(name)
            if gap is not None and now <= self._last_push[name] + 2 * gap:  # keeping its pace (late: due now)
                return max(self._last_push[name] + gap, now)
            return now + (now - self._last_used.get(name, 0.0))  # stopped, or no pace: idle as long again

        return sorted(names, key=next_use, reverse=True)

    def _spill(self, cells: int, exclude: set[str]) -> int:
        """Evict idle sessions, furthest next use first, until they held `cells`; returns cells freed."""
        with self._room:
            freed, evicted = self._evict_some(cells, exclude)
            self.pressure_spills += evicted
        return freed

    def _evict_some(self, cells: int, exclude: set[str]) -> tuple[int, int]:
        """Under `_room`: evict idle sessions, furthest next use first, until they held `cells`, up to
        `spill_threads` at a time (the core serves every eviction waiting in one turn); returns (cells
        freed, sessions evicted)."""
        infos = {i.name: i for i in self.engine.list_sessions() if i.name not in exclude}
        held = {n: max(self.engine.working_set(i.max_context, i.prefix_tokens), i.num_computed)
                for n, i in infos.items()}

        def in_order():
            """Furthest next use first; but a session whose standing answers are still being made for its
            newest data goes last: evicting it drops that work, and its subscribers would hear nothing of
            that bar until its next push restores it. Looked at only as far as victims are taken."""
            answering = []
            for name in self._victims(held):
                if self._answering(infos[name]):
                    answering.append(name)
                else:
                    yield name
            yield from answering

        victims = in_order()
        freed = evicted = 0
        while freed < cells and not self._stopped:
            batch, want = [], cells - freed
            for name in victims:
                batch.append(name)
                want -= held[name]
                if want <= 0 or len(batch) >= self.spill_threads:
                    break
            if not batch:
                break
            for name, ok in zip(batch, self._spillers.map(self._evict_idle, batch), strict=True):
                if ok:
                    freed += held[name]
                    evicted += 1
        if evicted:
            self._room_turn += 1  # under `_room`: make_rooms queued meanwhile retry their calls first
        return freed, evicted

    def _answering(self, info: SessionInfo) -> bool:
        """Whether some standing answer of the session is older than the data it has ingested."""
        try:
            return any(a.data_version < info.data_version for a in self.engine.standing(info.name))
        except SessionError:  # closed meanwhile
            return False

    def _evict_idle(self, name: str) -> bool:
        """Evict `name` if nobody is using it right now (its locks free, no work in flight)."""
        locks = self._try_locks(name)
        if locks is None:  # in use right now (a call on it, a push writing its log): not idle
            return False
        try:
            if self._evicted_entry(name) is not None:
                return False
            info = self.engine.session_info(name)
            if info.pushed_version > info.data_version:  # its ingest is pending: the core would refuse it
                return False  # (asking costs a turn of a busy core; its bar's answers come first)
            self._evict(name)
            return True
        except (SnapshotError, SessionError):  # busy (or could not write, or closed): the next one
            return False
        finally:
            for lock in reversed(locks):
                lock.release()

    def _evict(self, name: str) -> str:
        """Under the session's lock: export and drop it, write its snapshot; SnapshotError when busy."""
        if self.spill_dir is None:
            raise ValueError("this ResidentEngine has no spill_dir to evict sessions to")
        path = snapshot_path(self.spill_dir, name)
        ev = _Evicted(path, self.engine.session_info(name), self.engine.standing(name),
                      self.engine.standing_questions(name))
        with self._lock:  # listed as on disk before the engine drops it: readers never miss it
            self._evicted[name] = ev
        try:
            state = self.engine.evict_state(name)
        except BaseException as exc:  # busy (or gone): it stays resident, as it was
            with self._lock:
                self._evicted.pop(name, None)
            if isinstance(exc, SessionError):
                raise SnapshotError(str(exc)) from None
            raise
        if state.meta.pop("dropped_work", 0):  # entries or decodes nobody waited on: its restore redoes them
            self.evictions_dropped_work += 1
        try:
            write_state(self.engine, state, path, durable=False)  # a cache: recovery reads the ingest log
        except SnapshotError:  # could not write: put it back rather than lose it
            self.engine.import_session(state, name)
            with self._lock:
                self._evicted.pop(name, None)
            raise
        return str(path)

    def _try_locks(self, name: str) -> list[threading.RLock] | None:
        """The session's lock, then its ingest-log lock (close_session's order), without waiting; None when
        either is held: an auto-eviction skips a victim in use rather than wait for it (or race its push)."""
        locks = [self._session(name)]
        log = self.engine.ingest_log
        if log is not None:
            locks.append(log.session_lock(name))
        taken: list[threading.RLock] = []
        for lock in locks:
            if not lock.acquire(blocking=False):
                for held in reversed(taken):
                    held.release()
                return None
            taken.append(lock)
        return taken

    def _make_room(self, cells: int, exclude: set[str]) -> bool:
        """Evict idle sessions, furthest next use first, until a working set of `cells` can be reserved;
        True: try the refused call again (room was made, by this turn or another); False when it cannot be
        done (or auto_evict is off). With others waiting to make room (many opens or restores at once) it
        evicts for them too, up to spill_threads working sets in one turn. Each look at the core waits for
        a turn of a busy core, so it asks no question the caller's own retry answers."""
        if not self.auto_evict:
            return False
        with self._lock:
            self._room_waiters += 1
            turn = self._room_turn
        with self._room:
            with self._lock:
                self._room_waiters -= 1
                waiting = self._room_waiters  # opens and restores queued behind this one: room for them too
            if self._room_turn != turn:  # another turn evicted while this one queued: the caller tries first
                return True
            give_up = time.monotonic() + self.settle_s  # busy candidates may go idle meanwhile
            looked = False  # the caller was just refused: no need to ask the core again before evicting
            while True:
                if looked and self.engine.can_admit(cells):
                    return True
                looked = True
                _, evicted = self._evict_some(cells * min(1 + waiting, self.spill_threads), exclude)
                self.auto_evictions += evicted
                if evicted:  # the caller's retry is the check: one turn of the core, not two
                    return True
                left = give_up - time.monotonic()
                if left <= 0 or not any(i.name not in exclude for i in self.engine.list_sessions()):
                    break
                self.engine.wait_idle(timeout=min(0.25, left))
            self.auto_evict_refusals += 1
            return self.engine.can_admit(cells)


def _chain(inner: Future, outer: Future) -> None:
    """outer follows inner; cancelling outer cancels inner (and so the question)."""
    outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)

    def done(f: Future) -> None:
        if f.cancelled():
            outer.cancel()
        elif f.exception() is not None:
            settle(outer, error=f.exception())
        else:
            settle(outer, result=f.result())

    inner.add_done_callback(done)
