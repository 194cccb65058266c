"""Durable ingest log: every accepted batch is on disk before its push is acknowledged.

One folder per session, holding Arrow IPC *stream* segments written in order, and the
session's periodic snapshots (`checkpoint.py`):

    log_dir/sessions/<quoted session name>/000001.arrow  000002.arrow ...  snap-000000000120.safetensors

Each record is one row: kind (open | push | register | unregister | restore), session,
data_version, lines, recv_ns, meta (JSON: system prompt, max_context, question spec,
snapshot path, the feed position of a push) and a CRC32 over all of it. A segment is
closed (end-of-stream marker) and the next one started once it passes `segment_bytes`
or a checkpoint rotates it; a restarted process always starts a new segment, so an old
one is never appended to.

Durability (`flush`), for an acknowledged push:

    policy     process killed (SIGKILL, OOM)     machine loses power
    batch      kept                              kept: record fsynced before the ack
    interval   kept: in the OS before the ack    kept once the syncer ran after it (at most
                                                 `fsync_ms` + one fsync later, or `sync()`);
                                                 a power loss loses at most that window, always
                                                 a suffix of each session (never a hole)

With both policies the names are made durable too: the folder is fsynced after a
segment is created, a folder made or a file renamed (`files.py`), so a power loss can
never leave an fsynced segment without its directory entry.

A write or fsync that fails (disk full, I/O error) never leaves a record in doubt:

    a record's write or (batch) fsync fails    the segment is cut back to the bytes before it
                                               (ftruncate + fsync) and abandoned; the push gets
                                               `IngestLogError` (not acked) and the next record
                                               starts a new segment, so its data_version is
                                               free again: it is on disk nowhere
    that cut fails too, or an fsync fails      the log FAIL-STOPS (`failure` says why): every later
    under `interval` (the syncer's, a close's)  write raises `IngestLogError`, /health reports it;
                                               under `interval` the records acked since the last
                                               fsync may not be durable (the kernel may have dropped
                                               their pages), so nothing is written after them

Either way recovery finds no hole: an abandoned segment ends with its last acked record,
and a fail-stopped log ends where it stopped (at worst with the failed record, whole or torn,
which was never acked). Segments are written through a raw file descriptor (`os.write`, no
buffer that could flush a failed record's bytes later) in the Arrow IPC stream format.

Closing a session writes nothing: its folder is renamed aside (durably) and removed, so
recovery never reopens it. Reading is `log_reader.py` (torn tails, holes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow as pa

from streamllm.durability.files import durable_rename, fsync_dir, make_dirs

log = logging.getLogger("streamllm.durability.ingest_log")

SCHEMA = pa.schema([
    ("kind", pa.string()),
    ("session", pa.string()),
    ("data_version", pa.int64()),
    ("lines", pa.list_(pa.string())),
    ("recv_ns", pa.int64()),
    ("meta", pa.string()),
    ("crc", pa.uint32()),
])
KINDS = ("open", "push", "register", "unregister", "restore")
FLUSH_POLICIES = ("batch", "interval")
SEGMENT_SUFFIX = ".arrow"


class IngestLogError(RuntimeError):
    """The log could not be written: the batch was not acknowledged as durable."""


class DuplicateBatch(ValueError):
    """A feed batch at or before a position already in the log: dropped, not acknowledged."""


@dataclass(slots=True)
class Record:
    kind: str
    session: str
    data_version: int = 0
    lines: list[str] = field(default_factory=list)
    recv_ns: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _crc(kind: str, session: str, version: int, lines: list[str], recv_ns: int, meta: str) -> int:
    payload = json.dumps([kind, session, version, lines, recv_ns, meta], ensure_ascii=False).encode()
    return zlib.crc32(payload)


def record_batch(rec: Record) -> pa.RecordBatch:
    meta = json.dumps(rec.meta, ensure_ascii=False, sort_keys=True)
    crc = _crc(rec.kind, rec.session, rec.data_version, rec.lines, rec.recv_ns, meta)
    return pa.record_batch([[rec.kind], [rec.session], [rec.data_version], [rec.lines], [rec.recv_ns], [meta],
                            pa.array([crc], pa.uint32())], schema=SCHEMA)


def legacy_tenant(session: str) -> str:
    """The tenant of a session logged or snapshotted before records carried one: the server then
    named its sessions "tenant/name". Read once, at load; the engine is told it, never parses names."""
    head, sep, _ = session.partition("/")
    return head if sep else ""


def session_dir_name(session: str) -> str:
    # Tenant names hold '/': one flat folder per session; '.' is escaped too, so a folder
    # name with a dot is always one set aside (closed, replaced).
    return quote(session, safe="").replace(".", "%2E")


def segment_numbers(folder: Path) -> list[int]:
    return sorted(int(p.stem) for p in folder.glob(f"*{SEGMENT_SUFFIX}") if p.stem.isdigit())


def next_segment_number(folder: Path) -> int:
    """Segment numbers never go back, even when checkpoints truncated every segment:
    a checkpoint `snap-<version>-<k>` says segment k comes after it."""
    after = [int(p.name.removesuffix(".safetensors").split("-")[2]) - 1 for p in folder.glob("snap-*-*.safetensors")
             if p.name.removesuffix(".safetensors").split("-")[2].isdigit()]
    return max(segment_numbers(folder) + after, default=0) + 1


_SCHEMA_MESSAGE = SCHEMA.serialize().to_pybytes()
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class _Segment:
    """One open segment file, written as an Arrow IPC stream through a raw descriptor.

    `size` counts the bytes written, all of them in order (the schema goes out with the first
    record), so a failed write can be cut off exactly. `written` counts records in the OS,
    `synced` those covered by an fsync. The syncer reads `written` *before* its fsync and only
    then raises `synced`, so a record written while an fsync runs is never marked synced by it
    (the race of a shared flag). `lock` keeps the descriptor open while the syncer uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsync_dir(path.parent)  # the new name survives a power loss
        except OSError:
            os.close(self.fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        self.lock = threading.Lock()
        self.size = self.written = self.synced = 0
        self.closed = False
        self.fsync_failed = False  # an fsync of this file raised: what it covered may be lost

    def write(self, batch: pa.RecordBatch, fsync: bool) -> None:
        data = batch.serialize().to_pybytes()
        self._write(_SCHEMA_MESSAGE + data if self.size == 0 else data)
        self.written += 1
        if fsync:
            self._fsync()
            self.synced = self.written

    def sync(self) -> None:
        with self.lock:
            target = self.written  # everything counted here is already in the OS
            if target > self.synced and not self.closed:
                self._fsync()
                self.synced = max(self.synced, target)

    def close(self) -> None:
        """End-of-stream marker (a complete segment), fsync, close."""
        with self.lock:
            if self.closed:
                return
            self._write(_END_OF_STREAM if self.size else _SCHEMA_MESSAGE + _END_OF_STREAM)
            self._fsync()
            self.synced = self.written
            self.closed = True
            os.close(self.fd)

    def cut(self, size: int) -> None:
        """Drop everything past `size` bytes, durably, and close: the segment is abandoned."""
        with self.lock:
            if self.closed:
                return
            try:
                os.ftruncate(self.fd, size)
                self._fsync()
                self.size = size
            finally:
                self.closed = True
                with contextlib.suppress(OSError):
                    os.close(self.fd)

    def drop(self) -> None:
        """Close without writing anything more (a stopped log)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                with contextlib.suppress(OSError):
                    os.close(self.fd)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            done = os.write(self.fd, view)
            self.size += done
            view = view[done:]

    def _fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:
            self.fsync_failed = True
            raise


class IngestLog:
    def __init__(self, log_dir: str | Path, *, flush: str = "batch", fsync_ms: float = 50.0,
                 segment_bytes: int = 8 << 20, checkpoint_versions: int = 0, checkpoint_s: float = 0.0) -> None:
        if flush not in FLUSH_POLICIES:
            raise ValueError(f"flush must be one of {FLUSH_POLICIES}, got {flush!r}")
        if segment_bytes < 1024:
            raise ValueError(f"segment_bytes must be at least 1024, got {segment_bytes}")
        if checkpoint_versions < 0 or checkpoint_s < 0:
            raise ValueError("checkpoint_versions and checkpoint_s must be >= 0 (0: off)")
        self.root = Path(log_dir)
        self.sessions_dir = make_dirs(self.root / "sessions")
        self.flush, self.fsync_ms, self.segment_bytes = flush, fsync_ms, segment_bytes
        # Periodic snapshots (checkpoint.Checkpointer, started by recovery): every N versions or T seconds.
        self.checkpoint_versions, self.checkpoint_s = checkpoint_versions, checkpoint_s
        self.checkpointer: Any = None
        self._segments: dict[str, _Segment] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()
        # session -> feed id -> position after its last logged batch (exactly-once feeds)
        self.positions: dict[str, dict[str, int]] = {}
        self.records_written = 0
        self.bytes_written = 0
        self.duplicates_dropped = 0
        self.segments_abandoned = 0  # cut back after a failed write or fsync (the next record starts anew)
        self._failure: str | None = None  # set once: the log is fail-stopped and refuses every write
        self._stop = threading.Event()
        self._syncer = None
        if flush == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="streamllm-ingestlog", daemon=True)
            self._syncer.start()

    # -- ordering ---------------------------------------------------------
    def session_lock(self, session: str) -> threading.RLock:
        """Held by a push across version assignment, append and enqueue: the log is in version order."""
        with self._guard:
            return self._locks.setdefault(session, threading.RLock())

    def folder(self, session: str) -> Path:
        return self.sessions_dir / session_dir_name(session)

    # -- records ----------------------------------------------------------
    def record_open(self, session: str, system: str, max_context: int, tenant: str = "") -> None:
        self._check_writable(Record("open", session))
        self._fresh_folder(session)
        self.append(Record("open", session, meta={"system": system, "max_context": max_context, "tenant": tenant}))

    def record_restore(self, session: str, snapshot: str | Path, data_version: int) -> None:
        self._check_writable(Record("restore", session))
        self._fresh_folder(session)
        self.append(Record("restore", session, data_version, meta={"path": str(Path(snapshot).absolute())}))

    def record_push(self, session: str, data_version: int, lines: list[str],
                    source: tuple[str, int] | None = None, truths: dict[str, str] | None = None,
                    late_truths: dict[str, dict[int, str]] | None = None) -> None:
        """`source` = (feed id, position after this batch): kept with the batch; an older one is a duplicate.
        `truths` (labelled questions' right choices as of this batch) are accepted input too: a recovery
        pushes them again, so the versions it replays are scored as they were the first time."""
        meta: dict[str, Any] = {}
        if source is not None:
            feed, pos = source
            with self.session_lock(session):
                last = self.positions.get(session, {}).get(feed)
                if last is not None and pos < last:
                    self.duplicates_dropped += 1
                    raise DuplicateBatch(f"session {session!r}: feed {feed!r} batch at position {pos} is behind "
                                         f"the logged position {last}: already delivered, dropped")
                meta = {"feed": feed, "pos": int(pos)}
        if truths:
            meta["truths"] = dict(truths)
        if late_truths:  # JSON keys are strings: read_late_truths turns them back into versions
            meta["late_truths"] = {q: {str(v): c for v, c in by.items()} for q, by in late_truths.items()}
        self.append(Record("push", session, data_version, list(lines), time.time_ns(), meta))
        if source is not None:
            self.positions.setdefault(session, {})[source[0]] = int(source[1])

    def record_register(self, session: str, question: dict[str, Any]) -> None:
        self.append(Record("register", session, meta=question))

    def record_unregister(self, session: str, question_id: str) -> None:
        self.append(Record("unregister", session, meta={"id": question_id}))

    def record_close(self, session: str) -> None:
        """The session is gone: rename its folder aside (atomic, durable), then remove it."""
        with self.session_lock(session):
            with self._guard:
                seg = self._segments.get(session)
            if seg is not None:
                self._close_segment(session, seg, "closing the session")
            self.positions.pop(session, None)
            folder = self.folder(session)
            if folder.exists():
                gone = folder.with_name(f"{folder.name}.closed-{time.time_ns()}")
                try:
                    durable_rename(folder, gone)
                except OSError as exc:
                    raise IngestLogError(f"ingest log for session {session!r}: cannot set its folder aside: {exc}; "
                                         "it may come back at the next start") from exc
                shutil.rmtree(gone, ignore_errors=True)
        with self._guard:
            self._locks.pop(session, None)  # a closed session keeps no lock behind

    def feed_position(self, session: str, feed: str) -> int | None:
        """Where feed `feed` stands in session `session`'s log (None: never logged)."""
        return self.positions.get(session, {}).get(feed)

    @property
    def failure(self) -> str | None:
        """Why the log stopped writing (None while it writes): a failed fsync, or a failed write whose
        bytes could not be cut off. Every record after it was refused with `IngestLogError`."""
        return self._failure

    def append(self, rec: Record) -> None:
        batch = record_batch(rec)
        # Per-session lock: one session's fsync never waits for another's.
        with self.session_lock(rec.session):
            self._check_writable(rec)
            with self._guard:
                seg = self._segments.get(rec.session)
            if seg is not None and seg.size >= self.segment_bytes:
                self._close_segment(rec.session, seg, f"closing a full segment before a {rec.kind} record")
                seg = None
            if seg is None:
                try:
                    seg = _Segment(self._next_segment(rec.session))
                except OSError as exc:
                    raise self._refused(rec, f"cannot start a segment: {exc}") from exc
                with self._guard:
                    self._segments[rec.session] = seg
            before = seg.size
            try:
                seg.write(batch, fsync=self.flush == "batch")
            except OSError as exc:
                self._abandon(rec.session, seg, before, f"{rec.kind} record v{rec.data_version}: {exc}")
                raise self._refused(rec, str(exc)) from exc
            with self._guard:
                self.records_written += 1
                self.bytes_written += seg.size - before

    def _check_writable(self, rec: Record) -> None:
        if self._failure is not None:
            raise IngestLogError(f"ingest log for session {rec.session!r}: {rec.kind} record refused, the log is "
                                 f"stopped ({self._failure}); the batch is not durable and was not acknowledged")

    def _refused(self, rec: Record, why: str) -> IngestLogError:
        state = f"the log is stopped ({self._failure})" if self._failure is not None else \
            "its segment was abandoned; the next record starts a new one"
        return IngestLogError(f"ingest log for session {rec.session!r}: cannot write {rec.kind} record: {why}; "
                              f"the batch is not durable and was not acknowledged; {state}")

    def _abandon(self, session: str, seg: _Segment, keep: int, why: str) -> None:
        """Under the session lock, after a failed write or fsync: cut the segment back to its `keep`
        bytes (its acked records), durably, and drop it; the next record starts a new one. Fail-stop
        when the cut fails, or when an fsync failed under `interval` (acked records may be lost)."""
        with self._guard:
            if self._segments.get(session) is seg:
                del self._segments[session]
        try:
            seg.cut(keep)
        except OSError as exc:
            self._fail(f"{seg.path.name} of session {session!r}: {why}; cutting the failed record off failed "
                       f"too ({exc})")
            return
        if seg.fsync_failed and self.flush == "interval":
            self._fail(f"fsync of {seg.path.name} of session {session!r} failed ({why}): records acked since "
                       "the last fsync may not be durable")
            return
        if keep == 0:  # nothing acked in it: no empty segment is left behind
            with contextlib.suppress(OSError):
                seg.path.unlink()
                fsync_dir(seg.path.parent)
        with self._guard:
            self.segments_abandoned += 1
        log.error("ingest log: %s of session %r: %s; the segment was cut back to its acknowledged records and "
                  "abandoned, the next record starts a new one", seg.path.name, session, why)

    def _close_segment(self, session: str, seg: _Segment, doing: str) -> None:
        """Close a segment (rotation); a failure abandons it at its last record, or fail-stops the log."""
        with self._guard:
            if self._segments.get(session) is seg:
                del self._segments[session]
        if self._failure is not None:  # stopped: nothing is written after what it stopped at
            seg.drop()
            return
        keep = seg.size
        try:
            seg.close()
        except OSError as exc:
            self._abandon(session, seg, keep, f"{doing}: {exc}")
            if self._failure is not None:
                raise IngestLogError(f"ingest log for session {session!r}: {doing}: {exc}; the log is stopped "
                                     f"({self._failure})") from exc

    def _fail(self, why: str) -> None:
        with self._guard:
            if self._failure is None:
                self._failure = why
                log.critical("ingest log STOPPED: %s. Every later push, open and register is refused with an "
                             "error until the server restarts (recovery reads what is on disk)", why)

    def rotate(self, session: str) -> int:
        """Close the session's open segment; returns the number the next record's segment gets.

        Called under `session_lock` by a checkpoint: everything before that number is covered."""
        with self.session_lock(session):
            if self._failure is not None:
                raise IngestLogError(f"ingest log for session {session!r}: no rotation, the log is stopped "
                                     f"({self._failure})")
            with self._guard:
                seg = self._segments.get(session)
            if seg is not None:
                self._close_segment(session, seg, "rotating for a checkpoint")
            return next_segment_number(self.folder(session))

    def sync(self) -> None:
        """fsync every segment with records not yet synced (what the interval syncer does).

        A failed fsync fail-stops the log (records it acked may not be durable) and raises
        `IngestLogError`; a stopped log raises it at once."""
        if self._failure is not None:
            raise IngestLogError(f"ingest log: cannot sync, the log is stopped ({self._failure})")
        with self._guard:
            segments = list(self._segments.items())
        for session, seg in segments:
            try:
                seg.sync()  # closed meanwhile: nothing to do, its close() synced it
            except OSError as exc:
                self._fail(f"fsync of {seg.path.name} of session {session!r} failed ({exc}): records acked "
                           "since the last fsync may not be durable")
                raise IngestLogError(f"ingest log: {self._failure}") from exc

    def close(self) -> None:
        """Close every segment (shutdown); failures are logged, never raised: nothing more is written."""
        self._stop.set()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        with self._guard:
            segments = list(self._segments.items())
        for session, seg in segments:
            with self.session_lock(session):
                try:
                    self._close_segment(session, seg, "closing the log")
                except IngestLogError as exc:
                    log.error("%s", exc)

    # -- internals --------------------------------------------------------
    def _fresh_folder(self, session: str) -> None:
        """A new session starts an empty folder; leftovers of an unrecovered one are moved aside."""
        folder = self.folder(session)
        with self._guard:
            seg = self._segments.get(session)
        if seg is not None:
            self._close_segment(session, seg, "starting the session anew")
        self.positions.pop(session, None)
        if folder.exists() and any(folder.iterdir()):
            aside = folder.with_name(f"{folder.name}.replaced-{time.time_ns()}")
            log.warning("ingest log: session %r already had a log folder; kept it as %s", session, aside.name)
            try:
                durable_rename(folder, aside)
            except OSError as exc:
                raise IngestLogError(f"ingest log for session {session!r}: cannot set its old folder aside: "
                                     f"{exc}; the session was not logged") from exc

    def _next_segment(self, session: str) -> Path:
        folder = make_dirs(self.folder(session))
        return folder / f"{next_segment_number(folder):06d}{SEGMENT_SUFFIX}"

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_ms / 1000):
            try:
                self.sync()
            except IngestLogError:  # stopped: `failure` says why, every later write is refused
                return
