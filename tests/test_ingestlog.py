"""The durable ingest log: ordered, rotated, torn tails dropped, and recovery rebuilds sessions."""

from __future__ import annotations

import threading

import pytest

from streamllm.config import parse_question
from streamllm.durability.ingest_log import IngestLog, Record
from streamllm.durability.log_reader import pushed_lines, read_session, session_folders
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.commands import Call

QUESTION = parse_question({"id": "trend", "text": "Up or down?", "choices": ["up", "down"]})


def lines(batch: int, n: int = 3) -> list[str]:
    return [f"12:{batch:02d}:{i:02d} BTCUSDT C 640{batch:02d}.{i} V {i}" for i in range(n)]


@pytest.fixture()
def make_engine(tiny_model):
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        eng = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=1024), **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()
        if eng.ingest_log is not None:
            eng.ingest_log.close()


def test_records_round_trip_in_order_and_rotate_segments(tmp_path):
    log = IngestLog(tmp_path, segment_bytes=4096)
    log.record_open("alice/btc.usd", "sys", 512)
    for v in range(1, 41):
        log.record_push("alice/btc.usd", v, lines(v))
    log.close()
    (folder,) = session_folders(tmp_path)
    slog = read_session(folder)
    assert slog.name == "alice/btc.usd" and slog.segments > 1 and not slog.torn
    assert [r.data_version for r in slog.records if r.kind == "push"] == list(range(1, 41))
    assert pushed_lines(tmp_path)["alice/btc.usd"] == [x for v in range(1, 41) for x in lines(v)]


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_a_torn_last_record_is_dropped_and_the_rest_kept(tmp_path, cut, caplog):
    log = IngestLog(tmp_path, flush="interval", fsync_ms=5)
    log.record_open("s", "sys", 512)
    for v in range(1, 6):
        log.record_push("s", v, lines(v))
    seg = log._segments["s"].path
    size_before_last = seg.stat().st_size
    log.record_push("s", 6, lines(6))
    # a crash mid-write: the last record is only partly on disk (no end-of-stream marker either)
    data = seg.read_bytes()
    seg.write_bytes(data[: size_before_last + max(1, (len(data) - size_before_last) - cut)])
    slog = read_session(seg.parent, repair=True)
    assert [r.data_version for r in slog.records if r.kind == "push"] == [1, 2, 3, 4, 5]
    assert slog.torn and "torn" in slog.torn[0] or "checksum" in slog.torn[0]
    assert "dropped it" in caplog.text
    again = read_session(seg.parent)  # repaired: no warning the second time
    assert not again.torn and len(again.records) == 6


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    log = IngestLog(tmp_path)
    log.record_open("s", "sys", 512)
    log.record_push("s", 1, ["first line"])
    log.record_push("s", 2, ["second line"])
    seg = log._segments["s"].path
    log.close()
    data = bytearray(seg.read_bytes())
    at = data.rindex(b"second line")
    data[at] ^= 0x01
    seg.write_bytes(bytes(data))
    slog = read_session(seg.parent)
    assert [r.lines for r in slog.records if r.kind == "push"] == [["first line"]]
    assert "checksum" in slog.torn[0]


