"""Feeds under the service: run off the loop, restarted with backoff, visible in /health."""

from __future__ import annotations

import asyncio

from feeds.synthetic import SyntheticFeed
from streamllm.engine import Engine
from streamllm.market.attach import Attachment, AttachSpec
from streamllm.service.bars import TapSink
from streamllm.service.feeds import FeedRunner
from streamllm.service.server import StreamServer


def test_a_failing_feed_restarts_and_health_says_degraded(tiny_model):
    engine = Engine(tiny_model, max_cells=16384, block_size=8, max_context=4096, chunk_tokens=64)
    engine.open_session("local/btc")
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
        while runner.status.restarts < 2:
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
    finally:
        engine.shutdown()
