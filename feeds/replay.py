"""Replay: merge recorded sources by receive time and pace them; merge live streams as they come.

Pacing: `speed=None` (or 0) runs as fast as possible; `speed=1.0` is real time;
`speed=X` compresses time X-fold. Sleeps are computed against a start anchor, not
event to event, so scheduling drift does not accumulate over a long replay.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any


def merge(*sources: Iterable[Any]) -> Iterator[Any]:
    """Events of several sources, each already in receive order, merged by `ts_recv`.

    Ties keep the order of `sources` (heapq.merge is stable), so replays are deterministic.
    """
    return heapq.merge(*sources, key=lambda ev: ev.ts_recv)


def _check_speed(speed: float | None) -> float | None:
    if speed is None or speed == 0 or speed == float("inf"):
        return None
    if speed < 0:
        raise ValueError(f"replay speed must be positive, got {speed}")
    return float(speed)


def paced(
    events: Iterable[Any],
    speed: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Any]:
    """Yield events no earlier than their receive times allow, scaled by `speed`."""
    rate = _check_speed(speed)
    if rate is None:
        yield from events
        return
    anchor_ev: int | None = None
    anchor_wall = 0.0
    for ev in events:
        if anchor_ev is None:
            anchor_ev, anchor_wall = ev.ts_recv, clock()
        due = anchor_wall + (ev.ts_recv - anchor_ev) / 1e9 / rate
        delay = due - clock()
        if delay > 0:
            sleep(delay)
        yield ev


async def apaced(events: Iterable[Any], speed: float | None = None) -> AsyncIterator[Any]:
    """Async `paced`: yields control to the loop between events even at full speed."""
    rate = _check_speed(speed)
    loop = asyncio.get_running_loop()
    anchor_ev: int | None = None
    anchor_wall = 0.0
    for i, ev in enumerate(events):
        if rate is not None:
            if anchor_ev is None:
                anchor_ev, anchor_wall = ev.ts_recv, loop.time()
            delay = anchor_wall + (ev.ts_recv - anchor_ev) / 1e9 / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        elif i % 256 == 0:
            await asyncio.sleep(0)
        yield ev


async def amerge(*streams: AsyncIterator[Any], queue_size: int = 4096) -> AsyncIterator[Any]:
    """Events of several live streams (one venue's connections) as each delivers them: each stream's own
    order is kept. A stream that fails fails the merge (the others are cancelled); it ends when all end."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield ev
        return
    queue: asyncio.Queue = asyncio.Queue(queue_size)  # bounded: a slow consumer slows the readers

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for ev in stream:
                await queue.put((False, ev))
        except Exception as exc:
            await queue.put((True, exc))
            return
        await queue.put((True, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            ended, item = await queue.get()
            if not ended:
                yield item
            elif item is not None:
                raise item
            else:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def replay(*sources: Iterable[Any], speed: float | None = None) -> Iterator[Any]:
    """merge + paced: the one call most users want."""
    return paced(merge(*sources), speed)
