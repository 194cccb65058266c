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
features stay one layout. The candidates of one order (every feature set and weight decay) draw the same
minibatches, so they are fitted in lockstep as one batch, and a step projects only the lines its
minibatch reads. With `reduce` (tune --reduce D), a feature set wider than d is fitted through its
d leading principal directions on the standardized training lines (coordinates, not whitened), and the
projection found is folded back onto the raw features like the standardization: the served head is the same [R, F] projection, and
a step costs d, not F, per line.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamllm.model.adapter import SeriesHead, series_width

LINES = 24  # K: lines a series head reads (the longest shipped label needs 21 bars)
RANK = 8  # R: numbers the head takes from each line
WEIGHT_DECAY = (1e-3, 1e-2, 1e-1)
STEPS, BATCH, EVAL_EVERY, LR = 600, 256, 20, 3e-3
# tune's default `reduce`: None, every column. Fitted through its 128 (or 512) leading directions, a head
# judged on markets it never saw scored 0.82 (0.80) mean accuracy against 0.85 over every column (make
# tune's bars heads, docs/tuning.md): the small directions carry what transfers. Faster, for trying things.
REDUCE: int | None = None
FIT_VERSION = 3  # bump when a fit's result changes for the same samples and settings (tune's fit cache key)
GRAM_LINES = 4096  # lines the principal components are found on (neighbouring lines are much alike)


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


def _basis(gram: torch.Tensor, d: int | None, seed: int) -> torch.Tensor | None:
    """The leading d principal directions of standardized lines, from their Gram matrix [F, F]: [F, d]
    orthonormal columns, largest first. None when d is None or the set
    is no wider than d. By subspace iteration from a seeded start (a full eigh of F = 2304 costs seconds
    a set; d of F directions need a few products), then the d x d problem; each column's sign fixed by
    its largest entry, so the same Gram matrix gives the same basis."""
    if d is None or d >= gram.shape[0]:
        return None
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(gram @ torch.randn(gram.shape[0], min(gram.shape[0], d + 32), generator=gen)).Q
    for _ in range(4):
        q = torch.linalg.qr(gram @ q).Q
    _, vectors = torch.linalg.eigh((q.T @ gram @ q).double())
    vectors = (q.double() @ vectors.flip(1)[:, :d])
    signs = vectors.gather(0, vectors.abs().argmax(0, keepdim=True)).sign()
    return (vectors * signs).float()


def _mean_se(losses: list[float]) -> tuple[float, float]:
    mean = sum(losses) / len(losses)
    if len(losses) < 2:
        return mean, 0.0
    return mean, float(np.std(losses, ddof=1) / np.sqrt(len(losses)))


def lag_basis(k: int, free: int) -> torch.Tensor:
    """[K, H]: the shapes a live head's lag weights are fitted as (fit_series' `lags`). The newest `free`
    lags each get their own column; over all K lags, exponential decays (half-lives 1, 2, 4, ... lines) and
    boxes (the newest 1, 2, 4, ... lines, and all K) follow, each column of unit length. A label that reads
    far back (an average of 50 bars) is a smooth sum over many lags: as a few such shapes it needs a few
    weights per projection, not one per lag, and a month of bars can fit it. Rows are lags oldest first."""
    if not 0 <= free <= k:
        raise ValueError(f"free lags must be in [0, {k}], got {free}")
    age = torch.arange(k - 1, -1, -1, dtype=torch.float32)  # 0 for the newest line
    cols = [torch.eye(k)[:, k - free:]] if free else []
    half = 1.0
    while half <= k:
        cols.append(torch.exp(-age / half)[:, None])
        half *= 2
    n = 1
    while n < k:
        cols.append((age < n).float()[:, None])
        n *= 2
    cols.append(torch.ones(k, 1))
    out = torch.cat(cols, 1)
    return out / out.norm(dim=0, keepdim=True)


