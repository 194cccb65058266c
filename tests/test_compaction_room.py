"""Room for compaction: a session at its budget always gets a copy made, so its pushes are applied.

Found by hand: three sessions (8192 + 2048 + 2048 of a 16384-cell pool) and a burst of
400 batches on the big one left it at its budget for good (the copy needed more free
cells than the pool had), its pushes never applied, while wait_idle() said all was done.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future

import pytest

from bench.common import market_lines
from streamllm.config import QuestionSpec
from streamllm.engine import CompactionPolicy, Engine, EngineConfig, SchedulerConfig
from streamllm.engine.commands import Call
from streamllm.engine.kv import BlockTable
from streamllm.engine.outputs import AdmissionError

WAIT_S = 240  # generous: a hang fails the test instead of hanging the suite


def retained_lines(engine: Engine, name: str, pushed: list[str]) -> list[str]:
    """The suffix of `pushed` whose tokens the (compacted) session holds after its prefix."""
    s = engine.sessions[name]
    data = s.token_ids[s.prefix_len :]
    ids = engine.layout.lines_ids(pushed)
    total = 0
    for k in range(1, len(pushed) + 1):
        total += len(ids[-k])
        if total == len(data):
            assert [t for line in ids[-k:] for t in line] == data
            return pushed[-k:]
    raise AssertionError("the session's data is not a suffix of what was pushed")


def dump(core) -> str:
    m = core.store.manager
    out = [f"free {m.num_free_blocks * m.block_size} reserved {m.num_reserved * m.block_size} {core.counters}"]
    for s in core.sessions.values():
        c = core.compactor.copies.get(s.name)
        out.append(f"{s.name} tokens {s.num_tokens} computed {s.num_computed} at_budget {s.at_budget} "
                   f"copy {c and (c.cut, c.num_computed, len(c.pending_ids), c.cells_to_go())}")
    return "\n".join(out)


def test_a_burst_on_a_big_session_beside_two_small_ones_is_all_applied(tiny_model):
    lines = market_lines()
    # copies that recompute: the reference below is a fresh prefill of the lines kept
    config = EngineConfig(max_cells=16384, block_size=8, max_context=8192, check_integrity_every_step=True,
                          scheduler=SchedulerConfig(chunk_tokens=64), compaction=CompactionPolicy(method="recompute"))
    with Engine(tiny_model, config) as eng:
        eng.open_session("big", max_context=8192)
        eng.open_session("a", max_context=2048)
        eng.open_session("b", max_context=2048)
        pushed: list[str] = []
        for _ in range(400):
            batch = list(itertools.islice(lines, 3))
            eng.push("big", batch)
            pushed += batch
        if not eng.wait_idle(timeout=WAIT_S):
            raise AssertionError("the big session is stuck at its budget:\n" + eng.call(dump))
        info = eng.session_info("big")
        assert info.data_version == info.pushed_version == 400 and info.backlog_lines == 0
        assert info.compactions >= 1 and info.num_tokens <= 8192
        assert eng.stats()["sessions_at_budget"] == 0
        kept = retained_lines(eng, "big", pushed)
        compacted = eng.ask("big", "Trend?", max_tokens=3, return_logits=True, timeout=60)
        tokens = list(eng.sessions["big"].token_ids)
        eng.check_integrity()
    # The reference: a fresh engine prefilled with exactly the retained lines.
    with Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=8192, scheduler=SchedulerConfig(chunk_tokens=64))) as ref:
        ref.open_session("fresh")
        for i in range(0, len(kept), 32):
            ref.push("fresh", kept[i : i + 32])
        assert ref.wait_idle(timeout=WAIT_S)
        assert ref.sessions["fresh"].token_ids == tokens
        fresh = ref.ask("fresh", "Trend?", max_tokens=3, return_logits=True, timeout=60)
    assert compacted.tokens == fresh.tokens
    assert (compacted.logits - fresh.logits).abs().max().item() <= 1e-4


def test_four_sessions_filling_at_once_in_a_tight_pool_do_not_deadlock(tiny_model):
    """Four sessions with standing questions compact again and again in a pool that holds their
    budgets plus room for one copy: copies, entries and questions compete for the same cells."""
    sessions, max_context = 4, 1024
    feeds = {f"s{k}": market_lines(seed=k) for k in range(sessions)}
    with Engine(tiny_model, EngineConfig(max_cells=sessions * max_context + 512, block_size=8, max_context=max_context, branch_cells=512, check_integrity_every_step=True, scheduler=SchedulerConfig(chunk_tokens=64, step_tokens=128))) as eng:
        for name in feeds:
            eng.open_session(name)
            eng.register(name, QuestionSpec("q", "Up or down?", choices=("up", "down"), threshold=0.5))
        with pytest.raises(AdmissionError):  # the pool is full: the room for a copy is not for sale
            eng.open_session("one-more", max_context=max_context)
        for _ in range(60):  # ~3 budgets each, all at once, at a pace whose rate starts copies early
            for name, lines in feeds.items():  # (early copies then hold cells others need: preempted)
                eng.push(name, list(itertools.islice(lines, 2)))
            time.sleep(0.05)
        if not eng.wait_idle(timeout=WAIT_S):
            raise AssertionError("sessions stuck at their budget:\n" + eng.call(dump))
        stats = eng.stats()
        assert stats["sessions_at_budget"] == 0 and stats["sessions_stuck"] == 0
        for name in feeds:
            info = eng.session_info(name)
            assert info.data_version == info.pushed_version == 60 and info.backlog_lines == 0
            assert info.compactions >= 1 and info.num_tokens <= max_context
            assert eng.ask(name, "q", timeout=60).text in ("up", "down")
        eng.check_integrity()


def test_admission_keeps_room_for_the_largest_sessions_compaction_copy(tiny_model):
    # working sets as large as the budgets: each session reserves its whole max_context
    with Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=8192, branch_cells=1024,
                                         working_set_tokens=8192)) as eng:
        eng.open_session("big", max_context=8192)
        eng.open_session("a", max_context=2048)
        eng.open_session("b", max_context=2048)  # ~4096 left: one copy of big (retain 0.5 x 8192)
        with pytest.raises(AdmissionError, match=r"cannot open session 'c': its working set needs 2048 cells, the "
                                                 r"pool has \d+ free and keeps 4096 free for questions and compaction"):
            eng.open_session("c", max_context=2048)
        assert eng.stats()["admissions_refused"] == 1
    with Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=2048, branch_cells=512,
                                         working_set_tokens=8192)) as eng:
        eng.open_session("a")
        eng.open_session("b")
        # 3584 + 512 for questions would fit the 4096 left, but not a copy of it (1792) beside it
        with pytest.raises(AdmissionError, match="keeps 1792 free"):
            eng.open_session("big", max_context=3584)
        eng.open_session("big", max_context=2560)  # 2560 + 1280 fits
        eng.check_integrity()


def test_a_session_stuck_for_want_of_cells_says_so_and_catches_up_when_they_come_back(tiny_model, caplog):
    """No room for a copy (cells held outside any session, as a leak would): wait_idle says not idle,
    the core logs it once, the pushes stay accepted; once the cells are back, all are applied."""
    lines = market_lines(seed=3)
    with Engine(tiny_model, EngineConfig(max_cells=2048, block_size=8, max_context=1024, branch_cells=128, scheduler=SchedulerConfig(chunk_tokens=64))) as eng:
        eng.open_session("s")
        held = BlockTable()
        eng.call(lambda core: core.store.manager.reserve(held, 1024))  # every free cell
        with caplog.at_level(logging.ERROR, logger="streamllm.engine"):
            for _ in range(40):  # ~3 budgets
                eng.push("s", list(itertools.islice(lines, 2)))
            assert not eng.wait_idle(timeout=3)  # pushes are pending: not idle
            stats = eng.stats()
            assert stats["sessions_at_budget"] == 1 and stats["sessions_stuck"] == 1
            assert eng.backlog("s") > 0 and eng.session_info("s").pushed_version == 40
        assert sum("no room" in r.getMessage() or "not enough" in r.getMessage() for r in caplog.records) == 1
        eng.call(lambda core: core.store.manager.free(held))
        assert eng.wait_idle(timeout=WAIT_S)
        info = eng.session_info("s")
        assert info.data_version == info.pushed_version == 40 and info.compactions >= 1
        assert eng.stats()["sessions_stuck"] == 0
        eng.check_integrity()


def test_a_copy_started_early_that_runs_out_of_cells_gives_way_instead_of_holding_the_engine_busy(tiny_model):
    """A copy started before its session filled up grows as the session computes; if the pool runs
    dry meanwhile and the feed goes quiet, the session never reaches its budget (so the at-budget
    rescue never runs) and the copy waited for cells forever: wait_idle() never returned (seen once
    in CI, 240 s with 48 cells free). A blocked copy that nothing will unblock is preempted."""
    lines = market_lines(seed=5)
    config = EngineConfig(max_cells=2048, block_size=8, max_context=1024, branch_cells=128,
                          scheduler=SchedulerConfig(chunk_tokens=64), compaction=CompactionPolicy(method="recompute"))
    with Engine(tiny_model, config) as eng:  # a shifted copy is whole when it starts: it never waits for cells
        eng.open_session("s")
        while eng.session_info("s").num_tokens < 600:  # below compact_at: no copy yet
            eng.push("s", list(itertools.islice(lines, 4)))
            assert eng.wait_idle(timeout=WAIT_S)
        assert eng.call(lambda core: not core.compactor.copies)
        held = BlockTable()
        gate = threading.Event()
        eng.core.submit(Call(lambda core: gate.wait(10)))  # hold the core so the next two apply in one drain
        tokens = eng.session_info("s").num_tokens  # (records are not published while the core is held)
        while tokens < 800:  # past compact_at once applied: the copy starts
            batch = list(itertools.islice(lines, 4))
            eng.push("s", batch)
            tokens += sum(map(len, eng.layout.lines_ids(batch)))
        assert tokens < 1024

        def starve(core) -> bool:
            started = "s" in core.compactor.copies
            core.store.manager.reserve(held, core.store.manager.num_free_blocks * core.store.manager.block_size)
            return started

        starved: Future = eng.core.submit(Call(starve))
        gate.set()
        assert starved.result(WAIT_S), "the push past compact_at did not start a copy"
        if not eng.wait_idle(timeout=20):
            raise AssertionError("a blocked copy kept the engine busy forever:\n" + eng.call(dump))
        stats = eng.stats()
        info = eng.session_info("s")
        assert info.data_version == info.pushed_version and info.backlog_lines == 0
        assert eng.call(lambda core: (not core.compactor.copies, core.compactor.preempted)) == (True, 1)
        eng.call(lambda core: core.store.manager.free(held))
        for _ in range(60):  # the cells are back: compaction works as before
            eng.push("s", list(itertools.islice(lines, 4)))
        assert eng.wait_idle(timeout=WAIT_S)
        info = eng.session_info("s")
        assert info.data_version == info.pushed_version and info.compactions >= 1
        assert stats["sessions_stuck"] == 0
        eng.check_integrity()
