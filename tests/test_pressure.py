"""Memory pressure: more sessions than the pool holds; idle ones go to disk and come back equal."""

from __future__ import annotations

import time

import pytest
import torch

from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.outputs import AdmissionError

QUESTION = "What is the last close?"


def lines(k: int) -> list[str]:
    return [f"12:00:{i:02d} S{k} C 64{k}{i:02d}.5 V {i}" for i in range(6)]


# room for two sessions of 512 cells (plus the cells kept for questions), not three
SMALL = EngineConfig(max_cells=1536, block_size=16, max_context=512, branch_cells=256)


def small_engine(tiny_model) -> Engine:
    return Engine(tiny_model, SMALL)


@pytest.fixture()
def engine(tiny_model, tmp_path):
    eng = ResidentEngine(small_engine(tiny_model), tmp_path / "spill", auto_evict=True)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("wrapped", [False, True])
def test_without_auto_eviction_the_third_session_is_refused(tiny_model, tmp_path, wrapped):
    engine = small_engine(tiny_model)
    if wrapped:  # eviction to disk, but not automatic
        engine = ResidentEngine(engine, tmp_path / "spill")
    with engine:
        engine.open_session("s0")
        engine.open_session("s1")
        with pytest.raises(AdmissionError):
            engine.open_session("s2")


def test_more_sessions_than_the_pool_holds_evict_and_restore_equal(engine):
    live = {}
    for k in range(5):
        engine.open_session(f"s{k}")
        engine.push(f"s{k}", lines(k))
        engine.wait_idle()
        live[k] = engine.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
    assert engine.auto_evictions >= 3 and engine.stats()["auto_evictions"] == engine.auto_evictions
    assert len(engine.engine.sessions) <= 2
    # evicted, still open: listed and described as they were, without being read back
    assert sorted(i.name for i in engine.list_sessions()) == [f"s{k}" for k in range(5)]
    evicted = sorted(engine.evicted())
    assert len(evicted) >= 3 and all(engine.session_info(n).data_version == 1 for n in evicted)
    assert sorted(engine.evicted()) == evicted and engine.auto_restores == 0
    engine.engine.check_integrity()
    for k in range(5):  # each one comes back (evicting another), with exactly the logits it had live
        got = engine.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
        assert torch.equal(got.logits, live[k].logits) and got.data_version == 1
        engine.wait_idle()
    assert engine.auto_restores >= 5 and engine.stats()["auto_restores"] == engine.auto_restores
    # a push to an evicted session restores it too and lands at the next version
    evicted = next(iter(engine.evicted()))
    assert engine.push(evicted, ["12:01:00 late C 1.0"]).data_version == 2
    engine.wait_idle()
    engine.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_restored_session_answers_bit_exactly(tiny_model, tmp_path, dtype):
    """Sessions after the first share its prefix blocks, so their cells sit in two runs; attention rounds
    per run, so a restore into one contiguous run answered differently (0.025 in bf16, `bench faults`).
    The restore lays the cells out in the runs they had live."""
    engine = ResidentEngine(Engine(tiny_model, SMALL, dtype=dtype), tmp_path / "spill", auto_evict=True)
    try:
        live, runs = {}, {}
        for k in range(3):
            engine.open_session(f"s{k}")
            engine.push(f"s{k}", lines(k))
            engine.wait_idle()
            live[k] = engine.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
            runs[k] = _runs(engine, f"s{k}")
        assert any(len(r) > 1 for r in runs.values())  # the case that used to differ is there
        for k in range(3):
            was_evicted = f"s{k}" in engine.evicted()
            got = engine.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
            assert torch.equal(got.logits, live[k].logits), (k, was_evicted)
            assert _runs(engine, f"s{k}") == runs[k]
            engine.wait_idle()
        assert engine.auto_restores >= 2
        engine.engine.check_integrity()
    finally:
        engine.shutdown()


def _runs(engine: ResidentEngine, name: str) -> list[tuple[int, int]]:
    """The session's computed cells as runs of consecutive slots: (first position, length)."""
    def read(core):
        s = core.session(name)
        return [(pos, n) for pos, _, n in core.store.manager.runs(s.table, s.num_computed)]
    return engine.engine.call(read)


def test_the_least_recently_asked_session_goes_first(engine):
    for k in range(2):
        engine.open_session(f"s{k}")
        engine.push(f"s{k}", lines(k))
    engine.wait_idle()
    engine.ask("s1", QUESTION, max_tokens=1)
    engine.ask("s0", QUESTION, max_tokens=1)  # s1 is now the least recently asked
    engine.wait_idle()
    engine.open_session("s2")
    assert set(engine.evicted()) == {"s1"}


def test_a_restart_recovers_more_sessions_than_the_pool_holds(tiny_model, tmp_path):
    """Auto-eviction let a server run five sessions in a pool of two; its restart must bring back all
    five (evicting as it goes), not only the ones that fit at once."""
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.recovery import recover

    def new_engine(**kw) -> ResidentEngine:  # as serve builds it with --spill-dir
        return ResidentEngine(Engine(tiny_model, SMALL, **kw), tmp_path / "spill", auto_evict=True)

    first = new_engine(ingest_log=IngestLog(tmp_path / "log"))
    try:
        live = {}
        for k in range(5):
            first.open_session(f"s{k}")
            for batch in (lines(k), lines(k + 5)):
                first.push(f"s{k}", batch)
            first.wait_idle()
            live[k] = first.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
        assert first.auto_evictions >= 3
    finally:
        first.shutdown()
        first.ingest_log.close()
    again = new_engine()  # "restart": a new engine on the same log and spill folder
    try:
        report = recover(again, IngestLog(tmp_path / "log"))  # as serve does
        assert report.sessions == 5 and not report.failed, report.summary()
        assert sorted(i.name for i in again.list_sessions()) == [f"s{k}" for k in range(5)]
        assert len(again.engine.sessions) <= 2 and again.auto_evictions >= 3
        for k in range(5):  # each one answers as it did before the restart
            got = again.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
            assert got.data_version == 2 and (got.logits - live[k].logits).abs().max().item() <= 1e-4
        again.engine.check_integrity()
    finally:
        again.shutdown()
        again.ingest_log.close()


def test_sessions_fed_round_robin_spill_the_one_just_fed_not_the_one_whose_bar_is_next(engine):
    """Bars arriving round robin: least recently used would evict s0, whose bar comes next (every bar
    would then restore a session); the one whose next push is furthest away, s1, just fed, goes."""
    for k in range(2):
        engine.open_session(f"s{k}")
    for i in range(3):
        for k in range(2):
            engine.push(f"s{k}", [lines(k)[i]])
            assert engine.wait_idle(5)
            time.sleep(0.15)  # a steady pace: each session's gap ~0.3 s
    engine.open_session("s2")  # the pool holds two: one of them goes to disk
    assert set(engine.evicted()) == {"s1"}
    engine.push("s0", [lines(0)[3]])  # s0's next bar finds it resident
    assert engine.auto_restores == 0
