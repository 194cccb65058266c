"""What `streamllm calibrate` measured: per labelled question, the samples it recorded, the
risk-coverage curve and the threshold that reaches the target precision (hindsight), and what
the live auto gate did on the same samples; then the same as JSON (`question.metric` and the
summary keys: each question at the target precision, and the weakest question), a table and a
PNG plot. The samples as rows: evaluation/samples.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamllm.config import QuestionSpec
from streamllm.engine.standing.calibration import WINDOW, calibration_for
from streamllm.evaluation.decision_bias import BiasedReplay, biased_replay
from streamllm.evaluation.intervals import (
    LEVEL,
    REPS,
    block_ids,
    coverage_at_precision,
    gate_intervals,
    percentile_interval,
    rounded,
    shared_resamples,
)
from streamllm.evaluation.scoring import (
    RiskCoveragePoint,
    balanced_accuracy,
    margin_ranking,
    risk_coverage,
    threshold_for_precision,
)
from streamllm.tuning.card import fmt_number


@dataclass(slots=True)
class QuestionRecord:
    """The samples of one labelled question, in replay order."""

    spec: QuestionSpec
    gaps: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    truths: list[str] = field(default_factory=list)
    bars: list[int] = field(default_factory=list)  # the replay bar each sample was taken at
    ranges: list[int] = field(default_factory=list)  # which replayed range, where several are pooled (else none)
    unknown: int = 0  # updates whose label had too few bars

    @property
    def correct(self) -> list[bool]:
        return [a == t for a, t in zip(self.answers, self.truths, strict=True)]


@dataclass(frozen=True, slots=True)
class QuestionReport:
    id: str
    samples: int
    unknown: int
    threshold: float | None  # None: no threshold reaches the target precision
    coverage: float  # at `threshold` (0.0 when there is none)
    precision: float | None
    fired: int  # samples the gate fires on at `threshold`
    best_precision: float | None  # the highest precision anywhere on the curve
    accuracy: float | None  # the fast answer on every sample (threshold 0)
    majority: str | None
    top_answer: str | None  # the model's most frequent fast answer
    top_answer_share: float | None  # 1.0: it always says the same thing, whatever the bars
    base_rate: float | None  # share of the majority answer among the truths
    majority_precision: float | None  # always answering the majority: its precision at coverage 1
    config_threshold: float
    config_coverage: float
    config_precision: float | None
    curve: list[RiskCoveragePoint]
    live: LiveGate  # what threshold = "auto:<target>" would have done, live
    # The same live gate at each of CONFIDENCES: what auto_confidence would cost and buy here.
    live_by_confidence: tuple[LiveGate, ...]
    # Mean of per-answer recall (evaluation/scoring.py): honest where one answer dominates (volume_spike says
    # "no" on ~93% of bars, so accuracy - base rate cannot reach 0.15).
    balanced_accuracy: float | None = None
    # Block-bootstrap intervals (evaluation/intervals.py): blocks of the label's history in bars.
    accuracy_interval: tuple[float, float] | None = None
    coverage_interval: tuple[float, float] | None = None
    # evaluation/scoring.py margin_ranking: whether the margin tells the truths apart at all (0.5: no). With a
    # low balanced accuracy it says which is off: the decision point (high), or the head (about 0.5).
    ranking: float | None = None
    # evaluation/decision_bias.py: the answers replayed with a live decision bias (None: not two choices).
    biased: BiasedReplay | None = None


CONFIDENCES = (0.5, 0.7, 0.8, 0.9, 0.95)  # auto_confidence values every report replays the live gate at


@dataclass(frozen=True, slots=True)
class LiveGate:
    """The live gate on the replay: `threshold`, `coverage` and `precision` above are hindsight (one
    threshold chosen knowing every answer); this is the engine's own auto threshold, which fires on
    an answer only from the answers scored before it (engine/standing/calibration.py)."""

    fired: int
    first: int | None  # samples scored before its first fast answer (None: it never opened)
    coverage: float
    precision: float | None
    confidence: float  # the auto_confidence it ran at (0.5: the point estimate)
    fires: tuple[bool, ...] = field(default=(), repr=False)  # per sample, in replay order (--samples)


@dataclass(slots=True)
class CalibrationRun:
    session: str
    model: str
    bars: int  # replayed, warmup included
    warmup: int
    updates: int
    context_tokens: int
    seconds: float
    records: list[QuestionRecord]


def gate_at(gaps: Sequence[float], correct: Sequence[bool], threshold: float) -> tuple[float, float | None, int]:
    """(coverage, precision, fired) of a gate firing when gap >= threshold."""
    fired = [c for g, c in zip(gaps, correct, strict=True) if g >= threshold]
    coverage = len(fired) / len(gaps) if gaps else 0.0
    return coverage, (sum(fired) / len(fired) if fired else None), len(fired)


def summarize(record: QuestionRecord, target: float, confidence: float | None = None) -> QuestionReport:
    """The hindsight gate at `target`, and the live one at `confidence` (default: the question's own
    auto_confidence)."""
    gaps, correct = record.gaps, record.correct
    curve = risk_coverage(gaps, correct)
    point = threshold_for_precision(curve, target)
    threshold = None if point is None else point.threshold
    coverage, precision, fired = gate_at(gaps, correct, threshold) if point is not None else (0.0, None, 0)
    counts = Counter(record.truths)
    majority, majority_n = counts.most_common(1)[0] if counts else (None, 0)
    base_rate = majority_n / len(record.truths) if record.truths else None
    config_coverage, config_precision, _ = gate_at(gaps, correct, record.spec.threshold)
    top_answer, top_n = Counter(record.answers).most_common(1)[0] if record.answers else (None, 0)
    spans = gate_intervals(correct, gaps, record_blocks(record, record.spec.label.bars_needed), target)
    own = record.spec.auto_confidence if confidence is None else confidence
    by_confidence = {c: live_gate(record, target, c) for c in CONFIDENCES}  # the main one is often among them
    return QuestionReport(
        record.spec.id, len(gaps), record.unknown, threshold, coverage, precision, fired,
        max((p.precision for p in curve), default=None), gate_at(gaps, correct, 0.0)[1],
        majority, top_answer, top_n / len(record.answers) if record.answers else None, base_rate, base_rate,
        record.spec.threshold, config_coverage, config_precision, curve,
        by_confidence.get(own) or live_gate(record, target, own), tuple(by_confidence.values()),
        balanced_accuracy(record.answers, record.truths), spans.get("accuracy"), spans.get("coverage_at_target"),
        margin_ranking(record.answers, gaps, record.truths, record.spec.choices[0]) if record.spec.choices else None,
        biased_replay(record.answers, gaps, record.truths, record.spec.choices[0])
        if len(record.spec.choices) == 2 else None,
    )


def confidence_for_target(report: QuestionReport, target: float) -> float | None:
    """The lowest of CONFIDENCES whose live gate fired and was right at least `target` of the time on
    this replay (the auto_confidence to set for the target as a floor here); None: none was."""
    return next((g.confidence for g in report.live_by_confidence
                 if g.precision is not None and g.precision >= target), None)


def live_gate(record: QuestionRecord, target: float, confidence: float | None = None) -> LiveGate:
    """Feed the samples in replay order to the engine's LiveCalibration, called as engine/standing/prepos.py calls
    it under `threshold = "auto:<target>"` and `auto_confidence = <confidence>` (default: the question's
    own): each answer fires or not on the thresholds the answers before it set, then is scored. It
    starts closed; pooled ranges share one window, as one session serving that market for longer
    keeps its window through compactions."""
    confidence = record.spec.auto_confidence if confidence is None else confidence
    calibration = calibration_for(record.spec, confidence, target)
    fires = []
    for version, (gap, answer, truth) in enumerate(zip(record.gaps, record.answers, record.truths, strict=True)):
        fires.append(gap >= calibration.threshold_for(answer))
        calibration.expect(version, truth)
        calibration.score(version, answer, gap, fires[-1], calibration.threshold)
    fired, right = sum(fires), sum(f and c for f, c in zip(fires, record.correct, strict=True))
    first = fires.index(True) if fired else None
    n = len(fires)
    return LiveGate(fired, first, fired / n if n else 0.0, right / fired if fired else None, confidence,
                    tuple(fires))


def record_blocks(record: QuestionRecord, length: int) -> np.ndarray:
    """Each sample's interval block: `length` consecutive bars of one replayed range."""
    bars = record.bars or range(len(record.gaps))  # a record built by hand: one sample a bar
    return block_ids(record.ranges or np.zeros(len(bars), dtype=np.int64), bars, length)


