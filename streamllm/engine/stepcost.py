"""A step's predicted wall time, fitted online from the steps the core measures.

    ms = fixed + per_item * items + per_token * tokens + per_kpair * (attention pairs / 1000)

An item is one sequence's chunk in the step; its attention pairs are the (query, key)
pairs it reads: n * start + n (n + 1) / 2 for n tokens from position `start`, so a
decode step on a long context costs more than one on a short one. The fit is least
squares over every step seen, each older step weighing `decay` times less, so it follows
the machine's load and the contexts held; coefficients stay >= 0, so the marginal cost
of a token never falls and the scheduler's "the most tokens within t ms" is well defined.
The scheduler plans against it and never measures; the core measures and never plans.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on: the items (sequences) it runs, their tokens, their attention pairs."""

    items: int = 0
    tokens: int = 0
    pairs: int = 0

    @staticmethod
    def of(chunks: Iterable[tuple[int, int]]) -> StepShape:
        """The shape of (start_pos, tokens) chunks."""
        items = tokens = pairs = 0
        for start, n in chunks:
            items, tokens, pairs = items + 1, tokens + n, pairs + attention_pairs(start, n)
        return StepShape(items, tokens, pairs)


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs n new tokens at positions start.. read: each reads the keys up to its own."""
    return n * start + n * (n + 1) // 2


class StepCost:
    """A step's predicted wall time: ms = fixed + per_item*items + per_token*tokens + per_kpair*pairs/1000.

    `observe` refits the four coefficients from measured steps (least squares, each older step
    weighing `decay` times less, coefficients kept >= 0); `ready` once `min_steps` are seen.
    `StepCost(coef=(...))` is a fixed model (tests, or a machine measured beforehand).
    """

    def __init__(self, coef: tuple[float, float, float, float] | None = None, *, decay: float = 0.9,
                 min_steps: int = 8) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"StepCost decay must be in (0, 1], got {decay!r}")
        self.decay, self.min_steps = decay, min_steps
        self.learns = coef is None
        self.coef: tuple[float, ...] = tuple(coef) if coef is not None else (0.0, 0.0, 0.0, 0.0)
        if len(self.coef) != 4 or min(self.coef) < 0:
            raise ValueError(f"StepCost coef must be 4 numbers >= 0 (fixed, item, token, kpair), got {coef!r}")
        self.steps = 0
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4

    @property
    def ready(self) -> bool:
        return not self.learns or self.steps >= self.min_steps

    @property
    def fixed_ms(self) -> float:
        return self.coef[0]

    def predict(self, shape: StepShape) -> float:
        return self.coef[0] + self.item_ms(0, 0) * shape.items + self._rest(shape.tokens, shape.pairs)

    def item_ms(self, start: int, n: int) -> float:
        """What one item of n tokens from position `start` adds to a step (0 tokens: its overhead alone)."""
        return self.coef[1] + self._rest(n, attention_pairs(start, n))

    def _rest(self, tokens: int, pairs: int) -> float:
        return self.coef[2] * tokens + self.coef[3] * pairs / 1000

    def affordable(self, start: int, limit: int, ms: float) -> int:
        """The most tokens (<= limit) one item starting at `start` may take for `ms` of step time."""
        if limit <= 0 or ms < self.item_ms(start, 1):
            return 0
        if self.item_ms(start, limit) <= ms:
            return limit
        lo, hi = 1, limit  # item_ms grows with n: the largest n within ms
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.item_ms(start, mid) <= ms else (lo, mid - 1)
        return lo

    def observe(self, shape: StepShape, ms: float) -> None:
        if not self.learns or shape.items == 0 or not math.isfinite(ms) or ms < 0:
            return
        if self.ready:  # one step stalled by the OS or a collection must not wreck the fit
            ms = min(ms, 4 * self.predict(shape) + 10)
        x = (1.0, float(shape.items), float(shape.tokens), shape.pairs / 1000)
        d = self.decay
        for i in range(4):
            self._xty[i] = d * self._xty[i] + x[i] * ms
            for j in range(4):
                self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        self.coef = _nonnegative_fit(self._xtx, self._xty)


def _nonnegative_fit(xtx: list[list[float]], xty: list[float]) -> tuple[float, ...]:
    """Least squares with a light ridge; a coefficient that comes out negative is dropped (0) and the rest refitted."""
    active = list(range(len(xty)))
    while active:
        a = [[xtx[i][j] + (1e-9 + 1e-6 * xtx[i][i] if i == j else 0.0) for j in active] for i in active]
        w = _solve(a, [xty[i] for i in active])
        if w is not None and min(w) >= 0:
            coef = [0.0] * len(xty)
            for i, wi in zip(active, w, strict=True):
                coef[i] = wi
            return tuple(coef)
        if w is None:
            active.pop()
        else:
            active.pop(min(range(len(w)), key=w.__getitem__))
    return (0.0,) * len(xty)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
