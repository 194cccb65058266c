"""Safe by default at the edge (issue #44): web pages on other sites, DNS rebinding, tokens in URLs,
the admin role, the local token file, what /health tells strangers, secrets kept out of argv.

A real server on a loopback port over the tiny engine; raw HTTP (http.client, so Host and Origin
are ours to set) and raw websockets, as a hostile page or script would send them.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamllm.cli.record import credentials
from streamllm.client import Client, ServiceError
from streamllm.client.local_token import (
    find_token,
    prune_stale_tokens,
    read_token,
    token_path,
    write_token,
)
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.client import ReplicaControl
from streamllm.service.edge import EdgeRules
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants, TokenConfigError

EVIL = "http://evil.example"
TENANTS = Tenants({"tok-a": Tenant("alice"), "tok-ops": Tenant("ops", admin=True)})


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512,
                                          scheduler=SchedulerConfig(chunk_tokens=64)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def open_server(engine, serve_in_thread):
    """The library default: no tokens (loopback only); the Origin and Host checks apply all the same."""
    with serve_in_thread(StreamServer(engine, None, ServerConfig(port=0))) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(engine, serve_in_thread):
    with serve_in_thread(StreamServer(engine, TENANTS, ServerConfig(port=0), replicas=FakeReplicas())) as server:
        yield server


def request(server: StreamServer, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, *, first_chunk: bool = False) -> tuple[int, Any]:
    """(status, JSON body) of one raw HTTP request; Host is ours to set. first_chunk: read only the start of
    the body (an SSE stream never ends)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    try:
        headers = {"Host": f"127.0.0.1:{server.port}", **(headers or {})}
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for key, value in {**headers, "Content-Length": str(len(body or b""))}.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read1(4096) if first_chunk else response.read()
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.status, json.loads(data)
        return response.status, data.decode()
    finally:
        conn.close()


def error_code(reply: Any) -> str:
    return reply["error"]["code"]


def refusals(server: StreamServer, code: str) -> float:
    return server.metrics.errors.labels(code)._value.get()  # noqa: SLF001 - prometheus_client has no reader


def handshake(url: str, **kw: Any) -> Any:
    """Open a websocket (and close it): its stats reply, or the InvalidStatus of a refused handshake."""
    async def go() -> Any:
        try:
            async with connect(url, open_timeout=10, **kw) as ws:
                await ws.send(json.dumps({"type": "stats", "id": 1}))
                return json.loads(await asyncio.wait_for(ws.recv(), 10))
        except InvalidStatus as exc:
            return exc

    return asyncio.run(go())


# -- Origin -----------------------------------------------------------------------------


def test_cross_origin_websocket_handshake_is_refused_while_same_origin_and_no_origin_work(open_server):
    """The attack of the issue: `new WebSocket("ws://127.0.0.1:8765/")` from any site, then `close`."""
    before = refusals(open_server, "forbidden_origin")
    refused = handshake(open_server.url, origin=EVIL)
    assert isinstance(refused, InvalidStatus) and refused.response.status_code == 403
    assert json.loads(refused.response.body)["error"]["code"] == "forbidden_origin"
    assert refusals(open_server, "forbidden_origin") == before + 1
    for origin in ("null", f"http://127.0.0.1:{open_server.port + 1}", f"https://evil.example:{open_server.port}"):
        assert isinstance(handshake(open_server.url, origin=origin), InvalidStatus), origin
    # the page this server served (same scheme, host and port), and a client without Origin (scripts, CLIs)
    assert handshake(open_server.url, origin=f"http://127.0.0.1:{open_server.port}")["type"] == "stats"
    assert handshake(open_server.url)["type"] == "stats"


def test_cross_origin_post_and_sse_are_refused(open_server, engine):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    sessions = len(engine.list_sessions())
    status, reply = request(open_server, "POST", "/v1/chat/completions", body,
                            {"Content-Type": "application/json", "Origin": EVIL})
    assert status == 403 and error_code(reply) == "forbidden_origin"
    assert reply["error"]["type"] == "permission_error"
    assert len(engine.list_sessions()) == sessions  # nothing ran: no temporary session was opened
    status, reply = request(open_server, "GET", "/v1/sessions/any/events", headers={"Origin": EVIL})
    assert status == 403 and error_code(reply) == "forbidden_origin"
    # same origin gets past the edge (to the 404 of a session that does not exist)
    status, reply = request(open_server, "GET", "/v1/sessions/nope/events",
                            headers={"Origin": f"http://127.0.0.1:{open_server.port}"})
    assert status == 404 and error_code(reply) == "unknown_session"


