"""Attaching feeds to sessions: pushing, holding back, coalescing with exact accounting."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import pytest

from feeds.bars import bars
from feeds.events import BUY, SELL, Quote, Trade
from feeds.synthetic import synthetic_events
from streamllm.feeding.attach import Attachment, AttachSpec, attach

S = 1_000_000_000
T0 = 1_723_161_600 * S


@dataclass
class PushAck:
    session: str
    data_version: int
    queue_depth: int


@dataclass
class Sink:
    """The engine's push/backlog contract; `ingest(n)` plays the batcher catching up."""

    lagging: bool = False
    queued: dict[str, int] = field(default_factory=dict)
    lines: dict[str, list[str]] = field(default_factory=dict)
    version: int = 0

    def push(self, session: str, lines: list[str]) -> PushAck:
        self.lines.setdefault(session, []).extend(lines)
        self.queued[session] = self.queued.get(session, 0) + len(lines)
        self.version += 1
        return PushAck(session, self.version, self.queued[session])

    def backlog(self, session: str) -> int:
        return self.queued.get(session, 0) if self.lagging else 0

    def ingest(self, session: str) -> None:
        self.queued[session] = 0


def _trade(sec: float, price: float, size: float, side: int, inst: str = "BTCUSDT") -> Trade:
    ns = T0 + round(sec * S)
    return Trade("t", inst, ns, ns, price, size, side, 0, 2, 3)


def test_bars_mode_pushes_bar_lines_on_time() -> None:
    sink = Sink()
    a = Attachment(sink, AttachSpec("btc", bar_s=60))
    for ev in [_trade(1, 100, 1, BUY), _trade(30, 101, 1, SELL), _trade(61, 102, 2, BUY)]:
        a.offer(ev)
    a.offer(Quote("t", "BTCUSDT", T0, T0, 1, 1, 2, 1, 2, 3))  # not a trade: ignored, counted
    ack = a.flush()
    assert ack.data_version == 1 and sink.lines["btc"] == ["2024-08-09T00:00 101 +1 v2 n2 b50"]
    a.tick(T0 + 180 * S)
    a.flush()
    assert sink.lines["btc"][1:] == ["00:01 102 +1 o+1 v2 n1 b100", "00:02 102 no trades"]
    assert a.accounted() == a.stats.events_in == 4 and a.stats.ignored == 1


def test_lagging_ingest_coalesces_events_without_losing_any() -> None:
    sink = Sink(lagging=True)
    spec = AttachSpec("btc", mode="events", max_backlog=10, max_pending=20)
    a = Attachment(sink, spec)
    evs = [_trade(i * 0.1, 100 + i % 7, 1, BUY if i % 3 else SELL) for i in range(100)]
    for ev in evs[:10]:
        a.offer(ev)
    a.flush()  # backlog 0 so far: pushed as ten lines
    assert len(sink.lines["btc"]) == 10
    for ev in evs[10:]:
        a.offer(ev)
        a.flush()  # ingest is behind (backlog 10): held, then coalesced
        assert a.accounted() == a.stats.events_in
    assert a.stats.held > 0 and a.stats.summaries >= 1
    sink.ingest("btc")
    a.flush()
    summary = [line for line in sink.lines["btc"] if "summary" in line]
    assert summary, sink.lines["btc"]
    counted = sum(int(line.split(" summary ")[1].split(" trades")[0]) for line in summary)
    assert counted == a.stats.events_summarized
    assert a.stats.events_as_lines + a.stats.events_summarized == 100 == a.accounted()


def test_lagging_bars_merge_into_one_line() -> None:
    sink = Sink(lagging=True)
    sink.queued["btc"] = 99
    a = Attachment(sink, AttachSpec("btc", bar_s=1, max_backlog=5, max_pending=3))
    for i in range(6):
        a.offer(_trade(i + 0.5, 100 + i, 1, BUY))
        a.flush()
    sink.ingest("btc")
    a.flush()
    summary, last = sink.lines["btc"]  # 4 bars coalesced when pending passed 3; the 5th after
    assert summary == "2024-08-09T00:00:00 103 +3 v4 n4 b100 (4 bars to 00:00:04)"
    assert last == "00:00:04 104 +1 o+1 v1 n1 b100"
    assert a.stats.events_summarized == 4 and a.accounted() == a.stats.events_in == 6


