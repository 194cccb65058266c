"""The service: one ASGI application on one port in front of one engine (any `EngineClient`).

    ws://host:port/                    the JSON websocket protocol (ws.py, docs/protocol.md)
    GET  /health, /metrics             JSON health, Prometheus text
    GET  /v1/models                    OpenAI-compatible API (openai_api.py)
    POST /v1/completions, /v1/chat/completions   (`stream: true`: SSE chunks, then [DONE])
    GET  /v1/sessions[/{name}/bars]    sessions and recent bar closes (page.py)
    GET  /v1/sessions/{name}/events    SSE stream of standing answers (sse.py)
    GET  /                             the live page (static/)

uvicorn serves it (websockets through the `websockets` package's sans-I/O protocol);
websocket frames go straight to ws.py's ASGI handler, HTTP through Starlette's router.
Before either, edge.py checks Host and Origin: a web page on another site, or one reached
through DNS rebinding, gets 403 and nothing runs.
Nothing blocking runs on the loop: engine calls that may fsync or do disk I/O go to
worker threads, and feeds run in their own threads (feeds.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from streamllm.engine.client import EngineClient, ReplicaControl
from streamllm.service import openai_api, page, sse
from streamllm.service.admin import admin_routes
from streamllm.service.bars import BarBook
from streamllm.service.connection import Conn, ConnectionCaps
from streamllm.service.edge import EdgeRules, is_loopback
from streamllm.service.httpauth import EXCEPTION_HANDLERS, ApiError, sees_everything
from streamllm.service.metrics import ServerMetrics
from streamllm.service.quotas import QuotaBook
from streamllm.service.tenants import LOCAL_TENANT, Tenants
from streamllm.service.ws import CLOSE_GOING_AWAY, WebSocketApp

FAILING_STEPS = 3  # this many failed engine steps in a row, none succeeding between: /health is 503 failing
BEHIND_LINES = 256  # a session with more lines waiting to be ingested counts as behind (attach's max_backlog)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets (sans-I/O) protocol, pausing reads only once `ws_max_queue` messages
    wait for the app. Upstream pauses after every message and resumes when the app has read it,
    two epoll_ctl calls per message. Back-pressure stays: at most ws_max_queue are buffered."""

    def send_receive_event_to_app(self) -> None:
        paused, self.read_paused = self.read_paused, True  # keeps the base class from pausing
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = paused
        if not paused and self.queue.qsize() >= self.config.ws_max_queue:
            self.read_paused = True
            self.transport.pause_reading()


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    max_message_bytes: int = 1 << 20  # larger messages get a `too_large` error reply; also the HTTP body limit
    hard_max_bytes: int = 0  # websocket frames above this close the connection (1009); 0: 4x max_message_bytes
    max_queue: int = 1024  # outgoing messages buffered per connection (websocket or SSE) before it is cut
    max_inflight_asks: int = 64  # per websocket connection
    max_connections: int = 1024  # websockets and HTTP completions/SSE streams at once; over it: 503
    max_preauth_connections: int = 128  # websockets not authenticated yet (no hello); over it: 503
    hello_timeout_s: float = 10.0  # with auth: close connections that never say hello
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own (edge.py); "*": any
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the bound address / loopback names; "*": any
    close_timeout_s: float = 5.0


