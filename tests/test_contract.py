"""One conformance suite for every `EngineClient`: what the service, feeds, durability and
scale-out may rely on, whichever engine sits behind them.

Each implementation is built once per module (the tiny random Llama, fp32) and every test
uses its own session names, so the suite runs in any order on a shared engine.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from streamllm.config import parse_question
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.client import EngineClient, EngineHealth
from streamllm.engine.outputs import (
    Answer,
    AskTimeout,
    PushAck,
    SessionError,
    SessionInfo,
    StandingAnswer,
)
from streamllm.engine.prompt import DEFAULT_SYSTEM

CONFIG = EngineConfig(max_cells=32768, block_size=8, max_context=2048, scheduler=SchedulerConfig(chunk_tokens=64))
QUESTION = {"id": "up", "text": "Is the price going up?", "choices": ["yes", "no"]}
TIMEOUT = 60
_names = itertools.count()


def lines(batch: int, n: int = 2) -> list[str]:
    return [f"12:{batch // 60:02d}:{batch % 60:02d} 640{i}{batch % 10}.5 +1.{i} v{batch}" for i in range(n)]


def until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def build_engine(tiny_model, tmp_path_factory) -> Iterator[EngineClient]:
    with Engine(tiny_model, CONFIG, dtype="float32") as engine:
        yield engine


def build_resident(tiny_model, tmp_path_factory) -> Iterator[EngineClient]:
    spill = tmp_path_factory.mktemp("contract-spill")
    with ResidentEngine(Engine(tiny_model, CONFIG, dtype="float32"), spill, auto_evict=True) as engine:
        yield engine


def build_cluster(tiny_model, tmp_path_factory) -> Iterator[EngineClient]:
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'streamllm[ray]' (make test installs it)")
    from streamllm.scale.cluster import ClusterEngine

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cluster = ClusterEngine("tiny", CONFIG, dtype="float32", replicas=1, log_dir=tmp_path_factory.mktemp("contract-cluster"),
                                call_timeout_s=20, poll_s=0.2)
        try:
            yield cluster
        finally:
            cluster.shutdown()
    finally:
        ray.shutdown()


BUILDERS = {"engine": build_engine, "resident": build_resident, "cluster": build_cluster}


@pytest.fixture(scope="module", params=list(BUILDERS))
def engine(request, tiny_model, tmp_path_factory) -> Iterator[EngineClient]:
    yield from BUILDERS[request.param](tiny_model, tmp_path_factory)


@pytest.fixture
def name(engine) -> Iterator[str]:
    """A fresh open session, closed after the test (when the test left it open)."""
    session = f"s{next(_names)}"
    engine.open_session(session, max_context=1024)
    yield session
    if session in {info.name for info in engine.list_sessions()}:
        engine.close_session(session)


def test_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)
    assert isinstance(engine.model_name, str) and engine.model_name
    short, default = engine.prefix_tokens("You watch prices."), engine.prefix_tokens()
    assert 0 < short < default == engine.prefix_tokens(DEFAULT_SYSTEM)


def test_the_tenant_is_told_at_open_and_reported(engine):
    session = f"s{next(_names)}"
    assert engine.open_session(session, max_context=512, tenant="acme").tenant == "acme"
    try:
        assert engine.session_info(session).tenant == "acme"
        assert {i.name: i.tenant for i in engine.list_sessions()}[session] == "acme"
    finally:
        engine.close_session(session)


def test_session_lifecycle(engine):
    session = f"s{next(_names)}"
    info = engine.open_session(session, "You watch prices.", max_context=512)
    assert isinstance(info, SessionInfo)
    assert (info.name, info.data_version, info.max_context) == (session, 0, 512)
    assert info.prefix_tokens == engine.prefix_tokens("You watch prices.")
    assert session in {i.name for i in engine.list_sessions()}
    with pytest.raises(SessionError):
        engine.open_session(session)
    assert info.tenant == ""  # none told
    engine.close_session(session)
    assert session not in {i.name for i in engine.list_sessions()}
    for call in (lambda: engine.session_info(session), lambda: engine.close_session(session),
                 lambda: engine.push(session, lines(0)), lambda: engine.standing(session)):
        with pytest.raises(KeyError):  # SessionError is a KeyError: "unknown" the same way everywhere
            call()


def test_push_acks_consecutive_versions(engine, name):
    acks = [engine.push(name, lines(0)), engine.push(name, lines(1), source=None, truths=None)]
    assert all(isinstance(a, PushAck) for a in acks)
    assert [a.data_version for a in acks] == [1, 2]
    assert acks[1].lines == 2
    assert engine.session_info(name).pushed_version == 2
    assert engine.wait_idle(TIMEOUT)
    info = engine.session_info(name)
    assert (info.data_version, info.lines_ingested) == (2, 4)
    assert engine.backlog(name) == 0
    with pytest.raises(ValueError):
        engine.push(name, [])


def test_standing_question_on_every_path(engine, name):
    spec = parse_question(QUESTION)
    engine.register(name, spec)
    engine.push(name, lines(2))
    assert engine.wait_idle(TIMEOUT)
    assert [q.id for q in engine.standing_questions(name)] == ["up"]
    until(lambda: any(a.data_version == 1 for a in engine.standing(name)))
    standing = engine.standing(name)[0]
    assert isinstance(standing, StandingAnswer)
    assert standing.text in QUESTION["choices"] and standing.question_id == "up"
    answer = engine.ask(name, "up", timeout=TIMEOUT)  # by id: from the pre-positioned entry
    assert isinstance(answer, Answer)
    assert answer.path in ("fast", "entry") and answer.text == standing.text
    assert answer.data_version == 1
    by_text = engine.ask(name, QUESTION["text"], timeout=TIMEOUT)  # by text: the same question
    assert by_text.text == answer.text and by_text.path in ("fast", "entry")
    engine.unregister(name, "up")
    assert engine.standing_questions(name) == []
    assert isinstance(engine.calibration(), dict)


def test_ad_hoc_ask_streams_its_text(engine, name):
    engine.push(name, lines(3))
    pieces: list[str] = []
    lock = threading.Lock()

    def on_text(piece: str) -> None:
        with lock:
            pieces.append(piece)

    answer = engine.submit_ask(name, "Describe the last line.", max_tokens=4, on_text=on_text,
                               min_version=1).result(TIMEOUT)
    assert answer.path == "cold" and answer.data_version == 1
    assert 1 <= len(answer.tokens) <= 4
    until(lambda: "".join(pieces) == answer.text)
    with pytest.raises(ValueError):  # a version the session has not been pushed
        engine.ask(name, "Anything?", min_version=99, timeout=TIMEOUT)


def test_ask_async_and_cancel(engine, name):
    engine.push(name, lines(4))

    async def run() -> tuple[Answer, bool]:
        answer = await engine.ask_async(name, "Is volume rising?", max_tokens=2)
        long = engine.submit_ask(name, "Tell a long story about the market.", max_tokens=400)
        return answer, long.cancel() or long.done()

    answer, cancelled = asyncio.run(run())
    assert answer.path == "cold" and len(answer.tokens) <= 2
    assert cancelled
    assert engine.wait_idle(TIMEOUT)  # the cancelled question holds nothing
    assert engine.health().alive


def test_an_ask_has_a_deadline(engine, name):
    engine.push(name, lines(7))
    answer = engine.ask(name, "Is volume rising?", max_tokens=2, min_version=1, deadline_s=TIMEOUT, timeout=TIMEOUT)
    assert answer.data_version == 1
    late = engine.submit_ask(name, "Is volume falling?", max_tokens=2, deadline_s=1e-6)  # past it on arrival
    with pytest.raises(AskTimeout, match="deadline"):
        late.result(TIMEOUT)
    assert engine.wait_idle(TIMEOUT)  # the dropped question holds nothing


def test_subscriptions_hear_data_and_standing_changes(engine, name):
    heard_data: list[tuple[str, int]] = []
    heard_standing: list[StandingAnswer] = []
    data_sub = engine.subscribe_data(name, lambda session, version: heard_data.append((session, version)))
    standing_sub = engine.subscribe(name, heard_standing.append)
    # Subscribed first: a standing answer is published when it changes, and its first answer (from
    # the question's registration on) is the change every subscriber must hear.
    engine.register(name, parse_question(QUESTION))
    engine.push(name, lines(5))
    engine.push(name, lines(6))
    until(lambda: (name, 2) in heard_data)
    until(lambda: any(a.question_id == "up" for a in heard_standing))
    data_sub.close()
    standing_sub.close()
    with pytest.raises(KeyError):
        engine.subscribe(f"missing-{next(_names)}", heard_standing.append)


def test_stats_and_health(engine, name):
    stats = engine.stats()
    assert stats["model"] == engine.model_name
    assert all(isinstance(v, int | float) for k, v in stats.items() if k not in ("model", "device", "dtype", "adapter"))
    health = engine.health()
    assert isinstance(health, EngineHealth)
    assert health.alive and health.failure is None and health.failed_steps == 0


def test_an_evicted_session_keeps_the_contract(tiny_model, tmp_path):
    """ResidentEngine's eviction is invisible through the contract: listed as it was, restored on use."""
    with ResidentEngine(Engine(tiny_model, CONFIG, dtype="float32"), tmp_path) as engine:
        engine.open_session("idle", max_context=512)
        engine.register("idle", parse_question(QUESTION))
        engine.push("idle", lines(7))
        assert engine.wait_idle(TIMEOUT)
        before = engine.session_info("idle")
        engine.evict_session("idle")
        assert engine.session_info("idle") == before
        assert "idle" in {i.name for i in engine.list_sessions()}
        assert [q.id for q in engine.standing_questions("idle")] == ["up"]
        assert engine.push("idle", lines(8)).data_version == 2  # restored on use
        assert engine.ask("idle", "up", timeout=TIMEOUT, min_version=2).data_version == 2
