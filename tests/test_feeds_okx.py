"""OKX v5: a real capture checked against OKX's own book checksums, the documented messages,
and the live adapter against a local server that speaks OKX's protocol (subscribe, ping/pong)."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import zlib
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import serve

from feeds.adapters import FeedAdapter
from feeds.events import BUY, SELL, Bar, BookDelta, Mark, Quote, Trade
from feeds.okx import OkxParser, candle_ns
from feeds.sources import open_source
from feeds.wire import VenueError
from tests.books import Book, apply

CAPTURE = Path(__file__).parent / "data" / "cryptofeed" / "OKX.ws.1.0.gz"


def _okx_text(x: float) -> str:
    """A number as OKX writes it: shortest decimal, no exponent, no trailing zeros."""
    return format(Decimal(repr(x)).normalize(), "f")


def _okx_checksum(bids: dict[float, float], asks: dict[float, float]) -> int:
    """OKX's book checksum: CRC32, as a signed 32-bit integer, of the top 25 bids and asks
    interleaved ('bidPx:bidSz:askPx:askSz:...'; a side that runs out is left out)."""
    b = sorted(bids.items(), reverse=True)[:25]
    a = sorted(asks.items())[:25]
    parts: list[str] = []
    for i in range(25):
        for side in (b, a):
            if i < len(side):
                parts += [_okx_text(side[i][0]), _okx_text(side[i][1])]
    crc = zlib.crc32(":".join(parts).encode())
    return crc - (1 << 32) if crc >= 1 << 31 else crc


def test_a_real_okx_capture_rebuilds_to_every_book_checksum_okx_sent() -> None:
    src = open_source(CAPTURE)
    assert src.venue == "okx"
    events = list(src)
    with gzip.open(CAPTURE, "rt") as fh:
        logged = [json.loads(line.split(": ", 1)[1]) for line in fh if line[:1].isdigit()]
    raw = [m for m in logged if "data" in m]
    assert src.stats.control == len(logged) - len(raw) > 0  # the subscribe acks
    per_channel = Counter(m["arg"]["channel"] for m in raw)
    got = Counter(type(e) for e in events)
    assert got[Trade] == sum(len(m["data"]) for m in raw if m["arg"]["channel"] == "trades")
    assert got[Quote] == per_channel["tickers"] and got[BookDelta] == per_channel["books"]
    assert src.stats.errors == 0 and {e.venue for e in events} == {"okx"}
    trades = [(e, d) for e, d in zip((e for e in events if isinstance(e, Trade)),
                                     (d for m in raw if m["arg"]["channel"] == "trades" for d in m["data"]),
                                     strict=True)]
    for t, d in trades:
        assert (t.instrument, t.trade_id, t.price, t.size, t.ts_event) == (
            d["instId"], d["tradeId"], float(d["px"]), float(d["sz"]), int(d["ts"]) * 10**6)
        assert t.side == (BUY if d["side"] == "buy" else SELL)
    books: dict[str, Book] = {}
    sent = [d["checksum"] for m in raw if m["arg"]["channel"] == "books" for d in m["data"]]
    checked = 0
    for d, checksum in zip((e for e in events if isinstance(e, BookDelta)), sent, strict=True):
        assert _okx_checksum(*apply(books, d)) == checksum, (checked, d.instrument)
        checked += 1
    assert checked == per_channel["books"] >= 290


def test_okx_messages_as_the_docs_write_them() -> None:
    p = OkxParser()
    (t,) = p.parse('{"arg":{"channel":"trades","instId":"BTC-USDT"},"data":[{"instId":"BTC-USDT","tradeId":"130639474",'
                   '"px":"42219.9","sz":"0.12060306","side":"buy","ts":"1630048897897","count":"3"}]}', 1)
    assert (t.side, t.trade_id, t.ts_event, t.px_dp, t.sz_dp) == (BUY, "130639474", 1_630_048_897_897_000_000, 1, 8)
    # An instrument with no ask has no quote; one with both sides has.
    tick = {"instId": "X-USDT", "bidPx": "1.5", "bidSz": "2", "askPx": "", "askSz": "", "ts": "1"}
    assert p.parse(json.dumps({"arg": {"channel": "tickers", "instId": "X-USDT"}, "data": [tick]}), 2) == []
    (q,) = p.parse(json.dumps({"arg": {"channel": "tickers", "instId": "X-USDT"},
                               "data": [{**tick, "askPx": "1.6", "askSz": "0"}]}), 3)
    assert (q.bid, q.ask, q.ask_size) == (1.5, 1.6, 0.0)
    (bbo,) = p.parse('{"arg":{"channel":"bbo-tbt","instId":"BTC-USDT"},"data":[{"asks":[["8476.98","415","0","13"]],'
                     '"bids":[["8476.97","256","0","12"]],"ts":"1597026383085","seqId":123}]}', 4)
    assert isinstance(bbo, Quote) and (bbo.bid, bbo.ask, bbo.bid_size) == (8476.97, 8476.98, 256.0)
    # Books: seqId chains through prevSeqId; a broken chain is a gap.
    book = lambda action, seq, prev: json.dumps({  # noqa: E731
        "arg": {"channel": "books", "instId": "BTC-USDT"}, "action": action,
        "data": [{"asks": [["8476.98", "0", "0", "0"]], "bids": [["8476.97", "256", "0", "12"]], "ts": "1597026383085",
                  "checksum": -855196043, "prevSeqId": prev, "seqId": seq}]})
    (s,) = p.parse(book("snapshot", 10, -1), 5)
    (u,) = p.parse(book("update", 12, 10), 6)
    assert s.snapshot and not u.snapshot and u.asks == [(8476.98, 0.0)] and p.stats.gaps == 0
    p.parse(book("update", 20, 15), 7)
    assert p.stats.gaps == 1 and p.stats.gap_samples == ["BTC-USDT@books: expected 12, got 15"]
    # Candles: a Bar once confirm is "1"; without the field, once the next candle starts.
    candle = lambda row, ch="candle1m": json.dumps({"arg": {"channel": ch, "instId": "BTC-USDT"}, "data": [row]})  # noqa: E731
    assert p.parse(candle(["1597026360000", "8533", "8553.7", "8527.1", "8548.2", "45247", "529", "529", "0"]), 8) == []
    (bar,) = p.parse(candle(["1597026360000", "8533", "8553.7", "8527.1", "8550", "45300", "530", "530", "1"]), 9)
    assert isinstance(bar, Bar) and (bar.close, bar.volume, bar.ts_open, bar.interval_ns) == (
        8550.0, 45300.0, 1_597_026_360_000_000_000, 60 * 10**9)
    old = ["1597026360000", "1", "2", "1", "2", "10", "10"]
    assert p.parse(candle(old, "candle1H"), 10) == [] and p.parse(candle(old, "candle1H"), 11) == []
    (b2,) = p.parse(candle(["1597029960000", "2", "2", "2", "2", "1", "1"], "candle1H"), 12)
    assert b2.ts_event == 1_597_029_960_000_000_000 and b2.interval_ns == 3600 * 10**9
    assert candle_ns("candle4Hutc") == 4 * 3600 * 10**9 and candle_ns("candle1s") == 10**9
    (m,) = p.parse('{"arg":{"channel":"mark-price","instId":"BTC-USDT-SWAP"},"data":[{"instType":"SWAP",'
                   '"instId":"BTC-USDT-SWAP","markPx":"42310.6","ts":"1630049139746"}]}', 13)
    assert isinstance(m, Mark) and m.mark == 42310.6 and math.isnan(m.funding_rate)
    for control in ('pong', '{"event":"subscribe","arg":{"channel":"tickers","instId":"BTC-USDT"},"connId":"a4d3ae55"}',
                    '{"event":"notice","code":"64008","msg":"The connection will soon be closed for a service upgrade",'
                    '"connId":"a4d3ae55"}'):
        assert p.parse(control, 14) == []
    assert p.stats.control == 3 and p.stats.errors == 0
    # Bad input: counted with what and where; the stream goes on.
    assert p.parse(candle(old, "candle1M"), 15) == []
    assert p.parse('{"arg":{"channel":"funding-rate","instId":"BTC-USDT-SWAP"},"data":[{}]}', 16) == []
    assert p.parse('{"event":"error","code":"60012","msg":"Invalid request: {\\"op\\": \\"subscribe\\"}","connId":"x"}',
                   17) == []
    assert p.stats.error_kinds == {"ValueError": 2, "VenueError": 1}
    assert "months vary" in p.stats.error_samples[0] and "'funding-rate'" in p.stats.error_samples[1]
    assert "60012" in p.stats.error_samples[2]


def test_the_okx_adapter_subscribes_pings_and_streams() -> None:
    seen: dict[str, Any] = {}

    async def venue(ws: Any) -> None:
        seen["subscribe"] = json.loads(await ws.recv())
        await ws.send('{"event":"subscribe","arg":{"channel":"trades","instId":"BTC-USDT"},"connId":"c1"}')
        seen["ping"] = await ws.recv()  # an idle client must ping within 30 s
        await ws.send("pong")
        await ws.send('{"arg":{"channel":"trades","instId":"BTC-USDT"},"data":[{"instId":"BTC-USDT","tradeId":"7",'
                      '"px":"30218.8","sz":"1","side":"sell","ts":"1652459199958"}]}')
        await ws.close()

    async def run() -> tuple[list[Any], FeedAdapter]:
        async with serve(venue, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            adapter = FeedAdapter("okx", ["BTC-USDT", "ETH-USDT"], url=f"ws://127.0.0.1:{port}", ping_s=0.2,
                                  max_reconnects=0)
            out = []
            async for ev in adapter.events():
                out.append(ev)
            return out, adapter

    events, adapter = asyncio.run(asyncio.wait_for(run(), 20))
    assert seen["subscribe"] == {"op": "subscribe", "args": [
        {"channel": c, "instId": s} for c in ("trades", "tickers") for s in ("BTC-USDT", "ETH-USDT")]}
    assert seen["ping"] == "ping"
    assert [(e.instrument, e.side, e.price) for e in events] == [("BTC-USDT", SELL, 30218.8)]
    assert adapter.parser.stats.control == 2 and adapter.parser.stats.errors == 0


def test_an_okx_error_event_is_named_by_its_code() -> None:
    p = OkxParser()
    with pytest.raises(VenueError, match="60018"):
        p._read(json.dumps({"event": "error", "code": "60018", "msg": "doesn't exist"}), 0)


def test_sessions_on_one_venue_share_one_connection_from_their_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamllm.config import parse_config
    from streamllm.feeding.wiring import group_feeds, parse_feed_override, venue_credentials

    subscribed: list[Any] = []

    async def venue(ws: Any) -> None:
        subscribed.append(json.loads(await ws.recv()))
        for inst, px in (("BTC-USDT", "30218.8"), ("ETH-USDT", "2001.5")):
            await ws.send(json.dumps({"arg": {"channel": "trades", "instId": inst}, "data": [
                {"instId": inst, "tradeId": "1", "px": px, "sz": "1", "side": "buy", "ts": "1652459199958"}]}))
        await ws.close()

    async def run() -> list[Any]:
        from streamllm.feeding.wiring import feed_events

        async with serve(venue, "127.0.0.1", 0) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            config = parse_config({"sessions": [
                {"name": n, "instrument": inst, "feed": f"okx:{url}"} for n, inst in (("btc", "BTC-USDT"),
                                                                                      ("eth", "ETH-USDT"))]})
            (group,) = group_feeds(config, None)
            out = []
            async for ev in feed_events(group, None, 0):
                out.append(ev)
                if len(out) == 2:
                    break
            return out

    events = asyncio.run(asyncio.wait_for(run(), 20))
    assert [e.instrument for e in events] == ["BTC-USDT", "ETH-USDT"]
    assert subscribed == [{"op": "subscribe", "args": [
        {"channel": c, "instId": s} for c in ("trades", "tickers") for s in ("BTC-USDT", "ETH-USDT")]}]
    assert parse_feed_override("okx:wss://wsaws.okx.com:8443/ws/v5/public").url == "wss://wsaws.okx.com:8443/ws/v5/public"
    with pytest.raises(ValueError, match="use synthetic, a venue"):
        parse_feed_override("okx:BTC-USDT")
    monkeypatch.delenv("APCA_API_KEY_ID", raising=False)
    with pytest.raises(ValueError, match="APCA_API_KEY_ID and APCA_API_SECRET_KEY"):
        venue_credentials("alpaca")
    monkeypatch.setenv("APCA_API_KEY_ID", "k")
    monkeypatch.setenv("APCA_API_SECRET_KEY", "s")
    assert venue_credentials("alpaca") == {"key": "k", "secret": "s"} and venue_credentials("okx") == {}


def test_serve_answers_a_session_fed_live_by_okx(tmp_path: Path) -> None:
    """The whole path a user takes: feed = "okx" in a config, `streamllm serve`, an ask."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from streamllm.client.client import AsyncClient

    subscribed: list[Any] = []
    ready = threading.Event()
    port: list[int] = []
    stop = threading.Event()

    async def venue(ws: Any) -> None:
        subscribed.append(json.loads(await ws.recv()))
        for i in range(100):  # a trade every 0.1 s, stamped now as a venue does: bars of 1 s close on time
            px = f"{30000 + (i % 7) * 1.5:.1f}"
            await ws.send(json.dumps({"arg": {"channel": "trades", "instId": "BTC-USDT"}, "data": [
                {"instId": "BTC-USDT", "tradeId": str(i), "px": px, "sz": "0.1", "side": "buy" if i % 3 else "sell",
                 "ts": str(time.time_ns() // 1_000_000)}]}))
            await asyncio.sleep(0.1)
        while not stop.is_set():
            await asyncio.sleep(0.1)

    def run_venue() -> None:
        async def main() -> None:
            async with serve(venue, "127.0.0.1", 0) as server:
                port.append(server.sockets[0].getsockname()[1])
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.1)

        asyncio.run(main())

    thread = threading.Thread(target=run_venue, daemon=True)
    thread.start()
    assert ready.wait(10)
    config = tmp_path / "okx.toml"
    config.write_text(f'[[sessions]]\nname = "btc"\ninstrument = "BTC-USDT"\nfeed = "okx:ws://127.0.0.1:{port[0]}"\n'
                      '[sessions.render]\nbar_seconds = 1\n'
                      '[[sessions.questions]]\nid = "trend"\ntext = "Up or down?"\nchoices = ["up", "down"]\n')
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "streamllm.cli", "serve", "--config", str(config), "--model",
                             "tiny", "--port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "STREAMLLM_TOKENS": ""})
    try:
        assert proc.stdout is not None
        head = proc.stdout.readline()
        assert head.startswith("streamllm serving tiny"), head + (proc.stderr.read() if proc.stderr else "")
        url = head.rsplit(" at ", 1)[1].strip()

        async def ask() -> tuple[dict, dict]:
            async with await AsyncClient.connect(url) as c:
                while (await c.stats())["sessions"][0]["data_version"] < 5:  # bars built from OKX's trades
                    await asyncio.sleep(0.1)
                return await c.ask("btc", "trend"), await c.stats()

        answer, stats = asyncio.run(asyncio.wait_for(ask(), 90))
        assert answer["session"] == "btc" and answer["text"] in ("up", "down")
        assert stats["sessions"][0]["data_version"] >= 5
        assert subscribed == [{"op": "subscribe", "args": [{"channel": c, "instId": "BTC-USDT"}
                                                           for c in ("trades", "tickers")]}]
    finally:
        proc.kill()
        proc.wait()
        stop.set()
