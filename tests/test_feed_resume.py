"""Exactly-once feeds: a recorded feed killed mid-way and restarted from its beginning delivers
every line once: positions logged with the batches, resumed from, duplicates refused."""

from __future__ import annotations

import pytest

from feeds.events import Trade
from streamllm.durability.ingest_log import DuplicateBatch, IngestLog
from streamllm.durability.log_reader import pushed_lines
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig
from streamllm.feeding.attach import Attachment, AttachSpec

FEED = "replay:trades.csv"
S = 1_000_000_000


def events() -> list[Trade]:
    out = []
    for i in range(400):
        ns = 1_700_000_000 * S + i * 370_000_000 + (60 * S if i > 200 else 0)  # a quiet minute midway
        inst = "BTCUSDT" if i % 5 else "ETHUSDT"  # every fifth event is another instrument: ignored
        out.append(Trade("t", inst, ns, ns, 64000 + (i * 7919 % 100) / 10, 0.01 * (1 + i % 3), 1, i))
    return out


def drive(att: Attachment, evs: list[Trade], *, until: int | None = None, every: int = 9) -> None:
    """What `market.attach.attach` does; `until` stops mid-feed without the final flush (a crash)."""
    for n, ev in enumerate(evs[:until], 1):
        att.offer(ev)
        if n % every == 0:
            att.tick(ev.ts_recv)
            att.flush()
    if until is None:
        att.flush()


def attachment(engine: Engine, log: IngestLog) -> Attachment:
    spec = AttachSpec("btc", mode="bars", bar_s=5, instruments=frozenset({"BTCUSDT"}), max_backlog=10**6)
    return Attachment(engine, spec, feed_id=FEED, resume_from=log.feed_position("btc", FEED))


@pytest.fixture()
def engines(tiny_model):
    made: list[Engine] = []

    def make() -> Engine:
        eng = Engine(tiny_model, EngineConfig(max_cells=16384, max_context=4096))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()
        if eng.ingest_log is not None:
            eng.ingest_log.close()


def reference_lines(engines, tmp_path) -> list[str]:
    eng, log = engines(), IngestLog(tmp_path / "ref")
    recover(eng, log)
    eng.open_session("btc")
    drive(attachment(eng, log), events())
    return pushed_lines(tmp_path / "ref")["btc"]


@pytest.mark.parametrize("crash_at", [50, 203, 331])
def test_a_restarted_replay_feed_delivers_each_line_once(engines, tmp_path, crash_at):
    want = reference_lines(engines, tmp_path)
    first, log = engines(), IngestLog(tmp_path / "log")
    recover(first, log)
    first.open_session("btc")
    drive(attachment(first, log), events(), until=crash_at)
    delivered = pushed_lines(tmp_path / "log")["btc"]
    assert delivered and delivered == want[: len(delivered)]
    # crash: the first engine is abandoned; the restarted one replays the feed from its beginning
    second, log2 = engines(), IngestLog(tmp_path / "log")
    recover(second, log2)
    att = attachment(second, log2)
    assert att.resume_from is not None
    drive(att, events())
    got = pushed_lines(tmp_path / "log")["btc"]
    assert got == want  # nothing twice, nothing missing, same order
    assert att.stats.resumed_lines == len(delivered) and att.stats.duplicates == 0
    assert att.accounted() == att.stats.events_in


def test_the_log_refuses_a_batch_behind_its_feed_position(engines, tmp_path):
    eng, log = engines(), IngestLog(tmp_path)
    recover(eng, log)
    eng.open_session("btc")
    assert eng.push("btc", ["a"], source=(FEED, 10)).data_version == 1
    assert eng.push("btc", ["b"], source=(FEED, 10)).data_version == 2  # same position: gap lines, allowed
    with pytest.raises(DuplicateBatch, match="behind the logged position 10"):
        eng.push("btc", ["old"], source=(FEED, 4))
    assert eng.push("btc", ["c"], source=("other-feed", 1)).data_version == 3  # positions are per feed
    assert eng.session_info("btc").pushed_version == 3 and log.duplicates_dropped == 1
    assert pushed_lines(tmp_path)["btc"] == ["a", "b", "c"]
