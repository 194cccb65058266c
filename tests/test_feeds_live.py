"""Live adapters end to end against the local replay server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import serve

from feeds.adapters import FeedAdapter
from feeds.server import ReplayServer
from feeds.sources import CaptureSource
from feeds.wire import AuthError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CAPTURE = DATA / "binance-spot" / "ethusdt_20240808.gz"
BINANCE_CHANNELS = ["trade", "bookTicker", "depth@100ms"]


def _key(ev: Any) -> Any:
    # receive times differ between the recording and this run; venue times must not
    same = ev.ts_event == ev.ts_recv
    return dataclasses.replace(ev, ts_recv=0, ts_event=0 if same else ev.ts_event)


async def _collect(adapter: FeedAdapter, limit: int | None = None) -> list[Any]:
    out = []
    async for ev in adapter.events():
        out.append(ev)
        if limit is not None and len(out) >= limit:
            adapter.stop()
    return out


@pytest.mark.skipif(not CAPTURE.exists(), reason=f"shared capture not found at {CAPTURE}")
def test_adapter_receives_exactly_the_capture() -> None:
    expected = [_key(ev) for ev in CaptureSource(CAPTURE)]

    async def run() -> tuple[list[Any], FeedAdapter]:
        async with ReplayServer([CAPTURE]) as server:
            adapter = FeedAdapter("binance", ["ethusdt"], BINANCE_CHANNELS, url=server.url + "/stream",
                                  max_reconnects=0)
            return await asyncio.wait_for(_collect(adapter), 60), adapter

    got, adapter = asyncio.run(run())
    assert adapter.parser.stats.errors == 0, adapter.parser.stats.error_samples
    assert adapter.parser.stats.control == 1  # the subscribe ack
    assert [_key(ev) for ev in got] == expected


def _write_capture(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt") as fh:
        for i, line in enumerate(lines):
            fh.write(f"{1_000 + i} {line}\n")


def _book_ticker(u: int) -> str:
    return json.dumps({"stream": "btcusdt@bookTicker",
                       "data": {"u": u, "s": "BTCUSDT", "b": "1.10", "B": "1", "a": "1.20", "A": "2"}})


def test_malformed_messages_counted_and_reconnect(tmp_path: Path) -> None:
    path = tmp_path / "btcusdt_bad.gz"
    lines = [_book_ticker(i) for i in range(10)]
    lines[3] = lines[3][:40]  # truncated
    lines[6] = "garbage"
    _write_capture(path, lines)

    async def run() -> tuple[list[Any], FeedAdapter, int]:
        async with ReplayServer([path], close_after=10) as server:
            adapter = FeedAdapter("binance", ["btcusdt"], ["bookTicker", "depth@100ms"],
                                  url=server.url + "/stream", backoff_s=(0.01, 0.05), max_reconnects=2, seed=1)
            got = await asyncio.wait_for(_collect(adapter), 30)
            return got, adapter, server.connections

    got, adapter, connections = asyncio.run(run())
    assert connections == 3 and adapter.stats.connects == 3
    assert len(got) == 3 * 8 and adapter.parser.stats.errors == 3 * 2
    assert len(adapter.stats.backoffs_s) == 2 and all(d <= 0.05 for d in adapter.stats.backoffs_s)


def test_raw_endpoint_and_unsubscribed_streams_filtered(tmp_path: Path) -> None:
    path = tmp_path / "btcusdt_x.gz"
    trade = {"e": "trade", "E": 1, "s": "BTCUSDT", "t": 1, "p": "2.5", "q": "1", "T": 1, "m": False, "M": True}
    _write_capture(path, [_book_ticker(1), json.dumps({"stream": "btcusdt@trade", "data": trade})])
    raw_seen: list[str] = []

    async def run() -> list[Any]:
        async with ReplayServer([path]) as server:
            adapter = FeedAdapter("binance", ["btcusdt"], ["trade"], url=server.url + "/ws",
                                  max_reconnects=0, on_raw=lambda ns, text: raw_seen.append(text))
            return await asyncio.wait_for(_collect(adapter), 30)

    (t,) = asyncio.run(run())
    assert t.price == 2.5 and not raw_seen[-1].startswith('{"stream"')


def test_alpaca_auth_failure_is_a_clear_error() -> None:
    async def venue(ws: Any) -> None:  # Alpaca's documented connect/auth exchange
        await ws.send('[{"T":"success","msg":"connected"}]')
        msg = json.loads(await ws.recv())
        assert msg["action"] == "auth"
        await ws.send('[{"T":"error","code":402,"msg":"auth failed"}]')
        await ws.wait_closed()

    async def run() -> None:
        async with serve(venue, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            adapter = FeedAdapter("alpaca", ["AAPL"], url=f"ws://127.0.0.1:{port}",
                                  credentials={"key": "k", "secret": "bad"})
            await asyncio.wait_for(_collect(adapter), 10)

    with pytest.raises(AuthError, match="402"):
        asyncio.run(run())


def test_alpaca_flow_delivers_batched_events() -> None:
    async def venue(ws: Any) -> None:
        await ws.send('[{"T":"success","msg":"connected"}]')
        assert json.loads(await ws.recv())["action"] == "auth"
        await ws.send('[{"T":"success","msg":"authenticated"}]')
        sub = json.loads(await ws.recv())
        assert sub == {"action": "subscribe", "trades": ["AAPL"], "quotes": ["AAPL"]}
        await ws.send('[{"T":"subscription","trades":["AAPL"],"quotes":["AAPL"],"bars":[]}]')
        await ws.send(json.dumps([
            {"T": "t", "i": 1, "S": "AAPL", "x": "V", "p": 126.55, "s": 1, "t": "2021-02-22T15:51:44.208Z", "c": ["@"], "z": "C"},
            {"T": "q", "S": "AAPL", "bx": "U", "bp": 126.5, "bs": 1, "ax": "Q", "ap": 126.6, "as": 4,
             "t": "2021-02-22T15:51:45.335689322Z", "c": ["R"], "z": "C"}]))
        await ws.close()

    async def run() -> list[Any]:
        async with serve(venue, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            adapter = FeedAdapter("alpaca", ["AAPL"], url=f"ws://127.0.0.1:{port}",
                                  credentials={"key": "k", "secret": "s"}, max_reconnects=0)
            return await asyncio.wait_for(_collect(adapter), 10)

    t, q = asyncio.run(run())
    assert t.price == 126.55 and q.ask == 126.6


def test_record_cli_from_replay_server(tmp_path: Path) -> None:
    import threading

    from feeds.events import Quote, Trade, read_parquet
    from streamllm.cli.record import main as cli_main

    src = tmp_path / "btcusdt_src.gz"
    trade = {"e": "trade", "E": 1, "s": "BTCUSDT", "t": 7, "p": "2.50", "q": "1", "T": 1, "m": False, "M": True}
    _write_capture(src, [_book_ticker(1), json.dumps({"stream": "btcusdt@trade", "data": trade}), _book_ticker(2)])
    ready, url = threading.Event(), []
    loop = asyncio.new_event_loop()
    server = ReplayServer([src])

    def serve_forever() -> None:
        asyncio.set_event_loop(loop)
        url.append(loop.run_until_complete(server.start()))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        out = tmp_path / "rec"
        rc = cli_main(["--venue", "binance", "--symbols", "btcusdt", "--channels", "trade,bookTicker",
                       "--out", str(out), "--url", url[0] + "/stream", "--once", "--duration", "20"])
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert rc == 0
    (raw,) = (out / "raw").glob("btcusdt_*.gz")
    replayed = list(CaptureSource(raw))
    assert [type(e) for e in replayed] == [Quote, Trade, Quote]
    (qfile,) = (out / "parquet" / "quote").glob("*.parquet")
    (tfile,) = (out / "parquet" / "trade").glob("*.parquet")
    assert len(read_parquet(qfile, Quote)) == 2 and read_parquet(tfile, Trade)[0].price == 2.5


@pytest.mark.skipif(not CAPTURE.exists(), reason=f"shared capture not found at {CAPTURE}")
def test_a_capture_replayed_through_the_venue_adapter_makes_the_recorded_bars() -> None:
    """Its trades carry the capture's dates and arrive stamped with today's clock: bars still close
    on the venue's time, so none of its trades is counted late (feeds/clock.py)."""
    from streamllm.feeding.attach import Attachment, AttachSpec, attach

    class Lines:  # the engine's push/backlog contract, keeping what is pushed
        def __init__(self) -> None:
            self.lines: list[str] = []

        def push(self, session: str, lines: list[str]) -> int:
            self.lines.extend(lines)
            return len(self.lines)

        def backlog(self, session: str) -> int:
            return 0

    def attachment(sink: Lines) -> Attachment:
        return Attachment(sink, AttachSpec("eth", bar_s=5, instruments=frozenset({"ETHUSDT"})))

    recorded, replayed = Lines(), Lines()
    on_file = attachment(recorded)
    asyncio.run(attach(CaptureSource(CAPTURE), [on_file]))

    async def run() -> Attachment:
        async with ReplayServer([CAPTURE]) as server:
            adapter = FeedAdapter("binance", ["ethusdt"], BINANCE_CHANNELS, url=server.url + "/stream",
                                  max_reconnects=0)
            live = attachment(replayed)
            await asyncio.wait_for(attach(adapter.events(), [live]), 60)
            return live

    live = asyncio.run(run())
    assert live.stats.late == 0 and on_file.stats.late == 0
    assert len(recorded.lines) > 50
    assert replayed.lines == recorded.lines