def test_allowed_origins_and_hosts_are_configurable(engine, serve_in_thread):
    config = ServerConfig(port=0, allowed_origins=("http://localhost:3000",), allowed_hosts=("myhost.lan",))
    with serve_in_thread(StreamServer(engine, None, config)) as server:
        assert handshake(server.url, origin="http://localhost:3000")["type"] == "stats"
        assert isinstance(handshake(server.url, origin="http://localhost:3001"), InvalidStatus)
        assert request(server, "GET", "/v1/sessions", headers={"Host": f"myhost.lan:{server.port}"})[0] == 200
        # a page served under the allowed name is same-origin with it
        assert request(server, "GET", "/v1/sessions", headers={
            "Host": f"myhost.lan:{server.port}", "Origin": f"http://myhost.lan:{server.port}"})[0] == 200
    with pytest.raises(ValueError, match="--allow-origin 'localhost:3000'"):
        StreamServer(engine, None, ServerConfig(allowed_origins=("localhost:3000",)))


# -- Host (DNS rebinding) ------------------------------------------------------------------


def test_a_foreign_host_is_refused_on_http_and_websocket(open_server):
    """DNS rebinding: evil.example resolves to 127.0.0.1, so the attacker's page is same-origin with
    `http://evil.example:PORT`; only the Host header tells."""
    port = open_server.port
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for method, path in (("GET", "/v1/sessions"), ("GET", "/health"), ("GET", "/")):
        status, reply = request(open_server, method, path, headers=rebound)
        assert status == 403 and error_code(reply) == "forbidden_host", path
    status, reply = request(open_server, "GET", "/v1/sessions", headers={"Host": "evil.example"})
    assert status == 403 and error_code(reply) == "forbidden_host"
    for host in ("localhost", f"localhost:{port}", f"[::1]:{port}", f"127.0.0.1:{port}"):
        assert request(open_server, "GET", "/v1/sessions", headers={"Host": host})[0] == 200, host
    refused = handshake(f"ws://evil.example:{port}/", host="127.0.0.1", port=port)  # the socket goes to us
    assert isinstance(refused, InvalidStatus) and refused.response.status_code == 403
    assert json.loads(refused.response.body)["error"]["code"] == "forbidden_host"


def test_host_rules_follow_the_bind_address():
    def allowed(bind: str, host: str, extra: tuple[str, ...] = ()) -> bool:
        return EdgeRules.for_bind(bind, extra).refusal({"headers": [(b"host", host.encode())]}) is None

    assert allowed("127.0.0.1", "localhost:1") and allowed("::1", "[::1]:8765") and allowed("localhost", "127.0.0.1")
    assert not allowed("127.0.0.1", "evil.example:8765") and not allowed("127.0.0.1", "10.0.0.5:8765")
    assert allowed("10.0.0.5", "10.0.0.5:8765") and not allowed("10.0.0.5", "localhost:8765")
    # a wildcard bind: any address (rebinding needs a name), names only when allowed
    assert allowed("0.0.0.0", "192.168.1.9:8765") and not allowed("0.0.0.0", "myhost.lan:8765")
    assert allowed("0.0.0.0", "myhost.lan:8765", ("myhost.lan",)) and allowed("0.0.0.0", "a.example.com", ("*.example.com",))
    assert allowed("127.0.0.1", "anything", ("*",)) and not allowed("127.0.0.1", "bad host:x")
    two_hosts = {"headers": [(b"host", b"127.0.0.1"), (b"host", b"evil.example")]}
    assert EdgeRules.for_bind("127.0.0.1").refusal(two_hosts) is not None


# -- JSON-only bodies --------------------------------------------------------------------


