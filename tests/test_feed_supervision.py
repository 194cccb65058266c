"""Feeds under the service: run off the loop, restarted with backoff, visible in /health."""

from __future__ import annotations

import asyncio

from feeds.events import Bar
from feeds.synthetic import SyntheticFeed
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.feeding.attach import Attachment, AttachSpec
from streamllm.feeding.render import Renderer
from streamllm.feeding.supervise import FeedRunner
from streamllm.service.bars import BarBook, TapSink
from streamllm.service.server import StreamServer


def test_a_failing_feed_restarts_and_health_says_degraded(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=4096, scheduler=SchedulerConfig(chunk_tokens=64)))
    engine.open_session("local/btc", tenant="local")
    server = StreamServer(engine)
    attachment = Attachment(TapSink(engine, server.bars), AttachSpec(
        session="local/btc", bar_s=1.0, instruments=frozenset({"BTCUSDT"})))
    attempts: list[int] = []
    threads: set[str] = set()

    def events(attempt: int):
        attempts.append(attempt)

        async def dropping():  # 40 simulated seconds of market, then the venue drops us
            import threading

            threads.add(threading.current_thread().name)
            async for ev in SyntheticFeed(seed=attempt).aevents(duration_s=40, speed=None):
                yield ev
            raise ConnectionError("venue closed the connection")

        return dropping()

    runner = FeedRunner("synthetic", ["local/btc"], events, [attachment], backoff_s=0.4)
    server.feeds.append(runner)

    async def scenario() -> list[dict]:
        seen = []
        task = asyncio.create_task(runner.run())
        while runner.status.restarts < 2 or len(attempts) < 3:  # the third attempt's thread has begun
            health = server.health()
            if health["status"] == "degraded":
                seen.append(health)
            await asyncio.sleep(0.02)
        await runner.aclose()
        task.cancel()
        return seen

    try:
        degraded = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert attempts[:3] == [0, 1, 2] and runner.status.state == "stopped"
        assert threads == {"feed-synthetic"}  # never on the service loop's thread
        # (under load a health can also be degraded by ingest lag first: take one taken while the feed was down)
        health = next(h for h in degraded if h["feeds"][0]["state"] == "down")
        feed = health["feeds"][0]
        assert feed["state"] == "down" and "ConnectionError: venue closed" in feed["last_error"]
        assert any("feed synthetic is down" in r and "retrying in" in r for r in health["reasons"])
        assert health["feed_lag_s"] is not None and feed["events"] > 0
        # what the feed delivered reached the engine, and the bar book saw the same bars
        assert engine.wait_idle(30)
        info = engine.session_info("local/btc")
        closes, seen = server.bars.bars("local/btc")
        assert info.lines_ingested == attachment.stats.lines_pushed == seen >= 30
        # Each attempt replays its market from the same start: the bars of its first 40 s closed, its trades are late.
        feed = server.health()["feeds"][0]
        assert (feed["late_trades"], feed["ahead_trades"]) == (attachment.stats.late, 0) and feed["late_trades"] > 0
    finally:
        engine.shutdown()


def test_the_bar_book_reads_dated_lines_as_the_renderer_writes_them():
    book = BarBook()
    t0 = 1_723_161_540  # 2024-08-08 23:59 UTC
    bars = [Bar(venue="x", instrument="BTCUSDT", ts_event=(t0 + 60 * i + 60) * 10**9, ts_recv=(t0 + 60 * i + 60) * 10**9,
                ts_open=(t0 + 60 * i) * 10**9, interval_ns=60 * 10**9, open=100.0 + i, high=101.0 + i, low=99.0 + i,
                close=100.5 + i, volume=1.0, trades=3, buy_volume=0.5, sell_volume=0.5, vwap=100.2 + i) for i in range(3)]
    lines = [Renderer().render(b) for b in bars]
    assert lines[1].startswith("2024-08-09T00:00 ")  # the new day's first line is dated
    assert book.record("s", [*lines, "2024-08-10 00:00 7 +1"]) == 4  # the older spaced date still reads
    closes, seen = book.bars("s")
    assert seen == 4 and [c for _, c in closes] == [100.5, 101.5, 102.5, 7.0]
    assert [t for t, _ in closes] == [t0, t0 + 60, t0 + 120, t0 + 60 + 86_400]
