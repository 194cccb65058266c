"""`EngineClient`: the one contract between an engine and everything that uses it.

The service, the feed path, durability and scale-out know an engine only through this
class. Three implementations pass one conformance suite (tests/test_contract.py):

    Engine           one core thread on one model, in this process   (engine/api.py)
    ResidentEngine   an Engine whose idle sessions go to disk         (durability/resident.py)
    ClusterEngine    engines as Ray actors behind one front door      (scale/cluster.py)

What a front door offers beyond the contract is a capability of its own, passed to the
layer that needs it by whoever built the engine (`cli/serve.py`), never guessed from
the engine with `hasattr`: `ReplicaControl` (scale-out) here, eviction on
`ResidentEngine` itself.

Promises every implementation keeps:
- a session name is either open (listed, answering) or unknown (`SessionError`, a KeyError);
- `push` returns at once with the data_version the batch becomes; versions of one session
  are consecutive and follow the order pushes were accepted;
- an answer never comes from data older than `min_version`, and a standing question's
  answer is the same whichever path produced it (fast, entry or cold);
- callbacks given to `subscribe` run on an engine thread and must return quickly;
- cancelling the future of `submit_ask` (or the task of `ask_async`) frees what the
  question held.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from streamllm.config import QuestionSpec
from streamllm.engine.outputs import Answer, PushAck, SessionInfo, StandingAnswer
from streamllm.engine.prompt import DEFAULT_SYSTEM
from streamllm.engine.subscriptions import Subscription

__all__ = ["EngineClient", "EngineHealth", "ReplicaControl"]

TextCallback = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Whether the engine can still serve, for /health (a dead core thread is not `ok`)."""

    alive: bool  # every core thread is running
    failure: str | None  # why a core stopped, when one did
    failed_steps: int  # steps that raised and were failed back to their callers
    log_failure: str | None = None  # why the ingest log stopped writing (pushes are refused), when it did
    failing_in_a_row: int = 0  # the latest steps that all failed (0 once a step succeeds): a broken forward
    last_step_error: str | None = None  # what the latest failed step raised