def test_attach_driver_with_synthetic_feed() -> None:
    sink = Sink()
    evs = synthetic_events(seed=2, duration_s=300)
    specs = [Attachment(sink, AttachSpec("btc", bar_s=60, instruments=frozenset({"BTCUSDT"}))),
             Attachment(sink, AttachSpec("eth-raw", mode="events", instruments=frozenset({"ETHUSDT"})))]
    asyncio.run(attach(evs, specs))
    assert len(sink.lines["btc"]) >= 4 and all(line[:2].isdigit() for line in sink.lines["btc"])
    raw = specs[1]
    assert raw.stats.events_as_lines == len(sink.lines["eth-raw"]) == sum(1 for e in evs if e.instrument == "ETHUSDT")
    for s in specs:
        assert s.accounted() == s.stats.events_in == len(evs)


def test_bars_mode_takes_a_bar_table_as_bars(tmp_path) -> None:
    """bench replay --data BARS.csv: a bars session gets one line per bar of the table."""
    from feeds.sources import ReadOptions, open_recorded

    csv = tmp_path / "btc-perp_1m.csv"
    csv.write_text("timestamp,open,high,low,close,volume\n1640991660000,100,101,99,100.5,3\n"
                   "1640991720000,100.5,102,100,101,4\n1640991780000,101,101,100,100,2\n")
    (src,) = open_recorded([csv], ReadOptions(instrument="BTCUSDT"))
    sink = Sink()
    a = Attachment(sink, AttachSpec("btc", mode="bars", bar_s=60, instruments=frozenset({"BTCUSDT"})))
    asyncio.run(attach(src, [a]))
    assert sink.lines["btc"] == ["2021-12-31T23:01 100.5 +0.5 h+0.5 l-1 v3", "23:02 101 +0.5 h+1 l-0.5 v4",
                                 "23:03 100 -1 v2"]
    assert a.accounted() == a.stats.events_in == 3 and a.stats.ignored == 0


def test_a_bp_session_is_rendered_alike_when_served_and_when_tuned(tmp_path) -> None:
    """`[sessions.render] changes = "bp"` reaches the attachment that feeds the engine and the
    windows `tune` extracts: a head is trained on the lines it will read."""
    from feeds.bars import bars
    from streamllm.config import load_config
    from streamllm.tuning.extract import render_window

    config = tmp_path / "q.toml"
    config.write_text('[[sessions]]\nname = "btc"\ninstrument = "BTCUSDT"\n'
                      '[sessions.render]\nmode = "bars"\nbar_seconds = 5\nchanges = "bp"\n')
    spec = load_config(config).sessions[0]
    assert spec.render.changes == "bp"
    trades = [e for e in synthetic_events(seed=3, duration_s=120) if isinstance(e, Trade) and e.instrument == "BTCUSDT"]
    sink = Sink()
    a = Attachment(sink, AttachSpec.of(spec))  # as serve, demo and the benches build it
    for ev in trades:
        a.offer(ev)
    a.tick(trades[-1].ts_event + 10 * S)
    a.flush()
    tuned = render_window(list(bars(trades, 5)), spec.render.changes)
    served = sink.lines["btc"][: len(tuned)]  # (the tick may close one more, empty, interval)
    assert len(tuned) >= 20 and served == tuned
    assert served != render_window(list(bars(trades, 5)))  # not the price-unit lines


def _recv_shifted(evs: list, shift_ns: int) -> list:
    return [dataclasses.replace(e, ts_recv=e.ts_recv + shift_ns) for e in evs]


def test_bars_close_on_the_venue_clock_when_the_receive_clock_is_far_off() -> None:
    # A capture replayed through a local server (`binance:ws://127.0.0.1:...`) arrives stamped with
    # today's receive times and its own venue times; so does a feed on a host whose clock is off.
    evs = synthetic_events(seed=3, duration_s=600)
    runs = {}
    for name, shift in {"recorded": 0, "replayed two years on": 2 * 365 * 86400 * S,
                        "host clock 90 s slow": -90 * S}.items():
        sink = Sink()
        a = Attachment(sink, AttachSpec("btc", bar_s=60, instruments=frozenset({"BTCUSDT"})))
        asyncio.run(attach(_recv_shifted(evs, shift), [a], flush_every=16))
        assert a.stats.late == 0 and a.accounted() == a.stats.events_in, name
        runs[name] = sink.lines["btc"]
    assert len(runs["recorded"]) >= 9
    assert runs["replayed two years on"] == runs["recorded"] == runs["host clock 90 s slow"]
    # Bars are closed between trades, not only by the next bar's first trade: a quiet feed still ticks.
    trades = [e for e in evs if type(e) is Trade and e.instrument == "BTCUSDT"]
    assert len(runs["recorded"]) == len(list(bars(trades, 60))) - 1  # all but the open one


