"""Feed supervision: each feed group runs in its own thread, restarted with backoff when it fails.

    FeedRunner.run()  (a task on the service loop)
        -> thread "feed-<name>": its own event loop runs attach(events, attachments)
           events -> attachments -> TapSink.push -> engine.push (may fsync; never on the service loop)
        <- ended: done; failed: status "down", wait backoff (0.5 s doubling to 30 s), start again

The attachments (pending lines, renderer state) survive a restart, so nothing already
accepted from the feed is lost. `status()` feeds /health: a feed that is down, or whose
sessions' ingest is behind, makes the service `degraded`, with the reason and the lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from streamllm.feeding.attach import attach

log = logging.getLogger("streamllm.feeding.supervise")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
QUIET_AFTER_S = 60.0  # a running feed with no event for this long counts as behind


@dataclass(slots=True)
class FeedStatus:
    name: str
    sessions: list[str]
    state: str = "starting"  # starting | running | down | ended | stopped
    restarts: int = 0
    last_error: str | None = None
    last_event_at: float | None = None  # wall clock (unix seconds)
    events: int = 0
    started_at: float = 0.0
    retry_at: float | None = None


class FeedRunner:
    """Run one feed group off the service loop and keep it running."""

    def __init__(self, name: str, sessions: list[str], events: Callable[[int], AsyncIterator[Any]],
                 attachments: list[Any], *, backoff_s: float = BACKOFF_START_S, backoff_max_s: float = BACKOFF_MAX_S,
                 restart: bool = True, live: bool = False) -> None:
        self.events = events  # events(attempt) -> a fresh async iterator of feed events
        self.attachments = attachments
        self.status = FeedStatus(name, sessions)
        self.backoff_s, self.backoff_max_s, self.restart = backoff_s, backoff_max_s, restart
        self.live = live  # receive times are this machine's clock: bars close while the feed is silent
        self._stop = threading.Event()
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._thread_task: asyncio.Task | None = None
        self._done: asyncio.Future | None = None

    async def run(self) -> None:
        delay = self.backoff_s
        attempt = 0
        try:
            while not self._stop.is_set():
                self.status.state, self.status.started_at, self.status.retry_at = "running", time.time(), None
                self._done = asyncio.get_running_loop().create_future()
                threading.Thread(target=self._thread_main, args=(attempt, self._done), daemon=True,
                                 name=f"feed-{self.status.name}").start()
                error = await asyncio.shield(self._done)
                if self._stop.is_set():
                    break
                if error is None:
                    self.status.state = "ended"
                    log.warning("feed %s ended; its sessions stay open and keep answering", self.status.name)
                    return
                self.status.state, self.status.last_error = "down", error
                if not self.restart:
                    return
                if time.time() - self.status.started_at > 10 * delay:
                    delay = self.backoff_s  # it ran a good while: a fresh failure, not a crash loop
                self.status.retry_at = time.time() + delay
                log.error("feed %s failed (%s); restarting in %.1f s", self.status.name, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                attempt += 1
                self.status.restarts += 1
        except asyncio.CancelledError:
            self.stop()
            raise
        finally:
            if self._stop.is_set():
                self.status.state = "stopped"

    async def aclose(self, timeout: float = 10.0) -> None:
        """Stop the feed and wait (bounded) for its thread to finish its current push."""
        self.stop()
        if self._done is not None and not self._done.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done), timeout)

    def stop(self) -> None:
        """Ask the feed thread to end (returns at once; the thread ends after its current push)."""
        self._stop.set()
        loop, task = self._thread_loop, self._thread_task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    def _thread_main(self, attempt: int, done: asyncio.Future) -> None:
        outer = done.get_loop()
        error: str | None = None
        try:
            asyncio.run(self._attach(attempt))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            log.exception("feed %s failed", self.status.name)
            error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(RuntimeError):  # the service loop is gone
            outer.call_soon_threadsafe(lambda: done.done() or done.set_result(error))

    async def _attach(self, attempt: int) -> None:
        self._thread_loop = asyncio.get_running_loop()
        self._thread_task = asyncio.current_task()
        if self._stop.is_set():
            return
        await attach(self._counted(self.events(attempt)), self.attachments, wall_clock=self.live)

    async def _counted(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        status = self.status
        async for ev in events:
            status.events += 1
            status.last_event_at = time.time()
            yield ev

    def health(self, backlog_lines: Callable[[str], int], max_backlog: int) -> tuple[dict[str, Any], list[str]]:
        """(this feed's /health entry, reasons it makes the service degraded)."""
        s, now = self.status, time.time()
        lag = None if s.last_event_at is None else round(now - s.last_event_at, 1)
        backlog = {name: backlog_lines(name) for name in s.sessions}
        entry = {"feed": s.name, "sessions": s.sessions, "state": s.state, "restarts": s.restarts,
                 "last_error": s.last_error, "events": s.events, "lag_s": lag, "ingest_backlog_lines": backlog}
        reasons = []
        if s.state == "down":
            retry = "" if s.retry_at is None else f", retrying in {max(0.0, s.retry_at - now):.1f} s"
            reasons.append(f"feed {s.name} is down ({s.last_error}){retry}")
        elif s.state == "running" and lag is not None and lag > QUIET_AFTER_S:
            reasons.append(f"feed {s.name} has sent nothing for {lag:.0f} s")
        behind = {k: v for k, v in backlog.items() if v > max_backlog}
        if behind:
            reasons.append(f"feed {s.name}: ingest is behind ({', '.join(f'{k} {v} lines' for k, v in behind.items())})")
        entry["pending_events"] = sum(getattr(a, "pending_events", 0) for a in self.attachments)
        # Trades in no bar: for an interval already closed, or stamped past the venue's clock (feeding/attach.py).
        entry["late_trades"] = sum(a.stats.late for a in self.attachments)
        entry["ahead_trades"] = sum(a.stats.ahead for a in self.attachments)
        return entry, reasons
