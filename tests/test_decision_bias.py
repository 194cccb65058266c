"""evaluation/decision_bias.py: the bias that is right most often, and a replay that only fits on the past."""

from __future__ import annotations

import random

import pytest

from streamllm.evaluation.decision_bias import biased_replay, fit_bias


def _right(margins, positive, bias):
    return sum((m + bias > 0) == p for m, p in zip(margins, positive, strict=True))


@pytest.mark.parametrize("seed", range(6))
def test_fit_bias_is_right_as_often_as_any_bias(seed: int) -> None:
    """Against every bias that can change an answer (each margin's edge, and past both ends)."""
    rng = random.Random(seed)
    n = rng.randint(5, 80)
    lean = rng.uniform(-2, 2)
    positive = [rng.random() < 0.4 for _ in range(n)]
    margins = [round(rng.gauss(1 if p else -1, 1) + lean, 1) for p in positive]  # rounded: ties
    candidates = [-m + d for m in margins for d in (-1e-9, 1e-9)] + [-max(margins) - 1, -min(margins) + 1, 0.0]
    best = max(_right(margins, positive, b) for b in candidates)
    b = fit_bias(margins, positive)
    if b != 0.0:
        assert _right(margins, positive, b) == best
        assert best - _right(margins, positive, 0.0) >= 3  # moved off 0 only for 3 more right answers
        # ... the one of the best whose nearest edge is nearest 0: the same answers as that edge gives.
        nearest = min((c for c in candidates if _right(margins, positive, c) == best), key=abs)
        assert [m + b > 0 for m in margins] == [m + nearest > 0 for m in margins]
    else:
        assert best - _right(margins, positive, 0.0) < 3
    assert fit_bias([], []) == 0.0


def test_fit_bias_at_the_ends() -> None:
    """Best answering the first choice everywhere, or nowhere: a bias past every margin."""
    up = [-3.0, -2.0, -1.0, -0.5]
    assert all(m + fit_bias(up, [True] * 4) > 0 for m in up)
    down = [0.5, 1.0, 2.0, 3.0]
    assert all(m + fit_bias(down, [False] * 4) <= 0 for m in down)
    assert fit_bias(up, [True, True, False, False], min_gain=1) == 0.0  # ranked backwards: no bias helps
    assert fit_bias(up[:2], [True, True]) == 0.0  # 2 more right answers: below MIN_GAIN


def test_a_leaning_head_is_set_straight_and_a_blind_one_is_left_alone() -> None:
    rng = random.Random(1)
    truths = [rng.choice(["up", "down"]) for _ in range(600)]
    # Ranks the truths but leans 'down' by 2: the argmax says 'down' far too often.
    signed = [rng.gauss(1.0 if t == "up" else -1.0, 0.7) - 2.0 for t in truths]
    answers = ["up" if m > 0 else "down" for m in signed]
    gaps = [abs(m) for m in signed]
    argmax = sum(a == t for a, t in zip(answers, truths, strict=True)) / len(truths)
    replay = biased_replay(answers, gaps, truths, "Up")
    assert argmax < 0.7 and replay.accuracy > argmax + 0.2
    assert replay.first == "Up" and replay.last_bias == pytest.approx(2.0, abs=0.5)
    # A margin that does not tell the truths apart gains nothing a window could trust.
    noise = [rng.gauss(0, 1) for _ in truths]
    blind = biased_replay(["up" if m > 0 else "down" for m in noise], [abs(m) for m in noise], truths, "up")
    assert abs(blind.accuracy - 0.5) < 0.08


def test_the_replay_answers_each_sample_from_the_samples_before_it() -> None:
    """Truths from a point on cannot change the answers up to it (each is fitted on earlier samples):
    flipping every later truth leaves those answers as they were, and changes later ones."""
    rng = random.Random(2)
    truths = [rng.choice(["yes", "no"]) for _ in range(300)]
    signed = [rng.gauss(1.0 if t == "yes" else -1.0, 1.0) - 1.0 for t in truths]
    answers, gaps = ["yes" if m > 0 else "no" for m in signed], [abs(m) for m in signed]
    flipped = truths[:200] + ["no" if t == "yes" else "yes" for t in truths[200:]]
    kept, changed = biased_replay(answers, gaps, truths, "yes"), biased_replay(answers, gaps, flipped, "yes")
    assert kept.says_first[:201] == changed.says_first[:201]  # sample 200 is fitted on 0..199 only
    assert kept.says_first[201:] != changed.says_first[201:]
    assert len(kept.says_first) == 300 and kept.said_first == sum(kept.says_first)
