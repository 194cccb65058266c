"""The public API as a state machine (hypothesis), against a plain reference model.

Random sequences of open / close / push / register / unregister / ask / cancel /
wait_idle run against the engine and against dictionaries that say what must be
true: which sessions exist, their acked versions and lines, their standing
questions. After every rule the block pool's integrity holds and the engine is alive.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamllm.config import QuestionSpec
from streamllm.engine import Engine, EngineConfig, SessionError

NAMES = ["a", "b", "t/c"]
QUESTIONS = [
    QuestionSpec("dir", "Up or down?", choices=("up", "down"), threshold=0.5, max_tokens=2),
    QuestionSpec("free", "What next?", threshold=50.0, max_tokens=3),
]


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, max_context=256, check_integrity_every_step=True))
    yield eng
    eng.shutdown()


def test_engine_api_state_machine(engine):
    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            for info in engine.list_sessions():
                engine.close_session(info.name)
            self.sessions: dict[str, dict] = {}  # name -> {"version", "lines", "questions", "opened"}
            self.pending = []  # (future, name, question, opened) of asks in flight
            self.opens = 0  # which opening of a name an ask went to (a name can close and reopen)

        @rule(name=st.sampled_from(NAMES))
        def open(self, name):
            if name in self.sessions:
                with pytest.raises(SessionError, match="already open"):
                    engine.open_session(name, "You watch bars.")
                return
            info = engine.open_session(name, "You watch bars.")
            assert info.pushed_version == 0
            self.opens += 1
            self.sessions[name] = {"version": 0, "lines": 0, "questions": set(), "opened": self.opens}

        @rule(name=st.sampled_from(NAMES))
        def close(self, name):
            if name not in self.sessions:
                with pytest.raises(SessionError):
                    engine.close_session(name)
                return
            engine.close_session(name)
            del self.sessions[name]

        @rule(name=st.sampled_from(NAMES), n=st.integers(1, 4), seed=st.integers(0, 999))
        def push(self, name, n, seed):
            lines = [f"12:{seed % 60:02d} {64000 + seed + i} +{i} v{i}" for i in range(n)]
            if name not in self.sessions:
                with pytest.raises(SessionError):
                    engine.push(name, lines)
                return
            ack = engine.push(name, lines)
            ref = self.sessions[name]
            ref["version"] += 1
            ref["lines"] += n
            assert ack.data_version == ref["version"] and ack.lines == n

        @rule(name=st.sampled_from(NAMES), q=st.sampled_from(QUESTIONS))
        def register(self, name, q):
            if name not in self.sessions:
                return
            if q.id in self.sessions[name]["questions"]:
                with pytest.raises(ValueError, match="already has"):
                    engine.register(name, q)
                return
            engine.register(name, q)
            self.sessions[name]["questions"].add(q.id)

        @rule(name=st.sampled_from(NAMES), q=st.sampled_from(QUESTIONS))
        def unregister(self, name, q):
            if name not in self.sessions:
                return
            if q.id not in self.sessions[name]["questions"]:
                with pytest.raises(KeyError):
                    engine.unregister(name, q.id)
                return
            engine.unregister(name, q.id)
            self.sessions[name]["questions"].discard(q.id)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), cancel=st.booleans())
        def ask(self, data, cancel):
            name = data.draw(st.sampled_from(sorted(self.sessions)))
            question = data.draw(st.sampled_from(["dir", "free", "What was the last close?"]))
            future = engine.submit_ask(name, question, max_tokens=2)
            if cancel:
                future.cancel()
            else:
                self.pending.append((future, name, question, self.sessions[name]["opened"]))

        @rule()
        def settle(self):
            for future, name, question, opened in self.pending:
                try:
                    answer = future.result(timeout=60)
                except SessionError:  # its session was closed meanwhile: a clear error, no hang
                    continue
                if question == "dir" and answer.path != "cold":
                    assert answer.text in ("up", "down")  # a choice question answers a choice
                if self.sessions.get(name, {}).get("opened") == opened:  # not an answer from a closed namesake
                    assert answer.data_version <= engine.session_info(name).pushed_version
            self.pending.clear()

        @rule()
        def wait_idle(self):
            assert engine.wait_idle(timeout=60)
            for name, ref in self.sessions.items():
                info = engine.session_info(name)
                assert info.pushed_version == ref["version"] == info.data_version
                assert info.lines_ingested + info.backlog_lines == ref["lines"] and info.backlog_lines == 0
                assert {q.id for q in engine.standing_questions(name)} == ref["questions"]

        @invariant()
        def alive_and_consistent(self):
            assert engine.stats()["core_alive"] == 1 and engine.stats()["failed_steps"] == 0
            assert {i.name for i in engine.list_sessions()} == set(self.sessions)

        def teardown(self):
            for future, *_ in self.pending:
                with contextlib.suppress(SessionError):  # a closed session's ask fails clearly
                    future.result(timeout=60)
            engine.check_integrity()

    EngineMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    EngineMachine.TestCase().runTest()
