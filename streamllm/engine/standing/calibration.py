"""Live calibration: each standing answer of a labelled question, scored as it is made.

Whoever feeds a session knows the market it renders; the engine only knows lines. So
the feeder (a feed attachment, or any client) sends with a batch the *truth* of each
labelled question on the data as of that batch (`push(..., truths={question_id: choice})`,
the label computed on the bars the batch completes). When the question's entry for that
data version is ready, its answer is scored against the truth there:

    sample = (gap, correct, fired, answer, run, truth)     one per pre-positioned data version

Over a rolling window the engine reports precision (correct among answers the gate
fired on), coverage (fired / answered), accuracy (correct / answered) and the base rate
(the share of the most common truth: what always giving it would score). A question
configured with `threshold = "auto:P"` has its thresholds set from the same window, one
per answer (choice): for each, the most-covering threshold whose fired samples *giving
that answer* reach precision P on at least MIN_EVIDENCE of them spread over at least
MIN_RUNS truth runs (evaluation/scoring.py `risk_coverage`), or closed (inf) until then.

**Recent evidence too.** The window spans hours; a market can change inside it (a slow label's
errors bunch where its truth turns, a head is refitted). So the thresholds in force must also
reach P on the newest RECENT (30) answers they would fire on; while those fall short, the gate
holds closed (`held`), and opens again as soon as the newest such answers reach P. Both checks
read only the window, so a restored window decides as the live one did. The newest answers the
thresholds fire on are kept as samples come and go (`_firing`), so a scored answer costs O(1) for
this check; they are gathered again from the window only when a refit changes the thresholds.

"Reach precision P" is judged on the window's point estimate (hits / fired) by default; with
`auto_confidence = C` it is judged on a lower confidence bound of that precision instead (Wilson
score interval, one-sided at C): the window's precision at the most-covering threshold is the best
of many looks, so out of the window it tends to land a little under P; a bound trades coverage for
that margin. C = 0.5 is the point estimate itself.

Per answer, because evidence is per answer: a window of right "no"s says nothing about a
"yes". Per truth run, because a slow label's samples are one observation repeated: a *run*
is a stretch of consecutive scored versions with the same truth, and 30 right "down"s
inside one downtrend only show the head can hold an answer, not that it lets go when the
trend turns. Runs are only
counted as distinct if a different truth came between them, so meeting MIN_RUNS means the
window saw the label change MIN_RUNS - 1 times or more.

A forecast's truth (a label that reads bars after its own, `close[+5] > close`) is known only
some bars later: the feeder sends it with the push that completes those bars, for the earlier
version (`push(..., late_truths={question_id: {version: choice}})`). So truths and answers meet
in either order: an answer waits (bounded) for its truth, a truth for its answer, and the pair
is scored when the second arrives. A truth sent for a version whose answer was never made
(entries skipped it under lag) scores nothing.

**A forecast needs more evidence.** Its truths overlap: `max(high, +10) > close * 1.002` at two
neighbouring versions reads 9 of the same 10 bars ahead, so h neighbouring fired answers are about
one observation. A forecast of horizon h needs MIN_EVIDENCE * h fired answers (`evidence_for`),
which a window of WINDOW answers may never hold: its gate fires rarely, never on thin evidence.

The truth is the judge, never the answer: nothing on an answer path reads it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from operator import itemgetter
from statistics import NormalDist
from typing import Any

WINDOW = 500  # scored answers the figures (and an auto threshold) rest on
MIN_EVIDENCE = 30  # fired samples an auto threshold needs before it opens
MIN_RUNS = 5  # ... spread over this many truth runs (a slow label's samples are not independent)
RECENT = 30  # the newest window answers the thresholds would fire on must reach the target too (point estimate)
RETUNE_EVERY = 8  # samples between auto-threshold refits (a refit sorts the window)
HISTORY_EVERY = 10  # scored answers between two points of a question's learning curve
HISTORY_SPAN = 50  # ... each point the accuracy and base rate of this many newest scored answers
HISTORY_POINTS = 120  # points kept (the newest)
MAX_PENDING = 256  # truths kept for versions whose entries are not ready yet; answers kept for their truth
# One scored answer: (gap, correct, fired, answer, truth run, truth; None where a window saved
# before truths were kept does not say).
Sample = tuple[float, bool, bool, str, int, str | None]


def evidence_for(horizon: int) -> int:
    """Fired answers an auto threshold needs for a label reading `horizon` bars ahead (0: the present)."""
    return MIN_EVIDENCE * max(1, horizon)


@dataclass(frozen=True, slots=True)
class CalibrationSummary:
    """A question's live figures over its window (None where nothing was fired/answered yet)."""

    samples: int  # scored answers in the window
    scored: int  # scored answers ever
    precision: float | None  # correct / fired
    coverage: float | None  # fired / samples
    accuracy: float | None  # correct / samples
    threshold: float | None  # the gate's threshold now (None: closed)
    target: float | None  # the auto target precision, if any
    confidence: float | None  # how sure the auto threshold is of reaching it (0.5: the point estimate)
    # The share of the window's truths that are its most common one: what always giving that
    # answer would score. accuracy means something only beside it (a volume spike is 1-9% of bars).
    base_rate: float | None = None
    # The learning curve: every HISTORY_EVERY scored answers, [scored, accuracy and base rate of the
    # newest HISTORY_SPAN, whether the gate was open for any answer] (oldest first).
    history: tuple[tuple[int, float, float | None, bool], ...] = ()
    held: bool = False  # an auto gate the window would open, held closed: its newest answers miss the target

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in self.__slots__}
        out["history"] = [list(point) for point in self.history]
        return out


