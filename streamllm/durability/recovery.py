"""Rebuild sessions from the ingest log at start-up.

    for each session folder:  open | restore(snapshot)  ->  register ...  ->  push v1, v2, ...
    then attach the log to the engine: new records go to fresh segments

Replay goes through the engine's public API with logging off (the records are already
on disk), so a recovered session is built exactly like a live one: same tokens, same
versions, standing questions re-registered and pre-positioned again. A push that the
session's budget cannot take yet (compaction catching up) waits for the engine and is
retried. Torn tails are cut off the segments (see `ingestlog.read_session`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from streamllm.config import parse_question
from streamllm.durability.ingest_log import IngestLog, Record, read_session, session_folders
from streamllm.engine.kv import KVCapacityError

log = logging.getLogger("streamllm.durability.recovery")
CAPACITY_RETRIES = 50


@dataclass(slots=True)
class RecoveryReport:
    sessions: int = 0
    batches: int = 0
    lines: int = 0
    questions: int = 0
    records: int = 0
    torn: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "session: why" for records that could not be applied
    version_mismatches: int = 0
    replay_s: float = 0.0  # reading the log and pushing every record
    ingest_s: float = 0.0  # until the engine has computed all of it

    def summary(self) -> str:
        text = (f"recovered {self.sessions} sessions from the ingest log: {self.batches} batches, {self.lines} lines, "
                f"{self.questions} standing questions in {self.replay_s:.2f}s (+{self.ingest_s:.2f}s ingest)")
        if self.torn:
            text += f"; dropped {len(self.torn)} torn tail(s)"
        if self.failed:
            text += f"; {len(self.failed)} record(s) could not be applied (see the log)"
        return text


def recover(engine: Any, ingest_log: IngestLog, *, progress: bool = False, wait: bool = True) -> RecoveryReport:
    """Replay `ingest_log`'s folder into `engine` (which must not hold those sessions), then attach the log."""
    report = RecoveryReport()
    t0 = time.perf_counter()
    logs = [read_session(folder, repair=True) for folder in session_folders(ingest_log.root)]
    total = sum(len(slog.records) for slog in logs)
    engine.ingest_log = None  # replayed records are on disk already
    try:
        with tqdm(total=total, desc="recovering sessions", unit="rec", disable=not progress or not total) as bar:
            for slog in logs:
                report.torn += [f"{slog.name}/{t}" for t in slog.torn]
                if _replay_session(engine, slog.name, slog.records, report, bar):
                    report.sessions += 1
    finally:
        engine.ingest_log = ingest_log
    report.replay_s = time.perf_counter() - t0
    if wait:
        t1 = time.perf_counter()
        engine.wait_idle()
        report.ingest_s = time.perf_counter() - t1
    log.info("%s", report.summary())
    return report


def _replay_session(engine: Any, name: str, records: list[Record], report: RecoveryReport, bar: tqdm) -> bool:
    if not records or records[0].kind not in ("open", "restore"):
        report.failed.append(f"{name}: the log does not start with open or restore; skipped")
        bar.update(len(records))
        return False
    for i, rec in enumerate(records):
        bar.update(1)
        report.records += 1
        try:
            _apply(engine, name, rec, report)
        except Exception as exc:  # one bad record never stops the others
            if rec.kind in ("open", "restore"):
                report.failed.append(f"{name}: {rec.kind} failed ({exc}); session skipped")
                log.warning("recovery: session %r: %s failed: %s; skipped", name, rec.kind, exc)
                bar.update(len(records) - i - 1)
                return False
            report.failed.append(f"{name}: {rec.kind} v{rec.data_version} failed ({exc})")
            log.warning("recovery: session %r: %s record failed: %s", name, rec.kind, exc)
    return True


def _apply(engine: Any, name: str, rec: Record, report: RecoveryReport) -> None:
    if rec.kind == "open":
        engine.open_session(name, rec.meta["system"], max_context=rec.meta["max_context"])
    elif rec.kind == "restore":
        engine.restore_session(rec.meta["path"], name)
        report.questions += len(engine.standing_questions(name))
    elif rec.kind == "register":
        engine.register(name, parse_question(rec.meta, source=f"ingest log {name}"))
        report.questions += 1
    elif rec.kind == "unregister":
        engine.unregister(name, rec.meta["id"])
        report.questions -= 1
    elif rec.kind == "push":
        ack = push_when_room(engine, name, rec.lines)
        report.batches += 1
        report.lines += len(rec.lines)
        if ack.data_version != rec.data_version:
            report.version_mismatches += 1


def push_when_room(engine: Any, name: str, lines: list[str]) -> Any:
    """Replay pushes faster than compaction: past the budget, let the engine catch up and retry."""
    for _ in range(CAPACITY_RETRIES):
        try:
            return engine.push(name, lines)
        except KVCapacityError:
            engine.wait_idle(timeout=5)
    return engine.push(name, lines)
