"""What the engine hands back to callers: acks, answers, session records, errors.

Everything here is immutable once built (or built and then only read), so the core
can publish it to other threads without a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from streamllm.config import QuestionSpec


class AnswerPath(StrEnum):
    """How an answer was made (compares equal to, and serialises as, its string)."""

    FAST = "fast"  # the gate fired: from the ready distribution, no model call
    ENTRY = "entry"  # from the pre-paid entry, gate closed
    COLD = "cold"  # prefilled on top of the session, then decoded
    GATE = "gate"  # a standing answer that is only the gate's view (its first token; nobody is pushed it)


class FinishReason(StrEnum):
    STOP = "stop"  # end of turn, a stop string, or a named choice
    LENGTH = "length"  # max_tokens reached


class StalePolicy(StrEnum):
    """What a standing question asked while its entry lags the session's data gets."""

    WAIT = "wait"  # wait for the entry at the current data version
    STALE = "stale"  # answer from the newest entry at once, marked stale


class SessionError(KeyError):
    """Unknown, duplicate or closed session."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class AdmissionError(RuntimeError):
    """The KV pool cannot reserve the cells a new session asks for."""


class ReplicaUnavailable(RuntimeError):
    """The engine holding the session is down, restarting or recovering its sessions, or the session
    is being moved (`ClusterEngine`). Nothing acked is lost: retry after a moment."""

    def __init__(self, message: str, *, replica: int | None = None) -> None:
        super().__init__(message)
        self.replica = replica


class AskTimeout(TimeoutError):
    """A question ran past its deadline (`EngineConfig.ask_timeout_s`, or the ask's `deadline_s`); it
    was dropped and its cells freed. The message says how long it waited and where it was."""


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
    tenant: str = ""  # as told at open (or restored with the session); "" when none was


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What a session's cells are valid for: a snapshot restores only into an engine with the same identity."""

    model_name: str
    config_hash: str  # model name, architecture and tokenizer vocabulary
    kv_dtype: str  # the cells' dtype by name (float32, bfloat16)
    adapter_id: str | None  # a `streamllm tune` adapter changes standing answers
    num_layers: int
    num_kv_heads: int
    head_dim: int
    line_feature_width: int  # series heads' per-line features, as this engine's taps keep them


@dataclass(slots=True, eq=False)
class Answer:
    session: str
    question: str
    text: str
    tokens: list[int]
    data_version: int
    tokens_computed: int
    latency_ms: float
    path: AnswerPath = AnswerPath.COLD
    confidence: float | None = None  # the gate's gap at the decision point
    stale: bool = False
    finish_reason: FinishReason = FinishReason.LENGTH
    logits: torch.Tensor | None = None  # the distribution at the decision point, when asked for
    choices: dict[str, float] | None = None  # each choice's probability (softmax over the choices)
    # Made before the question could be answered for real (`ReadyRecord.warming_up`): a guess, not an answer.
    warming_up: bool = False
    warming_up_reason: str | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "logits"}


@dataclass(frozen=True, slots=True)
class StandingAnswer:
    session: str
    question_id: str
    text: str
    path: AnswerPath  # FAST, ENTRY, or GATE (the gate's view only)
    confidence: float  # the gate's gap
    data_version: int
    updated_at: float = field(default_factory=time.time)
    choices: dict[str, float] | None = None
    calibration: dict | None = None  # live figures of a labelled question (engine/standing/calibration.py)
    warming_up: bool = False  # a guess made before the question can be answered (`ReadyRecord.warming_up`)
    warming_up_reason: str | None = None  # why: no data yet, a head's window or a label's history not in
    # The gap the gate fired at for this answer (None: closed, it fires on nothing) and whose it is:
    # "config" (the question's threshold), "head" (its adapter head's calibrated one), "auto" (live).
    threshold: float | None = None
    threshold_source: str = "config"

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class DecodedAnswer:
    """A free-text standing answer decoded whole from its entry: greedy, `max_tokens` (the question's
    own, capped), no stop strings. Any ask of the question by id at the entry's data_version with that
    max_tokens and no stop strings decodes exactly this, so it is answered from it at once."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """A standing question's ready distribution as the core last published it.

    Callers answer the fast path from this alone, without a round trip to the core.
    `final` says the gate's view is the whole answer (a choice question, or a fired gate
    on a one-token / end-of-turn answer); otherwise the answer needs a decode, and once
    one is decoded from this entry (the standing decode, or a first ask) it is `decoded`.
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
    logits: torch.Tensor | None  # [vocab], never mutated after publication
    # Why this view is only a guess (None: it is an answer): the session has no data yet, the question's
    # series head has fewer lines than it reads (the LM decided alone), or its label's history is not in.
    warming_up: str | None = None
    threshold: float | None = None  # the gap the gate decided at (None: closed), and whose (StandingAnswer)
    threshold_source: str = "config"
    decoded: DecodedAnswer | None = None  # the whole answer decoded from this entry, once it is


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session's counters as of the core's last update (read without a round trip)."""

    info: SessionInfo
    standing: tuple[StandingAnswer, ...] = ()
    questions: tuple[QuestionSpec, ...] = ()  # each standing question's spec
