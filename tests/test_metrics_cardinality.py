"""/metrics stays a bounded size at many sessions: per-session question series up to a cap,
per-question aggregates (min, mean, max) past it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from streamllm.service.metrics import SESSION_SERIES_CAP, _CalibrationCollector


def figures(sessions: int) -> dict[str, dict[str, dict]]:
    """`engine.calibration()`'s shape: session -> question -> figures (accuracy i / sessions)."""
    return {f"s{i}": {"trend": {"accuracy": i / sessions, "samples": 10, "history": [(0, 0.5, 0.4)]},
                      "spike": {"accuracy": 1.0}} for i in range(sessions)}


def scrape(sessions: int, cap: int = SESSION_SERIES_CAP) -> str:
    registry = CollectorRegistry()
    registry.register(_CalibrationCollector(lambda: figures(sessions), max_sessions=cap))
    return generate_latest(registry).decode()


def samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_per_session_series_under_the_cap():
    text = scrape(3, cap=5)
    assert 'streamllm_question_accuracy{question="trend",session="s2"}' in text
    assert "_over_sessions" not in text


def test_aggregates_past_the_cap_keep_a_scrape_bounded():
    small, large = samples(scrape(SESSION_SERIES_CAP + 1)), samples(scrape(500))
    assert len(large) == len(small)  # the same series at 65 and 500 sessions
    text = scrape(500)
    assert 'session="' not in text
    assert 'streamllm_question_sessions{question="trend"} 500.0' in text
    assert 'streamllm_question_accuracy_over_sessions{question="trend",stat="min"} 0.0' in text
    assert 'streamllm_question_accuracy_over_sessions{question="trend",stat="max"} 0.998' in text
    assert 'streamllm_question_accuracy_over_sessions{question="spike",stat="mean"} 1.0' in text
    assert 'streamllm_question_recent_accuracy_over_sessions{question="trend",stat="mean"} 0.5' in text
    assert 'streamllm_question_samples_over_sessions{question="spike"' not in text  # no session has it
