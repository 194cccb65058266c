"""One engine replica: the body of a Ray actor (cluster.py wraps this class with `ray.remote`).

A replica is one Engine (one model, one KV pool, one core thread), its own ingest log
directory, the feed attachments of the sessions it holds, and an event journal the
front door long-polls. Its constructor *is* its recovery: Ray reruns it when the actor
restarts (`max_restarts=-1`), and `recover` rebuilds every session from its checkpoint
plus the log, with every acked batch, before the actor takes a call. Then the feeds of
its sessions start again (recorded feeds resume after the log's position).

Ray runs the methods on a thread pool (`max_concurrency`), so a long question never
blocks a push or the event poll; the Engine facade is thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine
from streamllm.engine.config import EngineConfig
from streamllm.feeding.supervise import FeedRunner
from streamllm.feeding.wiring import FeedGroup, build_attachments, feed_events
from streamllm.model.loader import load_model
from streamllm.scale.journal import EventBatch, EventJournal
from streamllm.service.bars import BarBook, TapSink

log = logging.getLogger("streamllm.scale.replica")
_DONE = object()


@dataclass(slots=True)
class FeedPlan:
    """The config's feeds (`feeding.wiring.FeedGroup`s, picklable): a replica runs the part of them its sessions need."""

    groups: list[Any]
    owner: Any  # service.tenants.Tenant owning the config's sessions
    speed: float | None = 1.0
    seed: int = 0


@dataclass(slots=True)
class ReplicaSpec:
    index: int
    model: str
    log_dir: str
    config: EngineConfig = field(default_factory=EngineConfig)  # the Engine's settings (pickled to the actor)
    device: str | None = None
    dtype: str = "auto"
    adapter: str | None = None
    log_flush: str = "batch"
    checkpoint_versions: int = 0
    checkpoint_s: float = 0.0
    feeds: FeedPlan | None = None
    torch_threads: int | None = None  # the CPUs Ray reserved for it (None: torch's default)
    spill_dir: str | None = None  # evict idle sessions here when its cells run out (durability/resident.py)


