"""Rebuild sessions from the ingest log at start-up.

    for each session folder:
        newest checkpoint that validates (a torn one falls back to the one before it)
          -> the log segments from the checkpoint's cut on       (pushes it covers are skipped)
        or, without checkpoints: open | restore(snapshot) -> register ... -> push v1, v2, ...
    then attach the log to the engine (new records go to fresh segments) and start its checkpoints

Replay goes through the engine's public API before the log is attached (the records are
already on disk), so a recovered session is built exactly like a live one: same tokens, same
versions, standing questions re-registered and pre-positioned again. Register and
unregister replay idempotently (a checkpoint may already hold the question). A push that
the session's budget cannot take yet (compaction catching up) waits for the engine and
is retried. Torn tails are cut off the segments; a session whose log has a hole is not
opened unless `repair=True` (see `log_reader`). Each feed's position is restored into the
log (`IngestLog.positions`), so attachments resume where the log ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from tqdm import tqdm

from streamllm.config import parse_question
from streamllm.durability.checkpoint import snapshot_files, start_checkpoints
from streamllm.durability.ingest_log import IngestLog, Record, legacy_tenant
from streamllm.durability.log_reader import SessionLog, read_session, session_folders
from streamllm.durability.resident import ResidentEngine
from streamllm.durability.snapshot import SnapshotError, load_snapshot, restore_loaded
from streamllm.engine.api import Engine

log = logging.getLogger("streamllm.durability.recovery")


@dataclass(slots=True)
class RecoveryReport:
    sessions: int = 0
    batches: int = 0
    lines: int = 0
    questions: int = 0
    records: int = 0
    from_checkpoints: int = 0  # sessions restored from a checkpoint (then the log after it)
    torn: list[str] = field(default_factory=list)
    holes: list[str] = field(default_factory=list)  # "session: where" (refused, or repaired when `repaired`)
    repaired: list[str] = field(default_factory=list)
    checkpoint_fallbacks: list[str] = field(default_factory=list)  # checkpoints that did not validate
    failed: list[str] = field(default_factory=list)  # "session: why" for records that could not be applied
    version_mismatches: int = 0
    replay_s: float = 0.0  # reading the log and pushing every record
    ingest_s: float = 0.0  # until the engine has computed all of it

    def summary(self) -> str:
        text = (f"recovered {self.sessions} sessions from the ingest log ({self.from_checkpoints} from checkpoints): "
                f"{self.batches} batches, {self.lines} lines, {self.questions} standing questions in "
                f"{self.replay_s:.2f}s (+{self.ingest_s:.2f}s ingest)")
        if self.torn:
            text += f"; dropped {len(self.torn)} torn tail(s)"
        if self.checkpoint_fallbacks:
            text += f"; {len(self.checkpoint_fallbacks)} damaged checkpoint(s) skipped"
        if self.holes:
            fix = "REPAIRED, data after the hole lost" if self.repaired else "NOT OPENED, rerun with --repair"
            text += f"; HOLE in the log of {len(self.holes)} session(s) ({fix}): {'; '.join(self.holes)}"
        if self.failed:
            text += f"; {len(self.failed)} record(s) could not be applied (see the log)"
        return text


def recover(engine: Engine | ResidentEngine, ingest_log: IngestLog, *, progress: bool = False, wait: bool = True,
            repair: bool = False) -> RecoveryReport:
    """Replay `ingest_log`'s folder into `engine` (which must not hold those sessions), then attach the log.

    engine: an `Engine`, or a `ResidentEngine` with auto_evict: a server that ran more sessions than
    its pool holds, idle ones on disk, recovers every one of them (evicting as it goes), not only
    those that fit at once. Any log the engine had is detached during the replay."""
    report = RecoveryReport()
    t0 = time.perf_counter()
    engine.attach_log(None)  # replayed records are on disk already
    checkpointed: dict[str, int] = {}
    try:
        folders = session_folders(ingest_log.root)
        with tqdm(total=len(folders), desc="recovering sessions", unit="session",
                  disable=not progress or not folders) as bar:
            for folder in folders:
                bar.update(1)
                if _recover_session(engine, ingest_log, folder, report, repair, checkpointed):
                    report.sessions += 1
    finally:
        engine.attach_log(ingest_log)
    report.replay_s = time.perf_counter() - t0
    if wait:
        t1 = time.perf_counter()
        engine.wait_idle()
        report.ingest_s = time.perf_counter() - t1
    (log.error if report.holes else log.info)("%s", report.summary())
    checkpointer = start_checkpoints(engine, ingest_log)
    if checkpointer is not None:
        now = time.monotonic()
        checkpointer.last.update({name: (version, now) for name, version in checkpointed.items()})
    return report


def _recover_session(engine: Engine | ResidentEngine, ingest_log: IngestLog, folder: Any, report: RecoveryReport, repair: bool,
                     checkpointed: dict[str, int]) -> bool:
    name, start, after, positions = unquote(folder.name), 0, None, {}
    for snap in snapshot_files(folder):
        try:
            loaded = load_snapshot(engine, snap.path)
            restore_loaded(engine, loaded, snap.path, name)
        except SnapshotError as exc:
            report.checkpoint_fallbacks.append(str(exc))
            log.error("recovery: %s; falling back to the checkpoint before it", exc)
            continue
        start, after = snap.log_segment, snap.version
        positions = dict(loaded.meta.get("feed_positions", {}))
        report.from_checkpoints += 1
        report.questions += len(loaded.questions)
        checkpointed[name] = snap.version
        break
    slog = read_session(folder, repair=True, from_segment=start, after_version=after, repair_holes=repair)
    report.torn += [f"{name}/{t}" for t in slog.torn]
    if slog.hole is not None:
        report.holes.append(f"{name}: {slog.hole}")
        if not repair:
            report.failed.append(f"{name}: hole in the log ({slog.hole}); not opened without --repair")
            if after is not None:
                engine.close_session(name)
            return False
        report.repaired.append(name)
    if after is None and (not slog.records or slog.records[0].kind not in ("open", "restore")):
        report.failed.append(f"{name}: the log does not start with open or restore and no checkpoint validates; "
                             "skipped")
        return False
    ingest_log.positions[name] = positions
    for rec in slog.records:
        report.records += 1
        try:
            _apply(engine, name, rec, report)
        except Exception as exc:  # one bad record never stops the others
            if rec.kind in ("open", "restore"):
                report.failed.append(f"{name}: {rec.kind} failed ({exc}); session skipped")
                log.warning("recovery: session %r: %s failed: %s; skipped", name, rec.kind, exc)
                return False
            report.failed.append(f"{name}: {rec.kind} v{rec.data_version} failed ({exc})")
            log.warning("recovery: session %r: %s record failed: %s", name, rec.kind, exc)
            continue
        if rec.kind == "push" and "feed" in rec.meta:
            positions[rec.meta["feed"]] = int(rec.meta["pos"])
    return True


def _apply(engine: Engine | ResidentEngine, name: str, rec: Record, report: RecoveryReport) -> None:
    if rec.kind == "open":
        engine.open_session(name, rec.meta["system"], max_context=rec.meta["max_context"],
                            tenant=rec.meta["tenant"] if "tenant" in rec.meta else legacy_tenant(name))
    elif rec.kind == "restore":
        restore_loaded(engine, load_snapshot(engine, rec.meta["path"]), rec.meta["path"], name)
        report.questions += len(engine.standing_questions(name))
    elif rec.kind == "register":
        spec = parse_question(rec.meta, source=f"ingest log {name}", stored=True)  # accepted once: kept
        have = {q.id: q for q in engine.standing_questions(name)}
        if spec.id in have:  # the checkpoint already holds it
            if have[spec.id] == spec:
                return
            engine.unregister(name, spec.id)
            report.questions -= 1
        engine.register(name, spec)
        report.questions += 1
    elif rec.kind == "unregister":
        if any(q.id == rec.meta["id"] for q in engine.standing_questions(name)):
            engine.unregister(name, rec.meta["id"])
            report.questions -= 1
    elif rec.kind == "push":
        kw = {}
        if truths := rec.meta.get("truths"):
            kw["truths"] = truths
        if late := rec.meta.get("late_truths"):
            kw["late_truths"] = {q: {int(v): c for v, c in by.items()} for q, by in late.items()}
        try:  # the truths were checked when first pushed; should one no longer fit, the lines still go in
            ack = engine.push(name, rec.lines, **kw)
        except ValueError as exc:
            if not kw:
                raise
            log.warning("recovery: session %r: v%s truths not applied (%s); its lines are", name, rec.data_version, exc)
            ack = engine.push(name, rec.lines)
        report.batches += 1
        report.lines += len(rec.lines)
        if ack.data_version != rec.data_version:
            report.version_mismatches += 1


__all__ = ["RecoveryReport", "SessionLog", "recover"]
