"""A forecast's truth comes some bars after its answer: the two meet in either order and are scored
once, and nothing an answer was made from includes the bars that settle it."""

from __future__ import annotations

import pytest

from streamllm.config import parse_question
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.standing.calibration import MAX_PENDING, LiveCalibration

QUESTION = {"id": "forecast_up", "text": "Will it be higher in 2 bars?", "choices": ["up", "down"],
            "threshold": 2.0}


def test_an_answer_waits_for_its_truth_and_is_scored_once_it_comes() -> None:
    cal = LiveCalibration()
    assert cal.score(1, "up", 3.0, True, 2.0) is False  # no truth yet: waits
    assert cal.score(2, "down", 1.0, False, 2.0) is False
    assert cal.scored == 0 and set(cal.answers) == {1, 2}
    assert cal.expect(1, "up") is True and cal.scored == 1 and cal.correct == 1
    assert cal.expect(2, "up") is True and cal.scored == 2 and cal.correct == 1
    assert cal.expect(2, "up") is False and cal.scored == 2  # once: the answer was used up
    assert cal.answers == {}


def test_a_truth_for_a_version_never_answered_scores_nothing() -> None:
    cal = LiveCalibration()
    cal.score(5, "up", 3.0, True, 2.0)
    assert cal.expect(4, "up") is False and 4 not in cal.truths  # entries skipped version 4 under lag
    assert cal.expect(6, "down") is False and cal.truths == {6: "down"}  # a present truth, before its answer
    assert cal.score(6, "down", 3.0, True, 2.0) is True and cal.scored == 1 and cal.correct == 1


def test_answers_waiting_for_truths_are_bounded() -> None:
    cal = LiveCalibration()
    for version in range(1, MAX_PENDING + 50):
        cal.score(version, "up", 1.0, False, 2.0)
    assert len(cal.answers) == MAX_PENDING and min(cal.answers) == 50  # the oldest forgotten


