"""Passing threads (engine/passing.py): heavy torch work beside the core runs on threads that end,
so their OpenMP worker pools end too."""

from __future__ import annotations

import threading
import time

import pytest

from streamllm.engine.passing import PassingWorker, run_passing


def alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_run_passing_returns_or_raises_and_its_thread_is_gone():
    seen = []
    assert run_passing(lambda x: seen.append(threading.current_thread().name) or x * 2, 21, name="t-build") == 42
    assert seen == ["t-build"] and not alive("t-build")
    with pytest.raises(ValueError, match="bad weights"):
        run_passing(lambda: (_ for _ in ()).throw(ValueError("bad weights")), name="t-build")
    assert not alive("t-build")


def test_a_passing_worker_runs_jobs_in_order_one_at_a_time_each_on_a_thread_that_ends():
    worker = PassingWorker("t-learn")
    running, order, threads = [], [], []

    def job(i):
        running.append(i)
        assert len(running) == 1, "two jobs at once"
        threads.append(threading.current_thread())  # kept: a thread's ident is reused once it ends
        time.sleep(0.01)
        order.append(i)
        running.remove(i)
        if i == 2:
            raise RuntimeError("fit failed")
        return i

    futures = [worker.submit(job, i) for i in range(5)]
    assert [f.result(timeout=10) if i != 2 else None for i, f in enumerate(futures)] == [0, 1, None, 3, 4]
    with pytest.raises(RuntimeError, match="fit failed"):
        futures[2].result()
    assert order == [0, 1, 2, 3, 4] and len({id(t) for t in threads}) == 5
    deadline = time.monotonic() + 5
    while alive("t-learn") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive("t-learn")


def test_a_shut_down_worker_cancels_what_waits_and_takes_no_more():
    worker = PassingWorker("t-learn")
    gate = threading.Event()
    first = worker.submit(gate.wait, 10)
    waiting = worker.submit(lambda: "never")
    worker.shutdown()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
    gate.set()
    assert first.result(timeout=10) is True


def test_a_wider_worker_runs_up_to_max_workers_at_once_and_maps_in_order():
    worker = PassingWorker("t-restore", max_workers=2)
    both = threading.Barrier(2, timeout=10)  # passes only with two jobs running at once
    assert worker.map(lambda i: (both.wait(), i)[1], [0, 1, 2, 3]) == [0, 1, 2, 3]
    worker.shutdown(wait=True, cancel_futures=False)
    assert not alive("t-restore")