class Replica:
    def __init__(self, spec: ReplicaSpec) -> None:
        t0, self.init_at = time.perf_counter(), time.time()
        if spec.torch_threads:
            import torch

            torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.journal = EventJournal()
        # Snapshots for moves; with a spill folder, idle sessions to disk when its cells run out.
        self.engine = ResidentEngine(Engine(load_model(spec.model), spec.config, device=spec.device, dtype=spec.dtype,
                                            adapter=spec.adapter),
                                     spec.spill_dir or None, auto_evict=bool(spec.spill_dir))
        self.ingest_log = IngestLog(spec.log_dir, flush=spec.log_flush, checkpoint_versions=spec.checkpoint_versions,
                                    checkpoint_s=spec.checkpoint_s)
        # Memory pressure from the start, as `serve` does for one engine: a replica restarted with
        # more sessions than its pool holds brings every one back, idle ones to disk.
        self.recovery = recover(self.engine, self.ingest_log)
        self._subs: dict[str, list[Any]] = {}
        for info in self.engine.list_sessions():
            self._watch(info.name)
        self.asks_by_session: collections.Counter[str] = collections.Counter()
        self._asks_lock = threading.Lock()
        self.bars = BarBook()
        self._feeds: list[tuple[Any, threading.Thread]] = []
        self._feed_epoch = 0
        self._feed_lock = threading.Lock()
        self.start_s = time.perf_counter() - t0
        if spec.feeds is not None and self.engine.list_sessions():  # a restart: its sessions' feeds again
            self.start_feeds()

    # -- lifecycle and introspection ----------------------------------------
    def ready(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"index": self.spec.index, "incarnation": self.journal.incarnation, "pid": os.getpid(),
                "node": _node_id(), "model": stats["model"], "device": stats["device"], "dtype": stats["dtype"],
                "sessions": [i.name for i in self.engine.list_sessions()], "start_s": self.start_s,
                "init_at": self.init_at,
                "recovery": self.recovery.summary(), "recovered_sessions": self.recovery.sessions,
                "torch_threads": _torch_threads()}

    def stats(self) -> dict[str, Any]:
        out = self.engine.stats()
        with self._asks_lock:
            out["asks_executed"] = sum(self.asks_by_session.values())
        out["sessions"] = len(self.engine.list_sessions())
        out["log_records_written"] = self.ingest_log.records_written
        out["replica_start_s"] = self.start_s
        return out

    def asks_executed(self) -> dict[str, int]:
        """Questions this replica executed, per session (tests: a session's questions never run elsewhere)."""
        with self._asks_lock:
            return dict(self.asks_by_session)

    def prefix_tokens(self, system: str) -> int:
        return self.engine.prefix_tokens(system)

    def free_cells(self) -> int:
        return int(self.engine.stats()["cells_free"])

    def events(self, after: int, timeout: float) -> EventBatch:
        return self.journal.since(after, timeout)

    def journal_of(self, session: str) -> list[tuple[str, tuple[Any, ...]]]:
        return [(e.kind, e.args) for e in self.journal.of(session)]

    def shutdown(self) -> None:
        self.stop_feeds()
        self.engine.shutdown()
        self.ingest_log.close()

    # -- the Engine facade, for the sessions this replica holds ----------------
    def open_session(self, name: str, system: str | None, max_context: int | None, tenant: str = "") -> Any:
        kw: dict[str, Any] = {"max_context": max_context, "tenant": tenant}
        if system is not None:
            kw["system"] = system
        info = self.engine.open_session(name, **kw)
        self._watch(name)
        return info

    def close_session(self, name: str) -> None:
        self.engine.close_session(name)
        for sub in self._subs.pop(name, []):
            sub.close()
        self.bars.forget(name)

    def push(self, name: str, lines: list[str], source: tuple[str, int] | None = None,
             truths: dict[str, str] | None = None, late_truths: dict[str, dict[int, str]] | None = None) -> Any:
        ack = self.engine.push(name, lines, source=source, truths=truths, late_truths=late_truths)
        self.bars.record(name, lines)
        return ack

    def register(self, name: str, spec: Any) -> None:
        self.engine.register(name, spec)

    def unregister(self, name: str, question_id: str) -> None:
        self.engine.unregister(name, question_id)

    def ask(self, name: str, question: str, kw: dict[str, Any]) -> Any:
        future = self.engine.submit_ask(name, question, **kw)  # validates (and raises) before counting
        with self._asks_lock:
            self.asks_by_session[name] += 1
        return future.result()

    def ask_stream(self, name: str, question: str, kw: dict[str, Any]):
        """`ask` with the answer's text as it is decoded: yields text pieces, then the Answer (a Ray
        streaming generator: the front door receives each piece as it is yielded)."""
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        future = self.engine.submit_ask(name, question, on_text=pieces.put, **kw)
        with self._asks_lock:
            self.asks_by_session[name] += 1
        future.add_done_callback(lambda _f: pieces.put(_DONE))
        while (piece := pieces.get()) is not _DONE:
            yield piece
        while not pieces.empty():  # a token callback that raced the answer
            piece = pieces.get()
            if piece is not _DONE:
                yield piece
        yield future.result()

    def standing(self, name: str) -> list[Any]:
        return self.engine.standing(name)

    def calibration(self) -> dict[str, dict[str, dict]]:
        return self.engine.calibration()

    def standing_questions(self, name: str) -> list[Any]:
        return self.engine.standing_questions(name)

    def session_info(self, name: str) -> Any:
        return self.engine.session_info(name)

    def list_sessions(self) -> list[Any]:
        return self.engine.list_sessions()

    def backlog(self, name: str) -> int:
        return self.engine.backlog(name)

    def bar_closes(self, name: str) -> tuple[list[tuple[float, float]], int]:
        return self.bars.bars(name)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.engine.wait_idle(timeout)

    # -- moving a session: snapshot here, restore there -------------------------
    def snapshot_for_move(self, name: str, path: str) -> tuple[Any, dict[str, int]]:
        """Stop the session's feed, let its pending data in, snapshot it; (info, its feed positions)."""
        self.stop_feeds()
        self.engine.wait_idle(60)
        info = self.engine.snapshot_session(name, path)
        return info, dict(self.ingest_log.positions.get(name, {}))

    def restore_session(self, path: str, name: str, positions: dict[str, int] | None = None) -> Any:
        info = self.engine.restore_session(path, name)
        if positions:
            self.ingest_log.positions[name] = dict(positions)
        self._watch(name)
        if self.spec.feeds is not None:
            self.start_feeds()
        return info

    def finish_move_out(self, name: str) -> None:
        """The target holds the session now: close it here and restart the feeds without it."""
        self.close_session(name)
        if self.spec.feeds is not None:
            self.start_feeds()

    # -- feeds beside their sessions -------------------------------------------
    def start_feeds(self) -> list[str]:
        """(Re)start one feed per config feed group, attached to the group's sessions held here."""
        plan = self.spec.feeds
        if plan is None:
            return []
        with self._feed_lock:
            self._stop_feeds_locked()
            held = {i.name for i in self.engine.list_sessions()}
            started = []
            self._feed_epoch += 1
            for group in plan.groups:
                mine = FeedGroup(group.feed, [s for s in group.sessions if plan.owner.engine_name(s.name) in held],
                                 group.read)
                if not mine.sessions:
                    continue
                name = group.feed.kind if group.feed.kind in ("synthetic", "binance") else str(group.feed)
                seed = plan.seed + 1000 * (self._feed_epoch - 1)  # a restarted synthetic feed moves on in time
                runner = FeedRunner(name, [plan.owner.engine_name(s.name) for s in mine.sessions],
                                    lambda attempt, g=mine, s=seed: feed_events(g, plan.speed, s + attempt),
                                    build_attachments(TapSink(self.engine, self.bars), plan.owner, mine, self.ingest_log),
                                    restart=group.feed.kind in ("synthetic", "binance"))
                thread = threading.Thread(target=_run_feed, args=(runner,), daemon=True,
                                          name=f"replica{self.spec.index}-feed-{name}")
                thread.start()
                self._feeds.append((runner, thread))
                started.append(name)
            return started

    def stop_feeds(self) -> None:
        """Stop every feed of this replica (a move restarts the others after it)."""
        with self._feed_lock:
            self._stop_feeds_locked()

    def _stop_feeds_locked(self) -> None:
        for runner, _ in self._feeds:
            runner.stop()
        for _, thread in self._feeds:
            thread.join(timeout=10)
        self._feeds.clear()

    def feed_health(self) -> list[dict[str, Any]]:
        out = []
        for runner, _ in list(self._feeds):
            entry, why = runner.health(lambda name: _backlog_or_zero(self.engine, name), 256)
            entry["replica"] = self.spec.index
            entry["reasons"] = why
            out.append(entry)
        return out

    # -- internals --------------------------------------------------------------
    def _watch(self, name: str) -> None:
        journal = self.journal
        self._subs[name] = [
            self.engine.subscribe(name, lambda answer, n=name: journal.append(n, "standing", answer)),
            self.engine.subscribe_data(name, lambda session, version, n=name: journal.append(n, "data", session,
                                                                                              version)),
        ]


def _run_feed(runner: Any) -> None:
    with contextlib.suppress(Exception):
        asyncio.run(runner.run())


def _backlog_or_zero(engine: Any, name: str) -> int:
    try:
        return engine.backlog(name)
    except Exception:
        return 0


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""
