"""Live adapters: one websocket connection each, parsed into normalized events (a venue group
opens as many as its symbols need: `connection_shards`).

    adapter = FeedAdapter("binance", ["btcusdt", "ethusdt"], url="ws://127.0.0.1:9000/stream")
    async for ev in adapter.events():
        ...

Per venue (see each venue module's docstring for the documented rules):
  binance   subscribe by message (200 streams each, 4 a second); the server pings every 20 s and
            `websockets` pongs. At most 1024 streams a connection: `connection_shards`.
  coinbase  one subscribe per channel within 5 s, plus `heartbeats` to keep quiet channels open.
  kraken    subscribe per channel; application ping every `ping_s` (the server heartbeats too).
  kraken-futures  subscribe per feed, and to its heartbeat feed; `websockets`' own pings keep it open.
  bybit     subscribe topics ten a request; {"op": "ping"} every `ping_s` (Bybit asks for 20 s;
            the product line is in the url: /v5/public/spot, linear, inverse).
  okx       one subscribe for all channel/instrument pairs; a "ping" text every `ping_s` (OKX
            closes a connection silent for 30 s; candles need the /ws/v5/business url).
  alpaca    wait for "connected", send auth, wait for "authenticated", then subscribe.
A message larger than `max_frame_bytes` (per venue: `MAX_FRAME_BYTES`) closes the
connection with 1009 and reconnects, with `stats.last_error` saying so: a venue (or anything
at its url) cannot make the adapter buffer without bound. A silent connection (nothing for
`idle_timeout_s`) is treated as dead. Disconnects
reconnect with exponential backoff and full jitter; an auth refusal raises `AuthError`
at once (retrying cannot fix credentials). Malformed messages are counted by the parser
(`adapter.parser.stats`) and never stop the stream. `on_raw(recv_ns, text)` sees every
message before parsing (the recorder uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.frames import CloseCode

from feeds import alpaca, binance, bybit, coinbase, kraken, kraken_futures, okx
from feeds.wire import AuthError, Loads, fast_loads, parser_for

log = logging.getLogger("streamllm.feeds")

DEFAULT_URLS = {
    "binance": binance.DEFAULT_URL,
    "coinbase": coinbase.DEFAULT_URL,
    "kraken": kraken.DEFAULT_URL,
    "kraken-futures": kraken_futures.DEFAULT_URL,
    "okx": okx.DEFAULT_URL,
    "bybit": bybit.DEFAULT_URL,
    "alpaca": alpaca.DEFAULT_URL,
}
DEFAULT_CHANNELS = {
    "binance": binance.DEFAULT_CHANNELS,
    "coinbase": coinbase.DEFAULT_CHANNELS,
    "kraken": kraken.DEFAULT_CHANNELS,
    "kraken-futures": kraken_futures.DEFAULT_CHANNELS,
    "okx": okx.DEFAULT_CHANNELS,
    "bybit": bybit.DEFAULT_CHANNELS,
    "alpaca": alpaca.DEFAULT_CHANNELS,
}

# The largest message each venue may send, with room to spare. Order book snapshots are the big
# ones: Coinbase's level2 snapshot of BTC-USD is the whole book, several MB (over aiohttp's 4 MiB
# default, under 10 MB as measured by client libraries) and its docs ask for the largest receive
# buffer possible; the others cap their book depth (Kraken 1000 levels, Kraken Futures' snapshot,
# OKX 400, Bybit 1000, Binance diffs only), a few hundred KB at most.
MAX_FRAME_BYTES = {
    "binance": 16 << 20,
    "coinbase": 64 << 20,
    "kraken": 16 << 20,
    "kraken-futures": 16 << 20,
    "okx": 16 << 20,
    "bybit": 16 << 20,
    "alpaca": 16 << 20,
}


# Streams (symbol x channel) one connection may carry, where a venue documents a limit (each venue module
# cites its page). Elsewhere one connection carries them all, subscribed in requests the venue's own limits
# allow (Bybit: 10 topics a request; OKX: requests under its length limit).
MAX_STREAMS_PER_CONNECTION = {"binance": binance.MAX_STREAMS_PER_CONNECTION}


def connection_shards(venue: str, symbols: list[str], channels: list[str]) -> list[list[str]]:
    """`symbols` split over as few connections as `venue` allows, in order; each symbol on exactly one, so
    its events keep their order and a reconnect touches only its own connection's symbols."""
    limit = MAX_STREAMS_PER_CONNECTION.get(venue)
    if limit is None or not symbols:
        return [list(symbols)] if symbols else []
    per_connection = max(1, limit // max(1, len(channels)))
    return [list(symbols[i:i + per_connection]) for i in range(0, len(symbols), per_connection)]


def channels_for(venue: str, market: str = "spot") -> list[str]:
    """The channels an adapter subscribes by default."""
    return list(binance.FUTURES_CHANNELS if venue == "binance" and market != "spot" else DEFAULT_CHANNELS[venue])


@dataclass(slots=True)
class AdapterStats:
    connects: int = 0
    disconnects: int = 0
    messages: int = 0
    last_error: str = ""
    backoffs_s: list[float] = field(default_factory=list)


def _send_text(msg: dict[str, Any]) -> str:
    return orjson.dumps(msg).decode()


# Venues that want an application ping every `ping_s`: what to send, given a request number.
PINGS: dict[str, Callable[[int], str]] = {
    "kraken": lambda req_id: _send_text(kraken.ping_message(req_id)),
    "okx": lambda _: okx.PING,
    "bybit": lambda _: _send_text(bybit.ping_message()),
}


class FeedAdapter:
    def __init__(
        self,
        venue: str,
        symbols: list[str],
        channels: list[str] | None = None,
        url: str | None = None,
        credentials: dict[str, str] | None = None,
        loads: Loads = fast_loads,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        idle_timeout_s: float = 60.0,
        ping_s: float = 20.0,
        max_reconnects: int | None = None,
        on_raw: Callable[[int, str], None] | None = None,
        seed: int | None = None,
        market: str = "spot",
        max_frame_bytes: int | None = None,
    ) -> None:
        """max_frame_bytes: the largest message accepted (default: the venue's `MAX_FRAME_BYTES`)."""
        if venue not in DEFAULT_URLS:
            raise ValueError(f"unknown venue {venue!r} (one of {sorted(DEFAULT_URLS)})")
        if not symbols:
            raise ValueError(f"{venue} adapter: no symbols to subscribe")
        self.venue = venue
        self.symbols = list(symbols)
        if market != "spot" and venue != "binance":
            raise ValueError(f"--market {market} is for binance, not {venue}")
        self.channels = list(channels or channels_for(venue, market))
        self.url = url or (binance.URLS[market] if venue == "binance" and market in binance.URLS else DEFAULT_URLS[venue])
        self.credentials = credentials or {}
        if venue == "alpaca" and not {"key", "secret"} <= self.credentials.keys():
            raise AuthError("alpaca adapter needs credentials={'key': ..., 'secret': ...}")
        self.parser = parser_for(venue, loads=loads, **({"market": market} if venue == "binance" else {}))
        self.max_frame_bytes = max_frame_bytes or MAX_FRAME_BYTES[venue]
        self.backoff_s = backoff_s
        self.idle_timeout_s = idle_timeout_s
        self.ping_s = ping_s
        self.max_reconnects = max_reconnects
        self.on_raw = on_raw
        self.stats = AdapterStats()
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._pending: list[Any] = []  # events parsed during the handshake

    def stop(self) -> None:
        self._stop.set()

    async def events(self) -> AsyncIterator[Any]:
        """Events forever (until `stop()` or `max_reconnects` is exhausted), reconnecting."""
        attempt = 0
        while not self._stop.is_set():
            got_data = False
            try:
                async with connect(self.url, max_size=self.max_frame_bytes, open_timeout=10) as ws:
                    self.stats.connects += 1
                    await self._handshake(ws)
                    async for ev in self._stream(ws):
                        got_data = True
                        yield ev
                        if self._stop.is_set():
                            return
                    self.stats.last_error = "server closed the connection"
            except AuthError:
                raise
            except ConnectionClosed as exc:
                if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
                    self.stats.last_error = (f"{self.url} sent a message over max_frame_bytes = "
                                             f"{self.max_frame_bytes} ({exc.sent.reason}); closed 1009")
                else:
                    self.stats.last_error = f"{type(exc).__name__}: {exc}"
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
            except InvalidURI as exc:
                raise ValueError(f"{self.venue} adapter: bad url {self.url!r}: {exc}") from exc
            if self._stop.is_set():
                return
            self.stats.disconnects += 1
            attempt = 0 if got_data else attempt + 1
            if self.max_reconnects is not None and self.stats.disconnects > self.max_reconnects:
                return
            # Full jitter keeps many clients from reconnecting in lockstep after an outage.
            base, cap = self.backoff_s
            delay = self._rng.uniform(0, min(cap, base * 2**attempt))
            self.stats.backoffs_s.append(delay)
            log.warning("%s: %s; reconnecting in %.2fs", self.venue, self.stats.last_error, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    async def _recv(self, ws: ClientConnection) -> str | bytes:
        return await asyncio.wait_for(ws.recv(), self.idle_timeout_s)

    def _feed(self, raw: str | bytes) -> list[Any]:
        recv_ns = time.time_ns()
        self.stats.messages += 1
        if self.on_raw is not None:
            self.on_raw(recv_ns, raw if isinstance(raw, str) else raw.decode("utf-8", "replace"))
        return self.parser.parse(raw, recv_ns)

    async def _handshake(self, ws: ClientConnection) -> None:
        v, syms, chans = self.venue, self.symbols, self.channels
        if v == "binance":
            for i, msg in enumerate(binance.subscribe_messages(syms, chans)):
                if i:
                    await asyncio.sleep(binance.SUBSCRIBE_GAP_S)  # under Binance's 5 messages a second
                await ws.send(_send_text(msg))
        elif v == "coinbase":
            for msg in coinbase.subscribe_messages(syms, chans, self.credentials.get("jwt")):
                await ws.send(_send_text(msg))
        elif v == "kraken":
            for msg in kraken.subscribe_messages(syms, chans):
                await ws.send(_send_text(msg))
        elif v == "kraken-futures":
            for msg in kraken_futures.subscribe_messages(syms, chans):
                await ws.send(_send_text(msg))
        elif v == "okx":
            for msg in okx.subscribe_messages(syms, chans):
                await ws.send(_send_text(msg))
        elif v == "bybit":
            for msg in bybit.subscribe_messages(syms, chans):
                await ws.send(_send_text(msg))
        elif v == "alpaca":
            parser: alpaca.AlpacaParser = self.parser  # type: ignore[assignment]
            parser.authenticated = False
            self._pending = []
            while not parser.connected:
                self._pending += self._feed(await self._recv(ws))
            await ws.send(_send_text(alpaca.auth_message(self.credentials["key"], self.credentials["secret"])))
            while not parser.authenticated:  # an auth error raises AuthError from the parser
                self._pending += self._feed(await self._recv(ws))
            await ws.send(_send_text(alpaca.subscribe_message(syms, chans)))

    async def _stream(self, ws: ClientConnection) -> AsyncIterator[Any]:
        pending, self._pending = self._pending, []
        for ev in pending:
            yield ev
        pinger = asyncio.create_task(self._ping_loop(ws)) if self.venue in PINGS else None
        try:
            while True:
                try:
                    raw = await self._recv(ws)
                except ConnectionClosed as exc:
                    if exc.rcvd is not None and exc.rcvd.code == 1000:
                        return  # clean close by the server: reconnect without counting an error
                    raise
                for ev in self._feed(raw):
                    yield ev
        finally:
            if pinger is not None:
                pinger.cancel()

    async def _ping_loop(self, ws: ClientConnection) -> None:
        req_id = 0
        with contextlib.suppress(ConnectionClosed, asyncio.CancelledError):
            while True:
                await asyncio.sleep(self.ping_s)
                req_id += 1
                await ws.send(PINGS[self.venue](req_id))
