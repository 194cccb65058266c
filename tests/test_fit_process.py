"""The live-fit process (engine/standing/fit_process.py): fits run in a child of their own on one torch
thread under SCHED_IDLE; errors come back; a child that dies fails what it held and the next fit starts
a new one; and a script without a main guard that learns does not start itself again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from streamllm.engine.standing.fit_process import FitProcess


def where() -> tuple[int, int, int]:
    return os.getpid(), torch.get_num_threads(), os.sched_getscheduler(0)


def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.fixture()
def fits():
    return FitProcess()


def test_a_fit_runs_in_a_child_on_one_thread_only_on_idle_cpu_time(fits):
    pid, threads, policy = fits.submit(where).result(timeout=120)
    assert pid != os.getpid() and threads == 1 and policy == os.SCHED_IDLE
    assert fits.submit(where).result(timeout=60)[0] == pid  # one child, kept


def test_a_fits_error_comes_back_to_its_future(fits):
    with pytest.raises(ZeroDivisionError):
        fits.submit(divmod, 1, 0).result(timeout=120)
    assert fits.submit(divmod, 7, 2).result(timeout=60) == (3, 1)  # the child lives on


def test_a_child_that_dies_fails_what_it_held_and_the_next_fit_starts_a_new_one(fits):
    pid = fits.submit(where).result(timeout=120)[0]
    held = fits.submit(slow, 30.0)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="ended"):
        held.result(timeout=60)
    again = fits.submit(where).result(timeout=120)[0]
    assert again not in (pid, os.getpid())


def test_a_learning_script_without_a_main_guard_runs_once(tmp_path: Path):
    """multiprocessing's spawn would import this script again in the child and start it twice."""
    marker = tmp_path / "started"
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from streamllm.engine.standing.fit_process import submit_fit
        with open({str(marker)!r}, "a") as f:
            f.write("x")
        print(submit_fit(divmod, 9, 4).result(timeout=120))
    """))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2, 1)" and marker.read_text() == "x"


def test_a_job_that_does_not_pickle_fails_alone_and_submitting_never_waits_for_a_busy_child(fits):
    with pytest.raises(Exception, match="pickle|lambda"):
        fits.submit(lambda: 1).result(timeout=60)
    busy = fits.submit(slow, 3.0)
    big = torch.zeros(4_000_000)  # 16 MB: far more than a pipe holds while the child sleeps
    t0 = time.perf_counter()
    queued = fits.submit(torch.sum, big)
    assert time.perf_counter() - t0 < 1.0
    assert busy.result(timeout=60) == 3.0 and float(queued.result(timeout=60)) == 0.0
