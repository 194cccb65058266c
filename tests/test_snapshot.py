"""Session snapshots: restore equals live (logits), bad files are refused by name, eviction is transparent."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from streamllm.config import parse_question
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.durability.resident import ResidentEngine
from streamllm.durability.snapshot import SnapshotError, restore_session, save_session
from streamllm.engine import Engine, EngineConfig, SchedulerConfig

QUESTION = parse_question({"id": "trend", "text": "Up or down?", "choices": ["up", "down"]})
LINES = [f"12:00:{i:02d} BTCUSDT O 640{i:02d}.5 C 640{i:02d}.2 V {i}.5" for i in range(30)]


@pytest.fixture()
def engine(tiny_model, tmp_path):
    eng = ResidentEngine(Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=1024, scheduler=SchedulerConfig(chunk_tokens=24))),
                         tmp_path / "spill")
    yield eng
    eng.shutdown()


def filled(eng, name: str = "live"):
    eng.open_session(name, "You watch bars.")
    eng.register(name, QUESTION)
    for i in range(0, len(LINES), 7):
        eng.push(name, LINES[i : i + 7])
    eng.wait_idle()
    return eng


def rewrite(path, **meta_changes) -> None:
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["streamllm"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    meta.update(meta_changes)
    save_file(tensors, str(path), metadata={"streamllm": json.dumps(meta)})


def test_restore_gives_the_same_logits_as_the_live_session(engine, tmp_path):
    filled(engine)
    info = engine.snapshot_session("live", tmp_path / "live.safetensors")
    assert info.num_computed == info.num_tokens and info.data_version == 5
    restored = engine.restore_session(tmp_path / "live.safetensors", "copy")
    assert restored.data_version == 5
    a, b = engine.engine.sessions["live"], engine.engine.sessions["copy"]
    assert a.token_ids == b.token_ids and a.version_ends == b.version_ends and a.line_ends == b.line_ends
    assert a.table.blocks != b.table.blocks  # its own cells, copied back
    for question in ("What is the last close?", "trend"):
        live = engine.ask("live", question, return_logits=True, max_tokens=3)
        copy = engine.ask("copy", question, return_logits=True, max_tokens=3)
        assert (live.logits - copy.logits).abs().max().item() <= 1e-4
        assert live.text == copy.text and copy.data_version == live.data_version
    assert [q.id for q in engine.standing_questions("copy")] == ["trend"]
    # both keep ingesting independently
    engine.push("copy", ["12:01:00 BTCUSDT C 64100.0"])
    engine.wait_idle()
    assert engine.session_info("copy").data_version == 6 and engine.session_info("live").data_version == 5
    engine.engine.check_integrity()


@pytest.mark.parametrize(("damage", "message"), [
    ("truncate", "not a readable safetensors file"),
    ("flip", "checksum mismatch"),
    ("format", "format version 99"),
    ("tokens", "token ids, the metadata says"),
    ("versions", "version bookkeeping inconsistent"),
    ("data_version", "is not computed"),
    ("garbage", "not a readable safetensors file"),
    ("calibration", "question 'trend': calibration window malformed"),
])
def test_damaged_snapshots_are_refused_naming_the_problem(engine, tmp_path, damage, message):
    filled(engine)
    path = tmp_path / "s.safetensors"
    engine.snapshot_session("live", path)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        raw = bytearray(data)
        raw[-50] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "format":
        rewrite(path, format_version=99)
    elif damage == "tokens":
        rewrite(path, num_tokens=3)
    elif damage == "versions":
        meta_ends = engine.engine.sessions["live"].version_ends
        rewrite(path, version_ends=meta_ends[:-1])
    elif damage == "calibration":
        rewrite(path, calibration={"trend": {"samples": [[0.5, True, "no"]], "scored": 1, "run": 1}})
    elif damage == "data_version":
        rewrite(path, data_version=len(engine.engine.sessions["live"].version_ends) + 3)
    free = engine.engine.store.manager.num_free_blocks
    with pytest.raises(SnapshotError, match=message) as err:
        engine.restore_session(path, "copy")
    assert str(path) in str(err.value) and "not restored" in str(err.value)
    assert "copy" not in engine.engine.sessions and engine.engine.store.manager.num_free_blocks == free
    engine.engine.check_integrity()


def test_a_snapshot_of_another_model_is_refused(engine, tiny_model, tmp_path):
    filled(engine)
    path = tmp_path / "s.safetensors"
    engine.snapshot_session("live", path)
    other = Engine(dataclasses.replace(tiny_model, name="tiny-v2"), EngineConfig(max_cells=4096))
    try:
        with pytest.raises(SnapshotError, match="written by model 'tiny' with another config"):
            restore_session(other, path)
    finally:
        other.shutdown()


def test_restore_refuses_an_open_name_and_keeps_the_file(engine, tmp_path):
    filled(engine)
    path = tmp_path / "s.safetensors"
    engine.snapshot_session("live", path)
    with pytest.raises(SnapshotError, match="already open"):
        engine.restore_session(path)
    assert path.exists()


def test_evicted_session_comes_back_on_its_next_push_and_ask(engine, tmp_path):
    filled(engine)
    before = engine.ask("live", "What is the last close?", return_logits=True)
    seen = []
    engine.subscribe_data("live", lambda _s, v: seen.append(v))
    free = engine.engine.store.manager.num_free_blocks
    path = engine.evict_session("live")
    assert "live" not in engine.engine.sessions and engine.engine.store.manager.num_free_blocks > free
    engine.engine.check_integrity()
    after = engine.ask("live", "What is the last close?", return_logits=True)  # restored transparently
    assert (after.logits - before.logits).abs().max().item() <= 1e-4
    engine.wait_idle()  # restored standing questions re-compute their entries first
    engine.evict_session("live")
    assert engine.push("live", ["12:02:00 BTCUSDT C 64200.0"]).data_version == 6
    engine.wait_idle()
    assert seen[-1] == 6  # the subscriber stayed attached across eviction
    assert not engine.evicted() and not (tmp_path / path).exists()  # the snapshot is dropped once restored


def test_eviction_refuses_a_busy_session(engine, tmp_path):
    engine.open_session("busy")
    engine.push("busy", LINES)
    with pytest.raises(SnapshotError, match="not idle"):
        while True:  # until the engine has ingested it all, eviction must refuse
            engine.evict_session("busy")
    engine.wait_idle()


def test_recovery_restores_from_the_snapshot_then_replays_the_tail(tiny_model, tmp_path):
    snap = tmp_path / "snap.safetensors"
    eng = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024))
    filled(eng, "src")
    save_session(eng, "src", snap)
    eng.shutdown()
    log_dir = tmp_path / "log"
    eng = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024), ingest_log=IngestLog(log_dir))
    restore_session(eng, snap, "s")
    eng.push("s", ["tail line one", "tail line two"])
    eng.wait_idle()
    want = list(eng.sessions["s"].token_ids)
    eng.shutdown()
    eng2 = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024))
    try:
        report = recover(eng2, IngestLog(log_dir))
        assert report.sessions == 1 and report.batches == 1 and not report.failed
        assert eng2.sessions["s"].token_ids == want and eng2.session_info("s").data_version == 6
        assert torch.isfinite(eng2.ask("s", "trend", return_logits=True).logits).all()
    finally:
        eng2.shutdown()


def test_a_restored_session_keeps_its_tenant_and_an_older_file_gets_it_once_at_load(engine, tmp_path):
    engine.open_session("acme/live", "You watch bars.", tenant="acme")
    engine.push("acme/live", LINES[:7])
    engine.wait_idle()
    path = tmp_path / "t.safetensors"
    engine.snapshot_session("acme/live", path)
    assert engine.restore_session(path, "copy").session == "copy"
    assert engine.session_info("copy").tenant == "acme"  # the snapshot's field, whatever the new name
    engine.close_session("copy")
    with safe_open(str(path), framework="pt") as fh:  # a file written before snapshots carried the tenant
        meta = json.loads(fh.metadata()["streamllm"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    assert meta.pop("tenant") == "acme"
    save_file(tensors, str(path), metadata={"streamllm": json.dumps(meta)})
    engine.restore_session(path, "old")
    assert engine.session_info("old").tenant == "acme"  # derived from the name it was saved under
