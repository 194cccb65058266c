"""Spills: background work nobody waits on does not keep a session in the pool; spill files skip fsync."""

from __future__ import annotations

import os
import time

import pytest
import torch

from streamllm.config import parse_question
from streamllm.durability.resident import ResidentEngine
from streamllm.durability.snapshot import SnapshotError, save_session
from streamllm.engine import Engine, EngineConfig, SchedulerConfig

# A long question (its entry takes many small steps) so the test can catch one computing.
LONG = parse_question({"id": "long", "text": "Looking at every bar above, the closes, the volumes and the moves, "
                       * 6 + "is the price going up or down?", "choices": ["up", "down"]})
FREE = parse_question({"id": "free", "text": "Describe the last bar.", "max_tokens": 64})
SLOW = SchedulerConfig(step_tokens=8, chunk_tokens=4, ingest_floor=4, background_floor=4, step_latency_ms=None)


def bars(start: int, n: int = 4) -> list[str]:
    return [f"12:00:{i:02d} BTCUSDT O 640{i:02d}.5 C 640{i:02d}.2 V {i}.5" for i in range(start, start + n)]


@pytest.fixture()
def engine(tiny_model, tmp_path):
    eng = ResidentEngine(Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=1024,
                                                         scheduler=SLOW)), tmp_path / "spill")
    yield eng
    eng.shutdown()


def _wait_for(engine: ResidentEngine, name: str, what) -> None:
    """Poll the core until what(session, standing) holds for `name` (a few seconds at most)."""
    def look(core):
        return what(core.session(name), core.prepos.standing(name))
    give_up = time.monotonic() + 20
    while not engine.engine.call(look):
        assert time.monotonic() < give_up, f"session {name!r} never reached the state the test needs"
        time.sleep(0.001)


def test_an_eviction_drops_entries_nobody_waits_for_and_the_restore_answers_as_before(engine):
    for name in ("evicted", "kept"):
        engine.open_session(name, "You watch bars.")
        engine.register(name, LONG)
        engine.push(name, bars(0))
    engine.wait_idle()
    engine.push("kept", bars(4))
    engine.push("evicted", bars(4))
    # ingested, its entry at the new version part way through its prefill: background work nobody waits on
    _wait_for(engine, "evicted", lambda s, sts: s.pending_tokens == 0 and s.data_version == 2 and any(
        st.computing is not None and st.computing.num_computed > 0 for st in sts))
    engine.evict_session("evicted")  # refused as "entries computing" before
    assert "evicted" in engine.evicted() and engine.stats()["evictions_dropped_work"] == 1
    engine.engine.check_integrity()
    engine.wait_idle()
    want = engine.ask("kept", "long", return_logits=True, max_tokens=1)
    got = engine.ask("evicted", "long", return_logits=True, max_tokens=1)  # restores, then computes its entry again
    assert got.data_version == want.data_version == 2 and got.text == want.text
    assert (got.logits - want.logits).abs().max().item() <= 1e-4
    engine.engine.check_integrity()


def test_a_standing_decode_someone_hears_keeps_the_session_and_one_nobody_hears_goes(engine):
    heard: list = []
    for name in ("heard", "alone"):
        engine.open_session(name, "You watch bars.")
        engine.register(name, FREE)
    sub = engine.subscribe("heard", heard.append)
    for name in ("heard", "alone"):
        engine.push(name, bars(0))
        _wait_for(engine, name, lambda s, sts: s.pending_tokens == 0 and sts[0].decoding is not None)
        if name == "heard":
            with pytest.raises(SnapshotError, match="decoding for subscribers"):
                engine.evict_session(name)
        else:
            engine.evict_session(name)
    assert set(engine.evicted()) == {"alone"} and engine.stats()["evictions_dropped_work"] == 1
    engine.wait_idle()
    assert heard and heard[-1].data_version == 1  # the subscriber heard its answer
    sub.close()
    engine.push("alone", bars(4))  # restored: its entry and decode run again at the new version
    engine.wait_idle()
    assert engine.standing("alone")[0].data_version == 2
    engine.engine.check_integrity()


def test_a_spill_is_not_fsynced_a_snapshot_is_and_both_read_back_equal(engine, tmp_path, monkeypatch):
    engine.open_session("s", "You watch bars.")
    engine.push("s", bars(0, 12))
    engine.wait_idle()
    live = engine.ask("s", "Up or down?", return_logits=True, max_tokens=1)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    save_session(engine, "s", tmp_path / "snap.safetensors")
    assert len(synced) >= 2  # the file and its folder: a snapshot is a durability record
    synced.clear()
    engine.evict_session("s")
    assert synced == []  # a spill caches a live session; the ingest log is what a crash recovers from
    got = engine.ask("s", "Up or down?", return_logits=True, max_tokens=1)
    assert torch.equal(got.logits, live.logits)


def test_a_restore_under_pressure_takes_three_turns_of_the_core(tiny_model, tmp_path, monkeypatch):
    """Each look at the core waits for a step of a busy core: a restore that needs room is its refused import,
    one eviction and the import again (it used to ask can_admit before and after evicting too)."""
    from tests.test_pressure import SMALL, lines

    engine = ResidentEngine(Engine(tiny_model, SMALL), tmp_path / "spill", auto_evict=True)
    turns = {"import_session": 0, "can_admit": 0, "evict_state": 0}
    for attr in turns:
        real = getattr(engine.engine, attr)
        monkeypatch.setattr(engine.engine, attr, lambda *a, _real=real, _attr=attr, **kw: (
            turns.__setitem__(_attr, turns[_attr] + 1), _real(*a, **kw))[1])
    try:
        for k in range(4):
            engine.open_session(f"s{k}")
            engine.push(f"s{k}", lines(k))
            engine.wait_idle()
        restores, turns = engine.auto_restores, dict.fromkeys(turns, 0)
        for k in range(4):  # round robin over four sessions in a pool for two: every push restores one
            engine.push(f"s{k}", [f"12:01:00 S{k} C 1.0"])
            engine.wait_idle()
        restores = engine.auto_restores - restores
        assert restores >= 3
        assert sum(turns.values()) <= 3 * restores, turns
        engine.engine.check_integrity()
    finally:
        engine.shutdown()
