"""Heavy torch work beside the core runs on threads that end with it.

torch's CPU ops run on OpenMP, and libgomp keeps a pool of worker threads for every
thread that has run a parallel op, for as long as that thread lives. When the process
holds more such workers than it has CPUs, libgomp stops letting idle workers spin
between parallel regions and puts them to sleep instead, so each of the core's ops (a
decode step is hundreds of small ones) pays for waking its workers up. On a 2-core CPU
a model built on the caller's thread made every decode step of the core's one third
slower than the same step with the model built on a thread that had ended.

So the engine builds its model and cells on a passing thread (`run_passing`), and work
that runs beside the core (spills and restores) goes to a `PassingWorker`:
jobs in order, each on a fresh thread that ends with it. Whoever else runs big torch ops in the
engine's process while it serves costs the core the same (tiny ops never go parallel).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def run_passing(fn: Callable[..., T], *args: Any, name: str = "streamllm-build", **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a new thread, joined: its result (or its error, raised here) once the thread,
    and its OpenMP pool with it, is gone."""
    future: Future = Future()

    def main() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            future.set_exception(exc)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    thread.join()
    return future.result()


class PassingWorker:
    """Runs submitted jobs in order, at most `max_workers` at a time, each on a thread of its own that
    ends with it (a ThreadPoolExecutor whose threads never outlive their job)."""

    def __init__(self, name: str, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"PassingWorker needs max_workers >= 1, got {max_workers}")
        self.name, self.max_workers = name, max_workers
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._running = 0
        self._closed = False
        self._idle = threading.Event()  # set while no job runs
        self._idle.set()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            self._queue.append((future, lambda: fn(*args, **kwargs)))
            if self._running < self.max_workers:
                self._running += 1
                self._idle.clear()
                self._start_next()
        return future

    def map(self, fn: Callable[[Any], T], items) -> list[T]:
        """fn over items, as ThreadPoolExecutor.map; all results (the first error raised)."""
        futures = [self.submit(fn, item) for item in items]
        return [f.result() for f in futures]

    def shutdown(self, wait: bool = False, cancel_futures: bool = True, timeout: float | None = None) -> bool:
        """No new jobs; waiting ones are cancelled (or, without cancel_futures, still run); with `wait`,
        returns once every job has finished, or after `timeout` seconds. True when none runs."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
        if wait:
            return self._idle.wait(timeout)
        return self._idle.is_set()

    def _start_next(self) -> None:  # under the lock, with a job queued
        future, job = self._queue.popleft()
        threading.Thread(target=self._run, args=(future, job), name=self.name, daemon=True).start()

    def _run(self, future: Future, job: Callable[[], Any]) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever reads it
                future.set_exception(exc)
        with self._lock:
            if self._queue:
                self._start_next()  # a fresh thread: this one ends, and its OpenMP pool with it
            else:
                self._running -= 1
                if not self._running:
                    self._idle.set()
