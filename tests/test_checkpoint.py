"""Periodic checkpoints: the log is truncated behind them, recovery = newest valid checkpoint + log tail,
a torn newest checkpoint falls back to the one before it, and a power loss keeps them."""

from __future__ import annotations

import time

import pytest

from bench.powerloss import PowerLoss
from streamllm.config import parse_question
from streamllm.durability.checkpoint import snapshot_files, start_checkpoints
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.log_reader import session_folders
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig

QUESTION = parse_question({"id": "trend", "text": "Up or down?", "choices": ["up", "down"]})
CONFIG = EngineConfig(max_cells=16384, max_context=4096, block_size=8)  # no compaction: token ids compare


def lines(v: int) -> list[str]:
    return [f"12:{v // 60:02d}:{v % 60:02d} BTCUSDT C 640{v % 90:02d}.5 V {v}", f"n{v}"]


@pytest.fixture()
def engines(tiny_model):
    made: list[Engine] = []

    def make(**kw) -> Engine:
        eng = Engine(tiny_model, CONFIG, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()
        if eng.ingest_log is not None:
            eng.ingest_log.close()


def run(eng: Engine, log: IngestLog, versions: int, every: int) -> None:
    recover(eng, log)  # attaches the log, starts the checkpointer
    eng.open_session("s", "You watch bars.")
    eng.register("s", QUESTION)
    cp = log.checkpointer
    for v in range(1, versions + 1):
        eng.push("s", lines(v))
        if v % every == 0:
            eng.wait_idle()
            assert cp.checkpoint("s") is not None
    eng.wait_idle()


def test_checkpoints_truncate_the_log_and_recovery_replays_only_the_tail(engines, tmp_path):
    log = IngestLog(tmp_path, checkpoint_versions=10_000, segment_bytes=1024)
    eng = engines(ingest_log=None)
    run(eng, log, versions=47, every=10)
    (folder,) = session_folders(tmp_path)
    snaps = snapshot_files(folder)
    assert [s.version for s in snaps] == [40, 30]  # the newest two kept
    assert min(int(p.stem) for p in folder.glob("*.arrow")) >= snaps[1].log_segment  # older segments gone
    assert log.checkpointer.segments_truncated > 0
    live = eng.ask("s", "What is the last close?", return_logits=True, max_tokens=2)
    want = eng.sessions["s"].token_ids

    again = engines()
    report = recover(again, IngestLog(tmp_path))
    assert report.from_checkpoints == 1 and report.batches == 7 and not report.failed and not report.holes
    assert again.sessions["s"].token_ids == want and again.session_info("s").data_version == 47
    assert [q.id for q in again.standing_questions("s")] == ["trend"]
    got = again.ask("s", "What is the last close?", return_logits=True, max_tokens=2)
    assert (got.logits - live.logits).abs().max().item() <= 1e-4


def test_a_torn_newest_checkpoint_falls_back_to_the_one_before(engines, tmp_path):
    log = IngestLog(tmp_path, checkpoint_versions=10_000, segment_bytes=1024)
    eng = engines()
    run(eng, log, versions=33, every=10)
    want = eng.sessions["s"].token_ids
    (folder,) = session_folders(tmp_path)
    newest = snapshot_files(folder)[0]
    newest.path.write_bytes(newest.path.read_bytes()[:-300])
    again = engines()
    report = recover(again, IngestLog(tmp_path))
    assert report.from_checkpoints == 1 and len(report.checkpoint_fallbacks) == 1
    assert report.batches == 13 and not report.holes  # from the older checkpoint (v20) on
    assert again.sessions["s"].token_ids == want


def test_the_background_checkpointer_runs_by_itself(engines, tmp_path):
    log = IngestLog(tmp_path, checkpoint_versions=5)
    eng = engines()
    recover(eng, log)
    eng.open_session("s")
    for want, versions in ((1, range(1, 7)), (2, range(7, 13))):
        for v in versions:
            eng.push("s", lines(v))
        deadline = time.monotonic() + 30
        while log.checkpointer.checkpoints < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.checkpointer.checkpoints == want and log.checkpointer.errors == 0
    (folder,) = session_folders(tmp_path)
    assert snapshot_files(folder)[0].version >= 10


def test_checkpoints_survive_power_loss(engines, tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    with PowerLoss(root) as pl:
        log = IngestLog(root / "log", checkpoint_versions=10_000, segment_bytes=1024)
        eng = engines()
        run(eng, log, versions=25, every=10)
        want = eng.sessions["s"].token_ids
        image = pl.image(tmp_path / "image")
    again = engines()
    report = recover(again, IngestLog(image / "log"))
    assert report.from_checkpoints == 1 and not report.failed and not report.holes
    assert again.sessions["s"].token_ids == want


def test_a_closed_session_is_not_brought_back_by_its_checkpoints(engines, tmp_path):
    log = IngestLog(tmp_path, checkpoint_versions=10_000)
    eng = engines()
    run(eng, log, versions=12, every=10)
    eng.close_session("s")
    assert start_checkpoints(eng, log).checkpoint("s") is None
    again = engines()
    assert recover(again, IngestLog(tmp_path)).sessions == 0
