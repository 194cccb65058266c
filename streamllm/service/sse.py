"""Server-Sent Events: the wire format, and the stream of a session's standing answers.

    GET /v1/sessions/{name}/events[?data=false]     Authorization: Bearer <token> (or ?token=)

    event: snapshot      {"session", "data_version", "standing": [...]}   first, always
    event: standing      {"type": "standing", ...}   a standing answer whose text changed
    event: data          {"type": "data", "session", "data_version"}   (unless data=false)
    : keepalive          a comment every 15 s of silence

The same events, with the same fields, as a websocket `subscribe` (docs/protocol.md).
Each stream has a bounded queue like a websocket connection: a client that reads too
slowly gets `event: error` ("reading too slowly") and the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from streamllm.service import protocol as p
from streamllm.service.connection import threadsafe
from streamllm.service.httpauth import ApiError, hold_connection, session_name, tenant_of
from streamllm.service.shared import standing_dict

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

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


def routes(server: StreamServer) -> list[Route]:
    async def events(request: Request) -> StreamingResponse:
        tenant = tenant_of(server, request)
        session = session_name(request.path_params["name"])
        name = tenant.engine_name(session)
        want_data = request.query_params.get("data", "true").lower() not in ("false", "0", "no")
        engine = server.engine
        try:
            info = engine.session_info(name)
        except KeyError:
            raise ApiError(404, f"no session named {session!r}; open it first", code=p.UNKNOWN_SESSION,
                           param="name") from None
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(server.config.max_queue)
        last: dict[str, dict] = {}
        overflow = False

        def put(chunk: bytes) -> None:
            nonlocal overflow
            if overflow:
                return
            try:
                queue.put_nowait(chunk)
            except asyncio.QueueFull:
                overflow = True
                server.metrics.slow_disconnects.inc()
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()  # room for the reason
                queue.put_nowait(sse({"code": "too_slow", "message": "outgoing queue full: reading too slowly"},
                                     "error"))
                queue.put_nowait(None)

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

        def end() -> None:
            """Unsubscribe and release, once: from the stream's `finally`, or from the response's
            background task when the client left before the stream began."""
            nonlocal release
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.close()
            handles.clear()
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

        return sse_response(stream(), on_close=end)

    return [Route("/v1/sessions/{name}/events", events, methods=["GET"])]
