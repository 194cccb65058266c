"""Durable ingest log: every accepted batch is on disk before its push is acknowledged.

One folder per session, holding Arrow IPC *stream* segments written in order:

    log_dir/sessions/<quoted session name>/000001.arrow  000002.arrow ...

Each record is one row: kind (open | push | register | unregister | restore), session,
data_version, lines, recv_ns, meta (JSON: system prompt, max_context, question spec,
snapshot path) and a CRC32 over all of it. A segment is closed (end-of-stream marker)
and the next one started once it passes `segment_bytes`; a restarted process always
starts a new segment, so an old one is never appended to.

Durability (`flush`): "batch" flushes and fsyncs each record before the ack (survives
power loss); "interval" flushes each record to the OS before the ack (survives a killed
process) and fsyncs every `fsync_ms` from a background thread (a power loss may lose
that window). Closing a session writes nothing: its folder is renamed aside and removed,
so recovery never reopens it.

Reading (`read_session`) stops at the first record that does not decode or fails its
CRC: a crash mid-write leaves a torn tail, which is dropped with a warning and cut off
the segment (`repair=True`), keeping everything before it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.ipc as ipc

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


@dataclass(slots=True)
class Record:
    kind: str
    session: str
    data_version: int = 0
    lines: list[str] = field(default_factory=list)
    recv_ns: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SessionLog:
    """What reading one session's folder found."""

    name: str
    records: list[Record]
    segments: int
    torn: list[str] = field(default_factory=list)  # one "segment: why" per dropped tail


def _crc(kind: str, session: str, version: int, lines: list[str], recv_ns: int, meta: str) -> int:
    payload = json.dumps([kind, session, version, lines, recv_ns, meta], ensure_ascii=False).encode()
    return zlib.crc32(payload)


def _batch(rec: Record) -> pa.RecordBatch:
    meta = json.dumps(rec.meta, ensure_ascii=False, sort_keys=True)
    crc = _crc(rec.kind, rec.session, rec.data_version, rec.lines, rec.recv_ns, meta)
    return pa.record_batch([[rec.kind], [rec.session], [rec.data_version], [rec.lines], [rec.recv_ns], [meta],
                            pa.array([crc], pa.uint32())], schema=SCHEMA)


def session_dir_name(session: str) -> str:
    # Tenant names hold '/': one flat folder per session; '.' is escaped too, so a folder
    # name with a dot is always one set aside (closed, replaced).
    return quote(session, safe="").replace(".", "%2E")