@dataclass(slots=True)
class LiveCalibration:
    target: float | None = None  # threshold = "auto:P"
    confidence: float = 0.5  # auto_confidence = C: judge P on a lower bound at one-sided confidence C
    window: int = WINDOW
    min_evidence: int = MIN_EVIDENCE
    min_runs: int = MIN_RUNS
    thresholds: dict[str, float] = field(default_factory=dict)  # in force, per answer, while `target` is set
    fitted: dict[str, float] = field(default_factory=dict)  # what the window supports (`fit`); in force unless held
    held: bool = False  # the newest answers `fitted` fires on miss the target: the gate holds closed
    recent: int = RECENT
    scored: int = 0
    samples: deque[Sample] = field(default_factory=deque)
    truths: dict[int, str] = field(default_factory=dict)  # data version -> the right choice there
    # data version -> (answer, gap, fired) made there, waiting for its (forecast's) truth
    answers: dict[int, tuple[str, float, bool]] = field(default_factory=dict)
    last_answered: int = -1  # the newest version answered (a truth for an older one without an answer: skipped)
    last_scored: tuple[int, str, bool] | None = None  # (version, truth, right) of the newest scored answer (learning)
    summary: CalibrationSummary | None = None
    run: int = 0  # the truth run the last scored sample belongs to
    last_truth: str | None = None
    # The window's counts, kept as samples come and go (the summary is made on every scored answer).
    correct: int = 0
    fired: int = 0
    fired_correct: int = 0
    truth_counts: Counter[str] = field(default_factory=Counter)  # the window's truths (where known)
    history: deque[tuple[int, float, float | None, bool]] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    # The newest `recent` window samples `fitted` fires on, as (their index, correct): what `held` reads.
    # A sample's index counts the samples appended since `samples` was last replaced (`_appended`).
    _firing: deque[tuple[int, bool]] = field(default_factory=deque, init=False, repr=False)
    _firing_hits: int = field(default=0, init=False, repr=False)
    _firing_for: dict[str, float] | None = field(default=None, init=False, repr=False)  # the `fitted` it was kept for
    _appended: int = field(default=0, init=False, repr=False)

    def expect(self, version: int, choice: str, threshold: float = math.inf) -> bool:
        """The truth at `version`: sent with the push that makes it, or later (a forecast's). Scores
        the answer made there if it is waiting (True; `threshold`: the gate's fixed one now, for the
        summary), else keeps the truth for it."""
        waiting = self.answers.pop(version, None)
        if waiting is not None:
            self._add(version, choice, *waiting, threshold)
            return True
        if version <= self.last_answered:
            return False  # answered versions are past it and none was made there: nothing to judge
        self.truths[version] = choice
        if len(self.truths) > MAX_PENDING:  # entries skipped these versions (lag): forget the oldest
            del self.truths[min(self.truths)]
        return False

    def score(self, version: int, answer: str, gap: float, fired: bool, threshold: float) -> bool:
        """Score the answer made at `version`; False when its truth has not come (the answer then
        waits for it: a forecast's truth comes with a later push)."""
        self.last_answered = max(self.last_answered, version)
        truth = self.truths.pop(version, None)
        for stale in [v for v in self.truths if v < version]:  # older versions will get no answer now
            del self.truths[stale]
        if truth is None:
            self.answers[version] = (answer, gap, fired)
            if len(self.answers) > MAX_PENDING:  # truths that never come (a label still warming up)
                del self.answers[min(self.answers)]
            return False
        self._add(version, truth, answer, gap, fired, threshold)
        return True

    def _add(self, version: int, truth: str, answer: str, gap: float, fired: bool, threshold: float) -> None:
        truth = truth.casefold()
        self.last_scored = (version, truth, answer.casefold() == truth)
        if truth != self.last_truth:
            self.run, self.last_truth = self.run + 1, truth
        sample = (gap, answer.casefold() == truth, fired, answer.casefold(), self.run, truth)
        self.samples.append(sample)
        self._count(sample, 1)
        self._appended += 1
        self._note_firing(sample, self._appended - 1)
        if len(self.samples) > self.window:
            self._count(self.samples.popleft(), -1)
            if self._firing and self._firing[0][0] == self._appended - len(self.samples) - 1:  # it fired: out too
                self._firing_hits -= self._firing.popleft()[1]
        self.scored += 1
        if self.target is not None:
            if self.scored % RETUNE_EVERY == 0 or (not self.fitted and self._could_open()):
                self.fitted = self.fit()
            self._hold_or_open()
        if self.scored % HISTORY_EVERY == 0:
            self.history.append(self._point())
        self.summary = self._summary(threshold)

    def _point(self) -> tuple[int, float, float | None, bool]:
        newest = list(itertools.islice(reversed(self.samples), HISTORY_SPAN))
        truths = Counter(s[5] for s in newest if s[5] is not None)
        base = max(truths.values()) / truths.total() if truths else None
        return (self.scored, round(sum(s[1] for s in newest) / len(newest), 4),
                None if base is None else round(base, 4), math.isfinite(self.threshold) if self.target is not None
                else any(s[2] for s in newest))

    def export(self) -> dict:
        """The window as JSON-able data (snapshots, evictions, moves): an auto gate restored from it
        opens where it was, not closed again until 30 new fired samples over 5 truth runs."""
        return {"samples": [list(s) for s in self.samples], "scored": self.scored, "run": self.run,
                "last_truth": self.last_truth, "history": [list(p) for p in self.history]}

    def restore(self, saved: dict, fixed_threshold: float) -> None:
        """Take back an `export`ed window (its newest `window` samples); thresholds and figures are
        refitted from it. Raises ValueError naming what is malformed (`read_window`)."""
        samples, scored, run, last_truth = read_window(saved)
        self.history = deque(read_history(saved), maxlen=HISTORY_POINTS)
        self.samples = deque(samples[-self.window:])
        self._appended, self._firing_for = len(self.samples), None
        self.correct = self.fired = self.fired_correct = 0
        self.truth_counts = Counter()
        for sample in self.samples:
            self._count(sample, 1)
        self.scored, self.run, self.last_truth = max(scored, len(self.samples)), run, last_truth
        if self.target is not None:
            self.fitted = self.fit()
            self._hold_or_open()
        self.summary = self._summary(fixed_threshold) if self.samples else None

    @property
    def threshold(self) -> float:
        """The lowest live threshold over the answers (inf: the gate is closed for every answer)."""
        return min(self.thresholds.values(), default=math.inf)

    def threshold_for(self, answer: str) -> float:
        return self.thresholds.get(answer.casefold(), math.inf)

    def _hold_or_open(self) -> None:
        """Put `fitted` in force unless the newest `recent` window answers it would fire on miss the target."""
        if self._firing_for != self.fitted:
            self._gather_firing()
        n, hits = len(self._firing), self._firing_hits
        self.held = n >= self.recent and hits / n < self.target
        self.thresholds = {} if self.held else self.fitted

    def _note_firing(self, sample: Sample, index: int) -> None:
        """A new window sample: one of the newest that `fitted` fires on, if it fires."""
        if self._firing_for is None:
            return  # gathered afresh before it is read
        threshold = self._firing_for.get(sample[3])
        if threshold is not None and sample[0] >= threshold:
            self._firing.append((index, sample[1]))
            self._firing_hits += sample[1]
            if len(self._firing) > self.recent:
                self._firing_hits -= self._firing.popleft()[1]

    def _gather_firing(self) -> None:
        """`_firing` from the window, newest first back to `recent` of them (after a refit changed `fitted`)."""
        fitted = dict(self.fitted)
        found: list[tuple[int, bool]] = []
        if fitted:
            newest = self._appended - 1
            for back, (gap, correct, _, answer, *_) in enumerate(reversed(self.samples)):
                threshold = fitted.get(answer)
                if threshold is not None and gap >= threshold:
                    found.append((newest - back, correct))
                    if len(found) == self.recent:
                        break
        self._firing = deque(reversed(found))
        self._firing_hits = sum(correct for _, correct in found)
        self._firing_for = fitted

    def _could_open(self) -> bool:
        """Whether the window holds enough samples over enough truth runs for any answer to open:
        only then does a closed gate refit on every sample."""
        return len(self.samples) >= self.min_evidence and self.run - self.samples[0][4] + 1 >= self.min_runs

    def fit(self) -> dict[str, float]:
        """Per answer: the lowest threshold whose window samples giving that answer, at or above
        it, reach the target precision (its lower bound at `confidence`) on at least min_evidence
        of them from at least min_runs truth runs; answers with no such threshold are absent (closed).

        One pass per answer down its gaps (the risk-coverage curve, engine/standing/gate.py, with each
        point's truth runs): coverage grows along the pass, so the last point that qualifies is
        the most-covering one (`threshold_for_precision`'s pick)."""
        by_answer: dict[str, list[tuple[float, bool, int]]] = {}
        for gap, correct, _, answer, run, _ in self.samples:
            by_answer.setdefault(answer, []).append((gap, correct, run))
        out: dict[str, float] = {}
        z = NormalDist().inv_cdf(self.confidence)
        for answer, mine in by_answer.items():
            n = len(mine)
            if n < self.min_evidence:
                continue
            mine.sort(key=itemgetter(0), reverse=True)
            hits, runs, best = 0, set(), None
            for fired, (gap, correct, run) in enumerate(mine, start=1):
                hits += correct
                runs.add(run)
                if fired < n and mine[fired][0] == gap:
                    continue  # a threshold fires on the whole tie: judge it at the tie's last sample
                if (fired >= self.min_evidence and len(runs) >= self.min_runs
                        and precision_floor(hits, fired, z) >= self.target):
                    best = gap
            if best is not None:
                out[answer] = float(best)
        return out

    def _count(self, sample: Sample, sign: int) -> None:
        _, correct, fired, _, _, truth = sample
        self.correct += sign * correct
        self.fired += sign * fired
        self.fired_correct += sign * (fired and correct)
        if truth is not None:
            self.truth_counts[truth] += sign
            if not self.truth_counts[truth]:
                del self.truth_counts[truth]

    def _summary(self, fixed_threshold: float) -> CalibrationSummary:
        """The window's figures; the threshold is the live one under auto, else the gate's fixed one."""
        threshold = self.threshold if self.target is not None else fixed_threshold
        n, fired, known = len(self.samples), self.fired, self.truth_counts.total()
        return CalibrationSummary(
            n, self.scored, self.fired_correct / fired if fired else None, fired / n if n else None,
            self.correct / n if n else None, threshold if math.isfinite(threshold) else None, self.target,
            self.confidence if self.target is not None else None,
            max(self.truth_counts.values()) / known if known else None, tuple(self.history), self.held)


