"""Every ask has a deadline (`EngineConfig.ask_timeout_s`, or its own `deadline_s`): past it the ask is
dropped, its cells freed, and its future fails with `AskTimeout` saying how long it waited and where.
And an ask decodes at most MAX_ASK_TOKENS, whatever it asks for or inherits from a standing question."""

from __future__ import annotations

import threading
import time

import pytest

from streamllm.config import QuestionSpec
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.outputs import AskTimeout

LINES = [f"12:00:{i:02d} BTCUSDT C 640{i:02d}.2" for i in range(40)]
WAIT_S = 30  # a hang, not a speed limit


def _engine(tiny_model, **config) -> Engine:
    config = EngineConfig(max_cells=4096, block_size=8, max_context=2048, check_integrity_every_step=True,
                          scheduler=SchedulerConfig(chunk_tokens=32, step_tokens=64), **config)
    return Engine(tiny_model, config)


class _CoreHeld:
    """Holds the core thread between two steps (a test-only `call`), so what is submitted meanwhile
    is applied in one go once it lets go."""

    def __init__(self, engine: Engine) -> None:
        self.release, held = threading.Event(), threading.Event()

        def hold(_core) -> None:
            held.set()
            self.release.wait(WAIT_S)

        self.thread = threading.Thread(target=engine.call, args=(hold,), daemon=True)
        self.thread.start()
        assert held.wait(WAIT_S)

    def __enter__(self) -> _CoreHeld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(WAIT_S)


def test_an_ask_waiting_for_its_data_times_out_and_says_where_it_was(tiny_model):
    with _engine(tiny_model, ask_timeout_s=0.05) as eng:  # the engine's default deadline, no override
        eng.open_session("s")
        eng.push("s", LINES[:2])
        assert eng.wait_idle(WAIT_S)
        free = eng.store.manager.num_free_blocks
        with _CoreHeld(eng):
            version = eng.push("s", LINES).data_version  # acked, not ingested while the core is held
            future = eng.submit_ask("s", "Trend?", max_tokens=4, min_version=version)
            time.sleep(0.1)  # past its deadline before the core sees it
        with pytest.raises(AskTimeout, match=r"deadline of 0\.05 s \(waited \d+\.\d s\) while waiting for data "
                                             rf"version {version} \(the session is at {version - 1}"):
            future.result(WAIT_S)
        assert eng.wait_idle(WAIT_S)
        assert eng.stats()["questions_timed_out"] == 1
        assert eng.store.manager.num_free_blocks == free  # the data is in the session's reservation
        assert eng.ask("s", "Trend?", max_tokens=2, min_version=version, deadline_s=WAIT_S).data_version == version
        eng.check_integrity()


def test_a_decoding_ask_times_out_and_frees_its_cells(tiny_model):
    with _engine(tiny_model) as eng:  # the default deadline (120 s), overridden by this ask's own
        eng.open_session("s")
        eng.push("s", LINES[:5])
        assert eng.wait_idle(WAIT_S)
        free = eng.store.manager.num_free_blocks
        pieces: list[str] = []

        def slow_reader(piece: str) -> None:  # on the core thread: holds it past the deadline once
            pieces.append(piece)
            if len(pieces) == 1:
                time.sleep(0.7)

        future = eng.submit_ask("s", "Trend?", max_tokens=60, on_text=slow_reader, deadline_s=0.5)
        with pytest.raises(AskTimeout, match=r"deadline of 0\.5 s .* while decoding \(\d+ of 60 tokens\); it was dropped"):
            future.result(WAIT_S)
        assert pieces, "the ask decoded before its deadline"
        assert eng.wait_idle(WAIT_S)
        assert eng.store.manager.num_free_blocks == free
        eng.check_integrity()


def test_an_ask_within_its_deadline_is_answered_as_without_one(tiny_model):
    with _engine(tiny_model, ask_timeout_s=None) as eng:
        eng.open_session("s")
        eng.push("s", LINES[:5])
        plain = eng.ask("s", "Trend?", max_tokens=5, min_version=1)
        bounded = eng.ask("s", "Trend?", max_tokens=5, min_version=1, deadline_s=WAIT_S)
        assert bounded.tokens == plain.tokens
        assert eng.stats()["questions_timed_out"] == 0


def test_deadline_settings_are_checked(tiny_model):
    assert EngineConfig(ask_timeout_s=0).ask_timeout_s is None
    assert EngineConfig().ask_timeout_s == 120
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match="ask_timeout_s"):
            EngineConfig(ask_timeout_s=bad)
    with _engine(tiny_model) as eng:
        eng.open_session("s")
        for bad in (0, -1.0, "1"):
            with pytest.raises(ValueError, match="deadline_s"):
                eng.submit_ask("s", "Trend?", deadline_s=bad)


def test_max_tokens_is_capped_even_when_inherited_from_a_standing_question(tiny_model, monkeypatch):
    monkeypatch.setattr("streamllm.engine.answers.MAX_ASK_TOKENS", 3)
    with _engine(tiny_model) as eng:
        eng.open_session("s")
        eng.push("s", LINES[:5])
        eng.register("s", QuestionSpec(id="why", text="Why?", max_tokens=40, push=False))
        assert eng.wait_idle(WAIT_S)
        eos = eng.layout.eos_ids
        for answer in (eng.ask("s", "Why?", min_version=1),  # inherits the spec's 40
                       eng.ask("s", "Trend?", max_tokens=40, min_version=1)):
            assert len(answer.tokens) <= 3
            assert answer.finish_reason == "length" or answer.tokens[-1:] and answer.tokens[-1] in eos
