"""The KV pool never deadlocks: when every running question is blocked on cells, the newest is
preempted (its cells freed, recomputed later) or fails with a clear `KVCapacityError`; a question
that cannot fit even alone fails. Each wait has a timeout: before preemption these hung for good."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.kv import KVCapacityError

LINES = [f"12:00:{i:02d} BTCUSDT C 640{i:02d}.2" for i in range(3)]
# ~140 tokens of the tiny model's tokenizer each: one fits the 160 cells kept for questions, two do not.
LONG = "alpha " * 20
WAIT_S = 30  # a hang, not a speed limit: preempted questions finish in well under a second


def _config(branch_cells: int = 160) -> EngineConfig:
    return EngineConfig(max_cells=128 + branch_cells, block_size=8, max_context=128, branch_cells=branch_cells,
                        scheduler=SchedulerConfig(chunk_tokens=32, step_tokens=64), check_integrity_every_step=True)


def _settled(future: Future):
    """The answer, or the KVCapacityError it failed with; a future still pending after WAIT_S is a deadlock."""
    try:
        return future.result(WAIT_S)
    except KVCapacityError as exc:
        return exc
    except FutureTimeout:
        pytest.fail(f"a question is still pending after {WAIT_S} s: the pool deadlocked")


def _open(eng: Engine) -> int:
    free = eng.store.manager.num_free_blocks
    eng.open_session("s", "You are.")
    eng.push("s", LINES)
    eng.wait_idle()
    return free


def test_two_pool_filling_questions_both_finish_and_a_third_then_completes(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=128)) as ref:
        _open(ref)
        expected = [ref.ask("s", q, max_tokens=6).tokens for q in (LONG, LONG + "beta")]
        expected_short = ref.ask("s", "Trend?", max_tokens=4).tokens

    with Engine(tiny_model, _config()) as eng:
        free = _open(eng)
        first = eng.submit_ask("s", LONG, max_tokens=6)
        second = eng.submit_ask("s", LONG + "beta", max_tokens=6)
        answers = [_settled(first), _settled(second)]
        # Each fits alone: preempted, the newer one is recomputed once the older one is done, and both
        # answer exactly as they do on a pool with room for both.
        assert [a.tokens for a in answers] == expected
        assert eng.stats()["questions_preempted"] >= 1
        third = eng.submit_ask("s", "Trend?", max_tokens=4)
        assert _settled(third).tokens == expected_short
        assert eng.wait_idle(WAIT_S)
        assert eng.stats()["questions_running"] == eng.stats()["questions_waiting"] == 0
        eng.check_integrity()
        assert eng.store.manager.num_free_blocks + eng.store.manager.blocks_for(128) == free  # only the session holds cells


def test_a_preempted_question_that_cannot_fit_alone_fails_clearly(tiny_model):
    # 104 cells for questions: a ~150-token question never fits, even alone; the short one does.
    with Engine(tiny_model, _config(branch_cells=104)) as eng:
        _open(eng)
        first = eng.submit_ask("s", LONG, max_tokens=6)
        second = eng.submit_ask("s", LONG + "beta", max_tokens=6)
        outcomes = [_settled(first), _settled(second)]
        for outcome in outcomes:
            assert isinstance(outcome, KVCapacityError)
            assert "'s'" in str(outcome) and "more cells" in str(outcome) and "free" in str(outcome)
        assert _settled(eng.submit_ask("s", "Trend?", max_tokens=4)).text is not None
        assert eng.wait_idle(WAIT_S)
        eng.check_integrity()


def test_three_pool_filling_questions_all_finish_as_on_a_roomy_pool(tiny_model):
    questions = [LONG, LONG + "beta", LONG + "gamma"]
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=128)) as ref:
        _open(ref)
        expected = [ref.ask("s", q, max_tokens=6).tokens for q in questions]
    with Engine(tiny_model, _config()) as eng:
        _open(eng)
        futures = [eng.submit_ask("s", q, max_tokens=6) for q in questions]
        # Preempted ones wait first in line, oldest first, and restart only beside room for all: none is lost.
        assert [_settled(f).tokens for f in futures] == expected
        assert eng.stats()["questions_preempted"] >= 1
        eng.check_integrity()


def test_a_short_question_is_not_held_behind_a_preempted_long_one(tiny_model):
    """Backfilling: while a preempted question waits for the pool, a short one whose whole need fits
    beside the running question starts at once, and everyone answers as on a roomy pool."""
    long_q, long_r, short = "alpha " * 28, "alpha " * 28 + "beta", "Trend?"
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=128)) as ref:
        _open(ref)
        expected = [ref.ask("s", q, max_tokens=n).tokens for q, n in ((long_q, 60), (long_r, 60), (short, 4))]
    with Engine(tiny_model, _config(branch_cells=400)) as eng:
        _open(eng)
        first, second = (eng.submit_ask("s", q, max_tokens=60) for q in (long_q, long_r))
        for _ in range(WAIT_S * 100):  # until the newer long question has been preempted
            if eng.stats()["questions_preempted"] or first.done():
                break
            time.sleep(0.01)
        assert eng.stats()["questions_preempted"] >= 1, "the two long questions must not fit together"
        quick = eng.submit_ask("s", short, max_tokens=4)
        assert _settled(quick).tokens == expected[2]
        assert len(expected[0]) == 60  # the running long question decodes all 60: it is still at it
        assert not first.done(), "the short question waited for the long ones instead of starting beside them"
        assert [_settled(first).tokens, _settled(second).tokens] == expected[:2]
        eng.check_integrity()
