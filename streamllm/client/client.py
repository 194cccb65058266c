"""A Python client for the streamllm service (docs/protocol.md).

    async with await AsyncClient.connect("ws://127.0.0.1:8765", token="...") as c:
        await c.open("btc")
        await c.push("btc", ["12:00 64000.5 +1.5 v3.2"])
        print((await c.ask("btc", "Is the price going up?", min_version=1))["text"])
        async for message in c.ask_stream("btc", "Why?"):   # `token` messages, then the `answer`
            ...
        snapshot = await c.subscribe("btc")
        async for event in c.events():      # {"type": "standing" | "data", ...}
            ...

One reader task routes replies to the future of their request id and everything else
(standing answers, data events) to `events()`. `Client` is the same API, blocking, for
scripts and notebooks. `streamllm ask SESSION QUESTION` is the command-line front.
Without a `token`, the client uses $STREAMLLM_TOKEN, else the local token `streamllm serve`
wrote for that port on this machine (local_token.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from streamllm.client.local_token import TOKEN_ENV, find_token

__all__ = ["DEFAULT_URL", "TOKEN_ENV", "AsyncClient", "Client", "ServiceError"]

DEFAULT_URL = "ws://127.0.0.1:8765"
EVENT_TYPES = ("standing", "data")
MAX_EVENTS = 10_000  # buffered events before the oldest are dropped (counted in events_dropped)
_END = object()


class ServiceError(Exception):
    """An `error` reply (`code`, `message`), or `code == "closed"` when the connection ended."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AsyncClient:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.welcome: dict[str, Any] = {}
        self.events_dropped = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # ask_stream's token events by request id
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._closed_reason = ""
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str = DEFAULT_URL, token: str | None = None, **kw: Any) -> AsyncClient:
        """Connect and say hello: with `token`, else $STREAMLLM_TOKEN, else this machine's local token
        for the URL's port (local_token.py); a server without tokens ignores one."""
        token = find_token(url, token)
        ws = await connect(url, max_size=None, compression=None, **kw)
        client = cls(ws)
        try:
            client.welcome = await client.request("hello", **({"token": token} if token else {}))
        except BaseException:
            await client.aclose()
            raise
        return client

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    # -- requests -----------------------------------------------------------
    async def request(self, type: str, **fields: Any) -> dict[str, Any]:
        """Send one message and wait for the reply with its id; an `error` reply raises ServiceError."""
        if self._reader.done():
            raise ServiceError("closed", self._closed_reason or "connection closed")
        req_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        try:
            await self.ws.send(orjson.dumps({"type": type, "id": req_id, **fields}).decode())
            return await future
        except ConnectionClosed as exc:
            raise ServiceError("closed", _reason(exc)) from None
        finally:
            self._pending.pop(req_id, None)

    async def open(self, session: str, system: str | None = None, max_context: int | None = None) -> dict:
        return await self.request("open", session=session, **_some(system=system, max_context=max_context))

    async def close(self, session: str) -> dict:
        """Close a session (the connection closes with `aclose()`)."""
        return await self.request("close", session=session)

    close_session = close  # the name the blocking Client uses, where close() ends the connection

    async def push(self, session: str, lines: list[str]) -> dict:
        return await self.request("push", session=session, lines=lines)

    async def register(self, session: str, question: dict[str, Any]) -> dict:
        return await self.request("register", session=session, question=question)

    async def unregister(self, session: str, question_id: str) -> dict:
        return await self.request("unregister", session=session, question_id=question_id)

    async def ask(self, session: str, question: str, *, max_tokens: int | None = None,
                  stop: list[str] | None = None, min_version: int | None = None) -> dict:
        return await self.request("ask", session=session, question=question,
                                  **_some(max_tokens=max_tokens, stop=stop, min_version=min_version))

    async def ask_stream(self, session: str, question: str, *, max_tokens: int | None = None,
                         stop: list[str] | None = None, min_version: int | None = None) -> AsyncIterator[dict]:
        """`ask` with `stream: true`: yields `token` messages as they are decoded, then the `answer`."""
        if self._reader.done():
            raise ServiceError("closed", self._closed_reason or "connection closed")
        req_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        tokens: asyncio.Queue[dict] = asyncio.Queue()
        self._pending[req_id], self._streams[req_id] = future, tokens
        fields = _some(max_tokens=max_tokens, stop=stop, min_version=min_version)
        try:
            await self.ws.send(orjson.dumps({"type": "ask", "id": req_id, "session": session, "question": question,
                                             "stream": True, **fields}).decode())
            while not future.done():
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            while not tokens.empty():  # tokens always arrive before their answer
                yield tokens.get_nowait()
            yield future.result()
        except ConnectionClosed as exc:
            raise ServiceError("closed", _reason(exc)) from None
        finally:
            self._pending.pop(req_id, None)
            self._streams.pop(req_id, None)

    async def subscribe(self, session: str, data: bool = True) -> dict:
        """Returns the snapshot (`standing`: current answers); changes then arrive on `events()`."""
        return await self.request("subscribe", session=session, data=data)

    async def unsubscribe(self, session: str) -> dict:
        return await self.request("unsubscribe", session=session)

    async def stats(self) -> dict:
        return await self.request("stats")

    # -- events ---------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Standing answers and data events as they come; ends when the connection closes."""
        while True:
            event = await self._events.get()
            if event is _END:
                self._events.put_nowait(_END)  # later iterators end too
                return
            yield event

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                message = orjson.loads(raw)
                if message.get("type") == "token" and message.get("id") in self._streams:
                    self._streams[message["id"]].put_nowait(message)
                    continue
                future = self._pending.get(message.get("id")) if "id" in message else None
                if future is not None and not future.done():
                    if message.get("type") == "error":
                        future.set_exception(ServiceError(message.get("code", "?"), message.get("message", "")))
                    else:
                        future.set_result(message)
                else:  # events, and errors that could not be tied to a request
                    if self._events.qsize() >= MAX_EVENTS:
                        self._events.get_nowait()
                        self.events_dropped += 1
                    self._events.put_nowait(message)
        except ConnectionClosed as exc:
            self._closed_reason = _reason(exc)
        finally:
            self._closed_reason = self._closed_reason or _reason_of(self.ws)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ServiceError("closed", self._closed_reason))
            self._events.put_nowait(_END)

    @property
    def close_reason(self) -> str:
        return self._closed_reason


