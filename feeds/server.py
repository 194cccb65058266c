"""Local replay server: serves a raw capture in the venue's own wire format on loopback.

Binance mode mirrors the real endpoints: `/stream` (combined envelopes) and `/ws` (raw
payloads), streams chosen by the URL (`/stream?streams=btcusdt@trade/...`, `/ws/<name>`)
or by a `{"method":"SUBSCRIBE","params":[...],"id":n}` message, which is acknowledged with
`{"result":null,"id":n}` as Binance does. Lines of the capture without a stream name (the
REST depth snapshot embedded in the shared captures) go to combined-stream clients
subscribed to that symbol's depth, exactly where they sit in the capture.
Generic mode (any other venue) sends every line after the client's first message.

A many-symbol venue for tests: `events` (Trades and Bars of any number of instruments, e.g. from
recorded tables or the synthetic market) are served in Binance's wire format beside the captures,
each trade on `<symbol>@trade` and each bar on `<symbol>@kline_<kline_interval>`, so one combined
connection carries every symbol a client subscribes, as a live Binance connection does.

Each connection replays from the start, paced by receive time (`speed`) or as fast as
possible. `close_after` drops each connection after that many messages (reconnect tests).
Binds 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from feeds import binance
from feeds.events import Bar, Trade
from feeds.sources import read_capture

HOST = "127.0.0.1"
log = logging.getLogger("streamllm.feeds.server")


@dataclass(slots=True)
class _Line:
    recv_ns: int
    stream: str  # "" for envelope-less lines
    symbol: str
    raw: bytes
    payload: bytes  # the `data` part of a combined envelope (raw-stream endpoints)


def _load(paths: Iterable[str | Path], damage: list[str] | None = None) -> list[_Line]:
    """Every readable line of the captures; damage (a cut gzip, a line without a time) is
    appended to `damage` and logged, and the lines before it are served."""
    lines: list[_Line] = []

    def damaged(kind: str, text: str, sample: bytes) -> None:
        log.warning("replay server: %s", text)
        if damage is not None:
            damage.append(text)

    for path in paths:
        hint = Path(path).name.split("_")[0].lower()
        for recv, raw in read_capture(path, damaged):
            stream, payload = "", raw
            try:
                msg = orjson.loads(raw)
                if isinstance(msg, dict) and "stream" in msg:
                    stream = msg["stream"]
                    payload = orjson.dumps(msg["data"])
            except orjson.JSONDecodeError:
                pass  # served as recorded: the client's parser counts it
            symbol = stream.split("@", 1)[0] if stream else hint
            lines.append(_Line(recv, stream, symbol, raw, payload))
    lines.sort(key=lambda ln: ln.recv_ns)  # stable: same-time lines keep capture order
    return lines


def _encode(events: Iterable[Any], kline_interval: str) -> list[_Line]:
    """Trades and Bars as Binance combined-stream lines, at their receive times."""
    lines = []
    for ev in events:
        if isinstance(ev, Trade):
            msg = binance.trade_message(ev)
        elif isinstance(ev, Bar):
            msg = binance.kline_message(ev, kline_interval)
        else:
            raise ValueError(f"replay server: events are Trades and Bars, got {type(ev).__name__}")
        raw = orjson.dumps(msg)
        lines.append(_Line(ev.ts_recv, msg["stream"], binance.stream_symbol(ev.instrument), raw,
                           orjson.dumps(msg["data"])))
    return lines


@dataclass
class ReplayServer:
    captures: list[Path] = field(default_factory=list)
    venue: str = "binance"
    speed: float | None = None
    close_after: int | None = None
    port: int = 0
    events: list[Any] = field(default_factory=list)  # served in Binance's format (module docstring)
    kline_interval: str = "1m"  # the stream name bars are served on: <symbol>@kline_1m
    lines: list[_Line] = field(default_factory=list, init=False)
    connections: int = field(default=0, init=False)
    damage: list[str] = field(default_factory=list, init=False)  # what could not be read, per file
    _server: Server | None = field(default=None, init=False)

    async def start(self) -> str:
        if self.events and self.venue != "binance":
            raise ValueError(f"replay server: events are served in Binance's format, not {self.venue!r}'s")
        self.lines = _load(self.captures, self.damage)
        if self.events:
            self.lines = sorted(self.lines + _encode(self.events, self.kline_interval), key=lambda ln: ln.recv_ns)
        self._server = await serve(self._handle, HOST, self.port, max_size=None)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> ReplayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        path = ws.request.path if ws.request is not None else "/"
        parts = urlsplit(path)
        combined = not parts.path.startswith("/ws")
        streams: set[str] = set()
        if "streams" in parse_qs(parts.query):
            streams.update(parse_qs(parts.query)["streams"][0].split("/"))
        elif parts.path.startswith("/ws/"):
            streams.add(parts.path[4:])
        subscribed = asyncio.Event()
        if streams:
            subscribed.set()
        listener = asyncio.create_task(self._listen(ws, streams, subscribed))
        try:
            await subscribed.wait()
            await self._send(ws, streams, combined)
            await ws.close()
        except ConnectionClosed:
            pass
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self, ws: ServerConnection, streams: set[str], subscribed: asyncio.Event) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                if self.venue != "binance":
                    subscribed.set()
                    continue
                try:
                    req = orjson.loads(message)
                    method, params, req_id = req["method"], req.get("params", []), req.get("id")
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    await ws.send(orjson.dumps({"code": 2, "msg": "Invalid request: malformed JSON"}).decode())
                    continue
                if method == "SUBSCRIBE":
                    streams.update(params)
                    await ws.send(orjson.dumps({"result": None, "id": req_id}).decode())
                    subscribed.set()
                elif method == "UNSUBSCRIBE":
                    streams.difference_update(params)
                    await ws.send(orjson.dumps({"result": None, "id": req_id}).decode())
                elif method == "LIST_SUBSCRIPTIONS":
                    await ws.send(orjson.dumps({"result": sorted(streams), "id": req_id}).decode())
                else:
                    await ws.send(orjson.dumps({"code": 2, "msg": f"Invalid request: unknown method {method}", "id": req_id}).decode())

    def _wanted(self, line: _Line, streams: set[str], combined: bool) -> bool:
        if self.venue != "binance":
            return True
        if line.stream:
            return line.stream in streams
        # an envelope-less line (REST snapshot) follows its symbol's depth stream
        return combined and any(s.startswith(line.symbol + "@depth") for s in streams)

    async def _send(self, ws: ServerConnection, streams: set[str], combined: bool) -> None:
        loop = asyncio.get_running_loop()
        start_wall, start_ns = loop.time(), self.lines[0].recv_ns if self.lines else 0
        sent = 0
        for line in self.lines:
            if not self._wanted(line, streams, combined):
                continue
            if self.speed:
                delay = start_wall + (line.recv_ns - start_ns) / 1e9 / self.speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            # Text frames, as venues send them.
            await ws.send((line.raw if combined or not line.stream else line.payload).decode())
            sent += 1
            if self.close_after and sent >= self.close_after:
                return
