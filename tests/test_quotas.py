"""Per-tenant quotas: limits in the token file, refused with code `quota` over a real websocket server.

Counts come from the engine (sessions `tenant/...`, their standing questions), so a close or
an unregister frees them; one tenant's use never counts against another's, and a tenant's
`stats` shows its own sessions and quota use, never another's nor the engine-wide counters.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.quotas import DEFAULT_QUOTA, Quota, TokenBucket
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants, TokenConfigError

LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2 n{i + 3}" for i in range(30)]
TIMEOUT = 20
TOKENS = {"tok-a": Tenant("alice"), "tok-b": Tenant("bob"), "tok-c": Tenant("carol")}


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=1024, scheduler=SchedulerConfig(chunk_tokens=64)))
    yield eng
    eng.shutdown()


def run(scenario, engine, quotas):
    async def main():
        tenants = Tenants(TOKENS, quotas)
        async with StreamServer(engine, tenants, ServerConfig(port=0)) as server:
            await asyncio.wait_for(scenario(server), TIMEOUT)

    asyncio.run(main())


class Wire:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0

    @classmethod
    async def hello(cls, server: StreamServer, token: str) -> Wire:
        wire = cls(await connect(server.url))
        assert (await wire.req("hello", token=token))["type"] == "welcome"
        return wire

    async def req(self, type: str, **fields) -> dict:
        self.next_id += 1
        await self.ws.send(json.dumps({"type": type, "id": self.next_id, **fields}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == self.next_id:
                return message

    async def ok(self, type: str, **fields) -> dict:
        reply = await self.req(type, **fields)
        assert reply["type"] != "error", reply
        return reply


def quota_error(reply: dict, *words: str) -> None:
    assert reply["type"] == "error" and reply["code"] == "quota", reply
    for word in words:
        assert word in reply["message"], (word, reply["message"])


def test_sessions_quota_per_tenant_freed_by_close(engine):
    async def scenario(server):
        alice = await Wire.hello(server, "tok-a")
        bob = await Wire.hello(server, "tok-b")
        await alice.ok("open", session="s1")
        await alice.ok("open", session="s2")
        quota_error(await alice.req("open", session="s3"), "sessions = 2", "2 sessions open")
        assert "alice/s3" not in engine.sessions
        await bob.ok("open", session="s1")  # alice's use is not bob's
        await bob.ok("open", session="s2")
        await alice.ok("close", session="s1")
        await alice.ok("open", session="s3")  # the close freed one
        stats = await alice.ok("stats")
        assert sorted(s["name"] for s in stats["sessions"]) == ["s2", "s3"]
        assert stats["quota"]["limits"] == {"sessions": 2}
        assert stats["quota"]["use"]["sessions"] == 2
        assert "engine" not in stats  # no global counters for a tenant
        bob_stats = await bob.ok("stats")
        assert sorted(s["name"] for s in bob_stats["sessions"]) == ["s1", "s2"]
        for w, names in ((alice, ("s2", "s3")), (bob, ("s1", "s2"))):
            for name in names:
                await w.ok("close", session=name)

    run(scenario, engine, {"*": Quota(sessions=2)})


def test_standing_questions_quota_freed_by_unregister(engine):
    if not hasattr(engine, "register"):
        pytest.skip("engine has no register()")

    def question(qid: str) -> dict:
        return {"id": qid, "text": "Up or down?", "choices": ["up", "down"], "threshold": 1e9}

    async def scenario(server):
        alice = await Wire.hello(server, "tok-a")
        carol = await Wire.hello(server, "tok-c")
        await alice.ok("open", session="a")
        await alice.ok("open", session="b")
        await alice.ok("register", session="a", question=question("q1"))
        await alice.ok("register", session="b", question=question("q2"))  # counted over all sessions
        duplicate = await alice.req("register", session="a", question=question("q1"))
        assert duplicate["code"] == "bad_field", duplicate  # the engine's own error, not a quota one
        quota_error(await alice.req("register", session="b", question=question("q3")),
                    "standing_questions = 2", "2 standing questions")
        assert [q.id for q in engine.standing_questions("alice/b")] == ["q2"]
        await carol.ok("open", session="a")  # carol has no table and there is no "*": the default quota
        for i in range(3):
            await carol.ok("register", session="a", question=question(f"c{i}"))
        await alice.ok("unregister", session="b", question_id="q2")
        await alice.ok("register", session="b", question=question("q3"))
        stats = await alice.ok("stats")
        assert stats["standing_questions"] == 2 and stats["quota"]["use"]["standing_questions"] == 2
        assert {s["name"]: s["standing_questions"] for s in stats["sessions"]} == {"a": ["q1"], "b": ["q3"]}
        carol_stats = await carol.ok("stats")
        assert [(s["name"], s["standing_questions"]) for s in carol_stats["sessions"]] == [("a", ["c0", "c1", "c2"])]
        assert carol_stats["quota"] == {"limits": DEFAULT_QUOTA.limits(), "use": {
            "sessions": 1, "standing_questions": 3, "connections": 1, "asks_in_flight": 0,
            "push_lines_available": DEFAULT_QUOTA.push_lines_per_s}}
        await alice.ok("close", session="a")  # closing a session frees its questions too
        await alice.ok("register", session="b", question=question("q4"))
        for w, names in ((alice, ("b",)), (carol, ("a",))):
            for name in names:
                await w.ok("close", session=name)

    run(scenario, engine, {"alice": Quota(standing_questions=2)})


def test_connections_quota_refused_at_hello_and_bearer(engine):
    async def scenario(server):
        first = await Wire.hello(server, "tok-a")
        extra = Wire(await connect(server.url))
        quota_error(await extra.req("hello", token="tok-a"), "connections = 1", "1 connections open")
        with pytest.raises(ConnectionClosed) as closed:
            await extra.ws.recv()
        assert closed.value.rcvd.code == 1008
        bearer = await connect(server.url, additional_headers={"Authorization": "Bearer tok-a"})
        reply = json.loads(await bearer.recv())
        quota_error(reply, "connections = 1")
        with pytest.raises(ConnectionClosed):
            await bearer.recv()
        bob = await Wire.hello(server, "tok-b")  # another tenant is not counted against alice
        await first.ws.close()
        for _ in range(200):  # until the server has dropped the closed connection
            if sum(1 for c in server.conns if c.tenant is not None and c.tenant.name == "alice") == 0:
                break
            await asyncio.sleep(0.01)
        again = await Wire.hello(server, "tok-a")
        assert (await again.ok("stats"))["server"]["connections"] == 1
        await again.ws.close()
        await bob.ws.close()

    run(scenario, engine, {"alice": Quota(connections=1)})


def test_push_rate_quota_refuses_the_whole_push(engine):
    async def scenario(server):
        alice = await Wire.hello(server, "tok-a")
        bob = await Wire.hello(server, "tok-b")
        await alice.ok("open", session="p")
        await bob.ok("open", session="p")
        quota_error(await alice.req("push", session="p", lines=LINES[:6]), "push_lines_per_s = 5", "6 lines")
        first = await alice.ok("push", session="p", lines=LINES[:5])
        assert first["lines"] == 5
        before = engine.session_info("alice/p").pushed_version
        assert before == first["data_version"] >= 1
        reply = await alice.req("push", session="p", lines=LINES[5:10])  # the bucket holds < 5 for ~a second
        quota_error(reply, "push_lines_per_s = 5", "nothing of it was accepted")
        assert engine.session_info("alice/p").pushed_version == before  # the refused push reached nothing
        assert (await alice.ok("stats"))["quota"]["use"]["push_lines_available"] < 5
        assert (await bob.ok("push", session="p", lines=LINES[:5]))["lines"] == 5  # bob has his own bucket
        await alice.ok("close", session="p")
        await bob.ok("close", session="p")

    run(scenario, engine, {"*": Quota(push_lines_per_s=5)})


def test_token_bucket_refills_at_rate():
    now = [0.0]
    bucket = TokenBucket(10, lambda: now[0])
    assert bucket.take(10) and not bucket.take(1)
    now[0] = 0.35
    assert not bucket.take(4) and bucket.take(3)  # 3.5 refilled; a refused take spends nothing
    now[0] = 100.0
    assert bucket.available() == 10  # never more than one second's worth


def test_token_file_quotas_parse(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[tokens]\n"tok-a" = "alice"\n"tok-b" = "bob"\n'
                    '[quotas."*"]\nsessions = 1\n[quotas.alice]\nsessions = 4\nstanding_questions = 16\n'
                    'connections = 8\npush_lines_per_s = 500\n')
    tenants = Tenants.load(path, env="")
    assert tenants.quotas["alice"] == Quota(4, 16, 8, 500)
    assert tenants.quotas["*"] == Quota(sessions=1)
    assert Tenants.load(None, env="tok-a=alice").quotas == {}  # no quota configured: unlimited
    for body, words in (
        ('[quotas.alice]\nsesions = 4\n', ("quotas.alice.sesions", "unknown limit")),
        ('[quotas.alice]\nsessions = -1\n', ("quotas.alice.sessions", ">= 0")),
        ('[quotas.alice]\nconnections = "8"\n', ("quotas.alice.connections", "whole number")),
        ('[quotas.alice]\npush_lines_per_s = 2.5\n', ("quotas.alice.push_lines_per_s",)),
        ('[quotas.alice]\nsessions = true\n', ("quotas.alice.sessions",)),
        ('[quotas]\nalice = 4\n', ("quotas.alice", "table of limits")),
        ('[quotas.zed]\nsessions = 1\n', ("quotas.zed", "no token names tenant 'zed'")),
        ('[quotas."bad name"]\nsessions = 1\n', ("quotas.bad name",)),
    ):
        path.write_text('[tokens]\n"tok-a" = "alice"\n' + body)
        with pytest.raises(TokenConfigError) as err:
            Tenants.load(path, env="")
        for word in (str(path), *words):
            assert word in str(err.value), (word, str(err.value))


def test_no_quota_means_unlimited_and_local_keeps_engine_stats(engine):
    async def scenario(server):
        w = Wire(await connect(server.url))
        await w.ok("open", session="free")
        assert (await w.ok("push", session="free", lines=LINES))["lines"] == len(LINES)
        stats = await w.ok("stats")
        assert "engine" in stats and stats["tenant"] == "local"
        await w.ok("close", session="free")
        await w.ws.close()

    async def main():
        async with StreamServer(engine, Tenants({}), ServerConfig(port=0)) as server:
            await asyncio.wait_for(scenario(server), TIMEOUT)

    asyncio.run(main())


def test_counts_come_from_the_engine_not_the_server(engine):
    """Sessions the engine already holds (restored at startup, or opened by --config) count at once."""
    engine.open_session("alice/restored", tenant="alice")
    try:
        async def scenario(server):
            alice = await Wire.hello(server, "tok-a")
            quota_error(await alice.req("open", session="new"), "1 sessions open", "sessions = 1")
            assert [s["name"] for s in (await alice.ok("stats"))["sessions"]] == ["restored"]
            await alice.ok("close", session="restored")
            await alice.ok("open", session="new")
            await alice.ok("close", session="new")

        run(scenario, engine, {"alice": Quota(sessions=1)})
    finally:
        if "alice/restored" in engine.sessions:
            engine.close_session("alice/restored")


async def _until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


def _http(server, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.http_url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_streams_and_completions_count_as_connections(engine):
    """The HTTP face holds connections too: an SSE stream, or a completion in flight (a stateless one
    opens a temporary session), counts against `connections` beside the websockets; over it, 429 `quota`."""
    completion = {"model": engine.model_name, "prompt": "Up or down?", "max_tokens": 2}

    def complete(server, token: str) -> tuple[int, dict]:
        return _http(server, "POST", "/v1/completions", token, completion)

    async def scenario(server):
        wire = await Wire.hello(server, "tok-a")
        await wire.ok("open", session="s")
        status, body = await asyncio.to_thread(complete, server, "tok-a")  # websocket + this request: 2 allowed
        assert status == 200, body
        req = urllib.request.Request(server.http_url + "/v1/sessions/s/events",
                                     headers={"Authorization": "Bearer tok-a"})
        stream = await asyncio.to_thread(urllib.request.urlopen, req, timeout=TIMEOUT)
        try:
            assert (await asyncio.to_thread(stream.readline)).startswith(b"event: snapshot")
            assert server.quotas.http.get("alice") == 1
            status, body = await asyncio.to_thread(complete, server, "tok-a")
            assert status == 429 and body["error"]["code"] == "quota", body
            assert "connections = 2" in body["error"]["message"], body
            status, body = await asyncio.to_thread(_http, server, "GET", "/v1/sessions/s/events", "tok-a")
            assert status == 429 and body["error"]["code"] == "quota", body
            extra = Wire(await connect(server.url))
            quota_error(await extra.req("hello", token="tok-a"), "connections = 2", "2 connections open")
            assert (await wire.ok("stats"))["quota"]["use"]["connections"] == 2
            status, _ = await asyncio.to_thread(complete, server, "tok-b")  # bob's connections are his own
            assert status == 200
        finally:
            stream.close()
        await _until(lambda: "alice" not in server.quotas.http, "the closed stream is released")
        status, _ = await asyncio.to_thread(complete, server, "tok-a")
        assert status == 200
        assert not server.quotas.http  # a completion holds its connection only while in flight
        assert not [s for s in engine.list_sessions() if ".stateless" in s.name]
        await wire.ok("close", session="s")
        await wire.ws.close()

    run(scenario, engine, {"alice": Quota(connections=2)})