def _recv_later(trades: list[Trade], lag_ms: int = 80) -> list[Trade]:
    return [dataclasses.replace(t, ts_recv=t.ts_event + lag_ms * 1_000_000) for t in trades]


def test_one_trade_stamped_an_hour_ahead_is_left_out() -> None:
    """One bad time must not settle the hour before it: the bars up to it would close at once and
    every trade after it would be late. The next trade is back in line, so it is left out."""
    good = _recv_later([_trade(i * 0.5, 100 + i % 5, 1, BUY, inst="BTCUSDT" if i % 3 else "ETHUSDT") for i in range(400)])
    bad = dataclasses.replace(good[200], ts_event=good[200].ts_event + 3600 * S, trade_id="bad")
    runs = {}
    for name, evs in {"clean": good, "one bad time": [*good[:200], bad, *good[200:]]}.items():
        sink = Sink()
        a = Attachment(sink, AttachSpec("btc", bar_s=10, instruments=frozenset({"BTCUSDT"})))
        asyncio.run(attach(evs, [a], flush_every=8))
        assert a.stats.late == 0 and a.accounted() == a.stats.events_in == len(evs), name
        runs[name] = (sink.lines["btc"], a.stats.ahead)
    assert runs["one bad time"] == (runs["clean"][0], 1) and runs["clean"][1] == 0


def test_a_venue_clock_that_steps_ahead_is_followed() -> None:
    """Every trade from some point on an hour later (a host clock corrected, a replay that skips
    a silence): the second trade confirms the first, and nothing is left out or late."""
    evs = _recv_later([_trade(i * 0.5, 100 + i % 5, 1, BUY) for i in range(200)])
    evs = evs[:100] + [dataclasses.replace(t, ts_event=t.ts_event + 3600 * S) for t in evs[100:]]
    sink = Sink()
    a = Attachment(sink, AttachSpec("btc", bar_s=10))
    asyncio.run(attach(evs, [a], flush_every=8))
    assert a.stats.ahead == a.stats.late == 0 and a.accounted() == a.stats.events_in == 200
    in_bars = sum(int(w[1:]) for line in sink.lines["btc"] for w in line.split() if w.startswith("n") and w[1:].isdigit())
    assert in_bars == 200 - 20 and any("no trades" in line for line in sink.lines["btc"])  # the last bar is open


@pytest.mark.parametrize("wall_clock", [True, False])
def test_a_silent_live_feed_still_closes_its_bars(wall_clock: bool) -> None:
    """A live feed's receive times are this machine's clock: while it is silent, its bars close on
    time anyway. A recorded feed's only move with its own events."""
    import time

    sink = Sink()
    seen_during_silence: list[int] = []

    async def live_feed():
        now = time.time_ns()
        for i in range(3):
            yield Trade("t", "BTCUSDT", now - 1_000_000 + i, now + i, 100.0 + i, 1.0, BUY, str(i), 2, 3)
        await asyncio.sleep(1.6)  # past the end of the bar those trades are in (and maybe of an empty one)
        seen_during_silence.extend(sink.lines.get("btc", []))
        now = time.time_ns()
        yield Trade("t", "BTCUSDT", now - 1_000_000, now, 104.0, 1.0, BUY, "4", 2, 3)

    a = Attachment(sink, AttachSpec("btc", bar_s=1))
    asyncio.run(attach(live_feed(), [a], wall_clock=wall_clock))
    assert (" v3 n3 " in seen_during_silence[0]) if wall_clock else seen_during_silence == []
    assert a.stats.late == 0 and a.accounted() == a.stats.events_in == 4


def test_a_push_failing_while_a_live_feed_is_silent_fails_the_feed() -> None:
    import time

    class Refusing(Sink):
        def push(self, session: str, lines: list[str]) -> PushAck:
            raise RuntimeError("session closed")

    async def live_feed():
        now = time.time_ns()
        yield Trade("t", "BTCUSDT", now - 1_000_000, now, 100.0, 1.0, BUY, "1", 2, 3)
        await asyncio.sleep(30)  # silent: only the quiet ticks can close the bar

    a = Attachment(Refusing(), AttachSpec("btc", bar_s=1))
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="session closed"):
        asyncio.run(attach(live_feed(), [a], wall_clock=True))
    assert time.perf_counter() - started < 5 and a.pending_events == 1  # kept for the next try