def min_coverage_interval(records: Sequence[QuestionRecord], target: float) -> tuple[float, float] | None:
    """Interval of the weakest question's coverage at `target`: the questions share the replay's bars, so
    each resample draws the same blocks (the longest label's history) for all of them."""
    records = [r for r in records if r.gaps]
    if not records:
        return None
    length = max(r.spec.label.bars_needed for r in records)
    data = [(np.array(r.gaps, dtype=np.float64), np.array(r.correct, dtype=np.float64)) for r in records]
    draws = shared_resamples([record_blocks(r, length) for r in records])
    return percentile_interval([min(coverage_at_precision(g[i], c[i], target) for (g, c), i in zip(data, draw, strict=True))
                                for draw in draws]) if draws else None


# -- reporting -------------------------------------------------------------------------


def _cfg(r: QuestionReport) -> str:
    """The configured threshold as written: a number, or an auto one (live, starts closed)."""
    return f"{r.config_threshold:g}" if math.isfinite(r.config_threshold) else "auto (set live)"


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def to_json(run: CalibrationRun, reports: list[QuestionReport], meta: dict[str, Any]) -> dict[str, Any]:
    """Flat `question.metric` pairs plus the curves under `curves` (null where undefined); intervals as
    [low, high], the middle `interval_level` of block-bootstrap resamples (null below 4 blocks)."""
    out: dict[str, Any] = dict(meta)
    out.update(session=run.session, model=run.model, bars=run.bars, warmup=run.warmup, updates=run.updates,
               context_tokens=run.context_tokens, seconds=round(run.seconds, 2))
    curves: dict[str, dict[str, list[float]]] = {}
    for r in reports:
        for key in ("samples", "unknown", "fired", "majority", "top_answer"):
            out[f"{r.id}.{key}"] = getattr(r, key)
        for key in ("threshold", "coverage", "precision", "best_precision", "accuracy", "base_rate", "top_answer_share",
                    "majority_precision", "config_threshold", "config_coverage", "config_precision", "balanced_accuracy",
                    "ranking"):
            out[f"{r.id}.{key}"] = _num(getattr(r, key))
        curves[r.id] = {name: [round(getattr(p, name), 6) for p in r.curve]
                        for name in ("threshold", "coverage", "precision")}
    # The summary keys: per question at the target precision, and the weakest question.
    for r in reports:
        out[f"coverage_at_target.{r.id}"] = _num(r.coverage)
        out[f"precision_at_target.{r.id}"] = _num(r.precision)
        out[f"accuracy.{r.id}"] = _num(r.accuracy)
        out[f"base_rate.{r.id}"] = _num(r.base_rate)
        out[f"balanced_accuracy.{r.id}"] = _num(r.balanced_accuracy)
        out[f"ranking.{r.id}"] = _num(r.ranking)
        out[f"bias_accuracy.{r.id}"] = _num(r.biased.accuracy) if r.biased else None
        out[f"accuracy_interval.{r.id}"] = rounded(r.accuracy_interval)
        out[f"coverage_at_target_interval.{r.id}"] = rounded(r.coverage_interval)
    for r in reports:  # the live auto gate (LiveGate): what a session with threshold = "auto:<target>" did
        out[f"live_coverage.{r.id}"] = _num(r.live.coverage)
        out[f"live_precision.{r.id}"] = _num(r.live.precision)
        out[f"live_fired.{r.id}"] = r.live.fired
        out[f"live_first.{r.id}"] = r.live.first
        out[f"live_confidence.{r.id}"] = r.live.confidence
        out[f"live_confidence_for_target.{r.id}"] = confidence_for_target(r, meta["target_precision"])
        out[f"live_by_confidence.{r.id}"] = [
            {"confidence": g.confidence, "coverage": _num(g.coverage), "precision": _num(g.precision),
             "fired": g.fired, "first": g.first} for g in r.live_by_confidence]
    out["live_min_coverage"] = _num(min((r.live.coverage for r in reports), default=None))
    out["min_coverage_at_target"] = _num(min((r.coverage for r in reports), default=None))
    out["min_coverage_at_target_interval"] = rounded(
        min_coverage_interval(run.records, meta["target_precision"]))
    out["interval_level"] = LEVEL
    out["curves"] = curves
    return out


