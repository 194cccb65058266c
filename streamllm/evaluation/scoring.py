"""Scoring a gate on recorded samples: risk-coverage curves, the threshold reaching a target precision,
balanced accuracy, how well the margins rank the truths, and which choice a decoded answer names.

Offline statistics (`streamllm calibrate`, `streamllm tune`, their reports); the runtime decision
is streamllm/engine/standing/gate.py.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class RiskCoveragePoint(NamedTuple):
    threshold: float  # the gate fires when gap >= threshold
    coverage: float  # fraction of questions on which it fires
    precision: float  # fraction of fired answers that are correct


def risk_coverage(gaps: Sequence[float], correct: Iterable[bool]) -> list[RiskCoveragePoint]:
    """One point per distinct gap, thresholds ascending (coverage descending).

    `gaps[i]` is the gate's gap on sample i and `correct[i]` whether its gated
    answer matched the label. Setting the threshold to a sample's gap fires on every
    sample with a gap at least as large.
    """
    correct = [bool(c) for c in correct]
    if len(correct) != len(gaps):
        raise ValueError(f"{len(gaps)} gaps but {len(correct)} correctness flags")
    order = sorted(range(len(gaps)), key=lambda i: gaps[i], reverse=True)
    points: list[RiskCoveragePoint] = []
    hits = 0
    total = len(order)
    for fired, i in enumerate(order, start=1):
        hits += correct[i]
        is_last_of_tie = fired == total or gaps[order[fired]] != gaps[i]
        if is_last_of_tie:
            points.append(RiskCoveragePoint(float(gaps[i]), fired / total, hits / fired))
    points.reverse()
    return points


def threshold_for_precision(
    curve: Sequence[RiskCoveragePoint | tuple[float, float, float]], target: float
) -> RiskCoveragePoint | None:
    """The point with the most coverage whose precision reaches `target`; None when none does."""
    reaching = [RiskCoveragePoint(*p) for p in curve if p[2] >= target]
    if not reaching:
        return None
    return max(reaching, key=lambda p: (p.coverage, -p.threshold))


def balanced_accuracy(answers: Sequence[object], truths: Sequence[object]) -> float | None:
    """Mean over the true answers seen of the share answered right (0.5 for always one answer of two):
    what accuracy hides when one answer dominates (a rare-event question says "no" on ~93% of bars)."""
    right = Counter(t for a, t in zip(answers, truths, strict=True) if a == t)
    seen = Counter(truths)
    return sum(right[t] / n for t, n in seen.items()) / len(seen) if seen else None


def signed_margins(answers: Sequence[str], gaps: Sequence[float], truths: Sequence[str],
                   first: str) -> tuple[list[float], list[bool]]:
    """Each answer's margin toward `first` (its gap, negated when it answered the other choice) and
    whether its truth is `first`; casefolded. What margin_ranking and a decision bias read."""
    first = first.casefold()
    margins = [g if a.casefold() == first else -g for a, g in zip(answers, gaps, strict=True)]
    return margins, [t.casefold() == first for t in truths]


def margin_ranking(answers: Sequence[str], gaps: Sequence[float], truths: Sequence[str], first: str) -> float | None:
    """How well the answers' margins rank the truths: the chance that a sample whose truth is `first`
    (choices[0]) leans further toward it than one whose truth is not (ties half), the ROC AUC of the
    signed margin (gap toward the answer, negated when the answer is not `first`). 0.5: the margin
    does not tell the truths apart, so no cutoff or bias on it can; near 1 with a low balanced
    accuracy: it ranks them, and only the decision point (0) is off. None without both truths.
    By ranks (Mann-Whitney U), ties sharing their mean rank; answers and truths compared casefolded."""
    margins, positive = signed_margins(answers, gaps, truths, first)
    n_pos = sum(positive)
    n_neg = len(positive) - n_pos
    if not n_pos or not n_neg:
        return None
    order = sorted(range(len(margins)), key=margins.__getitem__)
    rank_sum, i = 0.0, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and margins[order[j + 1]] == margins[order[i]]:
            j += 1
        rank_sum += ((i + j) / 2 + 1) * sum(positive[order[k]] for k in range(i, j + 1))
        i = j + 1
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def match_choice(text: str, choices: Sequence[str]) -> str | None:
    """The choice a decoded answer names first, as a whole word, any case ("The price is going
    up." -> "up"); None when it names none. Lets an entry-path answer to a choice question end
    as soon as the choice appears, and be reported in the question's own words."""
    best: tuple[int, str] | None = None
    for choice in choices:
        found = re.search(rf"(?<!\w){re.escape(choice)}(?!\w)", text, flags=re.IGNORECASE)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), choice)
    return None if best is None else best[1]
