"""Live calibration: answers scored against labels as they are made, `threshold = "auto:P"`.

The references: the offline risk-coverage curve (engine/standing/gate.py) for the auto threshold;
a first run of the same pushes for which answer each version gets; an independent bar
aggregation for the truths a feed attachment sends.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import urllib.request

import pytest
import torch

from feeds.bars import BarAggregator
from feeds.events import Trade
from feeds.synthetic import synthetic_events
from streamllm.config import ConfigError, parse_question
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.standing.calibration import (
    MIN_EVIDENCE,
    LiveCalibration,
    calibration_for,
    precision_floor,
)
from streamllm.engine.standing.gate import Gate
from streamllm.evaluation.scoring import risk_coverage, threshold_for_precision
from streamllm.feeding.attach import Attachment, AttachSpec
from streamllm.service.server import StreamServer

QUESTION = {"id": "trend", "text": "Is the trend up or down?", "choices": ["up", "down"], "label": "trend_up(n=3)"}
PUSHES = 44


def _lines(i: int) -> list[str]:
    return [f"00:{i % 60:02d} {100 + (i * 7) % 13}.5 +{i % 3} v{i % 5 + 1}"]


def _varied_lines(i: int) -> list[str]:
    """Lines on which the tiny random model's answer changes often (14 runs of one answer in 60)."""
    return [random.Random(2000 + i).choice(["rise", "fall", "up", "down", "flat", "x"])]


def _run(tiny_model, truths_for, threshold, lines=_lines, pushes=PUSHES, max_cells=4096):
    """Push `pushes` batches, each ingested and pre-positioned before the next; returns
    (version, standing answer text, path, gap) per version and the (still running) engine."""
    engine = Engine(tiny_model, EngineConfig(max_cells=max_cells, max_context=2048))
    engine.open_session("s")
    engine.register("s", parse_question({**QUESTION, "threshold": threshold}))
    seen = []
    for i in range(pushes):
        truths = truths_for(i)
        ack = engine.push("s", lines(i), **({"truths": truths} if truths else {}))
        assert engine.wait_idle(timeout=60)
        (answer,) = engine.standing("s")
        assert answer.data_version == ack.data_version
        seen.append((ack.data_version, answer.text, answer.path, answer.confidence))
    return seen, engine


def test_config_reads_auto_thresholds_and_needs_a_label() -> None:
    spec = parse_question({**QUESTION, "threshold": "auto:0.9"})
    assert spec.target_precision == 0.9 and math.isinf(spec.threshold) and spec.threshold_text == "auto:0.9"
    assert parse_question({**QUESTION, "threshold": spec.threshold_text}) == spec  # logs and snapshots round-trip
    with pytest.raises(ConfigError, match="auto thresholds learn from the label"):
        parse_question({"id": "q", "text": "up or down?", "choices": ["up", "down"], "threshold": "auto:0.9"})


def test_config_reads_auto_confidence_only_beside_an_auto_threshold() -> None:
    spec = parse_question({**QUESTION, "threshold": "auto:0.9", "auto_confidence": 0.9})
    assert spec.auto_confidence == 0.9 and parse_question({**QUESTION, "threshold": "auto:0.9"}).auto_confidence == 0.5
    assert parse_question(spec.to_dict()) == spec  # logs and snapshots keep it
    assert "auto_confidence" not in parse_question({**QUESTION, "threshold": "auto:0.9"}).to_dict()
    with pytest.raises(ConfigError, match=r"auto_confidence.*only with threshold"):
        parse_question({**QUESTION, "threshold": 2.0, "auto_confidence": 0.9})
    for bad in (1.0, 0.4, "high", True):
        with pytest.raises(ConfigError, match="auto_confidence"):
            parse_question({**QUESTION, "threshold": "auto:0.9", "auto_confidence": bad})


def _wilson_low_by_bisection(hits: int, n: int, z: float) -> float:
    """The reference: the smallest p the score test at z does not reject, (p_hat - p)^2 <= z^2 p (1 - p) / n,
    found by bisection below p_hat."""
    p_hat = hits / n
    lo, hi = 0.0, p_hat
    if (p_hat - lo) ** 2 <= z * z * lo * (1 - lo) / n:
        return 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if (p_hat - mid) ** 2 <= z * z * mid * (1 - mid) / n:
            hi = mid
        else:
            lo = mid
    return hi