def plot(reports: list[QuestionReport], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in reports:
        if not r.curve:
            continue
        xs, ys = [p.coverage for p in r.curve], [p.precision for p in r.curve]
        (line,) = ax.plot(xs, ys, drawstyle="steps-post", label=f"{r.id} (n={r.samples})")
        if r.base_rate is not None:  # the always-majority baseline, same colour
            ax.axhline(r.base_rate, color=line.get_color(), linestyle=":", linewidth=1)
        if r.threshold is not None:
            ax.plot([r.coverage], [r.precision], "o", color=line.get_color())
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set(xlabel="coverage (share of updates the gate fires on)", ylabel="precision of fired answers",
           xlim=(0, 1.02), ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.plot([], [], color="gray", linestyle=":", linewidth=1, label="always-majority precision")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _span(x: tuple[float, float] | None) -> str:
    return "-" if x is None else f"{x[0]:.2f}-{x[1]:.2f}"


def table(reports: list[QuestionReport], target: float) -> str:
    level = f"{LEVEL:.0%}"
    head = f"{'question':<16} {'samples':>7} {'threshold':>9} {'coverage':>8} {'(' + level + ')':>11} " \
           f"{'precision':>9} {'acc@all':>7} {'(' + level + ')':>11} {'base rate':>14} {'balanced':>8} {'ranks':>5}"
    rows = [head, "-" * len(head)]
    for r in reports:
        base = f"{fmt_number(r.base_rate)} ({r.majority})" if r.majority is not None else "-"
        rows.append(f"{r.id:<16} {r.samples:>7} {fmt_number(r.threshold):>9} {fmt_number(r.coverage):>8} "
                    f"{_span(r.coverage_interval):>11} {fmt_number(r.precision):>9} {fmt_number(r.accuracy):>7} "
                    f"{_span(r.accuracy_interval):>11} {base:>14} {fmt_number(r.balanced_accuracy):>8} {fmt_number(r.ranking):>5}")
    rows.append(f"({level}: the middle {level} of {REPS} block-bootstrap resamples, blocks as long as each label's "
                "history; neighbouring bars are not independent samples. ranks: how well the margin tells the "
                "truths apart, 0.5 not at all, 1 perfectly)")
    rows.append(f'live, threshold = "auto:{target:g}" as the engine runs it (starts closed; each answer fires on '
                "the evidence of the answers scored before it; auto_confidence 0.5 judges the precision it saw, "
                "higher a lower bound of it):")
    for r in reports:
        live = r.live
        if r.samples == 0:
            continue
        rows.append(f"  {r.id:<16} " + (f"never opened in {r.samples} samples" if live.first is None else
                    f"fired on {live.coverage:.2f} ({live.fired}) at precision {fmt_number(live.precision)}, "
                    f"first after {live.first} samples") + f" (auto_confidence {live.confidence:g})")
    if any(r.samples for r in reports):
        rows.append("the same live gate at each auto_confidence (coverage at precision; higher: fewer fast answers, "
                    "a margin under the target), and the lowest that reached the target here:")
        rows.append(f"  {'':<16} " + " ".join(f"{c:>13g}" for c in CONFIDENCES) + "   lowest reaching "
                    f"{target:g}")
        for r in reports:
            if r.samples:
                enough = confidence_for_target(r, target)
                rows.append(f"  {r.id:<16} " + " ".join(
                    f"{'closed':>13}" if g.first is None else f"{g.coverage:.2f} @ {fmt_number(g.precision, '.3f')}".rjust(13)
                    for g in r.live_by_confidence) + f"   {'none' if enough is None else f'{enough:g}'}")
    if any(r.biased and r.biased.accuracy is not None for r in reports):
        rows.append(f"with a live decision bias (not in the engine yet; evaluation/decision_bias.py): each answer's margin "
                    f"moved by the bias that was right most often on the {WINDOW} answers before it:")
        for r in reports:
            if r.biased and r.biased.accuracy is not None:
                rows.append(f"  {r.id:<16} accuracy {r.biased.accuracy:.2f} (argmax {fmt_number(r.accuracy)}); "
                            f"answered {r.biased.first!r} {r.biased.said_first} times, right {r.biased.right_first}")
    for r in reports:
        if r.samples == 0:
            rows.append(f"{r.id}: no samples (its label never had enough bars)")
        elif r.threshold is None:
            rows.append(f"{r.id}: the gate never reaches precision {target:g} (best "
                        f"{fmt_number(r.best_precision)}); keep threshold {_cfg(r)} or drop its fast path")
        elif r.fired < 10:
            rows.append(f"{r.id}: threshold {r.threshold:.2f} rests on {r.fired} fired samples; too few to trust")
        elif r.precision is not None and r.base_rate is not None and r.precision <= r.base_rate:
            rows.append(f"{r.id}: precision {r.precision:.2f} is no better than always answering "
                        f"{r.majority!r} ({r.base_rate:.2f}); the model says {r.top_answer!r} "
                        f"{r.top_answer_share:.0%} of the time" + _ranking_hint(r))
        if r.samples and r.config_coverage == 0.0 and math.isfinite(r.config_threshold):
            rows.append(f"{r.id}: its configured threshold {r.config_threshold:g} never fires on these bars")
    return "\n".join(rows)


def _ranking_hint(r: QuestionReport) -> str:
    """Why a question answering its base rate does: the decision point, or the margin itself."""
    if r.ranking is None:
        return ""
    if r.ranking < 0.65:
        return (f"; its margin barely tells the truths apart (ranks {r.ranking:.2f}), so no cutoff on it "
                "would do better: the head needs to learn this market")
    return (f"; its margin ranks the truths ({r.ranking:.2f}): a cutoff other than the argmax could "
            "answer the rarer one right")
