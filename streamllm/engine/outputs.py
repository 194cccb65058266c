"""What the engine hands back to callers: acks, answers, session records, errors.

Everything here is immutable once built (or built and then only read), so the core
can publish it to other threads without a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class SessionError(KeyError):
    """Unknown, duplicate or closed session."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class AdmissionError(RuntimeError):
    """The KV pool cannot reserve the cells a new session asks for."""


class EngineStopped(RuntimeError):
    """The engine was shut down (or its core died); nothing more is accepted."""


@dataclass(frozen=True, slots=True)
class PushAck:
    session: str
    data_version: int  # the version this batch becomes once ingested
    queue_depth: int  # lines accepted but not yet ingested, this batch included
    lines: int


@dataclass(frozen=True, slots=True)
class SessionInfo:
    name: str
    data_version: int
    pushed_version: int
    num_tokens: int
    num_computed: int
    prefix_tokens: int
    max_context: int
    backlog_lines: int
    lines_ingested: int
    compactions: int = 0


@dataclass(slots=True, eq=False)
class Answer:
    session: str
    question: str
    text: str
    tokens: list[int]
    data_version: int
    tokens_computed: int
    latency_ms: float
    path: str = "cold"  # "fast" (gate fired) | "entry" (from the pre-paid entry) | "cold"
    confidence: float | None = None  # the gate's gap at the decision point
    stale: bool = False
    finish_reason: str = "length"  # "stop" (eos, stop string or a named choice) | "length"
    logits: object = None  # the distribution at the decision point, when asked for (torch.Tensor)
    choices: dict[str, float] | None = None  # each choice's probability (softmax over the choices)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "logits"}


@dataclass(frozen=True, slots=True)
class StandingAnswer:
    session: str
    question_id: str
    text: str
    path: str  # "fast" (gate fired) | "entry" (from the entry, gate closed)
    confidence: float  # the gate's gap
    data_version: int
    updated_at: float = field(default_factory=time.time)
    choices: dict[str, float] | None = None
    calibration: dict | None = None  # live figures of a labelled question (engine/calibration.py)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """A standing question's ready distribution as the core last published it.

    Callers answer the fast path from this alone, without a round trip to the core.
    `final` says the gate's view is the whole answer (a choice question, or a fired gate
    on a one-token / end-of-turn answer); otherwise the answer needs a decode.
    """

    session: str
    question_id: str
    data_version: int
    fired: bool
    final: bool
    text: str
    token_id: int
    confidence: float
    choices: dict[str, float] | None
    logits: Any  # torch.Tensor [vocab], never mutated after publication


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session's counters as of the core's last update (read without a round trip)."""

    info: SessionInfo
    standing: tuple[StandingAnswer, ...] = ()
    questions: tuple[Any, ...] = ()  # QuestionSpec of each standing question