def test_a_post_that_is_not_json_is_refused(open_server, engine):
    """`fetch(url, {method: "POST", body: "..."})` from another site sends text/plain with no preflight."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    sessions = len(engine.list_sessions())
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        status, reply = request(open_server, "POST", "/v1/chat/completions", body, headers)
        assert status == 415 and error_code(reply) == "unsupported_media_type", headers
        assert "Content-Type: application/json" in reply["error"]["message"]
    assert len(engine.list_sessions()) == sessions
    # JSON with a charset parameter passes (here to the body check: a non-object is 400)
    status, reply = request(open_server, "POST", "/v1/chat/completions", b"[]",
                            {"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 400 and error_code(reply) == "bad_json"


# -- tokens in URLs, the admin role --------------------------------------------------------


def test_a_token_in_the_url_is_taken_only_by_the_sse_route(token_server, engine):
    engine.open_session("alice/feed", tenant="alice")
    try:
        status, reply = request(token_server, "GET", "/v1/sessions?token=tok-a")
        assert status == 401 and error_code(reply) == "unauthorized" and reply["error"]["param"] == "token"
        assert "Authorization: Bearer" in reply["error"]["message"]
        status, reply = request(token_server, "GET", "/v1/sessions", headers={"Authorization": "Bearer tok-a"})
        assert status == 200 and [s["name"] for s in reply["data"]] == ["feed"]
        status, text = request(token_server, "GET", "/v1/sessions/feed/events?token=tok-a", first_chunk=True)
        assert status == 200 and text.startswith("event: snapshot")  # EventSource cannot send a header
    finally:
        engine.close_session("alice/feed")


class FakeReplicas(ReplicaControl):
    """A front door's replicas, enough for the admin routes: moves are recorded, not made."""

    def __init__(self) -> None:
        self.replicas = [0, 1]
        self.moved: list[tuple[str, int]] = []

    def replica_health(self) -> list[dict[str, Any]]:
        return [{"replica": i, "state": "up", "sessions": 0, "restarts": 0, "last_recovery_s": None}
                for i in self.replicas]

    def feed_health(self) -> list[dict[str, Any]]:
        return []

    def move_session(self, name: str, to: int) -> dict[str, Any]:
        self.moved.append((name, to))
        return {"from": 0, "to": to, "data_version": 0, "seconds": 0.0}

    def bar_closes(self, name: str) -> tuple[list[tuple[float, float]], int]:
        return [], 0

    def metrics_collector(self) -> Any:
        class Empty:
            def collect(self) -> list:
                return []

        return Empty()


def test_moving_a_session_needs_an_admin_token(token_server):
    move = json.dumps({"to": 1}).encode()
    json_type = {"Content-Type": "application/json"}
    status, reply = request(token_server, "POST", "/v1/admin/sessions/btc/move", move,
                            {**json_type, "Authorization": "Bearer tok-a"})  # a write token, not an admin one
    assert status == 403 and error_code(reply) == "forbidden" and "admin = true" in reply["error"]["message"]
    status, reply = request(token_server, "GET", "/v1/admin/replicas", headers={"Authorization": "Bearer tok-a"})
    assert status == 403 and error_code(reply) == "forbidden"
    assert token_server.replicas.moved == []
    ops = {**json_type, "Authorization": "Bearer tok-ops"}
    assert request(token_server, "POST", "/v1/admin/sessions/btc/move", json.dumps({"to": 1, "tenant": "alice"})
                   .encode(), ops)[0] == 200
    assert request(token_server, "POST", "/v1/admin/sessions/own/move", move, ops)[0] == 200
    assert token_server.replicas.moved == [("alice/btc", 1), ("ops/own", 1)]  # another tenant's, or its own
    status, reply = request(token_server, "GET", "/v1/admin/replicas", headers={"Authorization": "Bearer tok-ops"})
    assert status == 200 and len(reply["data"]) == 2


def test_admin_tokens_in_the_token_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[tokens]\n"tok-ops" = { tenant = "ops", admin = true }\n"tok-a" = "alice"\n')
    tenants = Tenants.load(path, env="")
    assert tenants.authenticate("tok-ops") == Tenant("ops", admin=True)
    assert not tenants.authenticate("tok-a").admin
    path.write_text('[tokens]\n"tok-ops" = { tenant = "ops", admin = true, read_only = true }\n')
    with pytest.raises(TokenConfigError, match="cannot be read_only"):
        Tenants.load(path, env="")


# -- the local token ---------------------------------------------------------------------


