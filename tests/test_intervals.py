"""Block-bootstrap intervals (evaluation/intervals.py): the numpy gate curve against the engine's own, and
intervals that are honest about neighbouring samples."""

from __future__ import annotations

import numpy as np
import pytest

from streamllm.evaluation.intervals import (
    block_ids,
    block_interval,
    coverage_at_precision,
    judged_intervals,
    resamples,
)
from streamllm.evaluation.scoring import risk_coverage, threshold_for_precision


@pytest.mark.parametrize("seed", range(40))
def test_coverage_at_precision_is_the_engines_own_curve(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    gaps = rng.integers(0, 8, n) * 0.5  # few distinct gaps: ties, where a threshold fires on all of one gap
    correct = rng.random(n) < rng.uniform(0.3, 1.0)
    for target in (0.5, 0.8, 0.9, 1.0):
        point = threshold_for_precision(risk_coverage(gaps.tolist(), correct.tolist()), target)
        assert coverage_at_precision(gaps, correct, target) == pytest.approx(point.coverage if point else 0.0)


def test_blocks_hold_consecutive_bars_of_one_window():
    groups = [0] * 7 + [1] * 5
    positions = list(range(7)) + list(range(3, 8))
    ids = block_ids(groups, positions, 3)
    # window 0: bars 0-2, 3-5, 6; window 1: bars 3-5, 6-7 (blocks are bar ranges, not sample counts)
    assert [len(set(ids[:7][i:j])) for i, j in ((0, 3), (3, 6), (6, 7))] == [1, 1, 1]
    assert len(set(ids[:7])) == 3 and len(set(ids[7:])) == 2
    assert not set(ids[:7]) & set(ids[7:])  # no block spans two windows


def test_resamples_draw_whole_blocks_and_need_enough_of_them():
    blocks = np.repeat(np.arange(4), [3, 1, 2, 5])
    for idx in resamples(blocks, reps=50):
        drawn = blocks[idx]
        for b in np.unique(drawn):  # a drawn block comes with all its samples, once per draw
            assert (drawn == b).sum() % (blocks == b).sum() == 0
    assert resamples(np.repeat(np.arange(3), 3)) == []  # 3 blocks: too few to say anything
    assert block_interval(lambda i: 0.5, np.zeros(9, dtype=int)) is None


def test_runs_of_right_answers_widen_the_interval_honestly():
    """A market that trends for 20 bars makes 20 right (or wrong) answers at once: resampling single
    samples would claim a precision the data does not have."""
    rng = np.random.default_rng(1)
    runs = rng.random(20) < 0.6  # 20 regimes, each 20 bars all right or all wrong
    correct = np.repeat(runs, 20).astype(float)
    groups, positions = np.zeros(400, dtype=int), np.arange(400)
    one_by_one = block_interval(lambda i: correct[i].mean(), block_ids(groups, positions, 1))
    by_label = block_interval(lambda i: correct[i].mean(), block_ids(groups, positions, 20))
    assert by_label[1] - by_label[0] > 3 * (one_by_one[1] - one_by_one[0])
    assert by_label[0] < correct.mean() < by_label[1]


def test_ninety_percent_intervals_cover_the_truth_about_ninety_percent_of_the_time():
    rng = np.random.default_rng(7)
    truth, covered, trials = 0.7, 0, 200
    for _ in range(trials):  # independent regimes of 10 bars: blocks of 10 are exchangeable
        correct = np.repeat(rng.random(30) < truth, 10).astype(float)
        lo, hi = block_interval(lambda i, c=correct: c[i].mean(), block_ids(np.zeros(300, int), np.arange(300), 10),
                                reps=300, seed=int(rng.integers(1 << 30)))
        covered += lo <= truth <= hi
    assert 0.8 <= covered / trials <= 0.97


def test_judged_intervals_bracket_the_figures():
    rng = np.random.default_rng(3)
    correct = rng.random(300) < 0.8
    gaps = rng.random(300) + correct * 0.5  # right answers carry larger margins: the gate has something to cut
    got = judged_intervals(correct, gaps, block_ids(np.zeros(300, int), np.arange(300), 10), 0.9)
    lo, hi = got["accuracy_interval"]
    assert lo < correct.mean() < hi
    lo, hi = got["coverage_at_target_interval"]
    assert lo <= coverage_at_precision(gaps, correct, 0.9) <= hi
    assert judged_intervals(correct, gaps, np.zeros(300, dtype=int), 0.9) == {}