def test_precision_floor_is_the_wilson_score_bound() -> None:
    for hits, n in [(27, 30), (30, 30), (0, 5), (450, 500), (1, 1), (88, 97)]:
        assert precision_floor(hits, n, 0.0) == hits / n  # confidence 0.5: the point estimate, exactly
        for z in (0.8416, 1.2816, 2.3263):
            assert precision_floor(hits, n, z) == pytest.approx(_wilson_low_by_bisection(hits, n, z), abs=1e-9)
            assert 0.0 <= precision_floor(hits, n, z) < hits / n or hits == 0


def test_auto_thresholds_are_each_answers_offline_curve_point_with_enough_evidence() -> None:
    rng = random.Random(7)
    cal = LiveCalibration(target=0.9, window=200, min_evidence=30, min_runs=5)
    rows = []
    truth, run = None, 0
    for version in range(1, 301):
        gap = rng.uniform(0, 4)
        if truth is None or rng.random() < 0.3:  # a label that holds for a few versions at a time
            truth = "up" if rng.random() < 0.6 else "down"
        run += bool(rows) and truth != rows[-1][3]
        right = rng.random() < min(0.99, 0.4 + gap / 5)  # confident answers are right more often
        answer = truth if right else ("down" if truth == "up" else "up")
        cal.expect(version, truth)
        assert cal.score(version, answer, gap, fired=gap >= cal.threshold_for(answer), threshold=cal.threshold)
        rows.append((gap, right, answer, truth, run))
    window = rows[-200:]
    expected = {}
    for answer in ("up", "down"):
        mine = [(g, c, r) for g, c, a, _, r in window if a == answer]
        curve = [p for p in risk_coverage([g for g, _, _ in mine], [c for _, c, _ in mine])
                 if p.coverage * len(mine) >= 30 - 1e-9 and len({r for g, _, r in mine if g >= p.threshold}) >= 5]
        point = threshold_for_precision(curve, 0.9)
        if point is not None:
            expected[answer] = point.threshold
    assert expected and cal.fit() == expected
    s = cal.summary
    assert s.samples == 200 and s.scored == 300
    assert s.accuracy == pytest.approx(sum(c for _, c, *_ in window) / 200)
    fired = [(c, f) for (_, c, f, *_) in cal.samples if f]
    assert s.coverage == pytest.approx(len(fired) / 200)
    assert s.precision == pytest.approx(sum(c for c, _ in fired) / len(fired))


def _reference_fit(cal: LiveCalibration) -> dict[str, float]:
    """The offline curve: risk_coverage per answer, points with enough fired samples from enough runs,
    the most-covering one reaching the target (its Wilson bound, at auto_confidence above 0.5)."""
    z = statistics.NormalDist().inv_cdf(cal.confidence)
    out = {}
    for answer in {a for _, _, _, a, *_ in cal.samples}:
        mine = [(g, c, r) for g, c, _, a, r, _ in cal.samples if a == answer]
        if len(mine) < cal.min_evidence:
            continue
        curve = [p for p in risk_coverage([g for g, _, _ in mine], [c for _, c, _ in mine])
                 if p.coverage * len(mine) >= cal.min_evidence - 1e-9
                 and len({r for g, _, r in mine if g >= p.threshold}) >= cal.min_runs]
        if z > 0:  # judge each point by its bound: the score test's lowest p for its hits of fired
            fired = [round(p.coverage * len(mine)) for p in curve]
            curve = [p._replace(precision=_wilson_low_by_bisection(round(p.precision * k), k, z))
                     for p, k in zip(curve, fired, strict=True)]
        point = threshold_for_precision(curve, cal.target)
        if point is not None:
            out[answer] = point.threshold
    return out