class _Segment:
    """One open segment file and its Arrow stream writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "xb")  # noqa: SIM115 - kept open across appends
        self.writer = ipc.new_stream(self.file, SCHEMA)
        self.dirty = False

    @property
    def size(self) -> int:
        return self.file.tell()

    def write(self, batch: pa.RecordBatch, fsync: bool) -> None:
        self.writer.write_batch(batch)
        self.file.flush()  # in the OS before the ack: a killed process loses nothing
        if fsync:
            os.fsync(self.file.fileno())
        else:
            self.dirty = True

    def sync(self) -> None:
        if self.dirty and not self.file.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.dirty = False

    def close(self) -> None:
        if self.file.closed:
            return
        self.writer.close()  # end-of-stream marker: a complete segment
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class IngestLog:
    def __init__(self, log_dir: str | Path, *, flush: str = "batch", fsync_ms: float = 50.0,
                 segment_bytes: int = 8 << 20) -> None:
        if flush not in FLUSH_POLICIES:
            raise ValueError(f"flush must be one of {FLUSH_POLICIES}, got {flush!r}")
        if segment_bytes < 1024:
            raise ValueError(f"segment_bytes must be at least 1024, got {segment_bytes}")
        self.root = Path(log_dir)
        self.sessions_dir = self.root / "sessions"
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        self.flush, self.fsync_ms, self.segment_bytes = flush, fsync_ms, segment_bytes
        self._segments: dict[str, _Segment] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()
        self.records_written = 0
        self.bytes_written = 0
        self._stop = threading.Event()
        self._syncer = None
        if flush == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="streamllm-ingestlog", daemon=True)
            self._syncer.start()

    # -- ordering ---------------------------------------------------------
    def session_lock(self, session: str) -> threading.RLock:
        """Held by a push across version assignment and append: the log is in version order."""
        with self._guard:
            return self._locks.setdefault(session, threading.RLock())

    # -- records ----------------------------------------------------------
    def record_open(self, session: str, system: str, max_context: int) -> None:
        self._fresh_folder(session)
        self.append(Record("open", session, meta={"system": system, "max_context": max_context}))

    def record_restore(self, session: str, snapshot: str | Path, data_version: int) -> None:
        self._fresh_folder(session)
        self.append(Record("restore", session, data_version, meta={"path": str(Path(snapshot).absolute())}))

    def record_push(self, session: str, data_version: int, lines: list[str]) -> None:
        self.append(Record("push", session, data_version, list(lines), time.time_ns()))

    def record_register(self, session: str, question: dict[str, Any]) -> None:
        self.append(Record("register", session, meta=question))

    def record_unregister(self, session: str, question_id: str) -> None:
        self.append(Record("unregister", session, meta={"id": question_id}))

    def record_close(self, session: str) -> None:
        """The session is gone: rename its folder aside (atomic), then remove it."""
        with self.session_lock(session):
            with self._guard:
                seg = self._segments.pop(session, None)
            if seg is not None:
                seg.close()
            folder = self.sessions_dir / session_dir_name(session)
            if not folder.exists():
                return
            gone = folder.with_name(f"{folder.name}.closed-{time.time_ns()}")
            folder.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)

    def append(self, rec: Record) -> None:
        batch = _batch(rec)
        try:
            # Per-session lock: one session's fsync never waits for another's.
            with self.session_lock(rec.session):
                with self._guard:
                    seg = self._segments.get(rec.session)
                if seg is not None and seg.size >= self.segment_bytes:
                    seg.close()
                    seg = None
                if seg is None:
                    seg = _Segment(self._next_segment(rec.session))
                    with self._guard:
                        self._segments[rec.session] = seg
                before = seg.size
                seg.write(batch, fsync=self.flush == "batch")
                with self._guard:
                    self.records_written += 1
                    self.bytes_written += seg.size - before
        except OSError as exc:
            raise IngestLogError(f"ingest log for session {rec.session!r}: cannot write {rec.kind} record: {exc}; "
                                 "the batch is not durable and was not acknowledged") from exc

    def close(self) -> None:
        self._stop.set()
        with self._guard:
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()

    # -- internals --------------------------------------------------------
    def _fresh_folder(self, session: str) -> None:
        """A new session starts an empty folder; leftovers of an unrecovered one are moved aside."""
        folder = self.sessions_dir / session_dir_name(session)
        with self._guard:
            seg = self._segments.pop(session, None)
        if seg is not None:
            seg.close()
        if folder.exists() and any(folder.iterdir()):
            aside = folder.with_name(f"{folder.name}.replaced-{time.time_ns()}")
            log.warning("ingest log: session %r already had a log folder; kept it as %s", session, aside.name)
            folder.rename(aside)

    def _next_segment(self, session: str) -> Path:
        folder = self.sessions_dir / session_dir_name(session)
        folder.mkdir(parents=True, exist_ok=True)
        numbers = [int(p.stem) for p in folder.glob(f"*{SEGMENT_SUFFIX}") if p.stem.isdigit()]
        return folder / f"{max(numbers, default=0) + 1:06d}{SEGMENT_SUFFIX}"

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_ms / 1000):
            with self._guard:
                segments = list(self._segments.values())
            for seg in segments:
                with contextlib.suppress(OSError, ValueError):  # closed meanwhile: its close() synced it
                    seg.sync()


# -- reading -------------------------------------------------------------------


def session_folders(log_dir: str | Path) -> list[Path]:
    """Live session folders (closed and replaced ones are skipped), oldest name first."""
    root = Path(log_dir) / "sessions"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and "." not in p.name)


def _read_segment(path: Path) -> tuple[list[Record], str | None, int]:
    """(records, why the tail was dropped or None, number of good records)."""
    data = path.read_bytes()
    records: list[Record] = []
    try:
        reader = ipc.open_stream(pa.BufferReader(data))
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        return [], f"no readable schema ({len(data)} bytes): {exc}", 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return records, None, len(records)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            return records, f"torn record after {len(records)} good ones: {exc}", len(records)
        try:
            rows = batch.to_pylist()
            for row in rows:
                crc = _crc(row["kind"], row["session"], row["data_version"], row["lines"], row["recv_ns"], row["meta"])
                if crc != row["crc"] or row["kind"] not in KINDS:
                    return records, f"record {len(records)} fails its checksum", len(records)
                records.append(Record(row["kind"], row["session"], row["data_version"], row["lines"],
                                      row["recv_ns"], json.loads(row["meta"])))
        except (KeyError, TypeError, ValueError) as exc:
            return records, f"record {len(records)} does not decode: {exc}", len(records)


def _rewrite(path: Path, records: list[Record]) -> None:
    """Keep only the good records of a torn segment (written aside, then renamed over it)."""
    tmp = path.with_suffix(".tmp")
    buf = io.BytesIO()
    with ipc.new_stream(buf, SCHEMA) as writer:
        for rec in records:
            writer.write_batch(_batch(rec))
    with open(tmp, "wb") as fh:
        fh.write(buf.getvalue())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_session(folder: str | Path, *, repair: bool = False) -> SessionLog:
    """All good records of one session folder in order; a torn tail is dropped (and cut off with repair)."""
    folder = Path(folder)
    segments = sorted(p for p in folder.glob(f"*{SEGMENT_SUFFIX}") if p.stem.isdigit())
    out = SessionLog(unquote(folder.name), [], len(segments))
    for path in segments:
        records, why, _ = _read_segment(path)
        out.records.extend(records)
        if why is not None:
            out.torn.append(f"{path.name}: {why}")
            log.warning("ingest log %s/%s: %s; dropped it, kept the %d records before it",
                        folder.name, path.name, why, len(records))
            if repair:
                if records:
                    _rewrite(path, records)
                else:
                    path.unlink()
    return out


def iter_log(log_dir: str | Path) -> Iterator[SessionLog]:
    for folder in session_folders(log_dir):
        yield read_session(folder)


def pushed_lines(log_dir: str | Path) -> dict[str, list[str]]:
    """Every logged data line per session, in order (what an audit compares with the acks)."""
    out: dict[str, list[str]] = {}
    for slog in iter_log(log_dir):
        lines = out.setdefault(slog.name, [])
        for rec in slog.records:
            if rec.kind == "push":
                lines.extend(rec.lines)
    return out