class StreamServer:
    """Serve `engine`. `await start()`, then `port` / `url`; `await close()` to stop."""

    def __init__(self, engine: EngineClient, tenants: Tenants | None = None, config: ServerConfig | None = None,
                 *, replicas: ReplicaControl | None = None) -> None:
        """replicas: the front door's replicas (serve --ray), for /health, /metrics and /v1/replicas."""
        self.engine = engine
        self.replicas = replicas
        self.tenants = tenants or Tenants({})
        self.config = config or ServerConfig()
        self.edge = EdgeRules.for_bind(self.config.host, self.config.allowed_hosts, self.config.allowed_origins)
        # per tenant, checked by ws.py; serve's generated local token keeps a tokenless server's defaults
        self.quotas = QuotaBook(self.tenants.quotas, engine, auth=self.tenants.auth and not self.tenants.local_token)
        self.caps = ConnectionCaps(self.config.max_connections, self.config.max_preauth_connections)
        self.metrics = ServerMetrics(engine.stats, engine.calibration)
        self.conns: set[Conn] = set()
        self.bars = BarBook()
        self.feeds: list[Any] = []  # feeds.FeedRunner, shown in /health
        self.feed_owners: dict[str, Any] = {}  # engine session -> feeding.owners.FeedOwner (serve --config)
        if replicas is not None:  # per-replica series
            self.metrics.registry.register(replicas.metrics_collector())
        self.started_at = time.time()
        self.closing = asyncio.Event()  # set by close(): SSE streams end (binds to a loop on first use)
        self.ws = WebSocketApp(self)
        self.http = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            *openai_api.routes(self), *sse.routes(self), *page.routes(self),
            *admin_routes(self),
        ], exception_handlers=EXCEPTION_HANDLERS)
        self._uv: uvicorn.Server | None = None
        self._sock: socket.socket | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":  # straight to the protocol: no router or middleware per frame
            await self.ws(scope, receive, send)  # which checks Host and Origin at the handshake
            return
        refusal = self.edge.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:  # a foreign Host or Origin: nothing of the request is read or run
            self.metrics.errors.labels(refusal[0]).inc()
            await ApiError(403, refusal[1], code=refusal[0]).response()(scope, receive, send)
            return
        await self.http(scope, receive, send)

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> StreamServer:
        cfg = self.config
        if not self.tenants.auth and not is_loopback(cfg.host):
            raise ValueError(f"refusing to listen on {cfg.host!r} without tokens: anyone who can reach it could "
                             "read and write every session; pass --tokens FILE or set STREAMLLM_TOKENS, or "
                             "use --host 127.0.0.1")
        family, kind, proto, _, address = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        uv_config = uvicorn.Config(
            self, ws=WebSocketProtocol, http="h11", lifespan="off", log_config=None, log_level="warning",
            access_log=False, server_header=False, ws_max_size=cfg.hard_max_bytes or 4 * cfg.max_message_bytes,
            ws_per_message_deflate=False,  # deflate costs more CPU than loopback saves
            timeout_graceful_shutdown=max(1, round(cfg.close_timeout_s)))
        uv_config.load()
        self._uv = uvicorn.Server(uv_config)
        self._uv.lifespan = uv_config.lifespan_class(uv_config)
        await self._uv.startup(sockets=[sock])
        self._sock = sock
        return self

    @property
    def port(self) -> int:
        assert self._sock is not None, "start() first"
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"ws://{host}:{self.port}"

    @property
    def http_url(self) -> str:
        return "http" + self.url[2:]

    def connections_of(self, tenant: str, but: Conn | None = None) -> int:
        """A tenant's connections for its quota: websockets, and HTTP requests and SSE streams in flight."""
        websockets = sum(1 for c in self.conns if c is not but and c.tenant is not None and c.tenant.name == tenant)
        return websockets + self.quotas.http.get(tenant, 0)

    async def close(self) -> None:
        if self._uv is None:
            return
        self.closing.set()  # SSE streams end
        for conn in list(self.conns):
            conn.cut(CLOSE_GOING_AWAY, "server stopping")
        closers = [c.closer for c in self.conns if c.closer is not None]
        if closers:
            await asyncio.wait(closers, timeout=self.config.close_timeout_s)
        uv, self._uv = self._uv, None
        await uv.shutdown(sockets=[self._sock] if self._sock is not None else None)

    async def __aenter__(self) -> StreamServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- /health and /metrics ---------------------------------------------
    async def _health(self, request: HttpRequest) -> Response:
        # a stopped engine is 503: load balancers and supervisors act on the code
        health = self.health(private=sees_everything(self, request))
        return Response(orjson.dumps(health), status_code=503 if health["status"] == "failing" else 200,
                        media_type="application/json")

    async def _metrics(self, request: HttpRequest) -> Response:
        return Response(self.metrics.render(private=sees_everything(self, request)),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def health(self, private: bool | None = None) -> dict[str, Any]:
        """/health's body. Public (`private` false; default: private only without tokens): no session names,
        feed URLs or file paths; private (no tokens, or an admin token): everything, as its one operator sees it."""
        private = not self.tenants.auth if private is None else private
        stats = self.engine.stats()
        sessions = self.engine.list_sessions()
        backlog = {s.name: s.backlog_lines for s in sessions}
        out: dict[str, Any] = {
            "status": "ok", "model": stats["model"], "device": stats["device"], "dtype": stats.get("dtype"),
            "native_decode": bool(stats.get("native_decode")),
            "uptime_s": round(time.time() - self.started_at, 1), "auth": self.tenants.auth,
            "sessions": len(sessions), "connections": len(self.conns),
            "questions_waiting": stats["questions_waiting"], "questions_running": stats["questions_running"],
            "ingest_backlog_tokens": stats["ingest_backlog_tokens"],
            "ingest_backlog_lines": sum(backlog.values()),
            "outgoing_queue_max": max((c.out.qsize() for c in self.conns), default=0),
        }
        reasons: list[str] = []
        engine = self.engine.health()
        if not engine.alive:  # nothing will be ingested or answered until a restart
            out["status"] = "failing"
            reasons.append(f"the engine stopped: {engine.failure or 'shut down'}")
        elif engine.failing_in_a_row >= FAILING_STEPS:  # not a bad question: every step fails
            out["status"] = "failing"
            reasons.append(f"the last {engine.failing_in_a_row} engine steps all failed"
                           + (f" ({engine.last_step_error})" if private else ""))
        elif engine.failed_steps:
            reasons.append(f"{engine.failed_steps} engine step(s) failed (their questions got errors)")
        out["failed_steps"] = engine.failed_steps
        if engine.log_failure is not None:  # the disk failed: every push is refused until a restart
            out["status"] = "failing"
            reasons.append("the ingest log stopped writing: pushes are refused until a restart"
                           + (f" ({engine.log_failure})" if private else ""))  # its text names a session
        feeds: list[tuple[dict[str, Any], list[str]]] = []  # (entry, reasons) of each feed
        if self.replicas is not None:  # serve --ray: the replicas behind this front door
            out["replicas"] = self.replicas.replica_health()
            reasons += [f"replica {r['replica']} is {r['state']} (restarting; its sessions answer `unavailable`)"
                        for r in out["replicas"] if r["state"] != "up"]
            feeds += [(entry, entry.pop("reasons", [])) for entry in self.replicas.feed_health()]  # run in replicas
        feeds += [feed.health(lambda name: backlog.get(name, 0), BEHIND_LINES) for feed in self.feeds]
        if feeds:
            for entry, why in feeds:
                if private:  # each session by one name (feeds know them by the engine's key)
                    engine_names = [*entry.get("sessions", []), *backlog]
                    entry["sessions"] = [health_name(n) for n in entry.get("sessions", [])]
                    entry["ingest_backlog_lines"] = {health_name(k): v for k, v in entry["ingest_backlog_lines"].items()}
                    why = [_renamed(w, engine_names) for w in why]
                else:  # health is public: no tenant's names, no URL, path or error text
                    entry.pop("sessions", None)
                    entry["ingest_backlog_lines"] = sum(entry["ingest_backlog_lines"].values())
                    why = _public_feed(entry, [w.split(" (", 1)[0] if "behind" in w else w for w in why])
                reasons += why
            out["feeds"] = [entry for entry, _ in feeds]
            lags = [e["lag_s"] for e in out["feeds"] if e["lag_s"] is not None]
            out["feed_lag_s"] = max(lags) if lags else None
        at_budget = int(stats.get("sessions_at_budget", 0))
        out["sessions_at_budget"] = at_budget
        if at_budget:  # their pushes wait (accepted, not ingested) until a compaction copy swaps in
            reasons.append(f"{at_budget} session(s) at their context budget: ingest waits for compaction "
                           f"({stats.get('compactions_running', 0)} copies running)")
        stuck = int(stats.get("sessions_stuck", 0))
        out["sessions_stuck"] = stuck
        if stuck:  # no cells for a copy even after preempting: something outside the sessions holds them
            reasons.append(f"{stuck} session(s) at their budget with no free cells for a compaction copy "
                           "(logged; their pushes apply once cells are freed)")
        if reasons:
            out["status"] = "degraded" if out["status"] == "ok" else out["status"]
            out["reasons"] = reasons
        if private:  # names of sessions: never to the public
            out["queue_depths"] = {health_name(s.name): s.backlog_lines for s in sessions}
        return out


def health_name(engine_name: str) -> str:
    """A session's one name in /health: the local user's sessions by the name they were opened with
    (`btc`), another tenant's by the engine's key (`alice/btc`), so two tenants' `btc` stay apart."""
    return engine_name.removeprefix(f"{LOCAL_TENANT}/")


def _renamed(reason: str, engine_names: Any) -> str:
    """A feed's reason with each session's engine key replaced by its /health name."""
    for name in sorted(engine_names, key=len, reverse=True):
        if name != health_name(name):
            reason = reason.replace(name, health_name(name))
    return reason


def _public_feed(entry: dict[str, Any], reasons: list[str]) -> list[str]:
    """A feed's /health entry and reasons without what only its operator should read: the feed's URL or
    file (`replay:/home/me/data.jsonl` -> `replay`) and its error's text (the exception's type stays)."""
    name, error = entry["feed"], entry.get("last_error")
    kind = name.split(":", 1)[0]
    public_error = error.split(":", 1)[0] if error else error
    entry["feed"], entry["last_error"] = kind, public_error
    out = []
    for reason in reasons:
        if error:
            reason = reason.replace(error, public_error or "")
        out.append(reason.replace(name, kind))
    return out
