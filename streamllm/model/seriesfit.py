"""Fitting series heads on line features (streamllm/model/adapter.py, engine/taps.py): offline by
`streamllm tune` on extracted windows, live by the engine's learner (engine/standing/learning.py) on a session's own.

A sample is one bar i of a window with a known label: its features are the window's
lines i-K+1 .. i (oldest first), exactly what the engine's LineTaps.window gives an
entry made after bar i. A window starts as a session does, so its first bars (fewer
than K lines, a known label) are samples too, read as the engine reads a session's
first lines: over the newest lags only (SeriesHead.reads). Every bar of every window
is a sample (the features come from the session's own ingest: no branch per sample),
so a few dozen windows give thousands. Lines are standardized on the training set
(folded back into the saved projection), weight decay is picked by development
log-loss (the mean over several minibatch orders; the head served is the mean of that
candidate's fits), the best step by development loss (early stopping), the gate's margin
threshold calibrated on the development range. With word features (engine/taps.py)
the fit also tries the words alone (a head that needs only a bar's change reads only
that, fewer weights to fit from a month of bars) and keeps whichever set the
development loss prefers (or, with choose="simplest", the words unless all features are
better by more than the fits' own spread); the unread features get zero weights, so the engine's
features stay one layout.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamllm.model.adapter import SeriesHead, series_width

LINES = 24  # K: lines a series head reads (the longest shipped label needs 21 bars)
RANK = 8  # R: numbers the head takes from each line
WEIGHT_DECAY = (1e-3, 1e-2, 1e-1)
STEPS, BATCH, EVAL_EVERY, LR = 600, 256, 20, 3e-3


@dataclass(slots=True)
class Samples:
    lines: torch.Tensor  # [M, F] every line of the set's windows
    index: torch.Tensor  # [N, K] rows of `lines` each sample reads, oldest first (left-filled: see reads)
    labels: torch.Tensor  # [N] choice index
    reads: torch.Tensor  # [N] lines each sample has: K, or fewer at a window's start (its newest `reads` count)
    window: torch.Tensor  # [N] which of the set's windows each sample comes from

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def mask(self) -> torch.Tensor:
        """[N, K]: which of `index`'s rows a sample has."""
        k = self.index.shape[1]
        return torch.arange(k) >= (k - self.reads)[:, None]

    def subset(self, keep: torch.Tensor) -> Samples:
        return Samples(self.lines, self.index[keep], self.labels[keep], self.reads[keep], self.window[keep])

    def logits(self, head: SeriesHead) -> torch.Tensor:
        """[N, C]: the served head's logits for each sample, on exactly the lines the engine would give it."""
        out = torch.empty(len(self), len(head.choices))
        k = self.index.shape[1]
        for n in self.reads.unique().tolist():
            rows = self.reads == n
            out[rows] = head.logits(self.lines[self.index[rows][:, k - n:]]).float()
        return out


def samples(windows: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int = LINES, least: int | None = None) -> Samples:
    """From (line features [W, F], labels [W] with -1 unknown) per window: every bar with a label and k
    lines, or with `least` to k - 1 lines at the window's start (least: None for whole windows only)."""
    least = k if least is None else max(1, min(least, k))
    lines, index, labels, reads, where, offset = [], [], [], [], [], 0
    for w, (feats, y) in enumerate(windows):
        for i in range(least - 1, len(y)):
            if y[i] >= 0:
                n = min(k, i + 1)
                first = offset + i - n + 1
                index.append(torch.cat([torch.full((k - n,), first), torch.arange(first, offset + i + 1)]))
                labels.append(int(y[i]))
                reads.append(n)
                where.append(w)
        lines.append(feats.float())
        offset += len(feats)
    width = lines[0].shape[1] if lines else 0
    return Samples(torch.cat(lines) if lines else torch.empty(0, width),
                   torch.stack(index) if index else torch.empty(0, k, dtype=torch.long),
                   torch.tensor(labels, dtype=torch.long), torch.tensor(reads, dtype=torch.long),
                   torch.tensor(where, dtype=torch.long))


