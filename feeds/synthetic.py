"""Seeded synthetic market: the embedded default feed for `streamllm demo` and tests.

Per instrument, one step per simulated second of the log mid price:
  r = mu[regime] + kappa[regime] * (anchor - log p) + sigma * z,   z ~ N(0, 1)
  sigma^2 <- omega + alpha * r^2 + beta * sigma^2                  (GARCH(1,1) clustering)
Regimes (trend up, trend down, mean reversion) follow a Markov chain with a mean stay of
`regime_mean_s` seconds; a mean-reversion spell pulls toward the price it started at.
Within a second, trades arrive as a Poisson process whose rate rises with volatility;
the spread widens with volatility; sizes are log-normal; the aggressor side leans with
the move. Quotes are emitted when the top of book changes. Everything derives from one
`random.Random(seed)`, so a seed fixes the whole stream; timestamps are simulated
(`ts_event` from `start_ns`, `ts_recv` a few ms later).
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from feeds.events import BUY, SELL, Quote, Trade
from feeds.replay import apaced

S = 1_000_000_000
VENUE = "synthetic"
REGIMES = ("up", "down", "revert")


@dataclass(slots=True, frozen=True)
class InstrumentSpec:
    symbol: str
    price: float
    tick: float
    lot: float
    trades_per_s: float
    daily_vol: float = 0.03  # typical daily volatility of returns

    @property
    def px_dp(self) -> int:
        return max(0, -math.floor(math.log10(self.tick) + 1e-9))

    @property
    def sz_dp(self) -> int:
        return max(0, -math.floor(math.log10(self.lot) + 1e-9))


DEFAULT_INSTRUMENTS = (
    InstrumentSpec("BTCUSDT", 60_000.0, 0.01, 0.00001, 4.0, 0.03),
    InstrumentSpec("ETHUSDT", 2_600.0, 0.01, 0.0001, 3.0, 0.04),
    InstrumentSpec("SOLUSDT", 150.0, 0.01, 0.001, 2.0, 0.06),
)


@dataclass(slots=True)
class _Sim:
    spec: InstrumentSpec
    logp: float
    sigma2: float
    regime: str
    anchor: float
    bid: float = 0.0
    ask: float = 0.0
    trade_id: int = 0


@dataclass
class SyntheticFeed:
    seed: int = 0
    instruments: tuple[InstrumentSpec, ...] = DEFAULT_INSTRUMENTS
    start_ns: int = 1_704_067_200 * S  # 2024-01-01 00:00:00 UTC
    regime_mean_s: float = 300.0
    trend_per_s: float = 0.1  # trend drift as a multiple of the per-second base volatility
    garch: tuple[float, float] = (0.08, 0.90)  # alpha, beta
    regime_log: list[tuple[int, str, str]] = field(default_factory=list)  # (ts, symbol, regime)

    def __post_init__(self) -> None:
        if isinstance(self.instruments, str | InstrumentSpec):
            raise TypeError("instruments must be a tuple of InstrumentSpec")
        self.rng = random.Random(self.seed)
        self.sims = [
            _Sim(spec, math.log(spec.price), self._base_var(spec), self.rng.choice(REGIMES), math.log(spec.price))
            for spec in self.instruments
        ]
        for sim in self.sims:
            self.regime_log.append((self.start_ns, sim.spec.symbol, sim.regime))
        self.second = 0

    @staticmethod
    def _base_var(spec: InstrumentSpec) -> float:
        return spec.daily_vol**2 / 86_400

    def _step_second(self) -> list[Any]:
        rng = self.rng
        alpha, beta = self.garch
        t0 = self.start_ns + self.second * S
        events: list[Any] = []
        for sim in self.sims:
            spec = sim.spec
            base = self._base_var(spec)
            if rng.random() < 1.0 / self.regime_mean_s:
                sim.regime = rng.choice([r for r in REGIMES if r != sim.regime])
                sim.anchor = sim.logp
                self.regime_log.append((t0, spec.symbol, sim.regime))
            sigma = math.sqrt(sim.sigma2)
            drift = {"up": 1.0, "down": -1.0, "revert": 0.0}[sim.regime] * self.trend_per_s * math.sqrt(base)
            kappa = 0.02 if sim.regime == "revert" else 0.0
            r = drift + kappa * (sim.anchor - sim.logp) + sigma * rng.gauss(0.0, 1.0)
            sim.sigma2 = (1 - alpha - beta) * base + alpha * r * r + beta * sim.sigma2
            start, sim.logp = sim.logp, sim.logp + r
            vol_ratio = math.sqrt(sim.sigma2 / base)
            n = _poisson(rng, spec.trades_per_s * min(vol_ratio, 5.0))
            times = sorted(rng.random() for _ in range(max(n, 1)))
            for i, u in enumerate(times):
                mid = math.exp(start + r * u + 0.15 * sigma * rng.gauss(0.0, 1.0))
                events.extend(self._book(sim, mid, vol_ratio, t0 + int(u * S)))
                if i < n:
                    events.append(self._trade(sim, r, t0 + int(u * S) + 1))
        self.second += 1
        events.sort(key=lambda e: e.ts_event)
        return events

    def _book(self, sim: _Sim, mid: float, vol_ratio: float, ts: int) -> list[Quote]:
        spec, rng = sim.spec, self.rng
        ticks = max(1, round(rng.uniform(0.5, 1.5) * vol_ratio * max(1.0, mid * 2e-6 / spec.tick)))
        bid = math.floor((mid - ticks * spec.tick / 2) / spec.tick) * spec.tick
        ask = bid + ticks * spec.tick
        bid, ask = round(bid, spec.px_dp), round(ask, spec.px_dp)
        if (bid, ask) == (sim.bid, sim.ask):
            return []
        sim.bid, sim.ask = bid, ask
        bsz = self._size(spec, 4.0, mid)
        asz = self._size(spec, 4.0, mid)
        return [Quote(VENUE, spec.symbol, ts, ts + self._latency(), bid, bsz, ask, asz, spec.px_dp, spec.sz_dp)]

    def _trade(self, sim: _Sim, r: float, ts: int) -> Trade:
        spec, rng = sim.spec, self.rng
        p_buy = 0.5 + 0.3 * math.tanh(r / math.sqrt(self._base_var(spec)))
        side = BUY if rng.random() < p_buy else SELL
        sim.trade_id += 1
        price = sim.ask if side == BUY else sim.bid
        return Trade(VENUE, spec.symbol, ts, ts + self._latency(), price, self._size(spec, 1.0, price), side,
                     sim.trade_id, spec.px_dp, spec.sz_dp)

    def _size(self, spec: InstrumentSpec, scale: float, price: float) -> float:
        notional = scale * math.exp(self.rng.gauss(math.log(500.0), 1.2))  # ~$500 median, heavy tail
        lots = max(1, round(notional / price / spec.lot))
        return round(lots * spec.lot, spec.sz_dp)

    def _latency(self) -> int:
        return int(self.rng.uniform(0.5, 5.0) * 1_000_000)

    def regime(self, symbol: str) -> str:
        """The current regime of an instrument (ground truth for labels and tests)."""
        for sim in self.sims:
            if sim.spec.symbol == symbol:
                return sim.regime
        raise KeyError(f"unknown synthetic instrument {symbol!r}")

    def events(self, duration_s: float | None = None) -> Iterator[Any]:
        """Events in receive order; infinite when `duration_s` is None."""
        end = None if duration_s is None else self.second + math.ceil(duration_s)
        pending: list[Any] = []
        while end is None or self.second < end:
            # ts_recv adds up to 5 ms latency: hold back events that could be overtaken.
            pending.extend(self._step_second())
            pending.sort(key=lambda e: e.ts_recv)
            horizon = self.start_ns + self.second * S
            cut = 0
            while cut < len(pending) and pending[cut].ts_recv < horizon:
                cut += 1
            yield from pending[:cut]
            pending = pending[cut:]
        yield from pending

    def __iter__(self) -> Iterator[Any]:
        return self.events()

    async def aevents(self, duration_s: float | None = None, speed: float | None = 1.0) -> AsyncIterator[Any]:
        """Async events paced at `speed` x simulated time (None: as fast as possible)."""
        async for ev in apaced(self.events(duration_s), speed):
            yield ev


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: rates here are small (a few per second).
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def synthetic_events(seed: int = 0, duration_s: float = 60.0, **kw: Any) -> list[Any]:
    """A finite synthetic stream as a list (tests, examples)."""
    return list(SyntheticFeed(seed=seed, **kw).events(duration_s))
