"""Context budget: a session at its max_context is compacted in the background, never stopped."""

from __future__ import annotations

import pytest

from streamllm.config import QuestionSpec
from streamllm.engine import Engine

LINES = [f"12:{i // 60:02d}:{i % 60:02d} BTCUSDT C 640{i % 97:02d}.5 v{i % 13}.5 n{i % 7}" for i in range(400)]


@pytest.fixture()
def engine(tiny_model):
    eng = Engine(tiny_model, max_cells=16384, block_size=8, max_context=640, compact_at=0.75, retain=0.5,
                 chunk_tokens=32, step_tokens=64)
    yield eng
    eng.shutdown()


def retained_lines(engine, name, pushed):
    """The suffix of `pushed` whose tokens the (compacted) session holds after its prefix."""
    s = engine.sessions[name]
    data = s.token_ids[s.prefix_len :]
    for k in range(1, len(pushed) + 1):
        ids = [t for line in engine.layout.lines_ids(pushed[-k:]) for t in line]
        if ids == data:
            return pushed[-k:]
    raise AssertionError("the session's data is not a suffix of what was pushed")


def test_a_long_stream_is_compacted_and_answers_match_a_fresh_session(engine):
    engine.open_session("s")
    engine.register("s", QuestionSpec("q", "Next?", threshold=0.0, max_tokens=1))
    pushed = []
    for i in range(0, 120, 3):
        batch = LINES[i : i + 3]
        engine.push("s", batch)  # never refused: compaction keeps room
        pushed += batch
        engine.wait_idle()
    s = engine.sessions["s"]
    assert s.compactions >= 1 and s.num_tokens <= s.max_context
    assert engine.session_info("s").data_version == 40  # versions keep counting across swaps
    kept = retained_lines(engine, "s", pushed)
    assert 0 < len(kept) < len(pushed)
    engine.open_session("fresh")
    engine.push("fresh", kept)
    engine.wait_idle()
    assert engine.sessions["fresh"].token_ids == s.token_ids
    compacted = engine.ask("s", "Trend?", max_tokens=3, return_logits=True)
    fresh = engine.ask("fresh", "Trend?", max_tokens=3, return_logits=True)
    assert compacted.tokens == fresh.tokens
    assert (compacted.logits - fresh.logits).abs().max().item() <= 1e-4
    assert engine.ask("s", "q").data_version == 40  # standing questions re-positioned on the new blocks
    engine.check_integrity()


def test_questions_are_answered_while_a_compaction_runs(engine):
    engine.open_session("s")
    pushed = 0
    answers = []
    while engine.stats()["compactions_running"] == 0:
        engine.push("s", LINES[pushed : pushed + 2])
        pushed += 2
        engine.wait_idle(0)  # do not wait: let compaction start while we ask
        answers.append(engine.ask("s", "Trend?", max_tokens=2, timeout=30))
    answers.append(engine.ask("s", "Trend?", max_tokens=2, timeout=30))
    engine.wait_idle()
    assert engine.sessions["s"].compactions >= 1
    assert [a.data_version for a in answers] == sorted(a.data_version for a in answers)
    engine.check_integrity()


def test_closing_a_session_mid_compaction_frees_everything(engine):
    free = engine.store.manager.num_free_blocks
    engine.open_session("s")
    i = 0
    while engine.stats()["compactions_running"] == 0:
        engine.push("s", LINES[i : i + 4])
        i += 4
    engine.close_session("s")
    engine.wait_idle()
    assert engine.store.manager.num_free_blocks == free
    engine.check_integrity()
