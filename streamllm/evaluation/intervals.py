"""How sure a judged figure is: a percentile interval from a block bootstrap.

Neighbouring decision points are not independent samples. A label reads the last n bars,
so two samples fewer than n bars apart share most of what decides them, and a trend that
holds for 40 bars makes 40 right answers at once. Resampling single samples would give
intervals far too narrow (a Binance capture's 97 samples are a handful of market moves).
So the bootstrap resamples blocks of consecutive samples, each as long as the label's
history and never across two windows (or replays): Carlstein's non-overlapping block
bootstrap (1986). Each resample draws as many blocks as there are, with replacement,
and recomputes the figure on their samples; the interval is the middle `level` of the
recomputed figures.

A few lines of numpy: arch's bootstrap classes do the same but would bring scipy,
pandas and statsmodels into the core install for one index generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

LEVEL = 0.9  # the middle 90% of the resampled figures
REPS = 1000
SEED = 0  # fixed: a card written twice from the same samples shows the same intervals
MIN_BLOCKS = 4  # fewer: no interval (resampling 2 or 3 blocks, or 3 samples, says nothing)


def block_ids(groups: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    """Block of each sample: `groups[i]` the window (or replay) sample i comes from, `positions[i]`
    its bar there; a block holds the samples of `length` consecutive bars of one group. The ids
    depend on nothing else, so several sets over the same bars share them (shared_resamples)."""
    groups, positions = np.asarray(groups, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    if groups.shape != positions.shape:
        raise ValueError(f"{len(groups)} groups but {len(positions)} positions")
    return (groups << 32) + positions // max(1, length)


def resamples(blocks: np.ndarray, reps: int = REPS, seed: int = SEED) -> list[np.ndarray]:
    """`reps` resamples of sample indices: each draws as many blocks as there are, with replacement,
    and takes all of their samples (a block drawn twice counts twice). Empty below MIN_BLOCKS."""
    return [one for (one,) in shared_resamples([blocks], reps, seed)]


def shared_resamples(blocks_per_set: Sequence[np.ndarray], reps: int = REPS, seed: int = SEED) -> list[list[np.ndarray]]:
    """Resamples of several sets over one space of blocks (a replay's questions share its bars, so the
    weakest question's figure is resampled with the others'): each draw picks blocks of their union
    and gives every set its samples in them."""
    blocks_per_set = [np.asarray(b, dtype=np.int64) for b in blocks_per_set]
    universe = np.unique(np.concatenate(blocks_per_set)) if blocks_per_set else np.empty(0, np.int64)
    if len(universe) < MIN_BLOCKS:
        return []
    members = []
    for blocks in blocks_per_set:
        order = np.argsort(blocks, kind="stable")
        lo, hi = (np.searchsorted(blocks[order], universe, side) for side in ("left", "right"))
        members.append([order[a:b] for a, b in zip(lo, hi, strict=True)])
    draws = np.random.default_rng(seed).integers(0, len(universe), (reps, len(universe)))
    return [[np.concatenate([m[b] for b in draw]) for m in members] for draw in draws]


def percentile_interval(values: Sequence[float | None], level: float = LEVEL) -> tuple[float, float] | None:
    """The middle `level` of the resampled figures (None where the figure is undefined: skipped)."""
    got = np.array([v for v in values if v is not None], dtype=np.float64)
    if len(got) == 0:
        return None
    lo, hi = np.quantile(got, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def block_intervals(stats: dict[str, Callable[[np.ndarray], float | None]], blocks: np.ndarray, *,
                    reps: int = REPS, level: float = LEVEL, seed: int = SEED) -> dict[str, tuple[float, float]]:
    """Interval of each `stat(sample indices)`, all over the same block resamples; {} below MIN_BLOCKS."""
    draws = resamples(blocks, reps, seed)
    got = {name: percentile_interval([stat(idx) for idx in draws], level) for name, stat in stats.items()} if draws else {}
    return {name: span for name, span in got.items() if span is not None}


def block_interval(stat: Callable[[np.ndarray], float | None], blocks: np.ndarray, *, reps: int = REPS,
                   level: float = LEVEL, seed: int = SEED) -> tuple[float, float] | None:
    """Interval of `stat(sample indices)` over block resamples; None below MIN_BLOCKS blocks."""
    return block_intervals({"stat": stat}, blocks, reps=reps, level=level, seed=seed).get("stat")


def rounded(span: tuple[float, float] | None) -> list[float] | None:
    """An interval as a report writes it: [low, high] to 4 decimals."""
    return None if span is None else [round(span[0], 4), round(span[1], 4)]


def coverage_at_precision(gaps: np.ndarray, correct: np.ndarray, target: float) -> float:
    """The largest share of samples a gate can fire on (gap >= threshold, thresholds at the samples'
    gaps) with its fired answers at least `target` precise; 0.0 where none is. numpy's equal of
    scoring.threshold_for_precision(risk_coverage(...)).coverage, for thousands of resamples."""
    gaps, correct = np.asarray(gaps, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    if len(gaps) == 0:
        return 0.0
    order = np.argsort(-gaps, kind="stable")
    g, hits = gaps[order], np.cumsum(correct[order])
    fired = np.arange(1, len(g) + 1)
    last_of_tie = np.r_[g[1:] != g[:-1], True]  # a threshold fires on every sample of its gap
    ok = last_of_tie & (hits / fired >= target)
    return float(fired[ok].max()) / len(g) if ok.any() else 0.0


def gate_intervals(correct: np.ndarray, gaps: np.ndarray, blocks: np.ndarray, target: float, *,
                   reps: int = REPS, level: float = LEVEL) -> dict[str, tuple[float, float]]:
    """Intervals of a set's accuracy and its coverage at `target` precision (its own threshold), over
    the same resamples: keys "accuracy" and "coverage_at_target"; {} below MIN_BLOCKS blocks."""
    correct, gaps = np.asarray(correct, dtype=np.float64), np.asarray(gaps, dtype=np.float64)
    return block_intervals({"accuracy": lambda i: float(correct[i].mean()),
                            "coverage_at_target": lambda i: coverage_at_precision(gaps[i], correct[i], target)},
                           blocks, reps=reps, level=level)


def judged_intervals(correct: np.ndarray, gaps: np.ndarray, blocks: np.ndarray, target: float, *,
                     reps: int = REPS, level: float = LEVEL) -> dict[str, list[float]]:
    """gate_intervals as a card writes them: `accuracy_interval` and `coverage_at_target_interval`."""
    return {f"{name}_interval": rounded(span)
            for name, span in gate_intervals(correct, gaps, blocks, target, reps=reps, level=level).items()}