def test_engine_logs_before_ack_and_recovery_rebuilds_sessions(make_engine, tmp_path):
    eng = make_engine(ingest_log=IngestLog(tmp_path))
    eng.open_session("a", "You watch bars.", max_context=512)
    eng.open_session("b")
    eng.register("a", QUESTION)
    acked = {"a": [], "b": []}
    for v in range(1, 9):
        for name in acked:
            ack = eng.push(name, lines(v))
            assert ack.data_version == v
            acked[name] += lines(v)
        # each ack is on disk when push returns
        assert pushed_lines(tmp_path)["a"] == acked["a"]
    eng.open_session("gone")
    eng.push("gone", ["x"])
    eng.close_session("gone")
    eng.wait_idle()
    want = {n: eng.session_info(n) for n in acked}
    live = eng.ask("a", "trend", return_logits=True)
    # "crash": the first engine is abandoned without closing its log
    eng2 = make_engine()
    report = recover(eng2, IngestLog(tmp_path))
    assert report.sessions == 2 and report.batches == 16 and report.lines == 48 and not report.failed
    assert report.version_mismatches == 0 and report.questions == 1
    assert {s.name for s in eng2.list_sessions()} == {"a", "b"}
    for name, info in want.items():
        got = eng2.session_info(name)
        assert (got.data_version, got.num_tokens, got.lines_ingested) == (info.data_version, info.num_tokens,
                                                                         info.lines_ingested)
        assert eng2.sessions[name].token_ids == eng.sessions[name].token_ids
    assert [q.id for q in eng2.standing_questions("a")] == ["trend"]
    again = eng2.ask("a", "trend", return_logits=True)
    assert again.text == live.text and (again.logits - live.logits).abs().max() < 1e-4
    # the log goes on after recovery, in a fresh segment
    assert eng2.push("a", lines(9)).data_version == 9
    assert pushed_lines(tmp_path)["a"] == acked["a"] + lines(9)


def test_concurrent_pushes_are_logged_in_version_order(make_engine, tmp_path):
    eng = make_engine(ingest_log=IngestLog(tmp_path, flush="interval", fsync_ms=10))
    eng.open_session("s", max_context=1024)

    def pusher(k: int) -> None:
        for i in range(10):
            eng.push("s", [f"t{k} b{i}"])

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (folder,) = session_folders(tmp_path)
    versions = [r.data_version for r in read_session(folder).records if r.kind == "push"]
    assert versions == list(range(1, 41))


def test_a_log_that_does_not_start_with_open_is_reported_not_fatal(make_engine, tmp_path):
    log = IngestLog(tmp_path)
    log.append(Record("push", "orphan", 1, ["x"]))
    log.record_open("ok", "sys", 512)
    log.record_push("ok", 1, ["y"])
    log.close()
    eng = make_engine()
    report = recover(eng, IngestLog(tmp_path))
    assert report.sessions == 1 and "orphan" in report.failed[0]
    assert eng.session_info("ok").pushed_version == 1


def test_a_burst_longer_than_one_drain_applies_in_version_order(make_engine, tmp_path):
    """More pushes than the core drains at once (256) must still reach it in the acked order."""
    eng = make_engine(ingest_log=IngestLog(tmp_path, flush="interval"))
    eng.open_session("s", max_context=4096)  # no compaction: every token stays to compare
    n = 2 * eng.core.max_commands_per_drain
    blocker = threading.Event()
    eng.core.submit(Call(lambda core: blocker.wait(10)))  # the core is busy while the burst queues up
    for i in range(n):
        eng.push("s", [f"b{i}"])
    blocker.set()
    eng.wait_idle()
    assert eng.failure is None and eng.session_info("s").data_version == n
    s = eng.sessions["s"]
    ids = [t for i in range(n) for line in eng.layout.lines_ids([f"b{i}"]) for t in line]
    assert s.token_ids[s.prefix_len:] == ids  # each batch at the version its ack gave it


def test_recovery_keeps_each_sessions_tenant_and_derives_it_for_an_older_log(make_engine, tmp_path):
    eng = make_engine(ingest_log=IngestLog(tmp_path))
    eng.open_session("k1", tenant="acme")  # the key says nothing of the tenant: the field does
    eng.push("k1", lines(1))
    eng.ingest_log.close()
    log = IngestLog(tmp_path / "old")  # written before open records carried a tenant
    log.append(Record("open", "bob/s", meta={"system": "sys", "max_context": 512}))
    log.close()
    again = make_engine()
    recover(again, IngestLog(tmp_path))
    assert again.session_info("k1").tenant == "acme"
    older = make_engine()
    recover(older, IngestLog(tmp_path / "old"))
    assert older.session_info("bob/s").tenant == "bob"
