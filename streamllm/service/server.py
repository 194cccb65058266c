"""The websocket service: one asyncio server in front of one Engine (DESIGN §5).

    client --json--> _dispatch --> handler --> engine (push / submit_ask / register ...)
    client <--json-- writer task <-- bounded queue <-- replies, and engine callbacks
                                                       (call_soon_threadsafe, never await)

Each connection owns a bounded outgoing queue drained by one writer task. A client that
reads too slowly fills it and is cut (close 1013 with the reason); the engine thread and
other clients never wait for it. Questions run as tasks, so one connection can have many
in flight and a slow question never blocks its other requests. Plain HTTP on the same
port serves /health and /metrics. The protocol is written down in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as HttpRequest
from websockets.http11 import Response as HttpResponse

from streamllm.config import ConfigError, parse_question
from streamllm.engine import AdmissionError, Engine, SessionError
from streamllm.engine.kv import KVCapacityError
from streamllm.service import protocol as p
from streamllm.service.connection import Conn, Subscription, bridge, close_handles, threadsafe
from streamllm.service.metrics import ServerMetrics
from streamllm.service.protocol import ProtocolError, Request
from streamllm.service.tenants import LOCAL, Tenants

log = logging.getLogger("streamllm.service.server")
_ENGINE_NAME = re.compile(r"'[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})'")

PROTOCOL_VERSION = 1
CLOSE_POLICY = 1008  # bad token, no hello in time
# Tokenizing costs ~0.04 ms a line (tiny tokenizer: 1 line 0.04 ms, 64 lines 1.2 ms) and a thread hop
# ~0.05 ms: from this many lines the loop hands the push to a thread and keeps serving others.
PUSH_THREAD_LINES = 32


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    max_message_bytes: int = 1 << 20  # larger messages get a `too_large` error reply
    hard_max_bytes: int = 0  # websockets closes (1009) above this; 0: 4x max_message_bytes
    max_queue: int = 1024  # outgoing messages buffered per connection before it is cut
    max_inflight_asks: int = 64  # per connection
    hello_timeout_s: float = 10.0  # with auth: close connections that never say hello
    close_timeout_s: float = 5.0


class StreamServer:
    """Serve `engine` over websockets. `await start()`, then `port`; `await close()` to stop."""

    def __init__(self, engine: Engine, tenants: Tenants | None = None, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.tenants = tenants or Tenants({})
        self.config = config or ServerConfig()
        self.metrics = ServerMetrics(engine.stats)
        self.conns: set[Conn] = set()
        self.started_at = time.time()
        self._ws: WsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handlers: dict[str, Callable[[Conn, Request], Awaitable[dict | None]]] = {
            "hello": self._hello, "open": self._open, "close": self._close, "push": self._push,
            "register": self._register, "unregister": self._unregister, "ask": self._ask,
            "subscribe": self._subscribe, "unsubscribe": self._unsubscribe, "stats": self._stats,
        }

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> StreamServer:
        cfg = self.config
        if not self.tenants.auth and not is_loopback(cfg.host):
            raise ValueError(f"refusing to listen on {cfg.host!r} without tokens: anyone who can reach it could "
                             "read and write every session; pass --tokens FILE or set STREAMLLM_TOKENS, or "
                             "use --host 127.0.0.1")
        self._loop = asyncio.get_running_loop()
        self._ws = await serve(
            self._handle, cfg.host, cfg.port, process_request=self._http,
            max_size=cfg.hard_max_bytes or 4 * cfg.max_message_bytes,
            close_timeout=cfg.close_timeout_s, compression=None,  # deflate costs more CPU than loopback saves
        )
        return self

    @property
    def port(self) -> int:
        assert self._ws is not None, "start() first"
        return self._ws.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"ws://{host}:{self.port}"

    async def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            await self._ws.wait_closed()
            self._ws = None

    async def __aenter__(self) -> StreamServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections ------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        conn = Conn(ws, None if self.tenants.auth else LOCAL, self.config.max_queue, self.metrics)
        self.conns.add(conn)
        self.metrics.connections.inc()
        hello_timer = None
        if conn.tenant is None:
            hello_timer = asyncio.get_running_loop().call_later(
                self.config.hello_timeout_s,
                lambda: conn.tenant is None and conn.cut(CLOSE_POLICY, "no hello with a valid token in time"))
        try:
            async for raw in ws:
                await self._dispatch(conn, raw)
        except ConnectionClosed:
            pass
        finally:
            if hello_timer is not None:
                hello_timer.cancel()
            self.metrics.subscriptions.dec(len(conn.subs))
            conn.teardown()
            self.conns.discard(conn)
            self.metrics.connections.dec()
            if conn.closer is not None:
                with contextlib.suppress(Exception):
                    await conn.closer

    async def _dispatch(self, conn: Conn, raw: str | bytes) -> None:
        req_id = None
        kind = "?"
        try:
            req = p.decode(raw, self.config.max_message_bytes)
            req_id, kind = req.id, req.type
            self.metrics.messages.labels(kind).inc()
            if conn.tenant is None and kind != "hello":
                raise ProtocolError(p.UNAUTHORIZED, "send {\"type\": \"hello\", \"token\": ...} first")
            if kind in p.WRITE_TYPES and conn.tenant is not None and conn.tenant.read_only:
                raise ProtocolError(p.FORBIDDEN, f"{kind}: this token is read-only (ask, subscribe, stats)")
            reply = await self._handlers[kind](conn, req)
        except ProtocolError as exc:
            self._error(conn, exc.code, exc.message, req_id if req_id is not None else exc.request_id)
            return
        except Exception as exc:
            self._error(conn, *engine_error(exc, kind), req_id)
            return
        if reply is not None:
            if req_id is not None:
                reply["id"] = req_id
            conn.send(reply)

    def _error(self, conn: Conn, code: str, message: str, req_id: Any) -> None:
        self.metrics.errors.labels(code).inc()
        conn.send(p.error(code, message, req_id))

    # -- handlers ---------------------------------------------------------
    async def _hello(self, conn: Conn, req: Request) -> dict | None:
        token = req.field("token", str, "a token string", None)
        if self.tenants.auth:
            tenant = self.tenants.authenticate(token or "")
            if tenant is None:
                conn.send(p.error(p.UNAUTHORIZED, "unknown token", req.id))
                conn.finish(CLOSE_POLICY, "unknown token")
                self.metrics.errors.labels(p.UNAUTHORIZED).inc()
                return None
            if conn.tenant is not None and conn.tenant != tenant:
                raise ProtocolError(p.FORBIDDEN, "this connection already belongs to another tenant")
            conn.tenant = tenant
        assert conn.tenant is not None
        return {"type": "welcome", "protocol": PROTOCOL_VERSION, "tenant": conn.tenant.name,
                "read_only": conn.tenant.read_only, "auth": self.tenants.auth, "model": self.engine.model_name,
                "max_message_bytes": self.config.max_message_bytes, "max_queue": self.config.max_queue}

    async def _open(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        kw: dict[str, Any] = {"max_context": req.integer("max_context", None, 1, 1 << 24)}
        system = req.field("system", str, "a system prompt string", None)
        if system is not None:
            kw["system"] = system
        try:
            info = self.engine.open_session(_ename(conn, session), **kw)
        except SessionError:
            raise ProtocolError(p.SESSION_EXISTS, f"session {session!r} is already open") from None
        return {"type": "ok", "session": session, "info": _info(info, session)}

    async def _close(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        self.engine.close_session(_ename(conn, session))
        sub = conn.subs.pop(session, None)
        if sub is not None:
            close_handles(sub)
            self.metrics.subscriptions.dec()
        return {"type": "ok", "session": session}

    async def _push(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        lines = req.field("lines", list, "an array of strings")
        if len(lines) > p.MAX_LINES_PER_PUSH:
            raise ProtocolError(p.TOO_LARGE, f"push: {len(lines)} lines, over the limit of {p.MAX_LINES_PER_PUSH}")
        name = _ename(conn, session)
        # Tokenizing a big batch takes milliseconds: do it off the loop so other clients keep going.
        if len(lines) >= PUSH_THREAD_LINES:
            ack = await asyncio.to_thread(self.engine.push, name, lines)
        else:
            ack = self.engine.push(name, lines)
        self.metrics.lines_pushed.inc(ack.lines)
        return {"type": "ok", "session": session, "data_version": ack.data_version,
                "queue_depth": ack.queue_depth, "lines": ack.lines}

    async def _register(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        spec = parse_question(req.field("question", dict, "a question object (id, text, choices, ...)"),
                              source="register", key_path="question")
        self._require("register")(_ename(conn, session), spec)
        return {"type": "ok", "session": session, "question_id": spec.id}

    async def _unregister(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        question_id = req.text("question_id", "a standing question id")
        self._require("unregister")(_ename(conn, session), question_id)
        return {"type": "ok", "session": session, "question_id": question_id}

    async def _ask(self, conn: Conn, req: Request) -> None:
        session = req.session()
        question = req.text("question", "the question text, or a standing question's id")
        max_tokens = req.integer("max_tokens", None, 1, p.MAX_ASK_TOKENS)  # None: the standing spec's, or 16
        min_version = req.integer("min_version", None, 0, 1 << 62)
        stop = req.field("stop", list, "an array of strings", None)
        if stop is not None and not all(isinstance(s, str) and s for s in stop):
            raise ProtocolError(p.BAD_FIELD, "ask: field 'stop' must hold non-empty strings")
        req.flag("stream", False)  # accepted; the engine does not expose tokens yet: the answer comes whole
        if len(conn.asks) >= self.config.max_inflight_asks:
            raise ProtocolError(p.BUSY, f"ask: {len(conn.asks)} questions already in flight on this connection "
                                        f"(limit {self.config.max_inflight_asks}); wait for answers")
        t0 = time.perf_counter()
        kw: dict[str, Any] = {"stop": stop, "min_version": min_version}
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        future = self.engine.submit_ask(_ename(conn, session), question, **kw)
        if future.done() and future.exception() is None:  # fast path: answered inside submit_ask
            self._send_answer(conn, req.id, session, future.result(), t0)
            return None
        task = asyncio.create_task(self._await_answer(conn, req.id, session, future, t0))
        conn.asks.add(task)
        task.add_done_callback(conn.asks.discard)
        return None

    async def _await_answer(self, conn: Conn, req_id: Any, session: str, future: Future, t0: float) -> None:
        try:
            answer = await bridge(future)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._error(conn, *engine_error(exc, "ask"), req_id)
            return
        self._send_answer(conn, req_id, session, answer, t0)

    def _send_answer(self, conn: Conn, req_id: Any, session: str, answer: Any, t0: float) -> None:
        data = answer.to_dict()
        data.pop("tokens", None)  # token ids mean nothing to a client
        data["session"] = session
        message = {"type": "answer", **data}
        if req_id is not None:
            message["id"] = req_id
        self.metrics.answers.labels(answer.path).inc()
        self.metrics.ask_seconds.labels(answer.path).observe(time.perf_counter() - t0)
        conn.send(message)

    async def _subscribe(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        want_data = req.flag("data", True)
        name = _ename(conn, session)
        info = self.engine.session_info(name)  # unknown session -> error before any handle exists
        sub = conn.subs.get(session)
        if sub is None:
            sub = Subscription(session)
            loop = asyncio.get_running_loop()
            on_standing = self._require("subscribe")
            sub.handles.append(on_standing(name, threadsafe(loop, lambda a: self._on_standing(conn, sub, a))))
            if want_data and hasattr(self.engine, "subscribe_data"):
                sub.handles.append(self.engine.subscribe_data(  # type: ignore[attr-defined]
                    name, threadsafe(loop, lambda _s, v: self._on_data(conn, sub, v))))
            conn.subs[session] = sub
            self.metrics.subscriptions.inc()
        # Subscribed before the snapshot is read: a change in between arrives after it as an event,
        # and `last` drops it when the snapshot already showed it.
        snapshot = []
        for answer in self._require("standing")(name):
            data = _standing(answer, session)
            sub.last[data["question_id"]] = data
            snapshot.append(data)
        return {"type": "ok", "session": session, "data_version": info.data_version, "standing": snapshot}

    async def _unsubscribe(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        sub = conn.subs.pop(session, None)
        if sub is None:
            self.engine.session_info(_ename(conn, session))  # unknown_session rather than a silent ok
        else:
            close_handles(sub)
            self.metrics.subscriptions.dec()
        return {"type": "ok", "session": session, "subscribed": sub is not None}

    async def _stats(self, conn: Conn, req: Request) -> dict:
        assert conn.tenant is not None
        mine = []
        for info in self.engine.list_sessions():
            local = conn.tenant.local_name(info.name)
            if local is not None:
                mine.append(_info(info, local))
        return {"type": "stats", "tenant": conn.tenant.name, "sessions": mine, "engine": self.engine.stats(),
                "server": {"connections": len(self.conns), "outgoing_queued": conn.out.qsize()}}

    # -- engine events (on the loop, scheduled from the engine thread) -----
    def _on_standing(self, conn: Conn, sub: Subscription, answer: Any) -> None:
        if conn.subs.get(sub.session) is not sub:
            return  # unsubscribed while the event was in flight
        data = _standing(answer, sub.session)
        if sub.last.get(data["question_id"]) == data:
            return
        sub.last[data["question_id"]] = data
        self.metrics.events.labels("standing").inc()
        conn.send({"type": "standing", **data})

    def _on_data(self, conn: Conn, sub: Subscription, data_version: int) -> None:
        if conn.subs.get(sub.session) is sub:
            self.metrics.events.labels("data").inc()
            conn.send({"type": "data", "session": sub.session, "data_version": data_version})

    def _require(self, method: str) -> Callable[..., Any]:
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise ProtocolError(p.INTERNAL, f"this engine build has no {method}(); standing questions are unavailable")
        return fn

    # -- HTTP on the same port --------------------------------------------
    def _http(self, connection: ServerConnection, request: HttpRequest) -> HttpResponse | None:
        path = request.path.split("?", 1)[0]
        if path == "/health":
            return _respond(connection, orjson.dumps(self.health()), "application/json")
        if path == "/metrics":
            return _respond(connection, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        return None  # a websocket handshake (or websockets' own 426 for plain HTTP)

    def health(self) -> dict[str, Any]:
        stats = self.engine.stats()
        sessions = self.engine.list_sessions()
        out: dict[str, Any] = {
            "status": "ok", "model": stats["model"], "device": stats["device"], "dtype": stats.get("dtype"),
            "uptime_s": round(time.time() - self.started_at, 1), "auth": self.tenants.auth,
            "sessions": len(sessions), "connections": len(self.conns),
            "questions_waiting": stats["questions_waiting"], "questions_running": stats["questions_running"],
            "ingest_backlog_tokens": stats["ingest_backlog_tokens"],
            "ingest_backlog_lines": sum(s.backlog_lines for s in sessions),
            "outgoing_queue_max": max((c.out.qsize() for c in self.conns), default=0),
        }
        if not self.tenants.auth:  # with tenants, health is public: names stay private
            out["queue_depths"] = {s.name.partition("/")[2]: s.backlog_lines for s in sessions}
        return out


# -- helpers ------------------------------------------------------------------


def engine_error(exc: BaseException, kind: str) -> tuple[str, str]:
    """(code, message) for an exception raised by the engine or by validation."""
    if isinstance(exc, SessionError):
        return p.UNKNOWN_SESSION, _client_text(str(exc))
    if isinstance(exc, AdmissionError | KVCapacityError):
        return p.CAPACITY, _client_text(str(exc))
    if isinstance(exc, ConfigError):
        return p.CONFIG_ERROR, str(exc)
    if isinstance(exc, KeyError):  # e.g. unregister of an unknown question id
        return p.UNKNOWN_QUESTION, _client_text(str(exc.args[0] if exc.args else exc))
    if isinstance(exc, ValueError | TypeError):
        return p.BAD_FIELD, f"{kind}: {_client_text(str(exc))}"
    log.exception("%s failed", kind, exc_info=exc)
    return p.INTERNAL, f"{kind}: internal error ({type(exc).__name__}); the server logged it"


def _client_text(text: str) -> str:
    """Engine messages quote engine names ('alice/btc'); a client knows its sessions as 'btc'."""
    return _ENGINE_NAME.sub(r"'\1'", text)


def _ename(conn: Conn, session: str) -> str:
    assert conn.tenant is not None
    return conn.tenant.engine_name(session)


def _info(info: Any, local: str) -> dict[str, Any]:
    data = asdict(info)
    data["name"] = local
    return data


def _standing(answer: Any, local: str) -> dict[str, Any]:
    data = answer.to_dict()
    data["session"] = local
    return data


def _respond(connection: ServerConnection, body: bytes, content_type: str) -> HttpResponse:
    response = connection.respond(200, "")
    del response.headers["Content-Length"]  # Headers is a multidict: assigning would add a second value
    del response.headers["Content-Type"]
    response.headers["Content-Length"] = str(len(body))
    response.headers["Content-Type"] = content_type
    response.body = body
    return response


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cli_main(argv: list[str]) -> int:
    """`streamllm serve`: engine + feeds + server from one config (see streamllm.service.serve)."""
    from streamllm.service.serve import main

    return main(argv)