class Client:
    """Blocking wrapper: the async client runs on a private event loop in a daemon thread.

    Same methods as AsyncClient, except `close_session(name)` closes a session and `close()`
    ends the connection (as context managers expect).
    """

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, timeout: float | None = 60.0,
                 **kw: Any) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamllm-client", daemon=True)
        self._thread.start()
        try:
            self._client: AsyncClient = self._call(AsyncClient.connect(url, token, **kw))
        except BaseException:
            self._stop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if name in ("welcome", "events_dropped", "close_reason") or not callable(method):
            return method
        return lambda *args, **kw: self._call(method(*args, **kw))

    def ask_stream(self, *args: Any, **kw: Any) -> Iterator[dict[str, Any]]:
        """`token` messages as they are decoded, then the `answer` (see AsyncClient.ask_stream)."""
        agen = self._client.ask_stream(*args, **kw)
        while True:
            try:
                yield self._call(agen.__anext__())
            except StopAsyncIteration:
                return

    def events(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Events as they come; stops after `timeout` seconds without one, or when the connection ends."""
        agen = self._client.events()
        while True:
            try:
                yield self._call(asyncio.wait_for(agen.__anext__(), timeout))
            except (StopAsyncIteration, TimeoutError):
                return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._client.aclose())
        self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _some(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _reason(exc: ConnectionClosed) -> str:
    frame = exc.rcvd
    return f"closed by the server ({frame.code}: {frame.reason})" if frame is not None else "connection lost"


def _reason_of(ws: ClientConnection) -> str:
    code = ws.close_code
    return f"closed ({code}: {ws.close_reason})" if code is not None else "connection closed"
