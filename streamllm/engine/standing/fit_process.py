"""Live fits run in a child process of their own, not on a thread of the engine's process.

A fit (engine/standing/learning.py `fit_head`) is hundreds of optimizer steps of small torch ops. On a
thread beside the askers it holds the interpreter between ops, and an ask that arrives then waits for
it. In a child they share nothing but the CPUs, and the child takes only CPU time nobody else wants:
it runs under SCHED_IDLE (the lowest niceness where that policy is missing), so the engine's threads
preempt it the moment they wake. Merely niced, it still took a CPU from the core often enough to put the
standing answers a bar further behind under a steady feed.

One child serves every engine of the process, fits in submission order. It is started with
`python -c` on the first fit (not multiprocessing's spawn, which imports the parent's main script
again: a script without an `if __name__ == "__main__"` guard would start its engine once more), and
kept; it runs torch on one thread. Jobs and results cross its stdin and stdout as pickles (a training
set is a few MB of tensors). A child that dies fails the fits it held (their questions keep the head in
force and try again later) and the next fit starts a new one; the child ends when the parent closes its
stdin, at exit.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


class FitProcess:
    """The parent's side: submit(fn, ...) runs fn(...) in the child and returns its Future. Submitting never
    blocks: a writer thread pickles the jobs into the child's stdin (a busy child reads its next job only
    after its fit, and a training set is larger than a pipe holds), a reader thread resolves the futures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._jobs: queue.SimpleQueue | None = None  # the running child's jobs, for its writer thread
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._proc is None:
                self._start()
            job = next(self._ids)
            self._futures[job] = future
            self._jobs.put((job, fn, args, kwargs))
        return future

    def _start(self) -> None:
        # The child imports what the parent can (a job's function is pickled by its module's name): the
        # parent's import path, the folder holding this package first.
        paths = [str(Path(__file__).resolve().parents[3]), *(p for p in sys.path if p)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env)
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._proc, self._jobs = proc, jobs
        threading.Thread(target=self._write, args=(proc, jobs), name="streamllm-fit-jobs", daemon=True).start()
        threading.Thread(target=self._read, args=(proc,), name="streamllm-fit-results", daemon=True).start()

    def _write(self, proc: subprocess.Popen, jobs: queue.SimpleQueue) -> None:
        while True:
            job, fn, args, kwargs = jobs.get()
            try:
                data = pickle.dumps((job, fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - a job that does not pickle fails alone
                with self._lock:
                    future = self._futures.pop(job, None)
                if future is not None and not future.done():
                    future.set_exception(exc)
                continue
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except OSError:  # the child is gone: the reader fails what it held, this job included
                return

    def _read(self, proc: subprocess.Popen) -> None:
        """Resolve each finished job's future; when the child ends, fail those it still held."""
        while True:
            try:
                job, ok, value = pickle.load(proc.stdout)
            except Exception:  # noqa: BLE001 - EOF or a torn pickle: the child has ended
                break
            with self._lock:
                future = self._futures.pop(job, None)
            if future is not None and not future.done():
                (future.set_result if ok else future.set_exception)(value)
        proc.wait()
        with self._lock:
            if self._proc is proc:  # the next fit starts a new child
                self._proc = self._jobs = None
            held, self._futures = self._futures, {}
        if held:
            log.warning("the live-fit process ended (exit status %s) holding %d fits", proc.returncode, len(held))
        for future in held.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the live-fit process ended (exit status {proc.returncode})"))


_shared: FitProcess | None = None
_shared_lock = threading.Lock()


def submit_fit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """fn(*args, **kwargs) in the process's one fit child (fn and its arguments picklable); its Future."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = FitProcess()
    return _shared.submit(fn, *args, **kwargs)


def child_main() -> None:
    """The child's loop on its stdin and stdout (`_CHILD` has set its priority)."""
    jobs, results = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a fit prints goes to stderr, never into the results pipe
    serve(jobs, results)


# The child's program. Its priority comes first: importing this package loads torch, seconds of CPU
# that would otherwise compete with the engine at full priority. SCHED_IDLE: it runs only when a CPU
# would otherwise idle; where that policy is missing (not Linux), at niceness 19.
_CHILD = f"""import os
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from {__name__} import child_main
child_main()
"""


def serve(jobs: BinaryIO, results: BinaryIO) -> None:
    """The child's loop: a job, its result, until the parent closes `jobs`."""
    import torch

    torch.set_num_threads(1)
    while True:
        try:
            job, fn, args, kwargs = pickle.load(jobs)
        except EOFError:
            return
        try:
            out = (job, True, fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - sent back to the parent, whose future raises it
            out = (job, False, exc)
        try:
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or error: say what it was
            data = pickle.dumps((job, False, RuntimeError(f"fit result not picklable: {exc!r}")))
        results.write(data)
        results.flush()
