"""Power loss, simulated: only what was fsynced survives (files by content, names by their folder's fsync)."""

from __future__ import annotations

import os

import pytest

from bench.powerloss import PowerLoss
from streamllm.durability.ingest_log import IngestLog, _Segment
from streamllm.durability.log_reader import read_session, session_folders


def lines(v: int) -> list[str]:
    return [f"12:00:{v:02d} BTCUSDT C 640{v:02d}.5 V {v}"]


def survivors(pl: PowerLoss, tmp_path, n: int) -> dict[str, list[int]]:
    image = pl.image(tmp_path / f"after-{n}")
    out = {}
    for folder in session_folders(image / "log"):
        slog = read_session(folder)
        assert slog.hole is None
        out[slog.name] = [r.data_version for r in slog.records if r.kind == "push"]
    return out


def test_batch_policy_keeps_every_acked_record_across_rotations(tmp_path):
    with PowerLoss(tmp_path) as pl:
        log = IngestLog(tmp_path / "log", flush="batch", segment_bytes=2048)
        log.record_open("alice/btc", "sys", 512)
        for v in range(1, 31):
            log.record_push("alice/btc", v, lines(v))
            if v % 7 == 0:  # the machine could lose power right after any ack
                assert survivors(pl, tmp_path, v) == {"alice/btc": list(range(1, v + 1))}
        assert len(list((tmp_path / "log" / "sessions" / "alice%2Fbtc").glob("*.arrow"))) > 2
        assert survivors(pl, tmp_path, 99) == {"alice/btc": list(range(1, 31))}
        log.close()


def test_without_directory_fsync_a_new_segment_is_lost(tmp_path, monkeypatch):
    """The check above can fail: the same writes without the folder fsyncs lose everything."""
    monkeypatch.setattr("streamllm.durability.ingest_log.fsync_dir", lambda path: None)
    monkeypatch.setattr("streamllm.durability.files.fsync_dir", lambda path: None)
    with PowerLoss(tmp_path) as pl:
        log = IngestLog(tmp_path / "log", flush="batch")
        log.record_open("s", "sys", 512)
        log.record_push("s", 1, lines(1))
        image = pl.image(tmp_path / "image")
        log.close()
    assert not (image / "log").exists()


def test_interval_policy_loses_at_most_the_unsynced_suffix(tmp_path):
    with PowerLoss(tmp_path) as pl:
        log = IngestLog(tmp_path / "log", flush="interval", fsync_ms=60_000)  # the syncer never runs by itself
        log.record_open("s", "sys", 512)
        log.sync()
        for v in range(1, 11):
            log.record_push("s", v, lines(v))
        before = survivors(pl, tmp_path, 1).get("s", [])
        assert before == list(range(1, len(before) + 1)) and len(before) < 10  # a prefix, and not all of it
        log.sync()  # what the syncer does every fsync_ms
        assert survivors(pl, tmp_path, 2) == {"s": list(range(1, 11))}
        log.close()


def test_interval_syncer_does_not_lose_a_record_written_during_its_fsync(tmp_path, monkeypatch):
    seg = _Segment(tmp_path / "000001.arrow")
    from streamllm.durability.ingest_log import Record, record_batch

    seg.write(record_batch(Record("push", "s", 1, ["a"])), fsync=False)
    real = os.fsync
    calls = []

    def fsync_while_a_push_lands(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # a push is acked while the syncer's fsync is in progress
            seg.write(record_batch(Record("push", "s", 2, ["b"])), fsync=False)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync_while_a_push_lands)
    seg.sync()
    assert (seg.written, seg.synced) == (2, 1)  # the second record is not taken as synced
    seg.sync()
    assert len(calls) == 2 and seg.synced == 2
    seg.sync()
    assert len(calls) == 2  # nothing new: no fsync
    seg.close()


@pytest.mark.parametrize("flush", ["batch", "interval"])
def test_a_closed_session_stays_closed_after_power_loss(tmp_path, flush):
    with PowerLoss(tmp_path) as pl:
        log = IngestLog(tmp_path / "log", flush=flush)
        log.record_open("gone", "sys", 512)
        log.record_push("gone", 1, lines(1))
        log.sync()
        log.record_close("gone")
        assert survivors(pl, tmp_path, 1) == {}
        assert not log._locks  # nothing kept behind for a closed session
        log.close()