def read_window(saved: Any) -> tuple[list[Sample], int, int, str | None]:
    """An `export`ed window, checked: (samples, scored, run, last_truth); ValueError names what is
    malformed. Snapshot readers call it alone, before anything reaches the core. A window saved
    before samples kept their truth (5 fields) comes back with the truth unknown."""
    try:
        if any(len(s) not in (5, 6) for s in saved["samples"]):
            raise ValueError("a sample is [gap, correct, fired, answer, run, truth]")
        samples = [(float(g), bool(c), bool(f), str(a), int(r), None if not t or t[0] is None else str(t[0]))
                   for g, c, f, a, r, *t in saved["samples"]]
        scored, run, last_truth = int(saved["scored"]), int(saved["run"]), saved["last_truth"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"calibration window malformed ({exc!r})") from None
    if last_truth is not None and not isinstance(last_truth, str):
        raise ValueError(f"calibration window malformed (last_truth {last_truth!r})")
    read_history(saved)  # checked here too: snapshot readers call read_window alone
    return samples, scored, run, last_truth


def read_history(saved: Any) -> list[tuple[int, float, float | None, bool]]:
    """An exported learning curve (absent in windows saved before it was kept: empty)."""
    try:
        return [(int(n), float(a), None if b is None else float(b), bool(o)) for n, a, b, o in saved.get("history", [])]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"calibration history malformed ({exc!r})") from None


def precision_floor(hits: int, fired: int, z: float) -> float:
    """The lower end of the Wilson score interval for hits / fired at normal quantile z (z = 0: the
    point estimate). Wilson rather than the normal approximation: it stays inside [0, 1] and is not
    degenerate at hits == fired, which is where a good gate's high thresholds live. A few float
    operations, evaluated at every point of a refit's pass, so written out rather than imported."""
    p = hits / fired
    if z <= 0:
        return p
    z2 = z * z
    centre = p + z2 / (2 * fired)
    spread = z * math.sqrt(p * (1 - p) / fired + z2 / (4 * fired * fired))
    return (centre - spread) / (1 + z2 / fired)


def calibration_for(spec: Any, confidence: float | None = None, target: float | None = None) -> LiveCalibration:
    """A question's live calibration as the engine keeps it: its auto target and confidence (or these, for a
    replay judging it at others), and for a forecast the evidence its horizon asks for (`evidence_for`)."""
    horizon = spec.label.horizon if spec.label is not None else 0
    return LiveCalibration(spec.target_precision if target is None else target,
                           spec.auto_confidence if confidence is None else confidence,
                           min_evidence=evidence_for(horizon))