def test_the_local_token_file_is_private_and_read_by_the_client(engine, serve_in_thread, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STREAMLLM_TOKEN", raising=False)
    old_umask = os.umask(0)  # a permissive umask must not make the file readable by others
    try:
        path = write_token(8765, "tok-local-1")
    finally:
        os.umask(old_umask)
    assert path == token_path(8765) == tmp_path / "home" / "serve-8765.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token("ws://127.0.0.1:8765") == read_token("http://localhost:8765/") == "tok-local-1"
    assert read_token("ws://example.com:8765") is None  # never sent to another machine
    assert find_token("ws://127.0.0.1:8765", "given") == "given"  # precedence: given, $STREAMLLM_TOKEN, file
    monkeypatch.setenv("STREAMLLM_TOKEN", "from-env")
    assert find_token("ws://127.0.0.1:8765") == "from-env"
    monkeypatch.delenv("STREAMLLM_TOKEN")

    token = "tok-local-2"
    with serve_in_thread(StreamServer(engine, Tenants.local(token), ServerConfig(port=0))) as server:
        with pytest.raises(ServiceError, match="needs a token"):
            Client(server.url, timeout=20)  # no file for this port yet
        write_token(server.port, token)
        with Client(server.url, timeout=20) as client:  # found by port
            assert client.welcome["tenant"] == "local" and client.welcome["admin"]
            stats = client.stats()
            assert "engine" in stats  # what a tokenless server shows its one user
        assert server.quotas.quota("local").sessions is None  # and its limits: no default quota on sessions
        status, health = request(server, "GET", "/health", headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and "queue_depths" in health
        assert "queue_depths" not in request(server, "GET", "/health")[1]  # to anyone else: public health


def test_token_files_of_ports_nothing_listens_on_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMLLM_HOME", str(tmp_path / "home"))
    with socket.socket() as live, socket.socket() as dead:
        live.bind(("127.0.0.1", 0))
        live.listen()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused, as to a killed server
        ports = {name: sock.getsockname()[1] for name, sock in (("live", live), ("dead", dead))}
        for port in ports.values():
            write_token(port, f"tok-{port}")
        kept = write_token(ports["dead"] + 1 if ports["dead"] + 1 != ports["live"] else ports["dead"] + 2, "mine")
        (tmp_path / "home" / "serve-notaport.token").write_text("x\n")  # not ours to judge: left alone
        keep = int(kept.stem.removeprefix("serve-"))
        assert prune_stale_tokens(keep=keep) == [token_path(ports["dead"])]
        assert token_path(ports["live"]).exists() and kept.exists() and not token_path(ports["dead"]).exists()
        assert (tmp_path / "home" / "serve-notaport.token").exists()


# -- /health -----------------------------------------------------------------------------


class FakeFeed:
    """A feed as /health sees it (FeedRunner.health), down, with a path in its name and error."""

    def health(self, backlog_lines: Any, max_backlog: int) -> tuple[dict[str, Any], list[str]]:
        error = "FileNotFoundError: [Errno 2] No such file or directory: '/home/me/secret/btc.jsonl'"
        entry = {"feed": "replay:/home/me/secret/btc.jsonl", "sessions": ["alice/btc"], "state": "down",
                 "restarts": 1, "last_error": error, "events": 0, "lag_s": None,
                 "ingest_backlog_lines": {"alice/btc": 0}}
        return entry, [f"feed replay:/home/me/secret/btc.jsonl is down ({error})"]


def test_public_health_shows_no_feed_urls_or_paths(token_server):
    token_server.feeds.append(FakeFeed())
    try:
        status, public = request(token_server, "GET", "/health")
        assert status == 200 and "/home/me" not in json.dumps(public) and "alice" not in json.dumps(public)
        assert public["feeds"][0]["feed"] == "replay" and public["feeds"][0]["last_error"] == "FileNotFoundError"
        assert "feed replay is down (FileNotFoundError)" in public["reasons"]
        _, private = request(token_server, "GET", "/health", headers={"Authorization": "Bearer tok-ops"})
        assert private["feeds"][0]["feed"] == "replay:/home/me/secret/btc.jsonl" and "queue_depths" in private
        _, tenant = request(token_server, "GET", "/health", headers={"Authorization": "Bearer tok-a"})
        assert "/home/me" not in json.dumps(tenant)  # a tenant is not the operator
    finally:
        token_server.feeds.clear()


# -- secrets out of argv ---------------------------------------------------------------------


def test_record_reads_secrets_from_files_and_env_and_warns_on_argv(tmp_path, monkeypatch, capsys):
    for env in ("STREAMLLM_API_KEY", "STREAMLLM_API_SECRET", "STREAMLLM_API_JWT", "APCA_API_KEY_ID",
                "APCA_API_SECRET_KEY"):
        monkeypatch.delenv(env, raising=False)

    def args(**kw: Any) -> argparse.Namespace:
        base = {f"{n}{s}": None for n in ("key", "secret", "jwt") for s in ("", "_file")}
        return argparse.Namespace(**{**base, **kw})

    secret = tmp_path / "secret"
    secret.write_text("s3cr3t\n")
    secret.chmod(0o600)
    monkeypatch.setenv("STREAMLLM_API_KEY", "key-from-env")
    assert credentials(args(secret_file=secret)) == {"key": "key-from-env", "secret": "s3cr3t"}
    assert capsys.readouterr().err == ""
    assert credentials(args(jwt="on-argv")) == {"key": "key-from-env", "jwt": "on-argv"}  # still works, loudly
    assert "--jwt puts a secret in the command line" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--key and --key-file both given"):
        credentials(args(key="k", key_file=secret))
    Path(secret).chmod(0o644)
    credentials(args(secret_file=secret))
    assert "may be read by other users" in capsys.readouterr().err
