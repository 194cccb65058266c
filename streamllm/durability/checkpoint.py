"""Periodic snapshots of every logged session, written off the core's step path; log truncation.

    per session, every `checkpoint_versions` data versions or `checkpoint_s` seconds:
      under the session's log lock:  rotate the log (the next record starts segment k)
                                     enqueue Export (the core copies the cells between two steps)
      in the checkpoint thread:      hash, write, fsync, rename into the session folder as
                                     snap-<version>-<k>.safetensors, fsync the folder
      keep the newest two snapshots; delete the segments below the older one's k

Holding the log lock across rotate + enqueue makes the cut exact: every push in segments
before k was enqueued before the export (the facade logs and enqueues under that lock),
and every push after it lands in segment k or later. So recovery = the newest snapshot
that validates + segments from its k on, and a torn newest snapshot falls back to the
one before it, whose segments are still on disk. Recovery time is bounded by the
snapshot interval and the session's max context, not by uptime.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamllm.durability.files import durable_rename, fsync_dir, make_dirs
from streamllm.durability.ingest_log import (
    SEGMENT_SUFFIX,
    IngestLog,
    IngestLogError,
    session_dir_name,
)
from streamllm.durability.snapshot import SnapshotError, write_state
from streamllm.engine.outputs import SessionError

log = logging.getLogger("streamllm.durability.checkpoint")
KEEP = 2


@dataclass(slots=True, frozen=True)
class SnapshotFile:
    path: Path
    version: int  # pushed data_version it covers
    log_segment: int  # the first log segment it does not cover


def snapshot_files(folder: str | Path) -> list[SnapshotFile]:
    """The session folder's checkpoints, newest first."""
    out = []
    for p in Path(folder).glob("snap-*.safetensors"):
        parts = p.name.removesuffix(".safetensors").split("-")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            out.append(SnapshotFile(p, int(parts[1]), int(parts[2])))
    return sorted(out, key=lambda s: (s.version, s.log_segment), reverse=True)


class Checkpointer:
    """The background thread that checkpoints sessions of `engine` logged in `ingest_log`.

    `engine`: an `Engine` or a `ResidentEngine` (its sessions on disk are not checkpointed: their
    snapshot and the log hold them); used through `list_sessions`, `submit_export` and `identity`."""

    def __init__(self, engine: Any, ingest_log: IngestLog, *, every_versions: int = 0, every_s: float = 0.0,
                 poll_s: float | None = None) -> None:
        if every_versions <= 0 and every_s <= 0:
            raise ValueError("checkpoints need every_versions > 0 or every_s > 0")
        self.engine, self.log = engine, ingest_log
        self.every_versions, self.every_s = every_versions, every_s
        self.poll_s = poll_s if poll_s is not None else min(0.2, every_s / 4) if every_s > 0 else 0.1
        self.last: dict[str, tuple[int, float]] = {}  # session -> (version checkpointed, monotonic time)
        self.checkpoints = self.segments_truncated = self.errors = 0
        self.write_s_total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="streamllm-checkpoint", daemon=True)

    def start(self) -> Checkpointer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def stats(self) -> dict[str, float]:
        return {"checkpoints": self.checkpoints, "checkpoint_write_s": self.write_s_total,
                "log_segments_truncated": self.segments_truncated, "checkpoint_errors": self.errors}

    def due(self, name: str, pushed_version: int, backlog_lines: int = 0) -> bool:
        """Every N versions or T seconds; while the session has a backlog, up to 4x later (a checkpoint
        with pending lines costs their ingest again at recovery, one taken once they are in does not)."""
        version, at = self.last.get(name, (0, time.monotonic()))
        self.last.setdefault(name, (version, at))
        if pushed_version <= version:
            return False
        stretch = 4 if backlog_lines else 1
        return (self.every_versions > 0 and pushed_version - version >= stretch * self.every_versions) or \
            (self.every_s > 0 and time.monotonic() - at >= stretch * self.every_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self.engine.health().alive:
                return
            sessions = {info.name: info for info in self.engine.list_sessions()}
            for gone in set(self.last) - set(sessions):
                del self.last[gone]  # closed: nothing kept behind
            for name, info in sessions.items():
                if self._stop.is_set() or not self.due(name, info.pushed_version, info.backlog_lines):
                    continue
                try:
                    if self.checkpoint(name) is None:  # on disk or not ready: not again before new data
                        self.last[name] = (info.pushed_version, time.monotonic())
                except (SessionError, SnapshotError, OSError, IngestLogError) as exc:  # a stopped log: no rotation
                    self.errors += 1
                    log.warning("checkpoint of session %r failed (the log still holds everything): %s", name, exc)

    def checkpoint(self, name: str) -> SnapshotFile | None:
        """Snapshot `name` now and truncate its log; None when it cannot be (closed, evicted, not ready)."""
        t0 = time.perf_counter()
        folder = self.log.folder(name)
        with self.log.session_lock(name):
            if not folder.is_dir():
                return None
            inode = folder.stat().st_ino
            segment = self.log.rotate(name)
            positions = dict(self.log.positions.get(name, {}))
            future = self.engine.submit_export(name, only_ready=True)
        state = future.result(timeout=120)
        if state is None:
            return None
        version = int(state.meta["version_base"]) + len(state.meta["version_ends"]) - 1  # pushed, pending included
        final = SnapshotFile(folder / f"snap-{version:012d}-{segment:06d}.safetensors", version, segment)
        # Written outside the session folder, then moved in under the lock if the session is still there:
        # a session closed meanwhile never gets a snapshot that would bring it back at recovery.
        staging = make_dirs(self.log.root / "checkpoints-tmp") / f"{session_dir_name(name)}-{version}.safetensors"
        write_state(self.engine, state, staging, t0, {"log_segment": segment, "feed_positions": positions})
        with self.log.session_lock(name):
            if not folder.is_dir() or folder.stat().st_ino != inode:
                staging.unlink(missing_ok=True)
                return None
            durable_rename(staging, final.path)
            self._prune(folder)
        self.last[name] = (version, time.monotonic())
        self.checkpoints += 1
        self.write_s_total += time.perf_counter() - t0
        return final

    def _prune(self, folder: Path) -> None:
        """Keep the newest KEEP snapshots and the log segments the oldest kept one needs."""
        snaps = snapshot_files(folder)
        if not snaps:
            return
        for old in snaps[KEEP:]:
            with contextlib.suppress(FileNotFoundError):
                old.path.unlink()
        keep_from = snaps[: KEEP][-1].log_segment
        for seg in folder.glob(f"*{SEGMENT_SUFFIX}"):
            if seg.stem.isdigit() and int(seg.stem) < keep_from:
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()
                    self.segments_truncated += 1
        fsync_dir(folder)


def start_checkpoints(engine: Any, ingest_log: IngestLog) -> Checkpointer | None:
    """Start the log's checkpoint policy (if it has one) for `engine`; the log's close() stops it."""
    if ingest_log.checkpoint_versions <= 0 and ingest_log.checkpoint_s <= 0:
        return None
    if ingest_log.checkpointer is None:
        ingest_log.checkpointer = Checkpointer(engine, ingest_log, every_versions=ingest_log.checkpoint_versions,
                                               every_s=ingest_log.checkpoint_s).start()
    return ingest_log.checkpointer
