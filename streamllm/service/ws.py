"""The websocket face of the service: the JSON protocol of docs/protocol.md, as an ASGI app.

    client --json--> _dispatch --> handler --> engine (push / submit_ask / register ...)
    client <--json-- writer task <-- bounded queue <-- replies, and engine callbacks
                                                       (call_soon_threadsafe, never await)

Each connection owns a bounded outgoing queue drained by one writer task (connection.py).
Questions run as tasks, so one connection can have many in flight; closing the connection
cancels them in the engine. Engine calls that may block (push, which may fsync the ingest
log; open, close, register and unregister, which log too; an ask of a question's text, which
tokenizes it) run in a worker thread, never on the loop. `Authorization: Bearer` at connect
authenticates like a `hello` with that token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import orjson

from streamllm.config import parse_question
from streamllm.engine import SessionError
from streamllm.engine.standing.gate import GateError
from streamllm.feeding.barlines import BadBarLine, check_bar_lines
from streamllm.service import protocol as p
from streamllm.service.connection import (
    CapExceeded,
    Conn,
    Subscription,
    bridge,
    close_handles,
    is_standing,
    submit_off_loop,
    threadsafe,
)
from streamllm.service.errors import engine_error
from streamllm.service.protocol import ProtocolError, Request
from streamllm.service.quotas import QuotaExceeded
from streamllm.service.shared import bearer, info_dict, standing_dict
from streamllm.service.tenants import LOCAL

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

PROTOCOL_VERSION = 1
CLOSE_POLICY = 1008  # bad token, no hello in time
CLOSE_GOING_AWAY = 1001  # the server is stopping
_CHECK_ON_LOOP = 256  # a push with more lines has its bar lines checked in a worker thread


class WebSocketApp:
    """ASGI websocket endpoint; one instance serves every connection of one StreamServer."""

    def __init__(self, server: StreamServer) -> None:
        self.server = server
        self.engine = server.engine
        self.config = server.config
        self.metrics = server.metrics
        self._handlers: dict[str, Callable[[Conn, Request], Awaitable[dict | None]]] = {
            "hello": self._hello, "open": self._open, "close": self._close, "push": self._push,
            "register": self._register, "unregister": self._unregister, "ask": self._ask,
            "subscribe": self._subscribe, "unsubscribe": self._unsubscribe, "stats": self._stats,
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        refusal = self.server.edge.refusal(scope)  # a foreign Origin or Host (edge.py): HTTP 403, nothing accepted
        if refusal is not None:
            self.metrics.errors.labels(refusal[0]).inc()
            await _refuse(scope, send, 403, refusal[1], refusal[0])
            return
        tenants = self.server.tenants
        tenant = None if tenants.auth else LOCAL
        token = bearer(scope)
        if tenants.auth and token is not None:
            tenant = tenants.authenticate(token)
            if tenant is None:  # refused at the handshake: HTTP 401 where the server can say so
                self.metrics.errors.labels(p.UNAUTHORIZED).inc()
                await _refuse(scope, send, 401, "unknown bearer token")
                return
        try:
            slot = self.server.caps.admit(authenticated=tenant is not None)
        except CapExceeded as exc:  # over a server-wide connection cap: HTTP 503, nothing accepted
            self.metrics.errors.labels(p.CAPACITY).inc()
            await _refuse(scope, send, 503, str(exc), p.CAPACITY)
            return
        conn = None
        try:  # from here the slot is the connection's: its teardown releases it
            if (await receive())["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})
                conn = Conn(send, scope.get("client"), tenant, self.config.max_queue, self.metrics, slot)
        finally:
            if conn is None:
                slot.release()
        if conn is None:
            return
        if tenant is not None and tenants.auth and not self._admit(conn, tenant, None):
            conn.tenant = None  # refused: everything but the close is `unauthorized`
        self.server.conns.add(conn)
        self.metrics.connections.inc()
        hello_timer = None
        if conn.tenant is None:
            hello_timer = asyncio.get_running_loop().call_later(
                self.config.hello_timeout_s,
                lambda: conn.tenant is None and conn.cut(CLOSE_POLICY, "no hello with a valid token in time"))
        try:
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    break  # websocket.disconnect
                raw = message.get("text")
                await self._dispatch(conn, raw if raw is not None else message.get("bytes") or b"")
        finally:
            if hello_timer is not None:
                hello_timer.cancel()
            self.metrics.subscriptions.dec(len(conn.subs))
            conn.teardown()
            self.server.conns.discard(conn)
            self.metrics.connections.dec()
            if conn.closer is not None:
                await asyncio.gather(conn.closer, return_exceptions=True)

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
        tenants = self.server.tenants
        if tenants.auth and (token is not None or conn.tenant is None):  # a bearer header may have said it
            tenant = tenants.authenticate(token or "")
            if tenant is None:
                why = "unknown token" if token else "this server needs a token"
                hint = "" if token else (": send {\"type\": \"hello\", \"token\": ...}; `streamllm serve` prints "
                                         "its local token in the page's URL and writes it to "
                                         "$STREAMLLM_HOME/serve-PORT.token")
                conn.send(p.error(p.UNAUTHORIZED, why + hint, req.id))
                conn.finish(CLOSE_POLICY, why)
                self.metrics.errors.labels(p.UNAUTHORIZED).inc()
                return None
            if conn.tenant is not None and conn.tenant != tenant:
                raise ProtocolError(p.FORBIDDEN, "this connection already belongs to another tenant")
            if conn.tenant is None and not self._admit(conn, tenant, req.id):
                return None
            conn.tenant = tenant
        assert conn.tenant is not None
        return {"type": "welcome", "protocol": PROTOCOL_VERSION, "tenant": conn.tenant.name,
                "read_only": conn.tenant.read_only, "admin": conn.tenant.admin, "auth": tenants.auth,
                "model": self.engine.model_name, "max_message_bytes": self.config.max_message_bytes, "max_queue": self.config.max_queue}

    def _admit(self, conn: Conn, tenant: Any, req_id: Any) -> bool:
        """Check the tenant's `connections` quota for a connection about to become its; refuse and close if over."""
        try:
            self.server.quotas.check_connect(tenant.name, self.server.connections_of(tenant.name, but=conn))
        except QuotaExceeded as exc:
            self.metrics.errors.labels(p.QUOTA).inc()
            conn.send(p.error(p.QUOTA, str(exc), req_id))
            conn.finish(CLOSE_POLICY, "connection quota")
            return False
        return True

    async def _open(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        kw: dict[str, Any] = {"max_context": req.integer("max_context", None, 1, 1 << 24)}
        system = req.field("system", str, "a system prompt string", None)
        if system is not None:
            kw["system"] = system
        assert conn.tenant is not None
        quotas = self.server.quotas
        try:
            async with quotas.lock(conn.tenant.name):  # check and open as one step per tenant
                quotas.check_open(conn.tenant.name)
                info = await asyncio.to_thread(self.engine.open_session, _ename(conn, session),
                                               tenant=conn.tenant.name, **kw)
        except SessionError:
            raise ProtocolError(p.SESSION_EXISTS, f"session {session!r} is already open") from None
        return {"type": "ok", "session": session, "info": info_dict(info, session)}

    async def _close(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        await asyncio.to_thread(self.engine.close_session, _ename(conn, session))
        self.server.bars.forget(_ename(conn, session))
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
        owner = self.server.feed_owners.get(name)
        if owner is not None and not owner.client_pushes:  # a feed's session: its chart and data are the feed's
            raise ProtocolError(p.FORBIDDEN, owner.refusal())
        # Lines that claim to be bars are read back and checked before anything is taken (feeding/barlines.py).
        changes = owner.changes if owner is not None else None
        if len(lines) > _CHECK_ON_LOOP:
            await asyncio.to_thread(self._check_bars, name, lines, changes)
        else:
            self._check_bars(name, lines, changes)
        quotas, tenant = self.server.quotas, conn.tenant.name  # type: ignore[union-attr]
        if quotas.quota(tenant).push_lines_per_s is not None:
            self.engine.session_info(name)  # unknown session: its own error, and no quota spent
            quotas.take_push(tenant, len(lines))
        # Labelled questions' right choices on this batch's data: scored against the answers (live calibration).
        truths = req.field("truths", dict, "an object of question id -> right choice", None)
        kw: dict[str, Any] = {"truths": truths} if truths else {}
        # A forecast's truths, settled by this batch's bars for versions already pushed.
        late = req.field("late_truths", dict, "an object of question id -> {data version: right choice}", None)
        if late:
            kw["late_truths"] = _late_truths(late)
        ack = await asyncio.to_thread(self.engine.push, name, lines, **kw)  # may fsync the ingest log
        self.server.bars.record(name, lines)
        self.metrics.lines_pushed.inc(ack.lines)
        return {"type": "ok", "session": session, "data_version": ack.data_version,
                "queue_depth": ack.queue_depth, "lines": ack.lines}

    def _check_bars(self, name: str, lines: list[Any], changes: str | None) -> None:
        """ProtocolError `bad_field` naming the first line that claims to be a bar and is not one: a bad time
        or date, one before the session's last bar, a price not finite and > 0 (nothing of the batch is taken)."""
        closes, _ = self.server.bars.bars(name)
        try:
            check_bar_lines(lines, closes[-1][0] if closes else None, changes)
        except BadBarLine as exc:
            raise ProtocolError(p.BAD_FIELD, f"push: {exc}") from None

    async def _register(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        spec = parse_question(req.field("question", dict, "a question object (id, text, choices, ...)"),
                              source="register", key_path="question")
        assert conn.tenant is not None
        quotas = self.server.quotas
        async with quotas.lock(conn.tenant.name):
            quotas.check_register(conn.tenant.name, _ename(conn, session), spec.id)
            try:
                await asyncio.to_thread(self.engine.register, _ename(conn, session), spec)
            except GateError as exc:  # choices the tokenizer cannot tell apart: the question's mistake, not a field's
                raise ProtocolError(p.CONFIG_ERROR, f"register: question.choices: {exc}") from None
        return {"type": "ok", "session": session, "question_id": spec.id}

    async def _unregister(self, conn: Conn, req: Request) -> dict:
        session = req.session()
        question_id = req.text("question_id", "a standing question id")
        await asyncio.to_thread(self.engine.unregister, _ename(conn, session), question_id)
        return {"type": "ok", "session": session, "question_id": question_id}

    async def _ask(self, conn: Conn, req: Request) -> None:
        session = req.session()
        question, max_tokens, stop = req.question()  # within config/limits.py's bounds
        min_version = req.integer("min_version", None, 0, 1 << 62)
        stream = req.flag("stream", False)
        if len(conn.asks) >= self.config.max_inflight_asks:
            raise ProtocolError(p.BUSY, f"ask: {len(conn.asks)} questions already in flight on this connection "
                                        f"(limit {self.config.max_inflight_asks}); wait for answers")
        t0 = time.perf_counter()
        name = _ename(conn, session)
        kw: dict[str, Any] = {"stop": stop, "min_version": min_version}
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        streamed: list[int] = []
        if stream:
            loop = asyncio.get_running_loop()
            kw["on_text"] = threadsafe(loop, lambda text: self._send_token(conn, req.id, session, text, streamed))
        quotas, tenant = self.server.quotas, conn.tenant.name  # type: ignore[union-attr]
        if is_standing(self.engine, name, question):  # nothing to tokenize: microseconds, on the loop
            future = self.engine.submit_ask(name, question, **kw)
            if future.done() and future.exception() is None:  # fast path: answered inside submit_ask
                if stream:  # after any token the entry path already queued on the loop
                    asyncio.get_running_loop().call_soon(self._send_answer, conn, req.id, session, future.result(),
                                                         t0, streamed)
                else:
                    self._send_answer(conn, req.id, session, future.result(), t0, None)
                return None
            try:
                quotas.take_ask(tenant)
            except QuotaExceeded:
                future.cancel()
                raise
        else:  # a cold question is tokenized by submit_ask: in a worker thread, never on the loop
            quotas.take_ask(tenant)
            try:
                future = await submit_off_loop(lambda: self.engine.submit_ask(name, question, **kw))
            except BaseException:
                quotas.release_ask(tenant)
                raise
        task = asyncio.create_task(self._await_answer(conn, req.id, session, future, t0,
                                                      streamed if stream else None))
        conn.track(task, future)
        task.add_done_callback(lambda _t: quotas.release_ask(tenant))
        return None

    async def _await_answer(self, conn: Conn, req_id: Any, session: str, future: Future, t0: float,
                            streamed: list[int] | None) -> None:
        try:
            answer = await bridge(future)
        except asyncio.CancelledError:  # the client went away or the server is stopping: so does the question
            future.cancel()
            raise
        except Exception as exc:
            self._error(conn, *engine_error(exc, "ask"), req_id)
            return
        self._send_answer(conn, req_id, session, answer, t0, streamed)

    def _send_token(self, conn: Conn, req_id: Any, session: str, text: str, streamed: list[int]) -> None:
        streamed.append(len(text))
        message: dict[str, Any] = {"type": "token", "session": session, "text": text}
        if req_id is not None:
            message["id"] = req_id
        conn.send(message)

    def _send_answer(self, conn: Conn, req_id: Any, session: str, answer: Any, t0: float,
                     streamed: list[int] | None) -> None:
        if streamed is not None and not streamed and answer.text:  # fast path: the answer is one token event
            self._send_token(conn, req_id, session, answer.text, streamed)
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
            sub.handles.append(self.engine.subscribe(
                name, threadsafe(loop, lambda a: self._on_standing(conn, sub, a))))
            if want_data:
                sub.handles.append(self.engine.subscribe_data(
                    name, threadsafe(loop, lambda _s, v: self._on_data(conn, sub, v))))
            conn.subs[session] = sub
            self.metrics.subscriptions.inc()
        # Subscribed before the snapshot is read: a change in between arrives after it as an event,
        # and `last` drops it when the snapshot already showed it.
        snapshot = []
        for answer in self.engine.standing(name):
            data = standing_dict(answer, session)
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
        calibration = self.engine.calibration()
        for info in self.engine.list_sessions():
            local = conn.tenant.local_name(info)
            if local is not None:
                data = info_dict(info, local)
                data["standing_questions"] = [q.id for q in self._questions(info.name)]
                data["calibration"] = calibration.get(info.name, {})
                data["thresholds"] = self._thresholds(info.name)
                mine.append(data)
        if not self.server.tenants.auth or conn.tenant.admin:  # the operator (or the one local user) sees the engine
            return {"type": "stats", "tenant": conn.tenant.name, "sessions": mine, "engine": self.engine.stats(),
                    "server": {"connections": len(self.server.conns), "outgoing_queued": conn.out.qsize()}}
        # With tenants, nothing global: another tenant's load, sessions or counters are not this one's business.
        own = self.server.connections_of(conn.tenant.name)
        quota = self.server.quotas.use(conn.tenant.name, own)
        return {"type": "stats", "tenant": conn.tenant.name, "sessions": mine,
                "standing_questions": quota["use"]["standing_questions"], "quota": quota,
                "server": {"connections": own, "outgoing_queued": conn.out.qsize()}}

    def _thresholds(self, name: str) -> dict[str, dict[str, Any]]:
        """Each standing question's threshold in force at its latest answer and whose it is (config, head:
        an adapter head's own calibrated one, which replaces the config's; auto: live); null: closed."""
        try:
            answers = self.engine.standing(name)
        except KeyError:  # closed since it was listed
            return {}
        return {a.question_id: {"threshold": a.threshold, "source": a.threshold_source} for a in answers}

    def _questions(self, name: str) -> list[Any]:
        try:
            return self.engine.standing_questions(name)
        except KeyError:  # closed since it was listed
            return []

    # -- engine events (on the loop, scheduled from the engine thread) -----
    def _on_standing(self, conn: Conn, sub: Subscription, answer: Any) -> None:
        if conn.subs.get(sub.session) is not sub:
            return  # unsubscribed while the event was in flight
        data = standing_dict(answer, sub.session)
        if sub.last.get(data["question_id"]) == data:
            return
        sub.last[data["question_id"]] = data
        self.metrics.events.labels("standing").inc()
        conn.send({"type": "standing", **data})

    def _on_data(self, conn: Conn, sub: Subscription, data_version: int) -> None:
        if conn.subs.get(sub.session) is sub:
            self.metrics.events.labels("data").inc()
            conn.send({"type": "data", "session": sub.session, "data_version": data_version})



async def _refuse(scope: dict[str, Any], send: Any, status: int, message: str, code: str = p.UNAUTHORIZED) -> None:
    """Refuse a websocket handshake: an HTTP response when the server supports it, else 403."""
    if "websocket.http.response" in scope.get("extensions", {}):
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "server_error")
        body = orjson.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}})
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": CLOSE_POLICY})


def _ename(conn: Conn, session: str) -> str:
    assert conn.tenant is not None
    return conn.tenant.engine_name(session)


def _late_truths(late: dict) -> dict[str, dict[int, str]]:
    """`late_truths` off the wire: JSON object keys are strings, the engine's versions integers."""
    out: dict[str, dict[int, str]] = {}
    for question_id, by_version in late.items():
        if not isinstance(by_version, dict):
            raise ProtocolError(p.BAD_FIELD, f"late_truths[{question_id!r}]: expected an object of data version "
                                             f"-> right choice, got {type(by_version).__name__}")
        try:
            out[question_id] = {int(v): c for v, c in by_version.items()}
        except ValueError:
            raise ProtocolError(p.BAD_FIELD, f"late_truths[{question_id!r}]: data versions are integers, "
                                             f"got {list(by_version)}") from None
    return out
