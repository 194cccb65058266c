"""ResidentEngine beyond eviction itself: closing a session on disk, checkpoints and recovery
around evictions, asks that restore off the caller's thread, its figures."""

from __future__ import annotations

import threading

import pytest

from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig, SessionError
from streamllm.engine.outputs import EngineStopped

QUESTION = "What is the last close?"


def lines(k: int, v: int = 0) -> list[str]:
    return [f"12:{v:02d}:{i:02d} S{k} C 64{k}{i:02d}.5 V {i}" for i in range(4)]


def resident(tiny_model, spill, **kw) -> ResidentEngine:
    return ResidentEngine(Engine(tiny_model, EngineConfig(max_cells=4096, block_size=16, max_context=512), **kw), spill)


def test_closing_a_session_on_disk_deletes_it_ends_its_subscriptions_and_logs_the_close(tiny_model, tmp_path):
    eng = resident(tiny_model, tmp_path / "spill", ingest_log=IngestLog(tmp_path / "log"))
    try:
        eng.open_session("gone")
        eng.open_session("kept")
        for name in ("gone", "kept"):
            eng.push(name, lines(1))
        assert eng.wait_idle(30)
        sub = eng.subscribe_data("gone", lambda *_: None)
        path = eng.evict_session("gone")
        info = eng.session_info("gone")
        assert info.data_version == 1 and [i.name for i in eng.list_sessions()].count("gone") == 1
        assert eng.stats()["sessions_evicted"] == 1 and eng.backlog("gone") == 0
        eng.close_session("gone")
        assert sub.closed and not tmp_path.joinpath(path).exists() and eng.stats()["sessions_evicted"] == 0
        with pytest.raises(SessionError):
            eng.session_info("gone")
        eng.open_session("gone")  # the name is free again, a new session
        assert eng.session_info("gone").data_version == 0
        eng.close_session("gone")
    finally:
        eng.shutdown()
        eng.ingest_log.close()
    again = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=16, max_context=512))
    try:
        report = recover(again, IngestLog(tmp_path / "log"))
        assert [i.name for i in again.list_sessions()] == ["kept"] and not report.failed
    finally:
        again.shutdown()


def test_checkpoints_skip_sessions_on_disk_and_recovery_brings_every_one_back(tiny_model, tmp_path):
    log = IngestLog(tmp_path / "log", checkpoint_versions=10_000)  # checkpoints taken by hand below
    eng = resident(tiny_model, tmp_path / "spill")
    try:
        recover(eng, log)  # attaches the log and starts the checkpointer on the ResidentEngine
        for k in range(3):
            eng.open_session(f"s{k}")
            eng.push(f"s{k}", lines(k))
        assert eng.wait_idle(30)
        live = {k: eng.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1) for k in range(3)}
        eng.evict_session("s1")
        cp = log.checkpointer
        assert cp.checkpoint("s1") is None  # on disk: its snapshot and the log hold it
        assert cp.checkpoint("s0") is not None
        eng.push("s2", lines(2, 1))
        assert eng.wait_idle(30)
    finally:
        eng.shutdown()
        log.close()
    again = resident(tiny_model, tmp_path / "spill2")
    try:
        report = recover(again, IngestLog(tmp_path / "log"))
        assert report.sessions == 3 and not report.failed, report.summary()
        for k in range(3):
            got = again.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1, min_version=1)
            if k != 2:
                assert (got.logits - live[k].logits).abs().max().item() <= 1e-4
        assert again.session_info("s2").data_version == 2
    finally:
        again.shutdown()
        again.ingest_log.close()


def test_an_ask_on_a_session_on_disk_returns_at_once_and_restores_in_a_worker(tiny_model, tmp_path):
    eng = resident(tiny_model, tmp_path / "spill")
    try:
        eng.open_session("s")
        eng.push("s", lines(0))
        assert eng.wait_idle(30)
        before = eng.ask("s", QUESTION, return_logits=True, max_tokens=1)
        eng.evict_session("s")
        seen: list[str] = []
        original = eng.engine.import_session

        def slow_import(state, name):
            seen.append(threading.current_thread().name)
            release.wait(10)
            return original(state, name)

        release = threading.Event()
        eng.engine.import_session = slow_import
        future = eng.submit_ask("s", QUESTION, return_logits=True, max_tokens=1)
        assert not future.done()  # returned before the restore
        release.set()
        after = future.result(30)
        assert seen and seen[0].startswith("streamllm-restore") and threading.current_thread().name not in seen
        assert (after.logits - before.logits).abs().max().item() <= 1e-4
        stats = eng.stats()
        assert stats["auto_restores"] == 1 and stats["auto_evictions"] == 0 and stats["auto_evict_refusals"] == 0
    finally:
        eng.shutdown()


