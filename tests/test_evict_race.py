"""A push or ask that races an eviction is never lost: it waits for the eviction, then restores.

Found by bench/stress.py: the core closed the session (evict) before the facade knew it was
evicted, so a push acked in that window was dropped in the core ("a push the engine acked
failed in the core: no session named ..."), and an ask failed with "no session named".
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.commands import Call

LINES = [f"2024-01-01 00:00:0{i} 100.{i} +0.1 h+0.2 l-0.1 v1.0 n3 b50" for i in range(8)]


@pytest.fixture()
def engine(tiny_model, tmp_path):
    eng = ResidentEngine(Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512)), tmp_path / "spill")
    yield eng
    eng.shutdown()


def _evict_behind_a_blocked_core(engine):
    """Block the core, queue an eviction behind the block; returns (release, evicter thread)."""
    release, blocked = threading.Event(), threading.Event()
    core = engine.engine.core
    core.submit(Call(lambda core: (blocked.set(), release.wait(10))))
    assert blocked.wait(10)
    evicter = threading.Thread(target=engine.evict_session, args=("s",))
    evicter.start()
    deadline = time.monotonic() + 10
    while core._inbox.qsize() == 0:  # the eviction is queued in the core
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return release, evicter


def test_a_push_acked_during_an_eviction_is_ingested(engine, caplog):
    engine.open_session("s")
    engine.push("s", LINES[:2])
    engine.wait_idle()
    release, evicter = _evict_behind_a_blocked_core(engine)
    acks = []
    pusher = threading.Thread(target=lambda: acks.append(engine.push("s", LINES[2:4])))
    pusher.start()
    time.sleep(0.1)
    release.set()
    evicter.join(10)
    pusher.join(10)
    assert acks and acks[0].data_version == 2
    with caplog.at_level(logging.ERROR, logger="streamllm.engine"):
        engine.push("s", LINES[4:5])  # restores it if it is evicted
        engine.wait_idle()
    assert not [r for r in caplog.records if "acked failed" in r.getMessage()]
    info = engine.session_info("s")
    assert info.data_version == 3 and info.lines_ingested == 5  # nothing acked was lost
    engine.engine.check_integrity()


def test_an_ask_during_an_eviction_restores_the_session(engine):
    engine.open_session("s")
    engine.push("s", LINES[:2])
    engine.wait_idle()
    release, evicter = _evict_behind_a_blocked_core(engine)
    answers, errors = [], []

    def ask():
        try:
            answers.append(engine.ask("s", "Trend?", max_tokens=1, timeout=20))
        except Exception as exc:
            errors.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.1)
    release.set()
    evicter.join(10)
    asker.join(20)
    assert errors == [] and answers[0].data_version == 1
