"""Feed faults against the local replay server: drops, stalls, garbage, reorder, skipped messages,
a message over the adapter's max_frame_bytes.

`FaultyReplayServer` is the real replay server with faults injected into what it sends.
The real adapter must reconnect with backoff, count garbage and gaps, and keep feeding
an engine that keeps answering.
"""

from __future__ import annotations

import asyncio
import gzip
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection

from feeds.adapters import FeedAdapter
from feeds.server import ReplayServer
from streamllm.engine import Engine, EngineConfig

CAPTURE = Path(__file__).resolve().parents[2] / "shared" / "data" / "binance-spot" / "btcusdt_20240808.gz"
if not CAPTURE.exists():
    CAPTURE = Path("/work/shared/data/binance-spot/btcusdt_20240808.gz")
MAX_FRAME_BYTES = 256 << 10  # the adapter's limit in these tests: 4x the largest message of the capture
OVERSIZE = 1 << 20


@dataclass
class FaultyReplayServer(ReplayServer):
    """Faults per connection: the first `faulty` connections misbehave, later ones are clean."""

    drop_after: int | None = None  # abort the TCP connection (no close frame) after this many messages
    stall_after: int | None = None  # then go silent for stall_s
    stall_s: float = 0.0
    garbage_every: int | None = None  # replace every n-th message with garbage
    reorder: bool = False  # swap neighbouring messages
    skip_every: int | None = None  # silently lose every n-th message (a gap the parser can see)
    oversize_after: int | None = None  # then send one message of OVERSIZE bytes
    faulty: int = 2
    garbage_sent: int = field(default=0, init=False)

    async def _send(self, ws: ServerConnection, streams: set[str], combined: bool) -> None:
        conn_no = self.connections
        if conn_no > self.faulty:
            return await ReplayServer._send(self, ws, streams, combined)
        rng = random.Random(conn_no)
        wanted = [ln for ln in self.lines if self._wanted(ln, streams, combined)]
        if self.reorder:
            for i in range(0, len(wanted) - 1, 2):
                wanted[i], wanted[i + 1] = wanted[i + 1], wanted[i]
        for sent, line in enumerate(wanted, start=1):
            if self.skip_every and sent % self.skip_every == 0:
                continue
            if self.garbage_every and sent % self.garbage_every == 0:
                self.garbage_sent += 1
                junk = rng.choice([b"\x00\xff{", b'{"stream":"btcusdt@trade","data":{"e":"trade","p":[]}}',
                                   b"not json at all", b"[1,2,3]", b'{"e":"trade"'])
                await ws.send(junk.decode("latin-1"))
                continue
            await ws.send(line.raw.decode())
            if self.drop_after and sent >= self.drop_after:
                ws.transport.abort()  # the network dies: no close frame
                return None
            if self.stall_after and sent == self.stall_after:
                await asyncio.sleep(self.stall_s)
            if self.oversize_after and sent == self.oversize_after:
                await ws.send('{"stream":"btcusdt@trade","data":"' + "x" * OVERSIZE + '"}')
        return None


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cap") / "btcusdt_20240808.gz"
    with gzip.open(CAPTURE, "rb") as src, gzip.open(out, "wb") as dst:
        for _, line in zip(range(250), src, strict=False):
            dst.write(line)
    return out


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, max_context=4096))
    yield eng
    eng.shutdown()


async def run_feed(server: ReplayServer, engine: Engine, session: str, *, idle_timeout_s: float = 5.0,
                   max_reconnects: int = 3) -> FeedAdapter:
    """Adapter -> engine until the adapter gives up (max_reconnects), as `serve` attaches a feed."""
    async with server:
        adapter = FeedAdapter("binance", ["btcusdt"], ["trade", "bookTicker", "depth@100ms"],
                              url=server.url + "/stream", backoff_s=(0.01, 0.05), idle_timeout_s=idle_timeout_s,
                              max_reconnects=max_reconnects, seed=3, max_frame_bytes=MAX_FRAME_BYTES)
        batch: list[str] = []

        def flush() -> None:  # one summary line per 20 events, like a bar
            kinds = sorted(set(batch))
            engine.push(session, [f"{len(batch)} events: {' '.join(kinds)}"])
            batch.clear()

        async def consume() -> None:
            async for ev in adapter.events():
                batch.append(type(ev).__name__)
                if len(batch) >= 20:
                    flush()

        await asyncio.wait_for(consume(), 30)
        if batch:
            flush()
    return adapter


@pytest.mark.parametrize("fault", ["drop", "stall", "garbage", "reorder", "skip", "oversize"])
def test_adapter_survives_faults_and_the_engine_keeps_answering(engine, capture, fault, caplog):
    kw = {"drop": {"drop_after": 60}, "stall": {"stall_after": 40, "stall_s": 1.0, "faulty": 4},
          "garbage": {"garbage_every": 25}, "reorder": {"reorder": True}, "skip": {"skip_every": 30},
          "oversize": {"oversize_after": 50}}[fault]
    server = FaultyReplayServer([capture], **kw)
    session = f"faults-{fault}"
    engine.open_session(session, max_context=1024)
    adapter = asyncio.run(run_feed(server, engine, session, idle_timeout_s=0.3 if fault == "stall" else 5.0))
    stats, parsed = adapter.stats, adapter.parser.stats
    # every connection ended (faulty or clean end of replay) and the adapter came back each time
    assert stats.connects == server.connections == 4 and stats.disconnects == 4
    assert len(stats.backoffs_s) == 3 and all(0 <= b <= 0.05 for b in stats.backoffs_s)
    if fault == "drop":
        assert "ConnectionClosed" in stats.last_error or stats.last_error == "server closed the connection"
    if fault == "stall":
        assert stats.last_error.startswith("TimeoutError")  # silence past idle_timeout_s counts as dead
    if fault == "oversize":  # each faulty connection was closed 1009 at the big message, and came back
        too_big = [r.getMessage() for r in caplog.records if "over max_frame_bytes" in r.getMessage()]
        assert len(too_big) == server.faulty, too_big
        assert all(f"max_frame_bytes = {MAX_FRAME_BYTES}" in m and "closed 1009" in m for m in too_big)
    if fault == "garbage":
        assert parsed.errors == server.garbage_sent > 0 and len(parsed.error_samples) > 0
    if fault in ("reorder", "skip"):
        assert parsed.gaps > 0 and parsed.gap_samples  # reported, with where and what was expected
    info = engine.session_info(session)
    assert info.pushed_version > 0
    answer = engine.ask(session, "What happened last?", max_tokens=2, timeout=30)
    assert answer.data_version >= 1
    engine.check_integrity()
