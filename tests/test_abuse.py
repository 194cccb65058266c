"""`bench abuse` end to end, short: a real `streamllm serve --no-auth` subprocess under every hostile
scenario at once while a well-behaved client pushes and asks, then a failing disk and recovery.

Each limit has its own focused test (test_edge_security, test_limits, test_deadlock, test_log_failures,
test_sse...); this one proves they hold together, against the server as users start it. Latency is the
bench's business, not this test's: only the counters that must be 0 are checked."""

from __future__ import annotations

from bench.abuse import MUST_BE_ZERO, run_abuse


def test_hostile_clients_and_a_failing_disk_leave_nothing_broken():
    # slow_sse: tests/test_sse_slow.py proves the cut exactly; pool fill: two ~700-cell questions, not 3,600
    metrics, notes = run_abuse("tiny", alone_s=1.5, storm_s=6.0, skip=("slow_sse",), pool_fill_args=(64, 700))
    assert {k: metrics[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), notes
    assert metrics["cross_origin_refused"] >= 7  # every attempt was made, and refused
    assert metrics["storm_orphaned_asks"] == 0, "questions of clients that left must be cancelled"
    assert metrics["pool_fill_answer"] + metrics.get("pool_fill_error", 0) == 2
    assert metrics["pool_fill_preempted"] >= 1, "the two questions must not fit together: the deadlock case"
    assert metrics["disk_push_errors"] > 0 and metrics["disk_pushes_acked"] > 0  # the fault was hit, and passed
    assert metrics["bystander_asks"] > 10 and metrics["bystander_errors"] == 0, notes