@dataclass(slots=True)
class SeriesFit:
    proj: torch.Tensor  # [R, F] on raw line features
    proj_bias: torch.Tensor  # [R]
    lags: torch.Tensor  # [C, K, 2R]
    bias: torch.Tensor  # [C]
    weight_decay: float
    steps: int
    dev_loss: float
    features: str = "all"  # the feature set the head reads (feature_sets())
    # every candidate's development loss over its fits: (features, weight decay) -> (mean, standard error)
    candidates: dict[tuple[str, float], tuple[float, float]] | None = None


def feature_sets(hidden: int, words: int) -> dict[str, torch.Tensor]:
    """Column masks over a line's features [mean, last, word 1, ...] (each `hidden` wide) a fit may read."""
    width = series_width(hidden, words)
    sets = {"all": torch.ones(width, dtype=torch.bool)}
    if words:
        only = torch.zeros(width, dtype=torch.bool)
        only[2 * hidden:] = True
        sets["words"] = only
    return sets


class _Model(torch.nn.Module):
    def __init__(self, width: int, classes: int, k: int, rank: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, rank)
        self.lags = torch.nn.Parameter(torch.zeros(classes, k, 2 * rank))
        self.bias = torch.nn.Parameter(torch.zeros(classes))

    def forward(self, lines: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # series_logits, with each line projected once however many samples read it; lines a sample
        # lacks (a window's start) weigh nothing: series_logits on its newest lags, as served
        z = self.proj(lines)
        g = torch.cat([z, z.abs()], -1)[index] * mask[..., None]  # [N, K, 2R]
        return torch.einsum("nkr,ckr->nc", g, self.lags) + self.bias


def _stack(states: list[dict[str, torch.Tensor]], rank: int) -> dict[str, torch.Tensor]:
    """One head whose logits are the mean of the given heads': projections stacked (rank O*R), each
    head's lags over [z, |z|] placed by its rows, divided by O. Exactly series_logits' format."""
    o = len(states)
    lags = [s["lags"] for s in states]
    return {"proj.weight": torch.cat([s["proj.weight"] for s in states]),
            "proj.bias": torch.cat([s["proj.bias"] for s in states]),
            "lags": torch.cat([a[..., :rank] for a in lags] + [a[..., rank:] for a in lags], -1) / o,
            "bias": torch.stack([s["bias"] for s in states]).mean(0)}


def choose_candidate(spread: dict[tuple[str, float], tuple[float, float]], widths: dict[str, int],
                     rule: str) -> tuple[str, float]:
    """The (features, weight decay) served, from each candidate's (mean, standard error) development loss.
    "best": the lowest mean. "simplest": of the candidates whose mean is within one standard error of the
    lowest, the one reading the fewest columns (`widths`), then with the most weight decay."""
    best = min(spread, key=lambda c: spread[c][0])
    if rule == "best":
        return best
    near = [c for c in spread if spread[c][0] <= spread[best][0] + spread[best][1]]
    return min(near, key=lambda c: (widths[c[0]], -c[1]))


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """The same fit from the same samples in every run. The backward of the lines' gather (`[index]`)
    sums into shared rows, on several CPU threads in whatever order they finish; without
    deterministic kernels two processes fitting the same states can serve different heads."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _mean_se(losses: list[float]) -> tuple[float, float]:
    mean = sum(losses) / len(losses)
    if len(losses) < 2:
        return mean, 0.0
    return mean, float(np.std(losses, ddof=1) / np.sqrt(len(losses)))


def fit_series(train: Samples, dev: Samples, classes: int, *, k: int = LINES, rank: int = RANK,
               grid: Sequence[float] = WEIGHT_DECAY, steps: int = STEPS, seed: int = 0,
               sets: dict[str, torch.Tensor] | None = None, orders: int = 1, choose: str = "best",
               budget_s: float | None = None) -> SeriesFit:
    """sets: candidate feature sets (column masks, feature_sets()); default all columns.

    budget_s: wall seconds for all the fits together (live learning): once spent, a fit ends at its
    next evaluation with the best step so far (the fit is then no longer reproducible to the bit).

    choose: "best" serves the candidate of the lowest mean development loss; "simplest" the one with the
    fewest features (then the largest weight decay) whose mean is within one standard error (over the
    orders) of the best's: the one-standard-error rule. Where candidates differ by less than the orders'
    own spread, which is lowest depends on the minibatch draws more than on the data; "simplest"
    settles such ties on the smaller head.

    orders: fits per candidate, each from its own initial weights and minibatch order. Which 600
    minibatches a fit draws moves its optimum about as much as a change of features does, so a
    candidate (features, weight decay) is chosen by its mean development loss
    over the orders, and the head served is the mean of that candidate's fits. Order o draws the same
    minibatches for every candidate: candidates are compared on the same draws."""
    if len(train) == 0 or len(dev) == 0:
        raise ValueError("a series head needs training and development samples")
    if orders < 1:
        raise ValueError(f"orders must be >= 1, got {orders}")
    if choose not in ("best", "simplest"):
        raise ValueError(f"choose must be best or simplest, got {choose!r}")
    width = train.lines.shape[1]
    sets = sets or {"all": torch.ones(width, dtype=torch.bool)}
    mu = train.lines.mean(0)
    sd = train.lines.std(0).clamp_min(1e-4)
    all_lines, all_dev = (train.lines - mu) / sd, (dev.lines - mu) / sd
    ce = torch.nn.functional.cross_entropy
    train_mask, dev_mask = train.mask, dev.mask
    fits: dict[tuple[str, float], list[tuple[float, dict]]] = {}
    total = 0
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    with torch.enable_grad(), _deterministic():
        for (name, cols), wd in itertools.product(sets.items(), grid):
            lines, dev_lines = all_lines[:, cols], all_dev[:, cols]
            for order in range(orders):
                gen = torch.Generator().manual_seed(seed * 1009 + order)
                torch.manual_seed(seed * 1009 + order)
                model = _Model(lines.shape[1], classes, k, rank)
                opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=wd)
                best: tuple[float, dict] | None = None
                for step in range(1, steps + 1):
                    pick = torch.randint(0, len(train), (min(BATCH, len(train)),), generator=gen)
                    loss = ce(model(lines, train.index[pick], train_mask[pick]), train.labels[pick])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    total += 1
                    if step % EVAL_EVERY == 0 or step == steps:
                        with torch.no_grad():
                            dev_loss = float(ce(model(dev_lines, dev.index, dev_mask), dev.labels))
                        if best is None or dev_loss < best[0]:
                            best = (dev_loss, {n: p.detach().clone() for n, p in model.state_dict().items()})
                        if deadline is not None and time.perf_counter() > deadline:
                            break
                assert best is not None
                fits.setdefault((name, wd), []).append(best)
    spread = {c: _mean_se([loss for loss, _ in got]) for c, got in fits.items()}
    best = choose_candidate(spread, {n: int(cols.sum()) for n, cols in sets.items()}, choose)
    name, wd = best
    chosen = fits[best]
    state = _stack([s for _, s in chosen], rank)  # one fit: itself
    cols = sets[name]
    width_r = state["proj.weight"].shape[0]
    proj = torch.zeros(width_r, width)  # unread features: zero weights
    proj[:, cols] = state["proj.weight"] / sd[cols]  # fold the standardization in: P (f - mu) / sd + p
    fit = SeriesFit(proj, state["proj.bias"] - proj @ mu, state["lags"], state["bias"], wd, total, 0.0, name, spread)
    served = _Model(width, classes, k, width_r)  # the served head's own development loss, on raw features
    served.load_state_dict({"proj.weight": fit.proj, "proj.bias": fit.proj_bias, "lags": fit.lags, "bias": fit.bias})
    with torch.no_grad():
        fit.dev_loss = float(ce(served(dev.lines, dev.index, dev_mask), dev.labels))
    return fit
