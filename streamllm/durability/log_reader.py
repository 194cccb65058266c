"""Reading the ingest log back: torn tails are dropped, holes are refused.

    segment ... [good records] [bad record] [nothing readable]     torn tail: a crash mid-write
    segment ... [good records] [bad record] [good records ...]     HOLE: corruption, not a crash
    segment k ends at version 41, segment k+1 starts at 45         HOLE: versions 42..44 are gone

A torn tail is what a crash leaves (the write that never got its ack): its records are
dropped with a warning and, with `repair=True` (recovery always), cut off the segment, keeping everything
before it. Later segments (written by the restarted process) go on reading.

A hole is different: acknowledged data is missing with data after it. Reading stops at
the hole (`SessionLog.hole` says where and why) and recovery refuses to open the session
unless it runs with repair (`recover(repair=True)`, `streamllm serve --repair`); then the session opens
with the records before the hole only, the damaged segment and every later one are kept
aside as `*.arrow.hole-<ns>` for inspection, and both the log and the recovery report
say so at ERROR level. A session never opens with a silent gap in its data versions.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.ipc as ipc

from streamllm.durability.files import durable_rename, write_durably
from streamllm.durability.ingest_log import (
    KINDS,
    SCHEMA,
    SEGMENT_SUFFIX,
    Record,
    _crc,
    record_batch,
    segment_numbers,
)

log = logging.getLogger("streamllm.durability.log_reader")
_SCHEMA_MESSAGE = SCHEMA.serialize().to_pybytes()
_MARKER = b"\xff\xff\xff\xff"
_RESYNC_TRIES = 256


@dataclass(slots=True)
class SessionLog:
    """What reading one session's folder found."""

    name: str
    records: list[Record]
    segments: int
    torn: list[str] = field(default_factory=list)  # one "segment: why" per dropped tail
    hole: str | None = None  # set when acknowledged data is missing with data after it
    set_aside: list[str] = field(default_factory=list)  # files moved aside by a repair of a hole


@dataclass(slots=True)
class _SegmentRead:
    records: list[Record]
    problem: str | None = None
    after: int = 0  # good records found past the bad one (> 0: a hole, not a torn tail)


def _decode(batch: pa.RecordBatch) -> list[Record] | str:
    out = []
    try:
        for row in batch.to_pylist():
            crc = _crc(row["kind"], row["session"], row["data_version"], row["lines"], row["recv_ns"], row["meta"])
            if crc != row["crc"] or row["kind"] not in KINDS:
                return "fails its checksum"
            out.append(Record(row["kind"], row["session"], row["data_version"], row["lines"], row["recv_ns"],
                              json.loads(row["meta"])))
    except (KeyError, TypeError, ValueError) as exc:
        return f"does not decode: {exc}"
    return out


def _read_stream(data: bytes) -> tuple[list[Record], str | None, int]:
    """(good records, why reading stopped or None, byte offset where it stopped)."""
    src = pa.BufferReader(data)
    records: list[Record] = []
    try:
        reader = ipc.open_stream(src)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        return [], f"no readable schema ({len(data)} bytes): {exc}", 0
    while True:
        at = src.tell()
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return records, None, at
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            return records, f"torn record after {len(records)} good ones: {exc}", at
        got = _decode(batch)
        if isinstance(got, str):
            return records, f"record {len(records)} {got}", src.tell()
        records.extend(got)


def _records_after(data: bytes, offset: int) -> int:
    """Good records that follow a bad one: resynchronise on the next IPC message marker."""
    start = offset
    for _ in range(_RESYNC_TRIES):
        p = data.find(_MARKER, start)
        if p < 0:
            return 0
        found, _, _ = _read_stream(_SCHEMA_MESSAGE + data[p:])
        if found:
            return len(found)
        start = p + 1
    return 0


def _read_segment(path: Path) -> _SegmentRead:
    data = path.read_bytes()
    records, problem, stopped = _read_stream(data)
    if problem is None:
        return _SegmentRead(records)
    return _SegmentRead(records, problem, _records_after(data, max(stopped, 1)))


def _rewrite(path: Path, records: list[Record]) -> None:
    """Keep only the good records of a segment (written aside, fsynced, renamed over it, folder fsynced)."""
    buf = io.BytesIO()
    with ipc.new_stream(buf, SCHEMA) as writer:
        for rec in records:
            writer.write_batch(record_batch(rec))
    write_durably(path, buf.getvalue())


def session_folders(log_dir: str | Path) -> list[Path]:
    """Live session folders (closed and replaced ones are skipped), oldest name first."""
    root = Path(log_dir) / "sessions"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and "." not in p.name)


def read_session(folder: str | Path, *, repair: bool = False, repair_holes: bool = False, from_segment: int = 0,
                 after_version: int | None = None) -> SessionLog:
    """The good records of one session folder in order, from segment `from_segment` on.

    repair: cut torn tails off their segments. repair_holes: set the segments from a hole
    on aside and keep the records before it (see the module docstring); without it a hole
    only stops reading. `after_version`: the data_version the records continue (a
    checkpoint's; pushes up to it are skipped); None when the log starts with its
    open/restore record."""
    folder = Path(folder)
    numbers = [n for n in segment_numbers(folder) if n >= from_segment]
    out = SessionLog(unquote(folder.name), [], len(numbers))
    last = after_version
    for i, n in enumerate(numbers):
        path = folder / f"{n:06d}{SEGMENT_SUFFIX}"
        seg = _read_segment(path)
        good: list[Record] = []
        for rec in seg.records:
            if rec.kind in ("open", "restore"):
                last = rec.data_version
            elif rec.kind == "push":
                if after_version is not None and rec.data_version <= after_version:
                    continue  # covered by the snapshot this read continues
                if last is not None and rec.data_version != last + 1:
                    out.hole = f"{path.name}: data versions jump from {last} to {rec.data_version}"
                    break
                last = rec.data_version
            good.append(rec)
        if out.hole is None and seg.problem is not None and seg.after:
            out.hole = f"{path.name}: {seg.problem}, and {seg.after} good record(s) follow it"
        out.records.extend(good)
        if out.hole is not None:
            _report_hole(out, folder, [folder / f"{m:06d}{SEGMENT_SUFFIX}" for m in numbers[i:]], good, repair_holes)
            return out
        if seg.problem is not None:
            out.torn.append(f"{path.name}: {seg.problem}")
            log.warning("ingest log %s/%s: %s; dropped it, kept the %d records before it",
                        folder.name, path.name, seg.problem, len(seg.records))
            if repair:
                if seg.records:
                    _rewrite(path, seg.records)
                else:
                    path.unlink()
    return out


def _report_hole(out: SessionLog, folder: Path, damaged: list[Path], good: list[Record], repair: bool) -> None:
    last = max((r.data_version for r in out.records if r.kind == "push"), default=None)
    if not repair:
        log.error("ingest log %s: HOLE in the data versions (%s); reading stopped after version %s. The session "
                  "is not opened; rerun with repair (streamllm serve --repair) to open it up to that version",
                  folder.name, out.hole, last)
        return
    stamp = time.time_ns()
    for path in damaged:
        aside = path.with_name(f"{path.name}.hole-{stamp}")
        durable_rename(path, aside)
        out.set_aside.append(aside.name)
    if good:
        _rewrite(damaged[0], good)
    log.error("ingest log %s: HOLE in the data versions (%s); REPAIRED by opening the session at version %s and "
              "losing what followed; the damaged segments are kept as %s", folder.name, out.hole, last,
              ", ".join(out.set_aside))


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
