"""A failing disk: a write or fsync of the ingest log that raises never costs an acked batch or a hole.

The faults are injected at the system calls the log makes on its segment files (`os.write`,
`os.fsync`, `os.ftruncate`): a failed write lands half of its record first, as a full disk
can. After each scenario the log is recovered from its folder and compared with a reference
run that pushed the same acked batches on a healthy disk.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect

from streamllm.durability.ingest_log import IngestLog, IngestLogError
from streamllm.durability.log_reader import read_session, session_folders
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.outputs import SessionError

CONFIG = EngineConfig(max_cells=4096, block_size=8, max_context=1024)


def batch(i: int) -> list[str]:
    return [f"12:00:{i:02d} BTCUSDT C 640{i:02d}.5 V {i} b{i}"]


class DiskFaults:
    """Arms failures of the next N writes / fsyncs / truncates of ingest-log segments (other files pass)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes = self.fsyncs = self.truncates = 0
        self.hit: list[str] = []
        real_write, real_fsync, real_truncate = os.write, os.fsync, os.ftruncate

        def write(fd, data):
            if self.writes and _segment(fd):
                self.writes -= 1
                self.hit.append("write")
                real_write(fd, bytes(data)[: len(data) // 2])  # part of the record reaches the file
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        def fsync(fd):
            if self.fsyncs and _segment(fd):
                self.fsyncs -= 1
                self.hit.append("fsync")
                raise OSError(errno.EIO, "Input/output error")
            return real_fsync(fd)

        def ftruncate(fd, size):
            if self.truncates and _segment(fd):
                self.truncates -= 1
                self.hit.append("ftruncate")
                raise OSError(errno.EIO, "Input/output error")
            return real_truncate(fd, size)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "ftruncate", ftruncate)


def _segment(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(".arrow")
    except OSError:
        return False


@pytest.fixture()
def faults(monkeypatch):
    return DiskFaults(monkeypatch)


def push_all(eng: Engine, name: str, batches: range, arm=None) -> tuple[dict[int, list[str]], list[str]]:
    """Push each batch; `arm(i)` before batch i may arm a fault. (acked version -> lines, error texts)."""
    acked, errors = {}, []
    for i in batches:
        if arm is not None:
            arm(i)
        try:
            ack = eng.push(name, batch(i))
        except IngestLogError as exc:
            errors.append(str(exc))
        else:
            acked[ack.data_version] = batch(i)
    return acked, errors


def recovered(tiny_model, log_dir) -> tuple[dict[int, list[str]], list[int], object]:
    """Recover the log into a new engine: (logged pushes by version, the session's token ids, the report)."""
    (folder,) = session_folders(log_dir)
    eng = Engine(tiny_model, CONFIG)
    try:
        report = recover(eng, IngestLog(log_dir))
        eng.wait_idle()
        tokens = eng.call(lambda core: list(core.session("s").token_ids))
        eng.ingest_log.close()
    finally:
        eng.shutdown()
    logged = {r.data_version: r.lines for r in read_session(folder).records if r.kind == "push"}
    return logged, tokens, report


def reference(tiny_model, tmp_path, acked: dict[int, list[str]]) -> list[int]:
    """The session's token ids after the same acked batches on a healthy disk, recovered the same way."""
    eng = Engine(tiny_model, CONFIG, ingest_log=IngestLog(tmp_path / "reference"))
    eng.open_session("s")
    for version in sorted(acked):
        assert eng.push("s", acked[version]).data_version == version
    eng.shutdown()
    eng.ingest_log.close()
    return recovered(tiny_model, tmp_path / "reference")[1]


@pytest.mark.parametrize("fault", ["write", "fsync"])
def test_a_failed_write_or_fsync_abandons_the_segment_and_loses_nothing_acked(tiny_model, tmp_path, faults, fault):
    log = IngestLog(tmp_path / "log")
    eng = Engine(tiny_model, CONFIG, ingest_log=log)
    eng.open_session("s")

    def arm(i: int) -> None:
        if i == 3:
            setattr(faults, f"{fault}s", 1)

    acked, errors = push_all(eng, "s", range(1, 7), arm)
    assert faults.hit == [fault] and len(errors) == 1 and "not acknowledged" in errors[0]
    assert "abandoned" in errors[0]
    # the failed push's version is taken by the next one: nothing of it is on disk (cut off, fsynced)
    assert sorted(acked) == [1, 2, 3, 4, 5] and acked[3] == batch(4)
    assert log.failure is None and log.segments_abandoned == 1 and eng.health().log_failure is None
    segments = sorted(p.name for p in log.folder("s").glob("*.arrow"))
    assert segments == ["000001.arrow", "000002.arrow"]  # a new segment after the failure
    eng.shutdown()
    log.close()
    logged, tokens, report = recovered(tiny_model, tmp_path / "log")
    assert not report.holes and not report.failed and not report.torn, report.summary()
    assert logged == acked
    assert tokens == reference(tiny_model, tmp_path, acked)


def test_a_failure_that_cannot_be_cut_off_stops_the_log(tiny_model, tmp_path, faults):
    log = IngestLog(tmp_path / "log")
    eng = Engine(tiny_model, CONFIG, ingest_log=log)
    eng.open_session("s")

    def arm(i: int) -> None:
        if i == 3:  # the write fails half-way and the cut that would remove its bytes fails too
            faults.writes, faults.truncates = 1, 1

    acked, errors = push_all(eng, "s", range(1, 6), arm)
    assert faults.hit == ["write", "ftruncate"]
    assert sorted(acked) == [1, 2] and len(errors) == 3
    assert all("not acknowledged" in e and "stopped" in e for e in errors)
    assert log.failure is not None and "No space left" in log.failure
    assert eng.health().log_failure == log.failure
    with pytest.raises(IngestLogError, match="stopped"):  # nothing is opened that could not be logged
        eng.open_session("t")
    with pytest.raises(SessionError):
        eng.session_info("t")
    eng.shutdown()
    log.close()
    logged, tokens, report = recovered(tiny_model, tmp_path / "log")
    assert not report.holes and not report.failed, report.summary()
    assert report.torn  # the failed record's half is a torn tail, cut off at recovery
    assert logged == acked
    assert tokens == reference(tiny_model, tmp_path, acked)


def test_an_interval_fsync_failure_stops_the_log_instead_of_being_swallowed(tiny_model, tmp_path, faults):
    log = IngestLog(tmp_path / "log", flush="interval", fsync_ms=60_000)  # syncs only when told
    eng = Engine(tiny_model, CONFIG, ingest_log=log)
    eng.open_session("s")
    acked, _ = push_all(eng, "s", range(1, 3))
    faults.fsyncs = 1
    with pytest.raises(IngestLogError, match="fsync.*may not be durable"):
        log.sync()  # what the syncer does every fsync_ms
    assert log.failure is not None and eng.health().log_failure == log.failure
    more, errors = push_all(eng, "s", range(3, 5))
    assert more == {} and len(errors) == 2 and all("stopped" in e for e in errors)
    eng.shutdown()
    log.close()  # writes nothing after a stop
    logged, _, report = recovered(tiny_model, tmp_path / "log")
    assert not report.holes and not report.failed and logged == acked


def test_the_interval_syncer_stops_the_log_on_its_own(tiny_model, tmp_path, faults):
    log = IngestLog(tmp_path / "log", flush="interval", fsync_ms=5)
    faults.fsyncs = 1
    log.record_open("s", "sys", 512)
    log.record_push("s", 1, batch(1))  # acked: in the OS
    log._syncer.join(30)  # noqa: SLF001 - the syncer thread ends once the log stops
    assert log.failure is not None and "fsync" in log.failure
    with pytest.raises(IngestLogError, match="stopped"):
        log.record_push("s", 2, batch(2))
    log.close()


def test_a_websocket_push_on_a_failing_disk_gets_unavailable_and_health_says_why(tiny_model, tmp_path, faults):
    """What a client sees: a push that could not be logged is an `unavailable` error (never an ok); after
    an abandoned segment the next push is acked; once the log stopped, pushes keep getting `unavailable`
    and /health answers 503 `failing` with the reason."""
    from streamllm.service.server import ServerConfig, StreamServer

    log = IngestLog(tmp_path / "log")
    engine = Engine(tiny_model, CONFIG, ingest_log=log)

    def get_health(port: int) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    async def scenario():
        async with StreamServer(engine, None, ServerConfig(port=0)) as server, connect(server.url) as ws:
            replies, health = [], []
            steps = [{"type": "hello"}, {"type": "open", "session": "s"}, {"type": "push", "session": "s", "lines": batch(1)},
                     "fail once", {"type": "push", "session": "s", "lines": batch(2)},
                     {"type": "push", "session": "s", "lines": batch(3)}, "health",
                     "fail for good", {"type": "push", "session": "s", "lines": batch(4)},
                     {"type": "push", "session": "s", "lines": batch(5)}, "health"]
            for i, step in enumerate(steps):
                if step == "fail once":
                    faults.writes = 1
                elif step == "fail for good":  # the write fails and so does the cut of its bytes
                    faults.writes, faults.truncates = 1, 1
                elif step == "health":
                    health.append(await asyncio.to_thread(get_health, server.port))
                else:
                    await ws.send(json.dumps({**step, "id": i}))
                    replies.append(json.loads(await ws.recv()))
            return replies, health

    try:
        replies, health = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        engine.shutdown()
        log.close()
    assert [r["type"] for r in replies] == ["welcome", "ok", "ok", "error", "ok", "error", "error"], replies
    assert all(r["code"] == "unavailable" and "not acknowledged" in r["message"] for r in replies if r["type"] == "error")
    assert "stopped" in replies[5]["message"] and "stopped" in replies[6]["message"]
    assert [replies[2]["data_version"], replies[4]["data_version"]] == [1, 2]
    (code, first), (code_after, after) = health
    assert code == 200 and first["status"] == "ok"
    assert code_after == 503 and after["status"] == "failing"
    assert any("ingest log stopped writing" in r for r in after["reasons"])
    (folder,) = session_folders(tmp_path / "log")
    assert [r.lines for r in read_session(folder).records if r.kind == "push"] == [batch(1), batch(3)]
