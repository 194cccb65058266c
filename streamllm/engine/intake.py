"""The facade's push path: validate, tokenize, assign the version, log, ack, enqueue.

A push never waits for the core. The facade keeps, per session, what it needs to ack a
batch alone (`_Handle`: budget, acked version, lines pushed); versions are assigned under
the facade's lock in the order batches enter the core's inbox, so the core agrees. With
an ingest log the batch is on disk before its ack (durability/ingest_log.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from streamllm.engine.commands import Push
from streamllm.engine.outputs import PushAck
from streamllm.engine.prompt import validate_lines

log = logging.getLogger("streamllm.engine")


@dataclass(slots=True)
class _Handle:
    """What the facade knows of a session: enough to validate and ack a push without the core."""

    max_context: int
    prefix_len: int
    pushed_version: int
    lines_pushed: int


@dataclass(slots=True)
class _Batch:
    """A push on its way from the caller to the core."""

    lines: list[str]
    ids_per_line: list[list[int]]
    new_tokens: int
    source: tuple[str, int] | None
    truths: dict[str, str] | None
    late_truths: dict[str, dict[int, str]] | None


class Intake:
    """Mixed into `Engine` (api.py), whose registry (`_handles`, `_lock`, `core`, ...) it uses."""

    def push(self, name: str, lines: list[str], *, source: tuple[str, int] | None = None,
             truths: dict[str, str] | None = None, late_truths: dict[str, dict[int, str]] | None = None) -> PushAck:
        """Accept a batch of lines; returns at once with the data_version it will become.

        source: (feed id, feed position after this batch), logged with it; with an ingest log a
        batch behind its feed's logged position raises `DuplicateBatch` (exactly-once feeds).
        truths: question id -> the right choice on the data as of this batch, for labelled standing
        questions: their answers at this version are scored (live calibration), never answered from.
        late_truths: question id -> {earlier data version: right choice}: truths that this batch's data
        settles for versions already pushed (a forecast's), scored against the answers made there."""
        lines = validate_lines(lines)
        if not lines:
            raise ValueError("push at least one line")
        truths = (self._check_truths(name, truths) or None) if truths else None
        late_truths = (self._check_late_truths(name, late_truths) or None) if late_truths else None
        ids_per_line = self.layout.lines_ids(lines)  # tokenized in the caller's thread
        batch = _Batch(lines, ids_per_line, sum(len(ids) for ids in ids_per_line), source, truths, late_truths)
        with self._log_lock(name):  # with a log: version order == log order == inbox order
            if self.ingest_log is None:  # one critical section: assign, enqueue, ack
                with self._lock:
                    return self._enqueue(name, batch)
            with self._lock:  # (evict_state also takes the log lock: the session stays between the blocks)
                version = self._next_version(name, batch.new_tokens)
            # On disk before the ack. When it raises (IngestLogError) nothing is acked and the version stays
            # free: the log cut the failed record off (or stopped writing), so no record holds it twice.
            self.ingest_log.record_push(name, version, batch.lines, batch.source, batch.truths, batch.late_truths)
            with self._lock:
                return self._enqueue(name, batch, version)

    def _check_truths(self, name: str, truths: dict[str, str]) -> dict[str, str]:
        """Truths for questions the session does not have (unregistered meanwhile) are dropped: a
        feed must not stall over them. A choice the question does not offer is an error."""
        if not isinstance(truths, dict):
            raise ValueError(f"truths must map question ids to choices, got {type(truths).__name__}")
        record = self.core.records.get(name)
        specs = {q.id: q for q in record.questions} if record is not None else {}
        kept = {}
        for question_id, choice in truths.items():
            spec = specs.get(question_id)
            if spec is not None and choice not in spec.choices:
                raise ValueError(f"truths[{question_id!r}]: {choice!r} is not one of its choices {list(spec.choices)}")
            if spec is not None:
                kept[question_id] = choice
        return kept

    def _check_late_truths(self, name: str, late: dict[str, dict[int, str]]) -> dict[str, dict[int, str]]:
        """As `_check_truths`, per earlier version; a version must be one already pushed (>= 1)."""
        if not isinstance(late, dict) or not all(isinstance(v, dict) for v in late.values()):
            raise ValueError("late_truths must map question ids to {data version: choice}")
        with self._lock:
            pushed = self._handle(name).pushed_version
        kept: dict[str, dict[int, str]] = {}
        for question_id, by_version in late.items():
            for version in by_version:
                if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= pushed:
                    raise ValueError(f"late_truths[{question_id!r}]: version {version!r} is not one already "
                                     f"pushed (1..{pushed})")
            checked = {v: self._check_truths(name, {question_id: c}) for v, c in by_version.items()}
            if any(checked.values()):
                kept[question_id] = {v: c[question_id] for v, c in checked.items()}
        return kept

    def _next_version(self, name: str, new_tokens: int) -> int:
        """Under self._lock: the version the batch will get, or a clear refusal."""
        h = self._handle(name)
        room = h.max_context - h.prefix_len
        if new_tokens > room:
            raise ValueError(f"the batch is {new_tokens} tokens, more than session {name!r} can ever hold "
                             f"({room} data tokens); push it in smaller batches")
        return h.pushed_version + 1

    def _enqueue(self, name: str, batch: _Batch, version: int | None = None) -> PushAck:
        """Under self._lock: record the ack and hand the batch to the core (inbox order = version order)."""
        version = version if version is not None else self._next_version(name, batch.new_tokens)
        h = self._handle(name)
        h.pushed_version, h.lines_pushed = version, h.lines_pushed + len(batch.lines)
        self.core.submit(Push(name, batch.ids_per_line, version, batch.truths, batch.late_truths, batch.lines)
                         ).add_done_callback(_log_failure)
        return PushAck(name, version, max(self._backlog(name, h), len(batch.lines)), len(batch.lines))

    def backlog(self, name: str) -> int:
        """Lines accepted but not yet ingested (from the last published record)."""
        with self._lock:
            return self._backlog(name, self._handle(name))

    def _backlog(self, name: str, h: _Handle) -> int:
        record = self.core.records.get(name)
        return max(0, h.lines_pushed - (record.info.lines_ingested if record else 0))


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a push the engine acked failed in the core: %r", future.exception())
