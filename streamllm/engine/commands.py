"""The messages callers send the core. Each carries a future the core resolves.

The core drains its inbox between steps and applies commands in arrival order, so a
command never races a forward pass and pushes to one session keep their order.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamllm.config import QuestionSpec
    from streamllm.engine.core import EngineCore
    from streamllm.engine.standing.gate import Gate
    from streamllm.engine.state import SessionState


def settle(future: Future | None, *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a caller's future; one the caller abandoned (cancelled) is left as it is."""
    if future is None or future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled by its caller between done() and here: harmless by design
        pass


@dataclass(slots=True, eq=False)
class Command:
    future: Future = field(default_factory=Future, kw_only=True)


@dataclass(slots=True, eq=False)
class OpenSession(Command):
    name: str
    system: str
    prefix_ids: list[int]
    max_context: int
    tenant: str = ""


@dataclass(slots=True, eq=False)
class CloseSession(Command):
    name: str


@dataclass(slots=True, eq=False)
class Push(Command):
    name: str
    ids_per_line: list[list[int]]
    version: int  # the version the facade acked; the core checks it agrees
    truths: dict[str, str] | None = None  # question id -> right choice at this version (live calibration)
    late_truths: dict[str, dict[int, str]] | None = None  # question id -> {earlier version: choice} (forecasts)
    lines: list[str] | None = None  # the pushed text: its numbers are kept while a question reads them (taps.py)


@dataclass(slots=True, eq=False)
class Register(Command):
    name: str
    spec: QuestionSpec
    gate: Gate  # built in the caller's thread (tokenizer work)
    prompt_ids: list[int]


@dataclass(slots=True, eq=False)
class Unregister(Command):
    name: str
    question_id: str


@dataclass(slots=True, eq=False)
class Ask(Command):
    ask_id: int
    name: str
    question: str
    prompt_ids: list[int]
    max_tokens: int | None
    stop: list[str]
    min_version: int
    keep_logits: bool
    standing_id: str | None  # a standing question's id: fast / entry path
    choices: Gate | None = None  # the gate of a choice question asked cold
    on_text: Callable[[str], None] | None = None
    t_start: float = 0.0
    deadline_s: float | None = None  # seconds from t_start after which it is dropped (AskTimeout)


@dataclass(slots=True, eq=False)
class Cancel(Command):
    ask_id: int


@dataclass(slots=True, eq=False)
class ExportSession(Command):
    """Copy a session's cells and bookkeeping (`state.SessionState`); the session keeps running.
    only_ready: resolve to None instead of failing when it is not open or its prefix is not computed."""

    name: str
    only_ready: bool = False


@dataclass(slots=True, eq=False)
class EvictState(Command):
    """Export an idle session and drop it (its cells are freed); `SessionError` while it has work in flight."""

    name: str


@dataclass(slots=True, eq=False)
class ImportSession(Command):
    """Open `name` from an exported state: reserve its budget, copy the cells back, register its questions."""

    state: SessionState
    name: str
    gates: list[tuple[QuestionSpec, Gate, list[int]]]  # (spec, gate, prompt ids) per question, built by the caller


@dataclass(slots=True, eq=False)
class CanAdmit(Command):
    """Whether a session reserving `cells` would be admitted now (the core's own admission rule)."""

    cells: int


@dataclass(slots=True, eq=False)
class Call(Command):
    """Run fn(core) on the core thread between steps: tests and benches only, never production code."""

    fn: Callable[[EngineCore], Any]


@dataclass(slots=True, eq=False)
class WaitIdle(Command):
    pass


@dataclass(slots=True, eq=False)
class SwapLearned(Command):
    """A live fit finished on the learning worker (engine/standing/learning.py): its head takes over now."""


@dataclass(slots=True, eq=False)
class Stop(Command):
    pass