class EngineClient(abc.ABC):
    """Sessions, data, standing questions and asks: all a caller may do with an engine."""

    # -- identity -----------------------------------------------------------------
    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The model every session of this engine runs on."""

    @abc.abstractmethod
    def prefix_tokens(self, system: str = DEFAULT_SYSTEM) -> int:
        """Tokens a session's frozen prefix takes with this system prompt (sizing `max_context`)."""

    # -- sessions -----------------------------------------------------------------
    @abc.abstractmethod
    def open_session(self, name: str, system: str = DEFAULT_SYSTEM, *,
                     max_context: int | None = None, tenant: str = "") -> SessionInfo:
        """Open a session; `AdmissionError` when its cells cannot be had, `SessionError` if open.

        name: the engine's key for the session, opaque to the engine. tenant: who it belongs to,
        kept with the session (ingest log, snapshots, moves) and reported as `SessionInfo.tenant`;
        the scheduler is fair across tenants. The engine never derives a tenant from a name."""

    @abc.abstractmethod
    def close_session(self, name: str) -> None:
        """Close a session and free everything it held; its subscriptions end."""

    @abc.abstractmethod
    def session_info(self, name: str) -> SessionInfo:
        """The session as of its latest published record (pushed_version is the acked one)."""

    @abc.abstractmethod
    def list_sessions(self) -> list[SessionInfo]:
        """Every open session."""

    @abc.abstractmethod
    def backlog(self, name: str) -> int:
        """Lines accepted but not yet ingested."""

    # -- data ---------------------------------------------------------------------
    @abc.abstractmethod
    def push(self, name: str, lines: list[str], *, source: tuple[str, int] | None = None,
             truths: dict[str, str] | None = None, late_truths: dict[str, dict[int, str]] | None = None) -> PushAck:
        """Accept a batch of lines; returns at once with the data_version it will become.

        source: (feed id, feed position after this batch), for exactly-once feeds with an ingest log.
        truths: question id -> the right choice as of this batch, scoring labelled questions.
        late_truths: question id -> {earlier data version: the right choice there}: a forecast's truths,
        known once this batch's bars are in (engine/standing/calibration.py)."""

    # -- standing questions -------------------------------------------------------
    @abc.abstractmethod
    def register(self, name: str, spec: QuestionSpec) -> None:
        """Make `spec` a standing question of the session (replacing one with its id)."""

    @abc.abstractmethod
    def unregister(self, name: str, question_id: str) -> None:
        """Drop a standing question; `SessionError` when the session or question is unknown."""

    @abc.abstractmethod
    def standing(self, name: str) -> list[StandingAnswer]:
        """The session's current standing answers (those computed so far)."""

    @abc.abstractmethod
    def standing_questions(self, name: str) -> list[QuestionSpec]:
        """The session's standing questions."""

    @abc.abstractmethod
    def calibration(self) -> dict[str, dict[str, dict]]:
        """Live figures of labelled standing questions: {session: {question_id: summary}}."""

    # -- asks ---------------------------------------------------------------------
    @abc.abstractmethod
    def submit_ask(self, name: str, question: str, *, max_tokens: int | None = None,
                   stop: list[str] | None = None, min_version: int | None = None,
                   return_logits: bool = False, on_text: TextCallback | None = None,
                   deadline_s: float | None = None) -> Future:
        """Ask a question; the future resolves to an `Answer`. A standing question (by id or text)
        takes the fast or entry path. on_text(piece) receives the answer's text as it is decoded.
        max_tokens: at most `MAX_ASK_TOKENS` are decoded (a standing question's own is capped too).
        deadline_s: seconds after which an unanswered question is dropped, its cells freed and its
        future failed with `AskTimeout`; None takes the engine's default (`EngineConfig.ask_timeout_s`).
        Cancelling the future cancels the question. A refused ask (unknown session, bad argument)
        raises here or fails the future (a remote engine knows only later); `ask` raises either way."""

    def ask(self, name: str, question: str, *, timeout: float | None = None, **kw: Any) -> Answer:
        """`submit_ask`, waited on."""
        return self.submit_ask(name, question, **kw).result(timeout)

    async def ask_async(self, name: str, question: str, **kw: Any) -> Answer:
        """`submit_ask` for coroutines; cancelling the task cancels the question."""
        return await asyncio.wrap_future(self.submit_ask(name, question, **kw))

    # -- events -------------------------------------------------------------------
    @abc.abstractmethod
    def subscribe(self, name: str, callback: Callable[[StandingAnswer], None]) -> Subscription:
        """callback(StandingAnswer) whenever one of the session's standing answers changes."""

    @abc.abstractmethod
    def subscribe_data(self, name: str, callback: Callable[[str, int], None]) -> Subscription:
        """callback(session, data_version) whenever a batch of the session is ingested."""

    async def watch(self, name: str, maxsize: int = 1024) -> AsyncIterator[StandingAnswer]:
        """The session's standing-answer changes as an async iterator; ends when it closes.
        A consumer slower than the engine loses the oldest changes, never blocks the engine."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StandingAnswer] = asyncio.Queue(maxsize)

        def offer(answer: StandingAnswer) -> None:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(answer)

        sub = self.subscribe(name, lambda answer: loop.call_soon_threadsafe(offer, answer))
        try:
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if sub.closed:  # the session went away
                        return
        finally:
            sub.close()

    # -- operations ---------------------------------------------------------------
    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and gauges for /health, /metrics and benchmarks (numbers, but model/device/dtype)."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """Whether the engine can still serve."""

    @abc.abstractmethod
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending (pushed data ingested, no question in flight); False on timeout."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine; pending futures fail with `EngineStopped`. Idempotent."""

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ReplicaControl(abc.ABC):
    """What a scaled-out front door offers beyond `EngineClient`: its replicas and their feeds."""

    @abc.abstractmethod
    def replica_health(self) -> list[dict[str, Any]]:
        """One entry per replica: index, state ("up", "restarting", ...), sessions, figures."""

    @abc.abstractmethod
    def feed_health(self) -> list[dict[str, Any]]:
        """The health of the feeds running inside the replicas (as FeedRunner.health)."""

    @abc.abstractmethod
    def move_session(self, name: str, to: int) -> dict[str, Any]:
        """Move a session to replica `to` (snapshot, restore there, re-point its feed)."""

    @abc.abstractmethod
    def bar_closes(self, name: str) -> tuple[list[tuple[float, float]], int]:
        """The session's recent bar closes, kept where its feed runs: (t, close) pairs, bars seen."""

    @abc.abstractmethod
    def metrics_collector(self) -> Any:
        """A prometheus_client collector of per-replica series."""
