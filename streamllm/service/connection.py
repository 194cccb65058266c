"""One websocket client of the server: outgoing queue, subscriptions, questions in flight.

Nothing here ever waits on the client from the engine's side: `send` only appends to a
bounded queue that one writer task drains into the socket (ASGI `websocket.send`), and a
full queue cuts the connection (close 1013) instead of growing or blocking. Engine
callbacks arrive on the engine thread and are handed to the loop with `threadsafe`.

A client that goes away takes its work with it: `teardown` cancels the engine futures of
its questions in flight, which cancels the questions and frees their cells. `ConnectionCaps`
bounds the connections of the whole server, and those not authenticated yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from streamllm.engine.client import EngineClient
from streamllm.service import protocol as p
from streamllm.service.metrics import ServerMetrics
from streamllm.service.tenants import Tenant

log = logging.getLogger("streamllm.service.server")

CLOSE_TRY_AGAIN_LATER = 1013  # outgoing queue full: the client reads too slowly
_QUESTION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")  # ids as config/reader.py takes them
AsgiSend = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(slots=True, eq=False)
class Subscription:
    session: str  # the client's name
    handles: list[Any] = field(default_factory=list)
    last: dict[str, dict] = field(default_factory=dict)  # question_id -> last sent, to drop repeats


class CapExceeded(Exception):
    """A connection over one of the server-wide caps; the message names the cap."""


class ConnectionCaps:
    """Server-wide caps on what is connected at once: websockets and HTTP requests holding a connection
    (`total`), and websockets that have not authenticated yet (`pre_auth`), so strangers who never say
    hello cannot take every slot. `admit` counts a connection until its `Slot` is released."""

    def __init__(self, total: int, pre_auth: int) -> None:
        self.total, self.pre_auth = total, pre_auth
        self.open = 0
        self.unauthenticated = 0

    def admit(self, authenticated: bool) -> Slot:
        if self.open >= self.total:
            raise CapExceeded(f"the server has {self.open} connections open, its limit (max_connections = "
                              f"{self.total}); retry later")
        if not authenticated and self.unauthenticated >= self.pre_auth:
            raise CapExceeded(f"the server has {self.unauthenticated} connections waiting to authenticate, its "
                              f"limit (max_preauth_connections = {self.pre_auth}); retry later, or send "
                              "'Authorization: Bearer' with the handshake")
        self.open += 1
        self.unauthenticated += not authenticated
        return Slot(self, authenticated)


class Slot:
    """One admitted connection; `release` it once, whatever happens (a second call does nothing)."""

    __slots__ = ("caps", "authenticated", "released")

    def __init__(self, caps: ConnectionCaps, authenticated: bool) -> None:
        self.caps, self.authenticated, self.released = caps, authenticated, False

    def authenticate(self) -> None:
        if not self.authenticated and not self.released:
            self.authenticated = True
            self.caps.unauthenticated -= 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.caps.open -= 1
            self.caps.unauthenticated -= not self.authenticated


class Conn:
    """One client: its tenant, outgoing queue, subscriptions and questions in flight."""

    def __init__(self, send: AsgiSend, peer: Any, tenant: Tenant | None, max_queue: int,
                 metrics: ServerMetrics, slot: Slot | None = None) -> None:
        self._send = send
        self.peer = peer
        self.slot = slot
        self._tenant: Tenant | None = None
        self.tenant = tenant
        self.metrics = metrics
        self.out: asyncio.Queue[bytes | tuple[int, str]] = asyncio.Queue(max_queue)
        self.subs: dict[str, Subscription] = {}
        self.asks: dict[asyncio.Task, Future] = {}  # question tasks -> their engine futures
        self.cut_reason: str | None = None
        self.writer = asyncio.create_task(self._write())
        self.closer: asyncio.Task | None = None

    @property
    def tenant(self) -> Tenant | None:
        return self._tenant

    @tenant.setter
    def tenant(self, tenant: Tenant | None) -> None:
        """Set by `hello` (or a bearer token at connect): from then on the connection is not pre-auth."""
        self._tenant = tenant
        if tenant is not None and self.slot is not None:
            self.slot.authenticate()

    def track(self, task: asyncio.Task, future: Future) -> None:
        """A question in flight: its task, and the engine future that `teardown` cancels."""
        self.asks[task] = future
        task.add_done_callback(lambda done: self.asks.pop(done, None))

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
        for task, future in list(self.asks.items()):  # the client is gone: so are its questions
            future.cancel()  # the engine drops the question and frees its cells
            task.cancel()
        self.writer.cancel()
        if self.slot is not None:
            self.slot.release()


def bridge(future: Future) -> asyncio.Future:
    """Await an engine future from the loop. Unlike `asyncio.wrap_future`, cancelling the awaiting side
    leaves the engine future alone: whoever knows the client is gone cancels it, once (`Conn.teardown`,
    an HTTP request's disconnect); an engine future cancelled that way cancels the returned one."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def copy(done: Future) -> None:
        if out.cancelled():
            return
        if done.cancelled():
            out.cancel()
            return
        exc = done.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(done.result())

    future.add_done_callback(threadsafe(loop, copy))
    return out


async def until_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once an HTTP client has gone away (its request body already read): ASGI `http.disconnect`."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def submit_off_loop(submit: Callable[[], Future]) -> Future:
    """Run `submit` (an engine call that tokenizes, then returns a future) in a worker thread. Should the
    caller be cancelled meanwhile, the future it returns is cancelled the moment it exists."""
    running = asyncio.ensure_future(asyncio.to_thread(submit))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        running.add_done_callback(_cancel_result)
        raise


def _cancel_result(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().cancel()


def is_standing(engine: EngineClient, name: str, question: str) -> bool:
    """Whether `question` is the id of one of the session's standing questions: the fast or entry path,
    with nothing to tokenize. Only a question shaped like an id costs the look; a question's text goes
    the cold way (a worker thread), where the engine still finds a standing question by its text."""
    if not _QUESTION_ID.match(question):
        return False
    try:
        return any(spec.id == question for spec in engine.standing_questions(name))
    except KeyError:  # an unknown session: its ask says so
        return False


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