@pytest.mark.parametrize("confidence", [0.5, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_the_one_pass_fit_and_running_counts_equal_the_offline_curve(seed: int, confidence: float) -> None:
    """Tied gaps, three answers, a window that evicts: at every step the fit is the offline curve's
    point and the summary's figures are the window's own."""
    rng = random.Random(seed)
    cal = LiveCalibration(target=0.75, confidence=confidence, window=90, min_evidence=8, min_runs=3)
    truth = "a"
    for version in range(1, 400):
        if rng.random() < 0.15:
            truth = rng.choice("abc")
        answer = truth if rng.random() < 0.7 else rng.choice("abc")
        gap = round(rng.uniform(0, 2), 1)  # ties
        cal.expect(version, truth)
        cal.score(version, answer, gap, fired=rng.random() < 0.5, threshold=cal.threshold)
        assert cal.fit() == _reference_fit(cal), version
        n = len(cal.samples)
        fired = [c for _, c, f, *_ in cal.samples if f]
        s = cal.summary
        assert (s.samples, s.coverage, s.accuracy) == (n, len(fired) / n, sum(c for _, c, *_ in cal.samples) / n)
        assert s.precision == (sum(fired) / len(fired) if fired else None)
    assert cal.thresholds


def test_one_long_run_of_a_slow_label_is_not_evidence_enough() -> None:
    """The crypto replay incident: through a long downtrend every "down" was right, 30 of them
    opened "down" at the floor of their gaps, and after the turn the lagging head fired wrong
    "down"s. Samples of one truth run are one observation; evidence must span the label changing."""
    cal = LiveCalibration(target=0.9, min_evidence=30, min_runs=5)
    version = 0

    def step(truth: str, answer: str, gap: float) -> bool:
        nonlocal version
        version += 1
        fired = gap >= cal.threshold_for(answer)
        cal.expect(version, truth)
        assert cal.score(version, answer, gap, fired=fired, threshold=cal.threshold)
        return fired

    for i in range(60):  # one downtrend, every "down" right, some barely
        assert not step("down", "down", 0.07 + i / 100)
    assert math.isinf(cal.threshold)  # 60 right answers, one run: still closed
    fired_wrong = [step("up", "down", 1.0) for _ in range(3)]  # the turn; the head lags
    assert not any(fired_wrong)
    for _ in range(6):  # then the label turns every 8 versions; the head lags 2 at each turn
        for truth in ("up", "down"):
            other = "down" if truth == "up" else "up"
            step(truth, other, 1.0)
            step(truth, other, 1.0)
            for _ in range(6):
                step(truth, truth, 2.0)
    # Now the window spans many runs: both answers open, above the lagging answers' gaps.
    assert cal.thresholds == {"up": 2.0, "down": 2.0}
    assert not step("up", "down", 1.0) and step("up", "up", 2.0)


def test_a_confident_auto_threshold_is_never_below_the_point_estimates() -> None:
    """Both see the same window; a bound below the point estimate accepts only thresholds the point
    estimate accepts too, so each answer's window threshold is later and higher, and the summary says
    which rule ran."""
    rng = random.Random(11)
    point, sure = LiveCalibration(target=0.85), LiveCalibration(target=0.85, confidence=0.9)
    truth, opened = "up", set()
    for version in range(1, 1500):
        if rng.random() < 0.1:
            truth = "down" if truth == "up" else "up"
        gap = rng.uniform(0, 3)
        right = rng.random() < (0.97 if gap > 1.5 else 0.75)
        answer = truth if right else ("down" if truth == "up" else "up")
        for cal in (point, sure):
            cal.expect(version, truth)
            cal.score(version, answer, gap, fired=gap >= cal.threshold_for(answer), threshold=cal.threshold)
        for a in ("up", "down"):  # what each window supports (the recent check may hold either closed)
            assert sure.fitted.get(a, math.inf) >= point.fitted.get(a, math.inf), version
            if math.isfinite(sure.threshold_for(a)):
                opened.add(a)
    assert opened == {"up", "down"} and sure.fitted != point.fitted
    assert (point.summary.confidence, sure.summary.confidence) == (0.5, 0.9)
    assert LiveCalibration().summary is None and LiveCalibration()._summary(math.inf).confidence is None


@pytest.mark.parametrize("confidence", [0.5, 0.9])
def test_an_exported_window_restored_goes_on_as_if_never_interrupted(confidence: float) -> None:
    """A snapshot carries the window: restored (through JSON) into a fresh LiveCalibration, it has the
    same thresholds and figures, and every later sample gives both the same ones."""
    rng = random.Random(5)
    whole = LiveCalibration(target=0.85, confidence=confidence, window=120, min_evidence=10, min_runs=3)
    restored = None
    truth = "up"
    for version in range(1, 500):
        if rng.random() < 0.1:
            truth = "down" if truth == "up" else "up"
        gap = rng.uniform(0, 3)
        answer = truth if rng.random() < (0.95 if gap > 1.5 else 0.6) else ("down" if truth == "up" else "up")
        for cal in filter(None, (whole, restored)):
            cal.expect(version, truth)
            cal.score(version, answer, gap, fired=gap >= cal.threshold_for(answer), threshold=1.0)
        if version == 250:  # the restart, mid-stream, the window full and the gate open
            assert whole.thresholds
            restored = LiveCalibration(target=0.85, confidence=confidence, window=120, min_evidence=10, min_runs=3)
            restored.restore(json.loads(json.dumps(whole.export())), 1.0)
        if restored is not None:
            assert restored.thresholds == whole.thresholds and restored.summary == whole.summary, version
            assert (restored.run, restored.last_truth) == (whole.run, whole.last_truth)
    with pytest.raises(ValueError, match="calibration window malformed"):
        LiveCalibration().restore({"samples": [[1.0, True]], "scored": 1, "run": 1, "last_truth": "up"}, 1.0)
    with pytest.raises(ValueError, match="calibration window malformed"):
        LiveCalibration().restore({"samples": []}, 1.0)


def test_the_base_rate_is_the_windows_most_common_truth() -> None:
    """Beside accuracy, the share a constant answer would score: counted directly over the window's
    truths at every step, as old samples leave it; a window saved before samples kept their truth
    restores with the base rate unknown (None), never a guess."""
    rng = random.Random(11)
    cal = LiveCalibration(window=40)
    truths: list[str] = []
    for version in range(1, 200):
        truth = "yes" if rng.random() < 0.08 else "no"  # a rare event, as a volume spike is
        truths.append(truth)
        cal.expect(version, truth)
        cal.score(version, "no", 1.0, fired=False, threshold=2.0)
        window = truths[-40:]
        expected = max(window.count("yes"), window.count("no")) / len(window)
        assert cal.summary.base_rate == pytest.approx(expected), version
        assert cal.summary.accuracy == pytest.approx(window.count("no") / len(window))  # always "no": the base rate
    old = cal.export()
    old["samples"] = [s[:5] for s in old["samples"]]
    before = LiveCalibration(window=40)
    before.restore(json.loads(json.dumps(old)), 2.0)
    assert before.summary.base_rate is None and before.summary.accuracy == cal.summary.accuracy


def test_an_auto_gate_stays_open_through_a_snapshot_and_an_eviction(tiny_model, tmp_path) -> None:
    """The window travels with the session: restored under another name it answers fast at once,
    with the figures and per-answer thresholds it had, instead of closing for 30 new samples."""
    reference, engine = _run(tiny_model, lambda i: None, 2.0, _varied_lines, 60)
    engine.shutdown()
    answer_at = {v: text for v, text, *_ in reference}
    _, inner = _run(tiny_model, lambda i: {"trend": answer_at[i + 1]}, "auto:0.9", _varied_lines, 60,
                    max_cells=12288)
    engine = ResidentEngine(inner, tmp_path / "evicted")
    try:
        live = engine.calibration()["s"]["trend"]
        assert live["threshold"] is not None  # open
        path = tmp_path / "s.safetensors"
        engine.snapshot_session("s", path)
        engine.restore_session(path, "copy")
        assert engine.wait_idle(timeout=60)  # its entries are computed again; their answers carry the figures
        assert engine.calibration()["copy"]["trend"] == live
        gates = [inner.core.prepos.find(name, "trend").gate for name in ("s", "copy")]
        assert gates[1].choice_thresholds == gates[0].choice_thresholds and gates[1].threshold == gates[0].threshold
        asked = engine.ask("copy", "trend")
        assert asked.text == engine.ask("s", "trend").text and asked.path == engine.ask("s", "trend").path
        engine.evict_session("copy")
        engine.push("copy", _varied_lines(60))  # comes back on its next push, window and all
        assert engine.wait_idle(timeout=60)
        back = engine.calibration()["copy"]["trend"]
        assert back["scored"] >= live["scored"] and back["threshold"] is not None
    finally:
        engine.shutdown()


def test_truths_are_logged_and_a_recovery_scores_the_versions_it_replays(tiny_model, tmp_path) -> None:
    """Truths are accepted input: the ingest log keeps them with their batch, and a recovery from the
    log pushes them again, so the answers it recomputes are scored (before: an empty window)."""
    log_dir = tmp_path / "log"
    engine = Engine(tiny_model, EngineConfig(max_cells=4096, max_context=2048), ingest_log=IngestLog(log_dir))
    engine.open_session("s")
    engine.register("s", parse_question({**QUESTION, "threshold": "auto:0.9"}))
    for i in range(12):
        engine.push("s", _lines(i), truths={"trend": "up"} if i % 3 else {"trend": "down"})
        assert engine.wait_idle(timeout=30)
    scored = engine.calibration()["s"]["trend"]["scored"]
    engine.shutdown()
    again = Engine(tiny_model, EngineConfig(max_cells=4096, max_context=2048))
    try:
        report = recover(again, IngestLog(log_dir))
        assert not report.failed and report.batches == 12
        assert again.wait_idle(timeout=60)
        assert 1 <= again.calibration()["s"]["trend"]["scored"] <= scored  # (replay may skip versions' entries)
    finally:
        again.shutdown()


def test_a_closed_gate_skips_only_refits_that_could_not_open_it() -> None:
    class Always(LiveCalibration):  # the reference: refit on every sample while closed
        def _could_open(self) -> bool:
            return True

    rng = random.Random(3)
    cheap, always = LiveCalibration(target=0.8, min_evidence=10, min_runs=3), Always(target=0.8, min_evidence=10, min_runs=3)
    truth = "up"
    for version in range(1, 400):
        if rng.random() < 0.08:
            truth = "down" if truth == "up" else "up"
        answer = truth if rng.random() < 0.85 else ("down" if truth == "up" else "up")
        gap = rng.uniform(0, 3)
        for cal in (cheap, always):
            cal.expect(version, truth)
            cal.score(version, answer, gap, fired=gap >= cal.threshold_for(answer), threshold=cal.threshold)
        assert cheap.thresholds == always.thresholds, version
    assert cheap.thresholds  # it did open


def test_evidence_for_one_answer_does_not_open_the_gate_for_another(tiny_model) -> None:
    """The bench replay incident: right "no"s on a rare-event question opened a pooled threshold,
    and the first "yes"s then fired, wrong. Each answer needs its own evidence."""
    spike = {"id": "spike", "text": "Volume spike?", "choices": ["yes", "no"], "label": "volume_spike(k=3, n=5)",
             "threshold": "auto:0.9"}
    gate = Gate.for_question(parse_question(spike), tiny_model.tokenizer)
    cal = LiveCalibration(target=0.9, min_evidence=30, min_runs=5)
    for version in range(1, 61):
        truth = "yes" if version % 10 == 0 else "no"  # a spike every 10 bars, each answered right at a low gap
        cal.expect(version, truth)
        cal.score(version, truth, 0.2 + version / 100, fired=False, threshold=math.inf)
    gate.threshold, gate.choice_thresholds = cal.threshold, dict(cal.thresholds)
    assert set(cal.thresholds) == {"no"} and cal.threshold == pytest.approx(0.21)  # every right "no" counts
    # ... and 6 right "yes"s, though the "no"s between them were right too, are not evidence for "yes"
    assert gate._threshold_for("no", gate.threshold) == cal.thresholds["no"]
    assert math.isinf(gate._threshold_for("yes", gate.threshold))  # a confident "yes" still does not fire
    logits = torch.zeros(tiny_model.config.vocab_size)
    logits[gate.candidates("yes")[0]] = 5.0  # "yes" by a gap of 5, far above the "no"s' threshold
    decision = gate.decide(logits)
    assert decision.answer == "yes" and decision.gap >= 5.0 and not decision.fired
    logits[gate.candidates("yes")[0]], logits[gate.candidates("no")[0]] = 0.0, 5.0
    assert gate.decide(logits).fired  # the answer with evidence fires


def test_too_little_evidence_keeps_the_gate_closed() -> None:
    cal = LiveCalibration(target=0.9, min_evidence=30, min_runs=1)
    for version in range(1, 30):
        cal.expect(version, "up")
        cal.score(version, "up", 5.0, fired=False, threshold=cal.threshold)
    assert math.isinf(cal.threshold) and cal.summary.threshold is None and cal.summary.accuracy == 1.0
    assert not cal.score(99, "up", 5.0, False, cal.threshold)  # no truth sent for that version: not scored


def test_a_forecast_needs_evidence_in_proportion_to_its_horizon() -> None:
    """Neighbouring answers of a forecast read mostly the same bars ahead: h of them are about one
    observation. The same right answers that open a present-state gate leave a 5-bar forecast's shut
    until there are five times as many."""
    def question(label: str) -> object:
        return parse_question({"id": "q", "text": "Up?", "choices": ["up", "down"], "label": label,
                               "threshold": "auto:0.9"})

    now, ahead = calibration_for(question("close > close[-1]")), calibration_for(question("close[+5] > close"))
    assert now.min_evidence == MIN_EVIDENCE and ahead.min_evidence == 5 * MIN_EVIDENCE
    opened_at = {}
    for name, cal in (("now", now), ("ahead", ahead)):
        for version in range(1, 400):
            truth = "up" if version % 8 < 4 else "down"  # the label turns every 4 versions: many runs
            cal.expect(version, truth)
            cal.score(version, truth, 3.0, fired=cal.threshold_for(truth) <= 3.0, threshold=cal.threshold)
            if name not in opened_at and math.isfinite(cal.threshold_for("up")):
                opened_at[name] = version
    # "up" is half the answers: the present gate opens near its 30th fire, the forecast's near its 150th
    assert opened_at["now"] < 2 * MIN_EVIDENCE + 10 and 4.5 * opened_at["now"] <= opened_at["ahead"] < 400


def test_engine_opens_an_auto_gate_on_right_answers_and_keeps_it_shut_on_wrong_ones(tiny_model) -> None:
    reference, engine = _run(tiny_model, lambda i: None, 2.0, _varied_lines, 60)
    engine.shutdown()
    answer_at = {v: text for v, text, *_ in reference}
    assert set(answer_at.values()) == {"up", "down"}

    # Truths equal to the answers each version gets: every scored answer is right. The
    # reference for which versions fire: the same answers and gaps fed to a LiveCalibration.
    cal = LiveCalibration(target=0.9)
    expected = []
    for version, text, _, gap in reference:
        expected.append("fast" if gap >= cal.threshold_for(text) else "entry")
        cal.expect(version, text)
        cal.score(version, text, gap, fired=expected[-1] == "fast", threshold=cal.threshold)
    assert "fast" in expected and "fast" not in expected[:29]  # opens, and not before 30 scored answers
    right, engine = _run(tiny_model, lambda i: {"trend": answer_at[i + 1]}, "auto:0.9", _varied_lines, 60)
    try:
        assert [(v, t) for v, t, *_ in right] == [(v, t) for v, t, *_ in reference]  # the truth never changes an answer
        assert [p for _, _, p, _ in right] == expected
        cal = engine.calibration()["s"]["trend"]
        assert cal["scored"] == 60 and cal["accuracy"] == 1.0 and cal["precision"] == 1.0
        assert cal["target"] == 0.9 and cal["threshold"] is not None
        assert engine.standing("s")[0].calibration == cal
    finally:
        engine.shutdown()

    # One long run of right answers (this lines' answer hardly ever changes) is not evidence.
    steady, engine = _run(tiny_model, lambda i: None, 2.0)
    engine.shutdown()
    assert len({t for _, t, *_ in steady[1:]}) == 1
    held, engine = _run(tiny_model, lambda i: {"trend": steady[i][1]}, "auto:0.9")
    try:
        assert all(p != "fast" for _, _, p, _ in held) and engine.calibration()["s"]["trend"]["accuracy"] == 1.0
    finally:
        engine.shutdown()

    wrong, engine = _run(tiny_model, lambda i: {"trend": "down" if answer_at[i + 1] == "up" else "up"}, "auto:0.9",
                         _varied_lines, 60)
    try:
        assert all(p != "fast" for _, _, p, _ in wrong)
        cal = engine.calibration()["s"]["trend"]
        assert cal["accuracy"] == 0.0 and cal["precision"] is None and cal["threshold"] is None
    finally:
        engine.shutdown()


def test_push_rejects_a_truth_that_is_not_a_choice_and_drops_unknown_questions(tiny_model) -> None:
    with Engine(tiny_model, EngineConfig(max_cells=2048, max_context=1024)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        with pytest.raises(ValueError, match=r"truths\['trend'\]: 'sideways' is not one of its choices"):
            engine.push("s", ["09:30 100"], truths={"trend": "sideways"})
        assert engine.session_info("s").pushed_version == 0  # refused before anything was accepted
        ack = engine.push("s", ["09:30 100"], truths={"gone": "up", "trend": "up"})
        assert ack.data_version == 1 and engine.wait_idle(timeout=30)
        assert engine.calibration()["s"]["trend"]["scored"] == 1


def test_attachment_sends_the_labels_truth_on_the_bars_each_push_completes() -> None:
    spec = parse_question(QUESTION)
    pushes: list[dict | None] = []

    class Sink:  # records what the attachment sends; the engine's side is tested above
        def push(self, session, lines, truths=None):
            pushes.append(truths)
            return len(pushes)

        def backlog(self, session):
            return 0

    att = Attachment(Sink(), AttachSpec("s", bar_s=60, instruments=frozenset({"BTCUSDT"})), questions=(spec,))
    reference, closed, bars_at_push = BarAggregator(60), [], []
    for n, ev in enumerate(synthetic_events(seed=3, duration_s=1200)):
        att.offer(ev)
        if type(ev) is Trade and ev.instrument == "BTCUSDT":
            closed += reference.update(ev)
        if n % 50 == 49 and att.flush() is not None:
            bars_at_push.append(list(closed))  # what the push just sent completes these bars
    assert len(pushes) >= 5 and len(pushes) == len(bars_at_push)
    for truths, bars in zip(pushes, bars_at_push, strict=True):
        expected = spec.expected_answer(bars)
        assert truths == ({"trend": expected} if expected is not None else None)
    assert sum(t is not None for t in pushes) >= 3


def test_metrics_and_stats_carry_the_live_figures(tiny_model, serve_in_thread) -> None:
    with Engine(tiny_model, EngineConfig(max_cells=2048, max_context=1024)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question({**QUESTION, "threshold": "auto:0.9"}))
        for i in range(3):
            engine.push("s", _lines(i), truths={"trend": "up"})
            engine.wait_idle(timeout=30)
        cal = engine.calibration()["s"]["trend"]
        server = StreamServer(engine)
        with serve_in_thread(server), urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert f'streamllm_question_accuracy{{question="trend",session="s"}} {float(cal["accuracy"])}' in text
        assert 'streamllm_question_samples{question="trend",session="s"} 3.0' in text
        assert 'streamllm_question_base_rate{question="trend",session="s"} 1.0' in text  # every truth "up"
        assert "streamllm_question_threshold{" not in text  # closed: no figure rather than +Inf
        assert 'streamllm_question_target{question="trend",session="s"} 0.9' in text  # what to alert against
        assert 'streamllm_question_confidence{question="trend",session="s"} 0.5' in text


def test_metrics_carry_the_learning_curve_and_the_learners_figures_where_a_question_has_them() -> None:
    from streamllm.service.metrics import ServerMetrics

    figures = {"s": {
        "learns": {"samples": 40, "accuracy": 0.6, "history": [[10, 0.4, 0.5, False], [20, 0.55, 0.5, True]],
                   "learning": {"fits": 3, "samples": 38, "trained_upto": 17, "fit_s": 0.02, "compared": 20,
                                "answer_accuracy": 0.6, "control_accuracy": 0.85}},
        "fresh": {"samples": 12, "accuracy": 0.5, "history": [[10, 0.5, None, False]]},  # no base rate yet
        "early": {"samples": 4, "accuracy": 0.25, "history": []},  # under 10 scored: no point yet
    }}
    text = ServerMetrics(dict, lambda: figures).render(private=True).decode()
    assert 'streamllm_question_learned_heads{question="learns",session="s"} 3.0' in text
    assert 'streamllm_question_learning_samples{question="learns",session="s"} 38.0' in text
    assert 'streamllm_question_recent_accuracy{question="learns",session="s"} 0.55' in text  # the newest point
    assert 'streamllm_question_recent_base_rate{question="learns",session="s"} 0.5' in text
    assert 'streamllm_question_control_accuracy{question="learns",session="s"} 0.85' in text
    assert 'streamllm_question_answer_accuracy{question="learns",session="s"} 0.6' in text
    assert 'streamllm_question_control_accuracy{question="fresh"' not in text
    assert 'streamllm_question_recent_accuracy{question="fresh",session="s"} 0.5' in text
    assert 'streamllm_question_recent_base_rate{question="fresh"' not in text  # null: no figure
    for name in ("recent_accuracy", "recent_base_rate", "learned_heads"):  # under 10 scored: nothing recent
        assert f'streamllm_question_{name}{{question="early"' not in text
    assert 'streamllm_question_learned_heads{question="fresh"' not in text
    assert "streamllm_question_learned_heads" not in ServerMetrics(dict, lambda: figures).render().decode()


def test_websocket_push_carries_truths_and_stats_report_the_figures(tiny_model, serve_in_thread) -> None:
    import json

    from websockets.sync.client import connect

    with Engine(tiny_model, EngineConfig(max_cells=2048, max_context=1024)) as engine:
        server = StreamServer(engine)
        with serve_in_thread(server), connect(server.url) as ws:
            def call(msg: dict) -> dict:
                ws.send(json.dumps(msg))
                return json.loads(ws.recv(timeout=30))

            assert call({"type": "open", "session": "s"})["type"] == "ok"
            assert call({"type": "register", "session": "s", "question": QUESTION})["type"] == "ok"
            bad = call({"type": "push", "session": "s", "lines": ["09:30 100"], "truths": {"trend": "flat"}})
            assert bad["type"] == "error" and "'flat' is not one of its choices" in bad["message"]
            ok = call({"type": "push", "session": "s", "lines": ["09:30 100"], "truths": {"trend": "up"}})
            assert ok["type"] == "ok" and ok["data_version"] == 1
            engine.wait_idle(timeout=30)
            stats = call({"type": "stats"})
            (mine,) = stats["sessions"]
            assert mine["calibration"]["trend"]["scored"] == 1
            assert mine["calibration"]["trend"]["accuracy"] in (0.0, 1.0)


def test_an_open_gate_holds_closed_while_its_newest_fired_answers_miss_the_target_and_reopens() -> None:
    """The window supports a threshold, but the newest RECENT answers it would fire on go wrong (the market
    turned): the gate holds closed on that evidence alone, says so, and opens again once they are right."""
    cal, version, truth = LiveCalibration(target=0.9), 0, "up"

    def feed(n: int, right: bool) -> None:
        nonlocal version, truth
        for _ in range(n):
            version += 1
            truth = "down" if version % 7 == 0 or not right else "up"  # truth runs: the label turns often
            cal.expect(version, truth)
            cal.score(version, truth if right else "up", 2.0, fired=True, threshold=math.inf)  # wrong: "up"

    feed(200, right=True)
    assert cal.thresholds and not cal.held and not cal.summary.held
    feed(3, right=False)  # a few misses: the newest 30 still reach 0.9
    assert cal.thresholds and not cal.held
    feed(5, right=False)  # 8 of the newest 30 wrong: held, though the window of 208 is still 96% right
    assert cal.fitted and cal.held and cal.thresholds == {} and math.isinf(cal.threshold_for("up"))
    assert cal.summary.held and cal.summary.threshold is None
    again = LiveCalibration(target=0.9)
    again.restore(cal.export(), math.inf)
    assert again.held and again.thresholds == {}  # the window alone decides: a restore holds too
    feed(30, right=True)  # the newest 30 it fires on are right again
    assert cal.thresholds and not cal.held


class _WalkingHold(LiveCalibration):
    """The reference: the recent-evidence hold as first written, a walk back over the window on every
    scored answer (what `LiveCalibration` now keeps as samples come and go)."""

    def _hold_or_open(self) -> None:
        hits = n = 0
        if self.fitted:
            for gap, correct, _, answer, *_ in reversed(self.samples):
                threshold = self.fitted.get(answer)
                if threshold is not None and gap >= threshold:
                    n, hits = n + 1, hits + correct
                    if n == self.recent:
                        break
        self.held = n >= self.recent and hits / n < self.target
        self.thresholds = {} if self.held else self.fitted


def test_the_kept_recent_evidence_decides_as_the_walk_over_the_window_on_random_sequences() -> None:
    """Random answers whose accuracy turns between regimes (so gates open, hold and reopen), ties in the
    gaps, windows that slide, and restores from saved windows (into other window sizes too): the hold kept
    as samples come and go makes every decision the walk over the window makes."""
    def fresh(rng: random.Random, window: int) -> tuple[LiveCalibration, LiveCalibration]:
        params = dict(target=rng.choice([0.6, 0.75, 0.9]), confidence=rng.choice([0.5, 0.5, 0.8]), window=window,
                      min_evidence=rng.randint(3, 12), min_runs=rng.randint(1, 3), recent=rng.randint(2, 15))
        return LiveCalibration(**params), _WalkingHold(**params)

    seen = {"held": 0, "open": 0, "reopened": 0}
    for seed in range(30):
        rng = random.Random(seed)
        kept, walked = fresh(rng, rng.randint(15, 120))
        truth, accuracy, was_held = "up", 0.9, False
        for version in range(1, 300):
            if rng.random() < 0.04:
                accuracy = rng.choice([0.3, 0.6, 0.95, 1.0])  # the market turns
            if rng.random() < 0.2:
                truth = rng.choice(["up", "down", "flat"])
            right = rng.random() < accuracy
            answer = truth if right else rng.choice([c for c in ("up", "down", "flat") if c != truth])
            gap = rng.choice([0.5, 1.0, 1.5, 2.0]) + (1.0 if right and rng.random() < 0.5 else 0.0)
            for cal in (kept, walked):
                if rng.random() < 0.5 or version % 2:  # truths before answers, or after (a forecast's)
                    cal.expect(version, truth)
                    cal.score(version, answer, gap, fired=gap > 1.2, threshold=math.inf)
                else:
                    cal.score(version, answer, gap, fired=gap > 1.2, threshold=math.inf)
                    cal.expect(version, truth)
            assert (kept.held, kept.thresholds, kept.fitted) == (walked.held, walked.thresholds, walked.fitted), \
                (seed, version)
            assert kept.summary == walked.summary, (seed, version)
            seen["held"] += kept.held
            seen["open"] += bool(kept.thresholds)
            seen["reopened"] += was_held and bool(kept.thresholds)
            was_held = kept.held
            if rng.random() < 0.03:  # a snapshot, restored in place or where another window size is kept
                saved = json.loads(json.dumps(kept.export()))
                if rng.random() < 0.5:
                    kept, walked = fresh(rng, rng.randint(10, 120))
                for cal in (kept, walked):
                    cal.restore(saved, math.inf)
                assert (kept.held, kept.thresholds) == (walked.held, walked.thresholds), (seed, version)
    assert seen["held"] > 100 and seen["open"] > 100 and seen["reopened"] > 5, seen
