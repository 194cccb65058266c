"""A corrupt record in the middle of the log is a hole: reading stops there and recovery refuses
to open the session unless asked to repair it; a torn tail (a crash mid-write) is not a hole."""

from __future__ import annotations

import logging

import pytest

from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.log_reader import read_session, session_folders
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.outputs import SessionError


def lines(v: int) -> list[str]:
    return [f"12:00:{v:02d} BTCUSDT C 640{v:02d}.5 marker{v:03d}"]


def write_log(tmp_path, versions: int = 12, segment_bytes: int = 1 << 20):
    log = IngestLog(tmp_path, segment_bytes=segment_bytes)
    log.record_open("s", "sys", 1024)
    for v in range(1, versions + 1):
        log.record_push("s", v, lines(v))
    log.close()
    (folder,) = session_folders(tmp_path)
    return folder


def flip(path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(needle)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture()
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024))
    yield eng
    eng.shutdown()


def test_a_corrupt_record_mid_segment_stops_reading_and_says_hole(tmp_path, caplog):
    folder = write_log(tmp_path)
    seg = folder / "000001.arrow"
    flip(seg, b"marker005")
    before = seg.read_bytes()
    with caplog.at_level(logging.ERROR):
        slog = read_session(folder, repair=True)  # torn-tail repair never touches a hole
    assert [r.data_version for r in slog.records if r.kind == "push"] == [1, 2, 3, 4]
    assert slog.hole is not None and "checksum" in slog.hole and "7 good record(s) follow it" in slog.hole
    assert "HOLE" in caplog.text and seg.read_bytes() == before


def test_a_missing_segment_is_a_hole_by_its_versions(tmp_path):
    folder = write_log(tmp_path, versions=40, segment_bytes=2048)
    segments = sorted(folder.glob("*.arrow"))
    assert len(segments) >= 3
    segments[1].unlink()
    slog = read_session(folder)
    assert slog.hole is not None and "versions jump" in slog.hole
    got = [r.data_version for r in slog.records if r.kind == "push"]
    assert got == list(range(1, len(got) + 1))


def test_a_torn_tail_followed_by_a_restarted_segment_is_not_a_hole(tmp_path):
    folder = write_log(tmp_path, versions=5)
    seg = folder / "000001.arrow"
    seg.write_bytes(seg.read_bytes()[:-40])  # end-of-stream marker and part of v5 gone: a crash mid-write
    log = IngestLog(tmp_path)  # the restarted process goes on at v5 in a new segment
    log.record_push("s", 5, lines(5))
    log.close()
    slog = read_session(folder)
    assert slog.hole is None and slog.torn
    assert [r.data_version for r in slog.records if r.kind == "push"] == [1, 2, 3, 4, 5]


def test_recovery_refuses_a_session_with_a_hole_unless_repaired(tmp_path, engine, tiny_model, caplog):
    folder = write_log(tmp_path)
    flip(folder / "000001.arrow", b"marker008")
    with caplog.at_level(logging.ERROR):
        report = recover(engine, IngestLog(tmp_path))
    assert report.sessions == 0 and report.holes and "not opened without --repair" in report.failed[0]
    assert "HOLE" in report.summary() and "HOLE" in caplog.text
    with pytest.raises(SessionError):
        engine.session_info("s")
    again = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024))
    try:
        report = recover(again, IngestLog(tmp_path), repair=True)
        assert report.sessions == 1 and report.repaired == ["s"] and "REPAIRED" in report.summary()
        assert again.session_info("s").data_version == 7  # up to the hole, nothing after it
        kept = list(folder.glob("*.hole-*"))
        assert len(kept) == 1  # the damaged segment is kept aside for inspection
        assert read_session(folder).hole is None  # the log is consistent again
        assert again.push("s", lines(99)).data_version == 8
    finally:
        again.shutdown()
