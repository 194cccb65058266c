"""A slow SSE reader is ended, not left open: its queue overflows, it gets `event: error`
(`too_slow`) and the end, so its EventSource reconnects to a fresh snapshot; a reader that reads
nothing at all is dropped after `close_timeout_s`. Driven at the ASGI level, where "the reader
does not read" is exact: the server's `send` of a body chunk waits until the test lets it go."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants

LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2 n{i + 3}" for i in range(40)]
MAX_QUEUE = 2
TIMEOUT = 30


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512,
                                          scheduler=SchedulerConfig(chunk_tokens=64)))
    yield eng
    eng.shutdown()


class Reader:
    """One GET of the events route through the ASGI app. Body chunks after the first `reads` wait
    on `reading` (a reader that stopped reading); `gone` says the client hung up."""

    def __init__(self, server: StreamServer, reads: int) -> None:
        self.server = server
        self.reads = reads
        self.reading = asyncio.Event()
        self.gone = asyncio.Event()
        self.messages: list[dict] = []
        self.started = asyncio.Event()  # the snapshot arrived
        self.task = asyncio.create_task(server.http(self._scope(), self._receive, self._send))

    def _scope(self) -> dict:
        host = f"127.0.0.1:{self.server.port}".encode()
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "GET", "scheme": "http", "path": "/v1/sessions/s/events", "raw_path": b"/v1/sessions/s/events",
                "query_string": b"", "root_path": "", "headers": [(b"host", host), (b"authorization", b"Bearer tok-a")],
                "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", self.server.port)}

    async def _receive(self) -> dict:
        if not hasattr(self, "_requested"):
            self._requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        body = message["type"] == "http.response.body" and message.get("body")
        if body and sum(1 for m in self.messages if m.get("body")) >= self.reads:
            await self.reading.wait()
        self.messages.append(message)
        if message.get("body"):
            self.started.set()

    def events(self) -> list[tuple[str, dict]]:
        out = []
        for chunk in b"".join(m.get("body", b"") for m in self.messages).decode().split("\n\n"):
            lines = dict(line.split(": ", 1) for line in chunk.splitlines() if not line.startswith(":"))
            if "data" in lines:
                out.append((lines.get("event"), json.loads(lines["data"])))
        return out

    @property
    def ended(self) -> bool:
        return bool(self.messages) and self.messages[-1].get("more_body") is False


def slow_disconnects(server: StreamServer) -> float:
    return server.metrics.registry.get_sample_value("streamllm_slow_disconnects_total")


async def overflow(engine: Engine, server: StreamServer, reader: Reader) -> int:
    """Push until the reader's queue overflows; the pushes it took."""
    await asyncio.wait_for(reader.started.wait(), TIMEOUT)  # took the snapshot; reads no more after it
    before = slow_disconnects(server)
    for pushes in range(1, 50):
        await asyncio.to_thread(engine.push, "alice/s", LINES[pushes % len(LINES):][:1])
        while data_events(server) < pushes:  # the event reaches the loop through call_soon_threadsafe
            await asyncio.sleep(0.005)
        if slow_disconnects(server) > before:
            return pushes
    raise AssertionError("the reader's queue never overflowed")


def data_events(server: StreamServer) -> float:
    return server.metrics.registry.get_sample_value("streamllm_events_total", {"type": "data"}) or 0


def run(engine: Engine, scenario, **config) -> None:
    async def main() -> None:
        engine.open_session("alice/s", tenant="alice")
        try:
            cfg = ServerConfig(port=0, max_queue=MAX_QUEUE, **config)
            async with StreamServer(engine, Tenants({"tok-a": Tenant("alice")}), cfg) as server:
                await asyncio.wait_for(scenario(server), TIMEOUT)
        finally:
            engine.close_session("alice/s")

    asyncio.run(main())


def test_a_reader_that_reads_nothing_is_dropped(engine):
    async def scenario(server: StreamServer) -> None:
        reader = Reader(server, reads=1)
        pushes = await overflow(engine, server, reader)
        assert pushes > MAX_QUEUE  # one event in the stalled send, MAX_QUEUE queued, then the overflow
        await asyncio.wait_for(reader.task, TIMEOUT)  # ended without the reader reading a byte more
        assert [kind for kind, _ in reader.events()] == ["snapshot"] and not reader.ended
        assert slow_disconnects(server) == 1
        assert server.metrics.subscriptions._value.get() == 0 and not server.quotas.http
        # the EventSource reconnects and starts from a fresh snapshot at the latest version
        again = Reader(server, reads=1)
        await asyncio.wait_for(again.started.wait(), TIMEOUT)
        kind, snapshot = again.events()[0]
        assert kind == "snapshot" and snapshot["data_version"] == engine.session_info("alice/s").data_version
        again.gone.set()
        again.reading.set()
        await asyncio.wait_for(again.task, TIMEOUT)
        assert slow_disconnects(server) == 1

    run(engine, scenario, close_timeout_s=0.1)


def test_a_slow_reader_gets_the_error_and_the_end(engine):
    async def scenario(server: StreamServer) -> None:
        reader = Reader(server, reads=1)
        await overflow(engine, server, reader)
        assert not reader.task.done()
        reader.reading.set()  # reads again, within the grace: the error, then the end
        await asyncio.wait_for(reader.task, TIMEOUT)
        assert reader.ended
        events = reader.events()
        assert events[0][0] == "snapshot" and events[-1][0] == "error"
        assert events[-1][1]["code"] == "too_slow" and f"({MAX_QUEUE} events)" in events[-1][1]["message"]
        assert all(kind == "data" for kind, _ in events[1:-1]) and len(events) <= 3  # the backlog was dropped
        assert slow_disconnects(server) == 1 and server.metrics.subscriptions._value.get() == 0
        # later events go nowhere: the subscription was closed at the overflow
        await asyncio.to_thread(engine.push, "alice/s", LINES[:1])
        assert engine.wait_idle(TIMEOUT)
        assert slow_disconnects(server) == 1

    run(engine, scenario, close_timeout_s=TIMEOUT)
