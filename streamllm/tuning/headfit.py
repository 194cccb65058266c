"""Fitting and judging choice heads on extracted decision-point states (convex, seconds).

Per question: multinomial logistic regression over the standardized final hidden state,
L2 chosen on the development range (later than training), the gate's margin threshold
calibrated there to the target precision, then everything judged on held-out sets
(a later time range, other instruments, synthetic regimes) it never saw. The
standardization is folded into the saved weight and bias, so serving is W h + b.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from streamllm.evaluation.intervals import judged_intervals
from streamllm.evaluation.scoring import (
    balanced_accuracy,
    margin_ranking,
    risk_coverage,
    threshold_for_precision,
)

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
MIN_FIRED = 10  # a threshold resting on fewer fired dev samples is noise: the gate stays closed


@dataclass(slots=True)
class HeadFit:
    weight: torch.Tensor  # [C, H], on raw hidden states
    bias: torch.Tensor  # [C]
    l2: float
    steps: int  # LBFGS iterations, all grid points together
    dev_loss: float


def _fit_one(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float, max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor, int]:
    w = torch.zeros(classes, x.shape[1], requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=max_iter, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-6, tolerance_change=1e-9)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum() / 2
        loss.backward()
        return loss

    opt.step(closure)
    steps = int(opt.state[w].get("n_iter", 0))  # LBFGS keeps its counters on the first parameter
    return w.detach(), b.detach(), steps


def fit_head(x: torch.Tensor, y: torch.Tensor, x_dev: torch.Tensor, y_dev: torch.Tensor, classes: int,
             grid: tuple[float, ...] = L2_GRID) -> HeadFit:
    """Fit on (x, y), pick L2 by dev log-loss; returns weights on raw (unstandardized) states."""
    with torch.enable_grad():
        mu = x.mean(0)
        sd = x.std(0).clamp_min(1e-6)
        xs, xds = (x - mu) / sd, (x_dev - mu) / sd
        best: HeadFit | None = None
        total_steps = 0
        for l2 in grid:
            w, b, steps = _fit_one(xs, y, classes, l2)
            total_steps += steps
            dev_loss = float(torch.nn.functional.cross_entropy(xds @ w.T + b, y_dev)) if len(y_dev) else math.nan
            if best is None or dev_loss < best.dev_loss:
                weight = w / sd
                best = HeadFit(weight, b - weight @ mu, l2, 0, dev_loss)
    assert best is not None
    best.steps = total_steps
    return best


def margins(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winning choice index, best minus second-best logit) per row."""
    top = logits.topk(2, dim=1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def calibrate_threshold(logits: torch.Tensor, y: torch.Tensor, target: float) -> float:
    """The smallest margin whose fired answers reach `target` precision on these samples (inf: none)."""
    pred, gap = margins(logits)
    point = threshold_for_precision(risk_coverage(gap.tolist(), (pred == y).tolist()), target)
    if point is None or point.coverage * len(y) < MIN_FIRED:
        return math.inf
    return point.threshold


def judge(logits: torch.Tensor, y: torch.Tensor, choices: tuple[str, ...], threshold: float, target: float,
          blocks: np.ndarray | None = None) -> dict:
    """Accuracy, base rate, and the gate at `threshold` (calibrated elsewhere) and at this set's own best;
    with each sample's block (evaluation/intervals.py), intervals of the accuracy and that coverage too."""
    n = len(y)
    if n == 0:
        return {"samples": 0}
    pred, gap = margins(logits)
    correct = pred == y
    counts = Counter(y.tolist())
    majority, majority_n = counts.most_common(1)[0]
    fired = gap >= threshold
    fired_n = int(fired.sum())
    oracle = threshold_for_precision(risk_coverage(gap.tolist(), correct.tolist()), target)
    return {
        "samples": n,
        "accuracy": round(float(correct.float().mean()), 4),
        "base_rate": round(majority_n / n, 4),
        "majority": choices[majority],
        "coverage": round(fired_n / n, 4),  # at the dev-calibrated threshold
        "precision": round(float(correct[fired].float().mean()), 4) if fired_n else None,
        "coverage_at_target": round(oracle.coverage, 4) if oracle else 0.0,  # this set's own best threshold
        "answer_share": round(Counter(pred.tolist()).most_common(1)[0][1] / n, 4),
        "balanced_accuracy": round(balanced_accuracy(pred.tolist(), y.tolist()), 4),
        "ranks": _ranks(pred, gap, y, choices),
        **probability_quality(logits, y),
        **({} if blocks is None else judged_intervals(correct.numpy(), gap.numpy(), blocks, target)),
    }


def _ranks(pred: torch.Tensor, gap: torch.Tensor, y: torch.Tensor, choices: tuple[str, ...]) -> float | None:
    """How well the margin ranks the truths (evaluation/scoring.margin_ranking, as calibrate reports it):
    near 0.5 the head cannot tell them apart; high with a low balanced accuracy, only its decision
    point is off."""
    rank = margin_ranking([choices[i] for i in pred.tolist()], gap.tolist(), [choices[i] for i in y.tolist()],
                          choices[0])
    return None if rank is None else round(rank, 4)


def probability_quality(logits: torch.Tensor, y: torch.Tensor, bins: int = 10) -> dict[str, float]:
    """How honest the answer's choice probabilities are: log loss, and the expected calibration error
    (the top choice's probability against how often it was right, over `bins` bins of probability)."""
    probs = torch.softmax(logits.float(), dim=1)
    top, pred = probs.max(dim=1)
    right = (pred == y).float()
    edges = torch.linspace(1.0 / len(logits[0]), 1.0, bins + 1)
    which = torch.bucketize(top, edges[1:-1])
    ece = sum(float((top[which == b] - right[which == b]).sum().abs()) for b in range(bins)) / len(y)
    return {"log_loss": round(float(torch.nn.functional.cross_entropy(logits.float(), y)), 4),
            "ece": round(ece, 4), "mean_top_probability": round(float(top.mean()), 4)}
