"""The engine survives a seeded storm of threads and asyncio tasks (bench/stress.py, ~20 s).

Pushes, asks (half the async ones cancelled at random moments), register / unregister,
close + reopen and evict against several sessions, with a pusher compacting two small
sessions again and again and `check_integrity()` after every step. Nothing may die, hang,
leak, refuse a push to an open session, or fail with an error other than the expected
kinds (session closed, cancelled, evict refused while busy, question (not) registered).
"""

from __future__ import annotations

from bench.stress import StressConfig, run_stress, unexpected_errors


def test_engine_survives_a_storm_of_concurrent_callers(tiny_model):
    metrics, errors = run_stress(StressConfig(seconds=20, seed=3, call_timeout_s=30), model=tiny_model)
    assert metrics["stress_engine_deaths"] == 0
    assert metrics["stress_hung_callers"] == 0, errors
    assert metrics["stress_failed_steps"] == 0
    assert metrics["stress_pushes_refused"] == 0, errors
    assert metrics["stress_integrity_failures"] == 0, errors
    assert unexpected_errors(errors) == {}
    assert metrics["stress_unexpected_errors"] == 0
    assert metrics["stress_acked_pushes_lost"] == 0, errors  # an acked push racing an eviction was dropped
    assert metrics["stress_engine_errors_logged"] == 0, errors
    assert metrics["stress_compactions"] > 0  # the pusher really drove the hot sessions past their budget
    # the storm really happened: every kind of operation succeeded some of the time
    for key in ("stress_asks_ok", "stress_asks_cancelled", "stress_pushes_ok", "stress_registers_ok",
                "stress_unregisters_ok", "stress_reopens", "stress_evictions"):
        assert metrics[key] > 0, (key, metrics)


def test_error_kinds_are_classified():
    from bench.stress import expected, normalize
    from streamllm.engine.outputs import EngineStopped, SessionError

    assert expected(normalize(SessionError("session 'c1' was closed")))
    assert not expected(normalize(EngineStopped("the engine is stopped after an internal error: boom")))
    assert not expected(normalize(AssertionError("core version 3, acked 4")))
