"""Server-Sent Events: the wire format, and the stream of a session's standing answers.

    GET /v1/sessions/{name}/events[?data=false]     Authorization: Bearer <token> (or ?token=)

    event: snapshot      {"session", "data_version", "standing": [...]}   first, always
    event: standing      {"type": "standing", ...}   a standing answer whose text changed
    event: data          {"type": "data", "session", "data_version"}   (unless data=false)
    : keepalive          a comment every 15 s of silence

The same events, with the same fields, as a websocket `subscribe` (docs/protocol.md).
Each stream has a bounded queue like a websocket connection: a client that reads too
slowly gets `event: error` (code `too_slow`) and the stream ends, so its EventSource
reconnects and starts again from a fresh snapshot. A reader that reads nothing at all
cannot even take the error: after `close_timeout_s` its connection is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from streamllm.service import protocol as p
from streamllm.service.connection import threadsafe
from streamllm.service.httpauth import ApiError, hold_connection, session_name, tenant_of
from streamllm.service.shared import standing_dict

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

log = logging.getLogger("streamllm.service.server")

KEEPALIVE_S = 15.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: str | None = None) -> bytes:
    """One SSE message: `event:` line (optional), one `data:` line of JSON (or raw text), blank line."""
    body = data if isinstance(data, str) else orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n".encode()


def sse_response(chunks: AsyncIterator[bytes], on_close: Callable[[], Any] | None = None) -> StreamingResponse:
    """on_close also runs as the response's background task: a client gone before the stream's first
    chunk never starts the generator, so its `finally` alone would not release what it holds."""
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=None if on_close is None else BackgroundTask(on_close))


class CuttableStream(StreamingResponse):
    """An SSE response that ends even when its reader reads nothing. Once `cut` is set (the reader fell
    behind), the reader has `grace_s` to take what is still queued (the error, then the end); after
    that the send waiting on its full socket is cancelled and the server closes the connection,
    instead of holding the stream (and the tenant's connection) for as long as the reader stalls."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], Any], cut: asyncio.Event,
                 grace_s: float, peer: Any) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS,
                         background=BackgroundTask(on_close))
        self.cut = cut
        self.grace_s = grace_s
        self.peer = peer

    async def stream_response(self, send: Send) -> None:
        streaming = asyncio.ensure_future(super().stream_response(send))
        dropping = asyncio.ensure_future(self._drop_after_grace())
        try:
            await asyncio.wait({streaming, dropping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dropping.cancel()
            if not streaming.done():
                streaming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming
                await self.body_iterator.aclose()  # its `finally` unsubscribes now, not when collected
        if not streaming.cancelled():
            streaming.result()  # an error of the send itself (the client left) propagates as before

    async def _drop_after_grace(self) -> None:
        await self.cut.wait()
        await asyncio.sleep(self.grace_s)
        log.info("dropping SSE reader %s: read nothing for %.1f s after its queue overflowed",
                 self.peer, self.grace_s)


def routes(server: StreamServer) -> list[Route]:
    async def events(request: Request) -> StreamingResponse:
        tenant = tenant_of(server, request, query_token=True)  # EventSource cannot send a header
        session = session_name(request.path_params["name"])
        name = tenant.engine_name(session)
        want_data = request.query_params.get("data", "true").lower() not in ("false", "0", "no")
        engine = server.engine
        try:
            info = engine.session_info(name)
        except KeyError:
            raise ApiError(404, f"no session named {session!r}; open it first", code=p.UNKNOWN_SESSION,
                           param="name") from None
        # Unbounded as an asyncio.Queue, bounded by `put`: the error and the end always fit behind it.
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        max_queue = server.config.max_queue
        last: dict[str, dict] = {}
        cut = asyncio.Event()

        def put(chunk: bytes) -> None:
            if cut.is_set():
                return
            if queue.qsize() < max_queue:
                queue.put_nowait(chunk)
                return
            # Too slow: what is queued is stale (the reconnect brings a fresh snapshot), so the error
            # and the end go first; nothing more is queued and the engine stops calling back.
            cut.set()
            server.metrics.slow_disconnects.inc()
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(sse({"code": "too_slow", "message": f"outgoing queue full ({max_queue} events): "
                                  "reading too slowly; reconnect for a fresh snapshot"}, "error"))
            queue.put_nowait(None)
            unsubscribe()

        def on_standing(answer: Any) -> None:
            data = standing_dict(answer, session)
            if last.get(data["question_id"]) == data:
                return
            last[data["question_id"]] = data
            server.metrics.events.labels("standing").inc()
            put(sse({"type": "standing", **data}, "standing"))

        def on_data(_session: str, version: int) -> None:
            server.metrics.events.labels("data").inc()
            put(sse({"type": "data", "session": session, "data_version": version}, "data"))

        release = hold_connection(server, tenant)  # a stream is one of the tenant's connections
        handles: list[Any] = []
        server.metrics.subscriptions.inc()

        def unsubscribe() -> None:
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.close()
            handles.clear()

        def end() -> None:
            """Unsubscribe and release, once: from the stream's `finally`, or from the response's
            background task when the client left before the stream began."""
            nonlocal release
            unsubscribe()
            if release is not None:
                release, done = None, release
                server.metrics.subscriptions.dec()
                done()

        try:
            loop = asyncio.get_running_loop()
            handles.append(engine.subscribe(name, threadsafe(loop, on_standing)))
            if want_data:
                handles.append(engine.subscribe_data(name, threadsafe(loop, on_data)))
            snapshot = []
            for answer in engine.standing(name):  # subscribed first: nothing falls between snapshot and events
                data = standing_dict(answer, session)
                last[data["question_id"]] = data
                snapshot.append(data)
        except BaseException:
            end()
            raise
        first = sse({"session": session, "data_version": info.data_version, "standing": snapshot}, "snapshot")

        async def stream() -> AsyncIterator[bytes]:
            closing = asyncio.ensure_future(server.closing.wait())
            try:
                yield first
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter, closing}, timeout=KEEPALIVE_S,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        if closing in done:
                            return
                        yield b": keepalive\n\n"
                        continue
                    chunk = getter.result()
                    if chunk is None:
                        return
                    yield chunk
            finally:
                closing.cancel()
                end()

        return CuttableStream(stream(), end, cut, server.config.close_timeout_s, request.client)

    return [Route("/v1/sessions/{name}/events", events, methods=["GET"])]
