"""`ClusterEngine`: the front door's engine. Same surface the service uses, sessions on Ray replicas.

    open_session  -> the up replica with the most free cells (then the fewest sessions); its own admission
                     (with spill_dir, a full replica evicts its idle sessions to SPILL/replica-N instead of refusing)
    push, register, ask, standing, session_info, ... -> the replica in the placement table, by session name
    subscribe / subscribe_data / watch -> the local FanInHub, fed by one EventPump per replica (fanin.py)
    stats / replica_health / metrics_collector -> the replicas aggregated, with per-replica figures
    move_session -> snapshot on the source, restore on the target, placement updated, source closed

A replica that is down (its pump saw the actor die, or a call failed on it) makes every
call for its sessions raise `ReplicaUnavailable` at once (the service's `unavailable`),
never a hang; sessions on the other replicas carry on. Ray restarts the actor and its
constructor recovers its sessions from its own ingest log; the pump then marks it up.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import quote

from streamllm.engine.client import EngineClient, EngineHealth, ReplicaControl
from streamllm.engine.config import EngineConfig
from streamllm.engine.outputs import AdmissionError, ReplicaUnavailable, SessionError
from streamllm.engine.prompt import DEFAULT_SYSTEM
from streamllm.engine.subscriptions import Subscribable
from streamllm.scale.fanin import EventPump, FanInHub
from streamllm.scale.handle import ReplicaHandle, ReplicaState
from streamllm.scale.metrics import ReplicaCollector, cluster_stats, replica_health
from streamllm.scale.placement import PlacementTable
from streamllm.scale.replica import FeedPlan, Replica, ReplicaSpec

log = logging.getLogger("streamllm.scale.cluster")
READ_TIMEOUT_S = 5.0  # session_info, standing, ...: calls the service makes on its event loop


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("--ray needs Ray: pip install 'streamllm[ray]' (ray[default]>=2.60)") from exc
    return ray


class ClusterEngine(Subscribable, EngineClient, ReplicaControl):
    """Engine replicas as Ray actors behind one front door; a session lives on one replica."""

    def __init__(self, model: str = "smollm2-135m", config: EngineConfig | None = None, *, device: str | None = None,
                 dtype: str = "auto", replicas: int = 2, log_dir: str | Path | None = None,
                 address: str | None = None, num_cpus: int | None = None, cpus_per_replica: float = 1.0,
                 adapter: str | None = None, log_flush: str = "batch",
                 checkpoint_versions: int = 0, checkpoint_s: float = 0.0, feeds: FeedPlan | None = None,
                 call_timeout_s: float = 30.0, start_timeout_s: float = 900.0, max_concurrency: int = 32,
                 poll_s: float = 1.0, spill_dir: str | Path | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        ray = import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None and num_cpus is not None:
                kw["num_cpus"] = num_cpus
            ray.init(address=address, **kw)
        # Absolute: a replica resolves a relative path against its own working directory, not ours.
        self.log_dir = Path(log_dir).resolve() if log_dir is not None else Path(tempfile.mkdtemp(prefix="streamllm-cluster-"))
        spill_dir = Path(spill_dir).resolve() if spill_dir is not None else None
        adapter = str(Path(adapter).resolve()) if adapter is not None else None
        self.call_timeout_s = call_timeout_s
        self.placement = PlacementTable(self.log_dir / "placement.json", replicas)
        self.hub = FanInHub()
        self.ingest_log = None  # each replica has its own (under log_dir/replica-N)
        self._lock = threading.Lock()  # replica states
        self._place_lock = threading.RLock()  # opens, closes and moves, one at a time
        self._moving: set[str] = set()
        self._closing = False
        self._writes: collections.Counter[str] = collections.Counter()  # session -> mutating calls in flight
        self._writes_cond = threading.Condition()
        actor_cls = ray.remote(Replica)
        tag = uuid.uuid4().hex[:6]
        self.replicas: list[ReplicaHandle] = []
        for i in range(replicas):
            spec = ReplicaSpec(i, model, str(self.log_dir / f"replica-{i}"), config or EngineConfig(), device, dtype,
                               adapter, log_flush, checkpoint_versions, checkpoint_s, feeds, max(1, int(cpus_per_replica)),
                               str(spill_dir / f"replica-{i}") if spill_dir is not None else None)
            actor = actor_cls.options(name=f"streamllm-replica-{i}-{tag}", max_restarts=-1, max_task_retries=0,
                                      max_concurrency=max_concurrency, num_cpus=cpus_per_replica).remote(spec)
            self.replicas.append(ReplicaHandle(i, actor))
        infos = ray.get([h.actor.ready.remote() for h in self.replicas], timeout=start_timeout_s)
        for h, info in zip(self.replicas, infos, strict=True):
            self.mark_up(h, info)
        first = infos[0]
        self._model_name, self.device, self.dtype = first["model"], first["device"], first["dtype"]
        self.cpus_per_replica = cpus_per_replica
        changes, duplicates = self.placement.reconcile({h.index: h.info["sessions"] for h in self.replicas})
        for change in changes:
            log.warning("placement: %s", change)
        for name, replica in duplicates:  # a move interrupted after the restore: the table's copy wins
            log.warning("placement: %s is on replicas %d and %d; closing the copy on %d", name,
                        self.placement.get(name), replica, replica)
            self.call_replica(self.replicas[replica], "close_session", name)
        self.pumps = [EventPump(self, h, poll_s) for h in self.replicas]
        for pump in self.pumps:
            pump.start()

    # -- replica states ---------------------------------------------------
    def mark_down(self, h: ReplicaHandle, why: Any) -> None:
        with self._lock:
            if h.state == ReplicaState.DOWN or self._closing:
                return
            h.state, h.down_since, h.last_down_reason = ReplicaState.DOWN, time.monotonic(), str(why)[:300]
            h.restarts += 1
        log.warning("replica %d is down (%s): its sessions answer `unavailable` until it has recovered", h.index,
                    str(why)[:200])

    def mark_up(self, h: ReplicaHandle, info: dict[str, Any]) -> None:
        with self._lock:
            if h.down_since is not None:
                h.last_recovery_s = time.monotonic() - h.down_since
            h.state, h.down_since, h.incarnation, h.info = ReplicaState.UP, None, info["incarnation"], info
        if h.last_recovery_s is not None:
            log.warning("replica %d is back after %.2f s: %s", h.index, h.last_recovery_s, info.get("recovery"))

    # -- routing ------------------------------------------------------------
    def replica_of(self, name: str) -> ReplicaHandle:
        index = self.placement.get(name)
        if index is None:
            raise SessionError(f"no session named {name!r}; open it first")
        if name in self._moving:
            raise ReplicaUnavailable(f"session {name!r} is moving to another replica; try again in a moment",
                                     replica=index)
        h = self.replicas[index]
        if h.state != ReplicaState.UP:
            raise ReplicaUnavailable(f"session {name!r}: its replica ({index}) is restarting and recovering its "
                                     "sessions; try again in a moment (nothing acknowledged is lost)", replica=index)
        return h

    def call_replica(self, h: ReplicaHandle, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run `method` on replica h's actor; `ReplicaUnavailable` when it is down or does not answer in time."""
        return self._get(h, getattr(h.actor, method).remote(*args), timeout or self.call_timeout_s)

    def _get(self, h: ReplicaHandle, ref: Any, timeout: float) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as exc:
            raise exc.cause from None
        except GetTimeoutError:
            raise ReplicaUnavailable(f"replica {h.index} did not answer within {timeout:g} s", replica=h.index) from None
        except RayActorError as exc:
            self.mark_down(h, exc)
            raise ReplicaUnavailable(f"replica {h.index} died; it is restarting and recovering its sessions",
                                     replica=h.index) from None

    def _route(self, name: str, method: str, *args: Any) -> Any:
        h = self.replica_of(name)
        return self.call_replica(h, method, name, *args)

    def _read(self, name: str, method: str) -> Any:
        """A read the service may make on its event loop: a short timeout, so a replica that hangs
        without dying holds the loop for READ_TIMEOUT_S at most (then `unavailable`)."""
        h = self.replica_of(name)
        return self.call_replica(h, method, name, timeout=min(READ_TIMEOUT_S, self.call_timeout_s))

    @contextlib.contextmanager
    def _writing(self, name: str):
        """A mutating call in flight: a move waits for it, and refuses new ones while it runs."""
        with self._writes_cond:
            self._writes[name] += 1
        try:
            yield
        finally:
            with self._writes_cond:
                self._writes[name] -= 1
                if not self._writes[name]:
                    del self._writes[name]
                    self._writes_cond.notify_all()

    # -- sessions ---------------------------------------------------------
    @property
    def sessions(self) -> set[str]:
        return set(self.placement.names())

    def open_session(self, name: str, system: str = DEFAULT_SYSTEM, *, max_context: int | None = None,
                     tenant: str = "") -> Any:
        if not isinstance(name, str) or not name:
            raise ValueError("session name must be a non-empty string")
        with self._place_lock:
            if self.placement.get(name) is not None:
                raise SessionError(f"session {name!r} is already open")
            up = [h for h in self.replicas if h.state == ReplicaState.UP]
            if not up:
                raise ReplicaUnavailable("no replica is up; try again in a moment")
            counts = self.placement.counts()
            free = {}
            for h in up:
                with contextlib.suppress(ReplicaUnavailable):
                    free[h.index] = self.call_replica(h, "free_cells")
            refused = []
            for index in sorted(free, key=lambda i: (-free[i], counts[i], i)):
                try:
                    info = self.call_replica(self.replicas[index], "open_session", name, system, max_context,
                                             tenant)
                except AdmissionError as exc:  # the replica's own admission: try the next one
                    refused.append(f"replica {index}: {exc}")
                    continue
                self.placement.place(name, index)
                return info
            raise AdmissionError(f"no replica can admit session {name!r}: " + ("; ".join(refused) or "none answered"))

    def close_session(self, name: str) -> None:
        with self._place_lock, self._writing(name):
            self._route(name, "close_session")
            self.placement.remove(name)
            self.hub.drop_session(name)

    def push(self, name: str, lines: list[str], *, source: tuple[str, int] | None = None,
             truths: dict[str, str] | None = None, late_truths: dict[str, dict[int, str]] | None = None) -> Any:
        with self._writing(name):
            return self._route(name, "push", lines, source, truths, late_truths)

    def register(self, name: str, spec: Any) -> None:
        with self._writing(name):
            self._route(name, "register", spec)

    def unregister(self, name: str, question_id: str) -> None:
        with self._writing(name):
            self._route(name, "unregister", question_id)

    def session_info(self, name: str) -> Any:
        return self._read(name, "session_info")

    def backlog(self, name: str) -> int:
        return self._read(name, "backlog")

    def standing(self, name: str) -> list[Any]:
        return self._read(name, "standing")

    def standing_questions(self, name: str) -> list[Any]:
        return self._read(name, "standing_questions")

    def bar_closes(self, name: str) -> tuple[list[tuple[float, float]], int]:
        return self._read(name, "bar_closes")

    def calibration(self) -> dict[str, dict[str, dict]]:
        """Live calibration of every replica's labelled questions (sessions are on one replica each)."""
        out: dict[str, dict[str, dict]] = {}
        for h in self.replicas:
            if h.state == ReplicaState.UP:
                with contextlib.suppress(ReplicaUnavailable):
                    out.update(self.call_replica(h, "calibration", timeout=READ_TIMEOUT_S))
        return out

    def list_sessions(self) -> list[Any]:
        out = []
        for h in self.replicas:
            if h.state == ReplicaState.UP:
                with contextlib.suppress(ReplicaUnavailable):
                    h.sessions = self.call_replica(h, "list_sessions", timeout=READ_TIMEOUT_S)
            out += h.sessions  # a replica that is down: its sessions as last seen
        return out

    # -- subscriptions (fan-in) ---------------------------------------------
    def _known(self, name: str) -> None:
        if self.placement.get(name) is None:
            raise SessionError(f"no session named {name!r}; open it first")

    # -- identity -------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    def prefix_tokens(self, system: str = DEFAULT_SYSTEM) -> int:
        for h in self.replicas:  # every replica runs the same model and tokenizer
            if h.state == ReplicaState.UP:
                with contextlib.suppress(ReplicaUnavailable):
                    return int(self.call_replica(h, "prefix_tokens", system, timeout=READ_TIMEOUT_S))
        raise ReplicaUnavailable("no replica is up; try again in a moment")

    # -- questions ----------------------------------------------------------
    def submit_ask(self, name: str, question: str, *, max_tokens: int | None = None, stop: list[str] | None = None,
                   min_version: int | None = None, return_logits: bool = False, on_text=None,
                   deadline_s: float | None = None) -> Future:
        """The question runs on the session's replica; the Future resolves from Ray's ObjectRef.
        on_text(piece): the answer's text as it is decoded (a Ray streaming generator, read by a thread)."""
        h = self.replica_of(name)
        kw = {"max_tokens": max_tokens, "stop": stop, "min_version": min_version, "return_logits": return_logits,
              "deadline_s": deadline_s}
        out: Future = Future()
        if on_text is None:
            ref = h.actor.ask.remote(name, question, kw)
            ref.future().add_done_callback(lambda done: self._settle(out, h, name, done.result))
            return out
        pieces = h.actor.ask_stream.options(num_returns="streaming").remote(name, question, kw)
        threading.Thread(target=self._read_stream, args=(out, h, name, pieces, on_text), daemon=True,
                         name="streamllm-ask-stream").start()
        return out

    def _read_stream(self, out: Future, h: ReplicaHandle, name: str, pieces: Any, on_text) -> None:
        import ray

        def next_item() -> Any:
            for ref in pieces:
                item = ray.get(ref)
                if not isinstance(item, str):
                    return item
                on_text(item)
            raise RuntimeError("the replica's answer stream ended without an answer")

        self._settle(out, h, name, next_item)

    def _settle(self, out: Future, h: ReplicaHandle, name: str, result) -> None:
        """Resolve `out` with result(), Ray's errors turned into the engine's (or `unavailable`)."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            out.set_result(result())
        except RayTaskError as exc:
            out.set_exception(exc.cause)
        except RayActorError as exc:
            self.mark_down(h, exc)
            out.set_exception(ReplicaUnavailable(f"session {name!r}: replica {h.index} died during the question; "
                                                 "it is restarting", replica=h.index))
        except BaseException as exc:
            out.set_exception(exc)

    def ask(self, name: str, question: str, *, timeout: float | None = None, **kw) -> Any:
        return self.submit_ask(name, question, **kw).result(timeout or self.call_timeout_s)

    # -- moving a session -------------------------------------------------------
    def move_session(self, name: str, to: int) -> dict[str, Any]:
        """Move a session to replica `to` (draining one), with no write lost:

            refuse new writes for the session (`unavailable` meanwhile) and wait for those in flight
            source: stop its feeds, let pending data in, snapshot       -> LOG_DIR/moves/<name>-<ns>.safetensors
            target: restore (validated), logged in its own ingest log  -> its feeds restart with the session
            placement.json updated                                     <- the move commits here
            source: close its copy, restart its other feeds

        A front door that dies between the restore and the close leaves the session on both replicas;
        the next one keeps the copy placement.json names and closes the other (placement.reconcile).
        """
        if not isinstance(to, int) or not 0 <= to < len(self.replicas):
            raise ValueError(f"move {name!r}: replica must be 0..{len(self.replicas) - 1}, got {to!r}")
        t0 = time.perf_counter()
        with self._place_lock:
            src = self.replica_of(name)
            if src.index == to:
                raise ValueError(f"move {name!r}: it is already on replica {to}")
            dst = self.replicas[to]
            if dst.state != ReplicaState.UP:
                raise ReplicaUnavailable(f"move {name!r}: replica {to} is not up", replica=to)
            self._moving.add(name)
            try:
                with self._writes_cond:  # pushes already routed to the source land before the snapshot
                    if not self._writes_cond.wait_for(lambda: not self._writes.get(name), self.call_timeout_s):
                        raise ReplicaUnavailable(f"move {name!r}: writes in flight did not finish; nothing moved")
                path = self.log_dir / "moves" / f"{quote(name, safe='')}-{time.time_ns()}.safetensors"
                snap, positions = self.call_replica(src, "snapshot_for_move", name, str(path), timeout=300)
                try:
                    self.call_replica(dst, "restore_session", str(path), name, positions, timeout=300)
                except BaseException:
                    with contextlib.suppress(Exception):
                        self.call_replica(src, "start_feeds")
                    raise
                self.placement.place(name, to)  # the move commits here
                self.call_replica(src, "finish_move_out", name, timeout=300)
            finally:
                self._moving.discard(name)
        return {"session": name, "from": src.index, "to": to, "data_version": snap.data_version,
                "snapshot": str(path), "seconds": round(time.perf_counter() - t0, 3)}

    # -- figures --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals over the replicas (one that is down counts with its last figures), plus replica counts."""
        return cluster_stats(self)

    def replica_health(self) -> list[dict[str, Any]]:
        return replica_health(self)

    def feed_health(self) -> list[dict[str, Any]]:
        out = []
        for h in self.replicas:
            if h.state == ReplicaState.UP:
                with contextlib.suppress(ReplicaUnavailable):
                    out += self.call_replica(h, "feed_health", timeout=5.0)
        return out

    def metrics_collector(self) -> Any:
        return ReplicaCollector(self)

    def asks_executed(self) -> dict[int, dict[str, int]]:
        return {h.index: self.call_replica(h, "asks_executed") for h in self.replicas}

    def start_feeds(self) -> list[str]:
        return [name for h in self.replicas for name in self.call_replica(h, "start_feeds")]

    def health(self) -> EngineHealth:
        """Alive while every replica is up: one restarting still serves its peers' sessions, but not its own."""
        down = [h for h in self.replicas if h.state != ReplicaState.UP]
        why = "; ".join(f"replica {h.index} is {h.state}: {h.last_down_reason}" for h in down) or None
        failed = sum(int(h.stats.get("failed_steps", 0)) for h in self.replicas)
        in_a_row = max((int(h.stats.get("steps_failing_in_a_row", 0)) for h in self.replicas), default=0)
        return EngineHealth(not down, why, failed, failing_in_a_row=in_a_row)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return all(self.call_replica(h, "wait_idle", timeout, timeout=(timeout or 600) + 5) for h in self.replicas)

    def shutdown(self) -> None:
        if self._closing:
            return
        ray = import_ray()
        self._closing = True
        for pump in self.pumps:
            pump.stop()
        for h in self.replicas:
            with contextlib.suppress(Exception):
                self.call_replica(h, "shutdown", timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(h.actor, no_restart=True)
        for pump in self.pumps:
            pump.join(timeout=5)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> ClusterEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