def test_late_truths_score_the_answers_made_at_earlier_versions(tiny_model) -> None:
    with Engine(tiny_model, EngineConfig(max_cells=4096, max_context=1024)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        answers = {}
        for i in range(4):
            ack = engine.push("s", [f"00:0{i} {100 + i}.5 +{i} v1"])
            assert engine.wait_idle(timeout=60)
            (answer,) = engine.standing("s")
            answers[ack.data_version] = answer.text
        assert "s" not in engine.calibration()  # no truth yet: nothing judged
        wrong = {"up": "down", "down": "up"}
        engine.push("s", ["00:04 105.5 +1 v1"], late_truths={"forecast_up": {1: answers[1], 2: wrong[answers[2]]}})
        assert engine.wait_idle(timeout=60)
        cal = engine.calibration()["s"]["forecast_up"]
        assert cal["scored"] == 2 and cal["accuracy"] == 0.5
        # Sent again (a feed retrying), the same versions are not judged twice.
        engine.push("s", ["00:05 106.5 +1 v1"], late_truths={"forecast_up": {1: answers[1]}})
        assert engine.wait_idle(timeout=60)
        assert engine.calibration()["s"]["forecast_up"]["scored"] == 2


@pytest.mark.parametrize(("late", "message"), [
    ({"forecast_up": {0: "up"}}, r"version 0 is not one already pushed \(1\.\.1\)"),
    ({"forecast_up": {2: "up"}}, r"version 2 is not one already pushed \(1\.\.1\)"),
    ({"forecast_up": {"1": "up"}}, r"version '1' is not one already pushed"),
    ({"forecast_up": {1: "sideways"}}, r"'sideways' is not one of its choices"),
    ({"forecast_up": "up"}, r"late_truths must map question ids to \{data version: choice\}"),
])
def test_late_truths_are_checked_before_the_push_is_taken(tiny_model, late, message) -> None:
    with Engine(tiny_model, EngineConfig(max_cells=2048, max_context=1024)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        engine.push("s", ["00:00 100.5 +1 v1"])
        with pytest.raises(ValueError, match=message):
            engine.push("s", ["00:01 101.5 +1 v1"], late_truths=late)
        assert engine.session_info("s").pushed_version == 1  # nothing of the refused push was taken


def test_late_truths_are_logged_and_a_recovery_pushes_them_again(tiny_model, tmp_path, caplog) -> None:
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.recovery import recover

    log_dir = tmp_path / "log"
    with Engine(tiny_model, EngineConfig(max_cells=4096, max_context=1024), ingest_log=IngestLog(log_dir)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        for i in range(4):
            late = {"late_truths": {"forecast_up": {i - 2: "up"}}} if i >= 3 else {}
            engine.push("s", [f"00:0{i} {100 + i}.5 +1 v1"], **late)
            assert engine.wait_idle(timeout=60)
        assert engine.calibration()["s"]["forecast_up"]["scored"] == 1
    with Engine(tiny_model, EngineConfig(max_cells=4096, max_context=1024)) as again:
        report = recover(again, IngestLog(log_dir))
        assert not report.failed and report.batches == 4
        assert again.wait_idle(timeout=60)
    assert "truths not applied" not in caplog.text  # versions read back as the numbers they were


def _replay_forecasts(bars: list, batches: list[int]) -> list[tuple[dict | None, dict | None]]:
    """Feed `bars` through an attachment in pushes of `batches[i]` bars; returns (truths, late_truths) per push."""
    from streamllm.engine.outputs import PushAck
    from streamllm.feeding.attach import Attachment, AttachSpec

    sent: list[tuple[dict | None, dict | None]] = []

    class Sink:  # what the engine's push returns: the version the batch becomes
        def push(self, session, lines, truths=None, late_truths=None):
            sent.append((truths, late_truths))
            return PushAck(session, len(sent), 0, len(lines))

        def backlog(self, session):
            return 0

    questions = (parse_question({"id": "forecast_up2", "text": "Higher in 2 bars?", "choices": ["yes", "no"],
                                 "label": "close[+2] > close"}),
                 parse_question({"id": "up", "text": "Did it rise?", "choices": ["yes", "no"], "label": "trend_up(n=1)"}))
    att = Attachment(Sink(), AttachSpec("s", bar_s=60), questions=questions)
    at = 0
    for size in batches:
        for bar in bars[at: at + size]:
            att.offer(bar)
        at += size
        assert att.flush() is not None
    return sent


def test_an_attachment_settles_each_forecast_once_from_bars_it_has_seen() -> None:
    from feeds.events import Bar

    def bar(i: int, close: float) -> Bar:
        return Bar("v", "X", (i + 1) * 60 * 10**9, 0, i * 60 * 10**9, 60 * 10**9, close - 0.5, close + 1, close - 1,
                   close, 1.0, 1, 0.5, 0.5, close)

    closes = [100, 101, 99, 102, 103, 103, 101, 104, 100, 105, 106, 104]
    bars = [bar(i, c) for i, c in enumerate(closes)]
    batches = [1, 1, 2, 1, 3, 1, 1, 2]  # pushes of one bar and of several
    sent = _replay_forecasts(bars, batches)
    newest = [sum(batches[: n + 1]) - 1 for n in range(len(batches))]  # the newest bar of each push
    expected: dict[int, str] = {}  # version -> the forecast's truth: bar b's close against bar b + 2's
    for version, b in enumerate(newest, start=1):
        if b + 2 < len(closes):
            expected[version] = "yes" if closes[b + 2] > closes[b] else "no"
    got: dict[int, str] = {}
    for n, (truths, late) in enumerate(sent):
        assert truths is None or "forecast_up2" not in truths  # never judged on the bars of its own push
        for version, choice in ((late or {}).get("forecast_up2") or {}).items():
            assert version not in got  # settled once
            assert newest[version - 1] + 2 <= newest[n]  # by a push holding its bar two bars on
            got[version] = choice
    assert got == expected
    # Bars after a push cannot change what it sent: the same pushes over a different future.
    changed = bars[:7] + [bar(i, 50.0 + i) for i in range(7, len(closes))]
    again = _replay_forecasts(changed, batches)
    upto = next(n for n, b in enumerate(newest) if b >= 6)  # pushes whose bars are all among the first 7
    assert again[: upto + 1] == sent[: upto + 1]
