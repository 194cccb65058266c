"""Who hears about standing-answer changes and ingested data, and how.

Callbacks run on the engine thread after it has released its lock; they must be
quick (the websocket server only enqueues). `watch()` adapts a subscription to an
asyncio iterator for coroutine users.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

log = logging.getLogger("streamllm.engine.subscriptions")


@dataclass(slots=True, eq=False)
class Subscription:
    hub: SubscriptionHub
    session: str
    kind: str  # "standing" | "data"
    callback: Callable
    closed: bool = False

    def close(self) -> None:
        self.hub.remove(self)
        self.closed = True

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(slots=True)
class SubscriptionHub:
    _subs: dict[tuple[str, str], list[Subscription]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    errors: int = 0

    def add(self, session: str, kind: str, callback: Callable) -> Subscription:
        sub = Subscription(self, session, kind, callback)
        with self._lock:
            self._subs.setdefault((session, kind), []).append(sub)
        return sub

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get((sub.session, sub.kind), [])
            if sub in subs:
                subs.remove(sub)

    def has(self, session: str, kind: str) -> bool:
        """Whether anyone hears `kind` events of `session` now."""
        with self._lock:
            return bool(self._subs.get((session, kind)))

    def drop_session(self, session: str) -> None:
        with self._lock:
            for key in [k for k in self._subs if k[0] == session]:
                for sub in self._subs.pop(key):
                    sub.closed = True

    def publish(self, session: str, kind: str, *args) -> None:
        with self._lock:
            subs = list(self._subs.get((session, kind), ()))
        for sub in subs:
            try:
                sub.callback(*args)
            except Exception:  # a broken subscriber never stops the engine or the others
                self.errors += 1
                log.exception("subscriber callback failed for %s/%s", session, kind)


class Subscribable:
    """What a facade over sessions offers subscribers (Engine, and ClusterEngine over Ray replicas):
    it needs `hub` and `_known(name)`, which raises for a session it does not hold."""

    __slots__ = ()
    hub: SubscriptionHub

    def _known(self, name: str) -> None:
        raise NotImplementedError

    def subscribe(self, name: str, callback) -> Subscription:
        """callback(StandingAnswer) on the core thread whenever a standing answer changes."""
        self._known(name)
        return self.hub.add(name, "standing", callback)

    def subscribe_data(self, name: str, callback) -> Subscription:
        """callback(session, data_version) on the core thread whenever a batch is ingested."""
        self._known(name)
        return self.hub.add(name, "data", callback)

    def watch(self, name: str):
        """Async iterator of a session's standing-answer changes."""
        self._known(name)
        return watch(self.hub, name, "standing")


async def watch(hub: SubscriptionHub, session: str, kind: str = "standing", maxsize: int = 1024) -> AsyncIterator:
    """Async iterator over one session's events; ends when the session closes."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize)

    def put(*args) -> None:
        loop.call_soon_threadsafe(_offer, queue, args[0] if len(args) == 1 else args)

    sub = hub.add(session, kind, put)
    try:
        while True:
            try:
                yield await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if sub.closed:  # the hub marks it closed when the session goes away
                    return
    finally:
        sub.close()


def _offer(queue: asyncio.Queue, item) -> None:
    if queue.full():  # a slow async consumer loses the oldest change, never blocks the engine
        queue.get_nowait()
    queue.put_nowait(item)
