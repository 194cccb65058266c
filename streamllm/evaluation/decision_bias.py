"""Would a live decision bias help? A question's answers replayed with a bias fitted as they come.

A head decides a two-choice question by the sign of its margin toward the first choice. On a
market it never saw that margin may still rank the truths well (calibrate's `ranks`) while
leaning to one side: on EURUSD the trend head says "up" on 810 bars where 1,122 are up. A
bias b added to the margin moves the decision point; fitted on the answers already scored,
it is what a live calibration could learn. This replays that: each sample is answered with
the sign of margin + b, b fitted on the WINDOW samples before it (never on itself), and
scored. The engine does not do this yet; calibrate reports it so that a market's samples say
whether it would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamllm.engine.standing.calibration import MIN_EVIDENCE, RETUNE_EVERY, WINDOW
from streamllm.evaluation.scoring import signed_margins

MIN_GAIN = 3  # right answers a bias must add on its window before it moves off 0 (noise stays at 0)


def fit_bias(margins: Sequence[float], positive: Sequence[bool], min_gain: int = MIN_GAIN) -> float:
    """The b for which sign(margin + b) agrees with `positive` most often, nearest 0 among the best;
    0 unless it gets at least `min_gain` more right than b = 0 does. One sort and one pass: answering
    the first choice for the k largest margins gets right the positives among them plus the
    negatives below them."""
    n = len(margins)
    if n == 0:
        return 0.0
    at_zero = sum((m > 0) == p for m, p in zip(margins, positive, strict=True))
    order = sorted(range(n), key=lambda i: -margins[i])
    negatives = n - sum(positive)
    best, best_ks, right = negatives, [0], negatives  # k = 0: the second choice everywhere
    for k, i in enumerate(order, start=1):
        right += 1 if positive[i] else -1
        if k < n and margins[order[k]] == margins[i]:
            continue  # a bias cannot split a tie
        if right > best:
            best, best_ks = right, [k]
        elif right == best:
            best_ks.append(k)
    if best - at_zero < min_gain:
        return 0.0

    def interval(k: int) -> tuple[float, float]:  # (low, high]: the biases answering the first choice for the top k
        low = -math.inf if k == 0 else -margins[order[k - 1]]  # above it the k-th margin + b > 0
        high = math.inf if k == n else -margins[order[k]]  # up to it the (k+1)-th margin + b <= 0
        return low, high

    def bias_for(k: int) -> float:  # inside its interval, midway when it is bounded
        low, high = interval(k)
        return high - 1.0 if low == -math.inf else low + 1.0 if high == math.inf else (low + high) / 2

    # The best interval nearest 0 (0 itself is never inside one: that would have gained nothing).
    return bias_for(min(best_ks, key=lambda k: min(abs(e) for e in interval(k))))


@dataclass(frozen=True, slots=True)
class BiasedReplay:
    first: str  # the first choice, whose margin the bias moves
    accuracy: float | None  # right / samples, each answered with the bias fitted before it
    right_first: int  # answers of the first choice that were right
    last_bias: float  # the bias fitted on the replay's last window
    says_first: tuple[bool, ...] = field(default=(), repr=False)  # per sample: answered the first choice

    @property
    def said_first(self) -> int:
        """Samples answered with the first choice."""
        return sum(self.says_first)


def biased_replay(answers: Sequence[str], gaps: Sequence[float], truths: Sequence[str], first: str,
                  window: int = WINDOW, min_samples: int = MIN_EVIDENCE) -> BiasedReplay:
    """Each sample answered by sign(margin + b), b from `fit_bias` on up to `window` samples before it,
    refitted every RETUNE_EVERY samples as the engine refits a live threshold (0 until `min_samples`
    are in); answers and truths compared casefolded."""
    margins, positive = signed_margins(answers, gaps, truths, first)
    right = said_right = 0
    bias, says = 0.0, []
    for i, (m, p) in enumerate(zip(margins, positive, strict=True)):
        lo = max(0, i - window)
        if i - lo >= min_samples and i % RETUNE_EVERY == 0:
            bias = fit_bias(margins[lo:i], positive[lo:i])
        says_first = m + bias > 0
        says.append(says_first)
        right += says_first == p
        said_right += says_first and p
    return BiasedReplay(first, right / len(margins) if margins else None, said_right, bias, tuple(says))