class _Project(torch.autograd.Function):
    """lines [M, D] @ weight [O, D]^T + bias [O], the lines taking no gradient. Autograd's own backward
    computes the weight's gradient as lines^T @ grad, a product BLAS runs several times slower than its
    transpose grad^T @ lines (O is a few dozen, M and D thousands): it was most of a fit's time."""

    @staticmethod
    def forward(ctx, lines: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(lines)
        return torch.addmm(bias, lines, weight.T)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        (lines,) = ctx.saved_tensors
        return None, grad.T @ lines, grad.sum(0)


class _Candidates:
    """Every candidate (feature set x weight decay) of one order, fitted in lockstep as one batch of
    _Model's: they draw the same minibatches, so one step serves them all. Set s's lines are [M, D_s], one
    tensor a set; proj is [S, G*R, D] (zero beyond a set's width: those columns get no gradient and stay
    zero); candidate (s, g)'s projection is rows g*R..(g+1)*R of proj[s]. With a lag basis [K, H] (lag_basis()) the lags
    are fitted as H weights per choice and number, lags = lag_basis @ those (what weight decay pulls toward 0)."""

    def __init__(self, widths: list[int], classes: int, k: int, rank: int, grid: Sequence[float], seed: int,
                 lag_basis: torch.Tensor | None = None) -> None:
        s, g, d = len(widths), len(grid), max(widths)
        self.rank, self.widths = rank, widths
        self.proj, self.proj_bias = torch.zeros(s, g * rank, d), torch.zeros(s, g * rank)
        for i, width in enumerate(widths):  # each candidate's initial weights as its own _Model draws them
            for j in range(g):
                torch.manual_seed(seed)
                first = _Model(width, classes, k, rank).proj
                self.proj[i, j * rank:(j + 1) * rank, :width] = first.weight.detach()
                self.proj_bias[i, j * rank:(j + 1) * rank] = first.bias.detach()
        self.lag_basis = lag_basis
        h = k if lag_basis is None else lag_basis.shape[1]
        self.coef, self.bias = torch.zeros(s, g, classes, h, 2 * rank), torch.zeros(s, g, classes)
        self.params = [p.requires_grad_() for p in (self.proj, self.proj_bias, self.coef, self.bias)]
        self.decay = torch.tensor([float(w) for w in grid])

    @property
    def lags(self) -> torch.Tensor:
        """[S, G, C, K, 2R]: every candidate's lag weights."""
        return self.coef if self.lag_basis is None else torch.einsum("kh,sgchr->sgckr", self.lag_basis, self.coef)

    def project(self, lines: Sequence[torch.Tensor], grad: bool = True) -> torch.Tensor:
        """[S, M, G*R]: every set's lines [M, D_s] through its candidates' projections."""
        out = []
        for i, x in enumerate(lines):
            w, b = self.proj[i, :, :x.shape[1]], self.proj_bias[i]
            out.append(_Project.apply(x, w, b) if grad else torch.addmm(b, x, w.T))
        return torch.stack(out)

    def logits(self, lines: Sequence[torch.Tensor], index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[S, G, N, C] from each set's lines [M, D_s], as _Model.forward for each candidate."""
        s, g = self.coef.shape[:2]
        z = self.project(lines).view(s, -1, g, self.rank)
        x = torch.cat([z, z.abs()], -1)[:, index] * mask[None, :, :, None, None]  # [S, N, K, G, 2R]
        return torch.einsum("snkgr,sgckr->sgnc", x, self.lags) + self.bias[:, :, None]

    def losses(self, lines: Sequence[torch.Tensor], index: torch.Tensor, mask: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
        """[S, G]: each candidate's mean cross-entropy, as `logits` gives it; for evaluation (no gradient).
        Every line is scored at every lag first ([S, M, K, G, C]), so the samples' gather moves C numbers
        a line and lag, not 2R."""
        lags = self.lags
        s, g = lags.shape[:2]
        k, c = lags.shape[2:4][::-1]
        z = self.project(lines, grad=False).view(s, -1, g, self.rank)
        y = torch.einsum("smgr,sgckr->smkgc", torch.cat([z, z.abs()], -1), lags).reshape(s, -1, g * c)
        at = index * k + torch.arange(k)  # row of line index[n, j] at lag j
        x = (y[:, at] * mask[None, :, :, None]).sum(2).view(s, -1, g, c).transpose(1, 2) + self.bias[:, :, None]
        return torch.nn.functional.cross_entropy(x.reshape(-1, c), labels.repeat(s * g), reduction="none").view(
            s, g, -1).mean(-1)

    def decay_(self, lr: float) -> None:
        """AdamW's decoupled weight decay, each candidate its own: p *= 1 - lr * wd, before the Adam step."""
        keep = 1 - lr * self.decay
        s, g = self.coef.shape[:2]
        with torch.no_grad():
            self.proj.view(s, g, self.rank, -1).mul_(keep[:, None, None])
            self.proj_bias.view(s, g, self.rank).mul_(keep[:, None])
            self.coef.mul_(keep[:, None, None, None])
            self.bias.mul_(keep[:, None])

    def state(self, i: int, j: int) -> dict[str, torch.Tensor]:
        """Candidate (set i, weight decay j) as a _Model state dict."""
        rows = slice(j * self.rank, (j + 1) * self.rank)
        return {"proj.weight": self.proj[i, rows, :self.widths[i]].detach().clone(),
                "proj.bias": self.proj_bias[i, rows].detach().clone(),
                "lags": self.lags[i, j].detach().clone(), "bias": self.bias[i, j].detach().clone()}  # folded


def _fit_order(fits: dict[tuple[str, float], list[tuple[float, dict]]], names: list[str],
               inputs: list[tuple[torch.Tensor, torch.Tensor]],
               train: Samples, dev: Samples, classes: int, k: int, rank: int, grid: Sequence[float], steps: int,
               seed: int, deadline: float | None, lag_basis: torch.Tensor | None = None,
               clock: Callable[[], float] = time.perf_counter) -> int:
    """One order: every candidate (set names[i] read as inputs[i], weight decay grid[j]) from its initial
    weights (seed) over the same minibatches, each keeping its step of lowest development loss (appended
    to `fits`). Returns the optimizer steps taken, all candidates'."""
    lines, dev_lines = [x for x, _ in inputs], [x for _, x in inputs]
    m = len(lines[0])
    batch = _Candidates([x.shape[1] for x, _ in inputs], classes, k, rank, grid, seed, lag_basis)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(batch.params, lr=LR)
    ce = torch.nn.functional.cross_entropy
    s, g = len(inputs), len(grid)
    train_mask, dev_mask = train.mask, dev.mask
    best = torch.full((s, g), torch.inf)
    states: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    taken = 0
    gathered = [torch.empty(min(m, BATCH * k) * x.shape[1]) for x in lines]
    for step in range(1, steps + 1):
        pick = torch.randint(0, len(train), (min(BATCH, len(train)),), generator=gen)
        if len(pick) * k >= m:  # the minibatch reads most lines (a live head's long reach): all of them
            logits = batch.logits(lines, train.index[pick], train_mask[pick])
        else:  # only the lines it reads, gathered into one buffer a set: a fresh copy each step is tens of
            # MB, which the allocator maps and unmaps every time (its page faults were a third of a fit)
            rows, where = torch.unique(train.index[pick], return_inverse=True)
            read = [torch.index_select(x, 0, rows, out=buf[:len(rows) * x.shape[1]].view(len(rows), x.shape[1]))
                    for x, buf in zip(lines, gathered, strict=True)]
            logits = batch.logits(read, where, train_mask[pick])
        loss = ce(logits.reshape(-1, classes), train.labels[pick].repeat(s * g)) * (s * g)  # each one's mean, summed
        opt.zero_grad()
        loss.backward()
        batch.decay_(LR)
        opt.step()
        taken += s * g
        if step % EVAL_EVERY == 0 or step == steps:
            with torch.no_grad():
                got = batch.losses(dev_lines, dev.index, dev_mask, dev.labels)
            for i, j in ((got < best) | best.isinf()).nonzero().tolist():  # the first evaluation, whatever it is
                best[i, j] = got[i, j]
                states[i, j] = batch.state(i, j)
            if deadline is not None and clock() > deadline:
                break
    for (i, name), (j, wd) in itertools.product(enumerate(names), enumerate(grid)):
        fits[name, wd].append((float(best[i, j]), states[i, j]))
    return taken


def fit_series(train: Samples, dev: Samples, classes: int, *, k: int = LINES, rank: int = RANK,
               grid: Sequence[float] = WEIGHT_DECAY, steps: int = STEPS, seed: int = 0,
               sets: dict[str, torch.Tensor] | None = None, orders: int = 1, choose: str = "best",
               budget_s: float | None = None, reduce: int | None = None,
               lag_basis: torch.Tensor | None = None, clock: Callable[[], float] = time.perf_counter) -> SeriesFit:
    """sets: candidate feature sets (column masks, feature_sets()); default all columns.

    lag_basis: a [K, H] basis the lag weights are fitted in (`lag_basis()`: the live learner's, whose labels may
    read 64 bars back from a few hundred samples); the served head's lags are folded back to [C, K, 2R].
    None: every lag its own weight.

    budget_s: seconds of `clock` (wall seconds by default) for all the fits together (live learning): once
    spent, a fit ends at its next evaluation with the best step so far (the fit is then no longer
    reproducible to the bit).

    reduce: fit a set wider than this through its `reduce` leading principal components on the training
    lines (standardized, then scaled to unit variance), folded back into the [R, F] projection served;
    the head can then only read those directions. None: every column, the whole [R, F] fitted.

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
    if lag_basis is not None and lag_basis.shape[0] != k:
        raise ValueError(f"a lag basis of {lag_basis.shape[0]} rows for a head of {k} lines")
    width = train.lines.shape[1]
    sets = sets or {"all": torch.ones(width, dtype=torch.bool)}
    mu = train.lines.mean(0)
    sd = train.lines.std(0).clamp_min(1e-4)
    all_lines, all_dev = (train.lines - mu) / sd, (dev.lines - mu) / sd
    gram = None
    if reduce is not None and width > reduce:  # principal directions from at most GRAM_LINES evenly spread lines
        some = all_lines[::max(1, len(all_lines) // GRAM_LINES)]
        gram = some.T @ some / len(some)
    ce = torch.nn.functional.cross_entropy
    dev_mask = dev.mask
    bases = {name: None if gram is None else _basis(gram[cols][:, cols], reduce, seed) for name, cols in sets.items()}
    # Each set's lines as its fits read them: its columns, or their coordinates on its principal directions,
    # not whitened: an orthonormal basis keeps the standardized lines' geometry, so weight decay pulls the
    # same way as on every column. (Whitened, the smallest of d components were blown up to the size of the
    # largest: the fit leaned on noise, and read other markets' lines worse the more components it had.)
    inputs = []
    for name, cols in sets.items():
        lines, dev_lines, basis = all_lines[:, cols], all_dev[:, cols], bases[name]
        if basis is not None:
            lines, dev_lines = lines @ basis, dev_lines @ basis
        inputs.append((lines, dev_lines))
    fits: dict[tuple[str, float], list[tuple[float, dict]]] = {(name, wd): [] for name in sets for wd in grid}
    total = 0
    deadline = None if budget_s is None else clock() + budget_s
    with torch.enable_grad(), _deterministic():
        for order in range(orders):
            total += _fit_order(fits, list(sets), inputs, train, dev, classes, k, rank, grid, steps, seed * 1009 + order,
                                deadline, lag_basis, clock)
    spread = {c: _mean_se([loss for loss, _ in got]) for c, got in fits.items()}
    best = choose_candidate(spread, {n: int(cols.sum()) for n, cols in sets.items()}, choose)
    name, wd = best
    chosen = fits[best]
    state = _stack([s for _, s in chosen], rank)  # one fit: itself
    cols, basis = sets[name], bases[name]
    weight = state["proj.weight"] if basis is None else state["proj.weight"] @ basis.T
    width_r = weight.shape[0]
    proj = torch.zeros(width_r, width)  # unread features: zero weights
    proj[:, cols] = weight / sd[cols]  # fold the standardization in: P (f - mu) / sd + p
    # A feature constant over the training lines (a number slot no training line writes) taught nothing:
    # its weight is zero, not its initial value over the clamped spread, which would turn a value first
    # seen when serving into a logit of thousands.
    proj[:, train.lines.std(0) < 1e-6] = 0.0
    fit = SeriesFit(proj, state["proj.bias"] - proj @ mu, state["lags"], state["bias"], wd, total, 0.0, name, spread)
    served = _Model(width, classes, k, width_r)  # the served head's own development loss, on raw features
    served.load_state_dict({"proj.weight": fit.proj, "proj.bias": fit.proj_bias, "lags": fit.lags, "bias": fit.bias})
    with torch.no_grad():
        fit.dev_loss = float(ce(served(dev.lines, dev.index, dev_mask), dev.labels))
    return fit
