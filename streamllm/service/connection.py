"""One websocket client of the server: outgoing queue, subscriptions, questions in flight.

Nothing here ever waits on the client from the engine's side: `send` only appends to a
bounded queue that one writer task drains into the socket (ASGI `websocket.send`), and a
full queue cuts the connection (close 1013) instead of growing or blocking. Engine
callbacks arrive on the engine thread and are handed to the loop with `threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from streamllm.service import protocol as p
from streamllm.service.metrics import ServerMetrics
from streamllm.service.tenants import Tenant

log = logging.getLogger("streamllm.service.server")

CLOSE_TRY_AGAIN_LATER = 1013  # outgoing queue full: the client reads too slowly
AsgiSend = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(slots=True, eq=False)
class Subscription:
    session: str  # the client's name
    handles: list[Any] = field(default_factory=list)
    last: dict[str, dict] = field(default_factory=dict)  # question_id -> last sent, to drop repeats


class Conn:
    """One client: its tenant, outgoing queue, subscriptions and questions in flight."""

    def __init__(self, send: AsgiSend, peer: Any, tenant: Tenant | None, max_queue: int,
                 metrics: ServerMetrics) -> None:
        self._send = send
        self.peer = peer
        self.tenant = tenant
        self.metrics = metrics
        self.out: asyncio.Queue[bytes | tuple[int, str]] = asyncio.Queue(max_queue)
        self.subs: dict[str, Subscription] = {}
        self.asks: set[asyncio.Task] = set()
        self.cut_reason: str | None = None
        self.writer = asyncio.create_task(self._write())
        self.closer: asyncio.Task | None = None

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message; never waits. A full queue means the client is too slow: cut it."""
        if self.cut_reason is not None:
            return
        try:
            self.out.put_nowait(p.encode(message))
        except asyncio.QueueFull:
            self.metrics.slow_disconnects.inc()
            self.cut(CLOSE_TRY_AGAIN_LATER, f"outgoing queue full ({self.out.maxsize} messages): reading too slowly")

    def cut(self, code: int, reason: str) -> None:
        if self.cut_reason is not None:
            return
        self.cut_reason = reason
        log.info("closing %s: %s", self.peer, reason)
        self.writer.cancel()
        self.closer = asyncio.create_task(self._close(code, reason))

    def finish(self, code: int, reason: str) -> None:
        """Close once what is queued is sent (the error reply to a bad token must reach the client)."""
        if self.cut_reason is None:
            try:
                self.out.put_nowait((code, reason))
            except asyncio.QueueFull:
                return self.cut(code, reason)
            self.cut_reason = reason

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):  # the client is already gone
            await self._send({"type": "websocket.close", "code": code, "reason": reason[:120]})

    async def _write(self) -> None:
        send = self._send
        with contextlib.suppress(OSError, RuntimeError):  # uvicorn: ClientDisconnected is an OSError
            while True:
                item = await self.out.get()
                if isinstance(item, tuple):  # queued by finish(): everything before it is sent
                    await self._close(*item)
                    return
                await send({"type": "websocket.send", "text": item.decode()})

    def teardown(self) -> None:
        for sub in self.subs.values():
            close_handles(sub)
        self.subs.clear()
        for task in self.asks:
            task.cancel()
        self.writer.cancel()


def bridge(future: Future) -> asyncio.Future:
    """Await an engine future without ever cancelling it: `asyncio.wrap_future` would, when the
    client goes away, and the engine thread would then fail on `set_result` of a cancelled future."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def copy(done: Future) -> None:
        if out.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(done.result())

    future.add_done_callback(threadsafe(loop, copy))
    return out


def threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None]) -> Callable[..., None]:
    """A callback for the engine thread: hands the call to the loop and returns at once."""

    def call(*args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            loop.call_soon_threadsafe(fn, *args)

    return call


def close_handles(sub: Subscription) -> None:
    for handle in sub.handles:
        with contextlib.suppress(Exception):
            handle.close()
    sub.handles.clear()
