"""Synthetic feed: seeded determinism, ordering, regimes and volatility clustering."""

from __future__ import annotations

import asyncio
import math
import statistics

from feeds.bars import bars
from feeds.events import Quote, Trade
from feeds.synthetic import SyntheticFeed, synthetic_events


def test_seed_fixes_the_stream_and_order_is_by_receive_time() -> None:
    a, b = synthetic_events(seed=5, duration_s=60), synthetic_events(seed=5, duration_s=60)
    assert a == b and a != synthetic_events(seed=6, duration_s=60)
    assert all(x.ts_recv <= y.ts_recv for x, y in zip(a, a[1:], strict=False))
    assert {type(e) for e in a} == {Trade, Quote}
    assert all(q.bid < q.ask for q in a if type(q) is Quote)
    assert {e.instrument for e in a} == {"BTCUSDT", "ETHUSDT", "SOLUSDT"}


def test_regimes_switch_and_volatility_clusters() -> None:
    feed = SyntheticFeed(seed=11)
    evs = list(feed.events(4 * 3600))
    assert len({r for _, sym, r in feed.regime_log if sym == "BTCUSDT"}) == 3
    closes = [b.close for b in bars(evs, 60) if b.instrument == "BTCUSDT"]
    rets = [abs(math.log(b / a)) for a, b in zip(closes, closes[1:], strict=False)]
    m = statistics.mean(rets)
    lag1 = sum((x - m) * (y - m) for x, y in zip(rets, rets[1:], strict=False)) / sum((x - m) ** 2 for x in rets)
    assert lag1 > 0.05  # |returns| autocorrelate: GARCH-like clustering


def test_async_iterator_matches_plain() -> None:
    async def collect() -> list:
        return [ev async for ev in SyntheticFeed(seed=3).aevents(duration_s=20, speed=None)]

    assert asyncio.run(collect()) == synthetic_events(seed=3, duration_s=20)