def test_a_shutdown_fails_the_asks_still_waiting_for_their_restore(tiny_model, tmp_path):
    eng = resident(tiny_model, tmp_path / "spill")
    eng.open_session("s")
    eng.push("s", lines(0))
    assert eng.wait_idle(30)
    eng.evict_session("s")
    started, release = threading.Event(), threading.Event()
    original = eng.engine.import_session

    def blocked_import(state, name):
        started.set()
        release.wait(10)
        return original(state, name)

    eng.engine.import_session = blocked_import
    futures = [eng.submit_ask("s", QUESTION, max_tokens=1) for _ in range(2)]  # one restoring, one queued
    assert started.wait(10)
    stopper = threading.Thread(target=eng.shutdown)
    stopper.start()
    release.set()
    stopper.join(30)
    for future in futures:
        assert isinstance(future.exception(10), EngineStopped)


def test_a_choice_question_on_a_session_on_disk_is_answered_as_before_without_a_restore(tiny_model, tmp_path):
    """What the engine's fast path answered before the eviction, field for field; asks the record cannot
    answer (free text, logits wanted) restore the session as before."""
    from streamllm.config import parse_question

    eng = resident(tiny_model, tmp_path / "spill")
    try:
        eng.open_session("s")
        for spec in ({"id": "fires", "text": "Up or down? Answer up or down.", "choices": ["up", "down"],
                      "threshold": 0.0},
                     {"id": "closed", "text": "Calm or busy? Answer calm or busy.", "choices": ["calm", "busy"],
                      "threshold": 1e9},
                     {"id": "free", "text": "What is the last close?", "threshold": 0.0, "max_tokens": 4}):
            eng.register("s", parse_question(spec))
        eng.push("s", lines(0))
        assert eng.wait_idle(30)
        before = {q: eng.ask("s", q) for q in ("fires", "closed", "Calm or busy?  answer calm or BUSY.")}
        assert before["fires"].path == "fast" and before["closed"].path == "entry"
        computed = eng.stats()["entries_computed"]
        eng.evict_session("s")
        assert eng.wait_idle(30)  # the core has published its figures since
        assert eng.stats()["entries_computed"] == computed  # an engine-wide count: the session's leave with it
        after = {q: eng.ask("s", q) for q in before}
        fields = ("session", "question", "text", "tokens", "data_version", "path", "confidence", "stale",
                  "finish_reason", "choices", "warming_up", "warming_up_reason")
        for q in before:
            assert [getattr(after[q], f) for f in fields] == [getattr(before[q], f) for f in fields], q
        stats = eng.stats()
        assert stats["answered_on_disk"] == 3 and stats["sessions_evicted"] == 1 and stats["auto_restores"] == 0
        assert eng.ask("s", "fires", return_logits=True).logits is not None  # logits: not kept on disk
        assert eng.stats()["auto_restores"] == 1
        eng.evict_session("s")
        assert eng.ask("s", "free").text  # free text: restored and asked
        assert eng.stats()["auto_restores"] == 2 and eng.stats()["answered_on_disk"] == 3
    finally:
        eng.shutdown()


def test_a_session_still_answering_its_newest_data_is_spilled_last(tiny_model, tmp_path):
    """The session just fed is the first to spill (its next bar is furthest away), unless its standing
    answers for that bar are still being made: evicting it would drop them until its next push."""
    from dataclasses import replace

    from streamllm.config import parse_question

    eng = resident(tiny_model, tmp_path / "spill")
    try:
        for name in ("a", "b", "c"):
            eng.open_session(name)
            eng.register(name, parse_question({"id": "q", "text": "Up or down? Answer up or down.",
                                               "choices": ["up", "down"], "threshold": 0.0}))
        for v in range(3):
            for name in ("a", "b", "c"):
                eng.push(name, lines(0, v))
        assert eng.wait_idle(30)
        order = ["c", "a", "b"]  # as if c were fed last: its next bar the furthest away
        eng._victims = lambda names: sorted(names, key=order.index)
        published = eng.engine.standing

        def c_still_answering(name):  # as the engine shows it while c's entries for its last bar run
            got = published(name)
            return [replace(a, data_version=a.data_version - 1) for a in got] if name == "c" else got

        eng.engine.standing = c_still_answering
        eng._spill(1, set())
        on_disk = {n for n in ("a", "b", "c") if eng._evicted_entry(n) is not None}
        assert on_disk and "c" not in on_disk
        eng.engine.standing = published
        eng._spill(1, set())
        assert eng._evicted_entry("c") is not None  # answered: first again
    finally:
        eng.shutdown()
