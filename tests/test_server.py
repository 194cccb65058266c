"""The websocket service end to end: a real server on a loopback port over the tiny engine.

Each test runs one asyncio scenario against a fresh StreamServer (port 0) sharing one
engine; sessions get per-test names. Raw JSON frames are used on purpose: these tests
pin the wire protocol, not the Python client (tests/test_client.py covers that).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants, TokenConfigError

LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2 n{i + 3}" for i in range(30)]
needs_standing = pytest.mark.skipif(not hasattr(Engine, "register"), reason="engine has no register() yet")
TIMEOUT = 20


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=1024, scheduler=SchedulerConfig(chunk_tokens=64)))
    yield eng
    eng.shutdown()


def run(scenario, engine, tenants=None, **config):
    async def main():
        async with StreamServer(engine, tenants, ServerConfig(port=0, **config)) as server:
            await asyncio.wait_for(scenario(server), TIMEOUT)

    asyncio.run(main())


class Wire:
    """A raw JSON-over-websocket peer that keeps events apart from replies."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict] = []
        self.next_id = 0

    @classmethod
    async def connect(cls, server: StreamServer, **kw) -> Wire:
        return cls(await connect(server.url, **kw))

    async def send(self, message: dict | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    async def reply(self, req_id=None) -> dict:
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("type") in ("standing", "data") and "id" not in message:
                self.events.append(message)
                continue
            assert req_id is None or message.get("id") == req_id, message
            return message

    async def req(self, type: str, **fields) -> dict:
        self.next_id += 1
        await self.send({"type": type, "id": self.next_id, **fields})
        return await self.reply(self.next_id)

    async def ok(self, type: str, **fields) -> dict:
        reply = await self.req(type, **fields)
        assert reply["type"] != "error", reply
        return reply

    async def event(self, predicate) -> dict:
        for i, ev in enumerate(self.events):
            if predicate(ev):
                return self.events.pop(i)
        while True:
            message = json.loads(await self.ws.recv())
            if predicate(message):
                return message
            self.events.append(message)

    async def close(self) -> None:
        await self.ws.close()


def error_code(reply: dict) -> str:
    assert reply["type"] == "error", reply
    assert reply["message"]
    return reply["code"]


def test_open_push_ask_stats_close(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        welcome = await w.ok("hello")
        assert welcome["type"] == "welcome" and welcome["tenant"] == "local" and welcome["model"] == "tiny"
        opened = await w.ok("open", session="s1", system="You watch BTC.", max_context=512)
        assert opened["session"] == "s1" and opened["info"]["name"] == "s1"
        ack = await w.ok("push", session="s1", lines=LINES[:5])
        assert (ack["data_version"], ack["lines"]) == (1, 5)
        answer = await w.ok("ask", session="s1", question="Is it going up?", max_tokens=3, min_version=1)
        assert answer["type"] == "answer" and answer["session"] == "s1" and answer["path"] == "cold"
        assert answer["data_version"] == 1 and "tokens" not in answer and answer["tokens_computed"] >= 3
        stats = await w.ok("stats")
        assert [s["name"] for s in stats["sessions"]] == ["s1"]
        assert stats["sessions"][0]["lines_ingested"] == 5
        # replies echo ids of either kind; a request without an id gets a reply without one
        await w.send({"type": "stats", "id": "abc"})
        assert (await w.reply("abc"))["id"] == "abc"
        await w.send({"type": "stats"})
        assert "id" not in await w.reply()
        await w.ok("close", session="s1")
        assert error_code(await w.req("ask", session="s1", question="x")) == "unknown_session"
        await w.close()

    run(scenario, engine)
    assert "local/s1" not in engine.sessions


@needs_standing
def test_register_paths_subscribe_unsubscribe(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        watcher = await Wire.connect(server)  # proves events keep flowing after w unsubscribes
        await w.ok("open", session="st")
        await w.ok("push", session="st", lines=LINES[:4])
        sure = {"id": "sure", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0.0}
        never = {"id": "never", "text": "Higher or lower?", "choices": ["higher", "lower"], "threshold": 1e9,
                 "max_tokens": 2}
        assert (await w.ok("register", session="st", question=sure))["question_id"] == "sure"
        await w.ok("register", session="st", question=never)
        # the snapshot holds what is pre-positioned so far (events only carry changed text, so poll it)
        snap = await w.ok("subscribe", session="st")
        while {a["question_id"] for a in snap["standing"] if a["data_version"] == 1} != {"sure", "never"}:
            assert all(a["session"] == "st" and a["path"] in ("fast", "entry") for a in snap["standing"])
            await asyncio.sleep(0.02)
            snap = await w.ok("subscribe", session="st")  # idempotent: a fresh snapshot, no second feed

        # pre-positioned at the current version: the gate decides fast or entry; ad hoc is cold
        fast = await w.ok("ask", session="st", question="sure")
        assert fast["path"] == "fast" and fast["text"] in ("up", "down") and fast["data_version"] == 1
        assert fast["tokens_computed"] == 0 and fast["confidence"] >= 0
        by_text = await w.ok("ask", session="st", question="  UP or   down? ")
        assert by_text["path"] == "fast"
        entry = await w.ok("ask", session="st", question="never")
        assert entry["path"] == "entry" and entry["confidence"] < 1e9
        cold = await w.ok("ask", session="st", question="Anything new?", max_tokens=2)
        assert cold["path"] == "cold" and cold["tokens_computed"] > 0

        # subscribed: a new standing answer and new data both arrive as events
        await w.ok("register", session="st", question={"id": "late", "text": "Calm or wild?",
                                                          "choices": ["calm", "wild"], "threshold": 0.0})
        late = await w.event(lambda m: m.get("type") == "standing" and m["question_id"] == "late")
        assert late["session"] == "st" and late["text"] in ("calm", "wild") and late["path"] == "fast"
        await watcher.ok("subscribe", session="st")
        await w.ok("push", session="st", lines=LINES[4:8])
        data = await w.event(lambda m: m.get("type") == "data" and m["data_version"] == 2)
        assert data == {"type": "data", "session": "st", "data_version": 2}

        assert (await w.ok("unsubscribe", session="st"))["subscribed"] is True
        w.events.clear()
        await w.ok("push", session="st", lines=LINES[8:12])
        await watcher.event(lambda m: m.get("type") == "data" and m["data_version"] == 3)
        await w.ok("stats")  # a round trip after the event: anything still subscribed would have come first
        assert not [e for e in w.events if e.get("type") in ("standing", "data")]

        await w.ok("unregister", session="st", question_id="never")
        assert error_code(await w.req("unregister", session="st", question_id="never")) == "unknown_question"
        bad = await w.req("register", session="st", question={"id": "x", "text": "t", "choices": ["a"]})
        assert error_code(bad) == "config_error" and "question.choices" in bad["message"]
        await w.ok("close", session="st")
        await w.close()
        await watcher.close()

    run(scenario, engine)


def test_bad_inputs_get_errors_and_the_connection_keeps_working(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        await w.ok("open", session="bad")
        cases: list[tuple[dict | str, str]] = [
            ("{not json", "bad_json"),
            ("[1, 2]", "bad_json"),
            ({"id": 7}, "bad_field"),
            ({"type": "dance", "id": 8}, "unknown_type"),
            ({"type": "stats", "id": {"x": 1}}, "bad_field"),
            ({"type": "push", "id": 9}, "bad_field"),
            ({"type": "push", "id": 10, "session": 5, "lines": []}, "bad_field"),
            ({"type": "push", "id": 11, "session": "a/b", "lines": []}, "bad_field"),
            ({"type": "push", "id": 12, "session": "bad", "lines": "one line"}, "bad_field"),
            ({"type": "push", "id": 13, "session": "bad", "lines": [1, 2]}, "bad_field"),
            ({"type": "push", "id": 14, "session": "bad", "lines": ["a\nb"]}, "bad_field"),
            ({"type": "push", "id": 15, "session": "nope", "lines": ["x"]}, "unknown_session"),
            ({"type": "ask", "id": 16, "session": "bad", "question": "   "}, "bad_field"),
            ({"type": "ask", "id": 17, "session": "bad", "question": "q", "max_tokens": 0}, "bad_field"),
            ({"type": "ask", "id": 18, "session": "bad", "question": "q", "max_tokens": True}, "bad_field"),
            ({"type": "ask", "id": 19, "session": "bad", "question": "q", "min_version": 99}, "bad_field"),
            ({"type": "ask", "id": 20, "session": "nope", "question": "q"}, "unknown_session"),
            ({"type": "open", "id": 21, "session": "bad"}, "session_exists"),
            ({"type": "open", "id": 22, "session": "huge", "max_context": 1 << 20}, "capacity"),
            ({"type": "subscribe", "id": 23, "session": "nope"}, "unknown_session"),
            ({"type": "unsubscribe", "id": 24, "session": "nope"}, "unknown_session"),
            ({"type": "close", "id": 25, "session": "nope"}, "unknown_session"),
            ({"type": "register", "id": 26, "session": "bad", "question": "text"}, "bad_field"),
            ({"type": "open", "id": 27, "session": "x", "system": 3}, "bad_field"),
        ]
        for message, code in cases:
            await w.send(message)
            reply = await w.reply()
            assert error_code(reply) == code, (message, reply)
            if isinstance(message, dict) and "id" in message and not isinstance(message["id"], dict):
                assert reply["id"] == message["id"]
        # over the soft limit: an error reply, and the connection lives on
        big = json.dumps({"type": "push", "id": 30, "session": "bad", "lines": ["x" * 300]})
        await w.send(big)
        reply = await w.reply()
        assert error_code(reply) == "too_large" and reply["id"] == 30  # the id read from the message's head
        assert (await w.ok("push", session="bad", lines=LINES[:2]))["data_version"] == 1
        await w.ok("close", session="bad")
        # over the hard limit websockets itself closes with 1009 (message too big)
        await w.send("x" * 2000)
        with pytest.raises(ConnectionClosed) as closed:
            await w.reply()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # the server and engine are fine: a new connection works
        w2 = await Wire.connect(server)
        assert (await w2.ok("stats"))["type"] == "stats"
        await w2.close()
        assert server.metrics.errors.labels("bad_json")._value.get() == 2

    run(scenario, engine, max_message_bytes=256, hard_max_bytes=1024)


TENANTS = Tenants({"tok-a": Tenant("alice"), "tok-b": Tenant("bob"), "tok-ro": Tenant("alice", read_only=True)})


def test_auth_and_tenant_isolation(engine):
    async def scenario(server):
        anon = await Wire.connect(server)
        assert error_code(await anon.req("stats")) == "unauthorized"
        assert error_code(await anon.req("open", session="x")) == "unauthorized"
        assert error_code(await anon.req("hello", token="wrong")) == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            await anon.reply()
        assert closed.value.rcvd.code == 1008

        silent = await Wire.connect(server)  # never says hello: closed once hello_timeout_s passes
        with pytest.raises(ConnectionClosed) as closed:
            await silent.reply()
        assert closed.value.rcvd.code == 1008 and "no hello" in closed.value.rcvd.reason

        alice, bob, audit = [await Wire.connect(server) for _ in range(3)]
        assert (await alice.ok("hello", token="tok-a"))["tenant"] == "alice"
        assert (await bob.ok("hello", token="tok-b"))["tenant"] == "bob"
        assert (await audit.ok("hello", token="tok-ro"))["read_only"] is True
        await alice.ok("open", session="btc")
        await alice.ok("push", session="btc", lines=LINES[:3])
        for type, fields in (("push", {"lines": ["x"]}), ("ask", {"question": "q"}), ("subscribe", {}),
                             ("unsubscribe", {}), ("close", {})):
            assert error_code(await bob.req(type, session="btc", **fields)) == "unknown_session", type
        assert (await bob.ok("stats"))["sessions"] == []
        # bob's own "btc" is another session entirely
        await bob.ok("open", session="btc")
        assert (await bob.ok("push", session="btc", lines=LINES[:1]))["data_version"] == 1
        assert {"alice/btc", "bob/btc"} <= set(engine.sessions)
        # read-only: may ask and watch alice's sessions, never change them
        assert error_code(await audit.req("push", session="btc", lines=["x"])) == "forbidden"
        assert error_code(await audit.req("close", session="btc")) == "forbidden"
        answer = await audit.ok("ask", session="btc", question="Up?", max_tokens=1, min_version=1)
        assert answer["session"] == "btc" and answer["data_version"] == 1
        assert error_code(await alice.req("hello", token="tok-b")) == "forbidden"
        # an engine error message names the client's session, never the namespaced one
        reply = await bob.req("open", session="btc")
        assert error_code(reply) == "session_exists" and "bob/" not in reply["message"]
        health = json.loads((await asyncio.to_thread(_get, server, "/health"))[0])
        assert "queue_depths" not in health  # health is public: no tenant's names in it
        await alice.ok("close", session="btc")
        await bob.ok("close", session="btc")
        for w in (alice, bob, audit):
            await w.close()

    run(scenario, engine, TENANTS, hello_timeout_s=0.3)


def test_no_tokens_means_loopback_only(engine):
    async def scenario():
        with pytest.raises(ValueError, match="without tokens"):
            await StreamServer(engine, Tenants({}), ServerConfig(host="0.0.0.0", port=0)).start()

    asyncio.run(scenario())


def test_token_sources(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[tokens]\n"t1" = "alice"\n"t2" = { tenant = "bob", read_only = true }\n')
    tenants = Tenants.load(path, env="t3=carol")
    assert tenants.authenticate("t2") == Tenant("bob", True)
    assert tenants.authenticate("t3") == Tenant("carol") and tenants.authenticate("t4") is None
    assert tenants.names == ["alice", "bob", "carol"]
    assert not Tenants.load(env="").auth
    for env, match in (("t1", "token=tenant"), ("t1=a/b", "tenant"), ("=alice", "token")):
        with pytest.raises(TokenConfigError, match=match):
            Tenants.load(env=env)
    path.write_text('[tokens]\n"t1" = 3\n')
    with pytest.raises(TokenConfigError, match="tokens.t1"):
        Tenants.load(path, env="")


def test_slow_consumer_is_cut_without_stalling_others(engine):
    async def scenario(server):
        fast = await Wire.connect(server)
        await fast.ok("open", session="slowfast")
        # A reader that never reads, with small buffers so backpressure builds quickly.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        slow = await connect(server.url, sock=sock, max_queue=1)
        request = json.dumps({"type": "stats", "id": 1})
        sent = 0
        while server.metrics.slow_disconnects._value.get() == 0 and sent < 200_000:
            await slow.send(request)
            sent += 1
            if sent % 100 == 0:
                ack = await fast.ok("push", session="slowfast", lines=LINES[:1])  # the fast client is served
                assert ack["session"] == "slowfast"
        assert server.metrics.slow_disconnects._value.get() == 1
        # the fast client keeps its normal service, questions included
        answer = await fast.ok("ask", session="slowfast", question="Up?", max_tokens=1)
        assert answer["type"] == "answer"
        # the slow one, once it reads, finds a close frame that says why
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await slow.recv()
        assert closed.value.rcvd.code == 1013 and "too slowly" in closed.value.rcvd.reason
        await fast.ok("close", session="slowfast")
        await fast.close()

    run(scenario, engine, max_queue=32)


def _get(server: StreamServer, path: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as response:
        assert response.status == 200
        return response.read(), response.headers["Content-Type"]


def test_health_and_metrics_over_http(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        await w.ok("open", session="hm")
        await w.ok("push", session="hm", lines=LINES[:3])
        await w.ok("ask", session="hm", question="Up?", max_tokens=1, min_version=1)
        await w.req("dance")
        body, content_type = await asyncio.to_thread(_get, server, "/health")
        health = json.loads(body)
        assert content_type == "application/json"
        assert health["status"] == "ok" and health["model"] == "tiny" and health["connections"] == 1
        assert health["queue_depths"]["hm"] == 0 and health["sessions"] >= 1
        body, content_type = await asyncio.to_thread(_get, server, "/metrics")
        text = body.decode()
        assert content_type.startswith("text/plain; version=0.0.4")
        assert "streamllm_connections 1.0" in text
        assert 'streamllm_answers_total{path="cold"} 1.0' in text
        assert 'streamllm_errors_total{code="unknown_type"} 1.0' in text
        assert "streamllm_engine_sessions " in text and "streamllm_ask_seconds_bucket" in text
        await w.ok("close", session="hm")
        await w.close()

    run(scenario, engine)


def test_health_is_degraded_while_a_session_waits_at_its_budget(tiny_model):
    # No room for a compaction copy (admission keeps it, so the test holds every free cell, as a
    # leak would): the session fills its budget and its pushes wait.
    from streamllm.engine.kv import BlockTable

    with Engine(tiny_model, EngineConfig(max_cells=512, max_context=256, branch_cells=64)) as engine:
        engine.open_session("s")
        held = BlockTable()
        m = engine.store.manager
        engine.call(lambda core: m.reserve(held, m.num_free_blocks * m.block_size))
        for i in range(40):
            engine.push("s", [f"09:{i:02d} 100.{i} +1 v2"])
        deadline = time.monotonic() + 30
        while engine.stats()["sessions_at_budget"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = StreamServer(engine).health()
        assert health["status"] == "degraded" and health["sessions_at_budget"] == 1
        assert any("at their context budget" in r for r in health["reasons"])
        assert health["queue_depths"]["s"] == engine.backlog("s") > 0
        while engine.stats()["sessions_stuck"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # nothing to preempt: the core gives up on a copy and says so
        health = StreamServer(engine).health()
        assert health["sessions_stuck"] == 1 and any("no free cells" in r for r in health["reasons"])
        engine.call(lambda core: m.free(held))
        assert engine.wait_idle(timeout=30)  # the cells came back: every push applied
        assert StreamServer(engine).health()["sessions_stuck"] == 0


def test_health_fails_with_503_once_the_engine_has_stopped(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8), dtype="float32")
    engine.open_session("s", max_context=512)
    engine.shutdown()  # what a core killed by an internal error looks like from outside: not alive

    async def scenario(server):
        try:
            await asyncio.to_thread(_get, server, "/health")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            health = json.loads(exc.read())
        else:
            raise AssertionError("a stopped engine answered /health with 200")
        assert health["status"] == "failing" and any("engine stopped" in r for r in health["reasons"])

    run(scenario, engine)
