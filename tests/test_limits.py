"""Bounded work per request (#44): one set of question limits on every face, questions that end
with their client, default quotas, and the server-wide connection caps.

- config/limits.py's bounds refuse the same values, with the same words, in `parse_question`
  (and config files), a websocket `ask` / `register` (`too_large`) and the HTTP API (400 `too_large`);
- a websocket, a completion or a streamed completion whose client goes away cancels its question:
  the engine never answers it and its cells come back (public `stats()`);
- `asks_in_flight` counts a tenant's questions over all its connections, so reconnecting resets nothing;
- tokens without a "*" table mean DEFAULT_QUOTA; the connection caps refuse handshakes with HTTP 503.

The engine's core thread is parked between steps (`core_held`) where a test needs a question to stay
in flight: its commands queue up, so what the test checks never races the tiny model's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamllm.config import ConfigError, limits, load_config, parse_question
from streamllm.config.limits import LimitError
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.recovery import recover
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.quotas import DEFAULT_QUOTA, NO_AUTH_QUOTA, Quota, QuotaBook
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants

LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2 n{i + 3}" for i in range(30)]
TIMEOUT = 20
TOKENS = {"tok-a": Tenant("alice"), "tok-b": Tenant("bob")}


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=1024,
                                          scheduler=SchedulerConfig(chunk_tokens=64)))
    yield eng
    eng.shutdown()


def run(scenario, engine, tenants=None, **config) -> None:
    async def main():
        async with StreamServer(engine, tenants, ServerConfig(port=0, **config)) as server:
            await asyncio.wait_for(scenario(server), TIMEOUT)

    asyncio.run(main())


class Wire:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0

    @classmethod
    async def connect(cls, server: StreamServer, token: str | None = None) -> Wire:
        wire = cls(await connect(server.url))
        if token is not None:
            assert (await wire.req("hello", token=token))["type"] == "welcome"
        return wire

    async def send(self, type: str, **fields) -> int:
        self.next_id += 1
        await self.ws.send(json.dumps({"type": type, "id": self.next_id, **fields}))
        return self.next_id

    async def reply(self, req_id: int) -> dict:
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == req_id:
                return message

    async def req(self, type: str, **fields) -> dict:
        return await self.reply(await self.send(type, **fields))

    async def ok(self, type: str, **fields) -> dict:
        reply = await self.req(type, **fields)
        assert reply["type"] != "error", reply
        return reply


@contextlib.contextmanager
def core_held(engine: Engine):
    """Park the core thread between two steps (a test-only `call`) until the block ends: commands sent
    meanwhile (asks, cancels) wait in its inbox, in order."""
    parked, go = threading.Event(), threading.Event()

    def park(_core) -> None:
        parked.set()
        go.wait(TIMEOUT)

    thread = threading.Thread(target=engine.call, args=(park,), daemon=True)
    thread.start()
    assert parked.wait(TIMEOUT), "the core thread did not park"
    try:
        yield
    finally:
        go.set()
        thread.join(TIMEOUT)


async def until(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


def http(server: StreamServer, path: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- one set of limits, three faces ----------------------------------------------------------------
OVER = [  # (ask field, value over its limit, the limits.py check that words the refusal)
    ("question", "x" * (limits.MAX_QUESTION_CHARS + 1), limits.text_problem),
    ("max_tokens", limits.MAX_ASK_TOKENS + 1, limits.max_tokens_problem),
    ("stop", ["."] * (limits.MAX_STOPS + 1), limits.stops_problem),
    ("stop", ["y" * (limits.MAX_STOP_CHARS + 1)], limits.stops_problem),
]


def test_parse_question_and_config_files_refuse_what_is_over_a_limit(tmp_path):
    with pytest.raises(LimitError) as err:
        parse_question({"id": "q", "text": "x" * 200_000, "max_tokens": 10**12}, source="register")
    assert err.value.key_path == "question.text"
    assert err.value.problem == limits.text_problem("x" * 200_000)
    with pytest.raises(LimitError) as err:
        parse_question({"id": "q", "text": "Up?", "max_tokens": 10**12}, source="register")
    assert (err.value.key_path, err.value.problem) == ("question.max_tokens", limits.max_tokens_problem(10**12))
    at_limit = parse_question({"id": "q", "text": "x" * limits.MAX_QUESTION_CHARS,
                               "max_tokens": limits.MAX_ASK_TOKENS})
    assert at_limit.max_tokens == limits.MAX_ASK_TOKENS
    path = tmp_path / "q.toml"
    path.write_text(f'[[sessions]]\nname = "btc"\ninstrument = "BTC"\n[[sessions.questions]]\nid = "q"\n'
                    f'text = "{"y" * 5000}"\n')
    with pytest.raises(ConfigError) as err:  # a LimitError is a ConfigError: the file and the key
        load_config(path)
    assert str(path) in str(err.value) and "sessions[0].questions[0].text" in str(err.value)
    assert "over the limit of 4096" in str(err.value)


def test_questions_accepted_before_the_limits_recover_capped_not_refused(tiny_model, tmp_path):
    """An ingest log (or snapshot) may hold a question registered before the limits: recovery keeps it,
    its max_tokens capped at the limit, rather than refusing the session."""
    long_text = {"id": "long", "text": "w" * 5000}
    assert parse_question(long_text, source="ingest log", stored=True).text == long_text["text"]
    old = {"id": "long", "text": "Up or down?", "max_tokens": 10**6}
    assert parse_question(old, source="ingest log", stored=True).max_tokens == limits.MAX_ASK_TOKENS
    config = EngineConfig(max_cells=4096, block_size=8, max_context=1024)
    first = Engine(tiny_model, config)
    try:
        recover(first, IngestLog(tmp_path))
        first.open_session("s", "You watch bars.")
        first.ingest_log.record_register("s", old)  # as an older server logged it
    finally:
        first.shutdown()
    again = Engine(tiny_model, config)
    try:
        report = recover(again, IngestLog(tmp_path))
        assert not report.failed
        assert [(q.id, q.max_tokens) for q in again.standing_questions("s")] == [("long", limits.MAX_ASK_TOKENS)]
    finally:
        again.shutdown()


def test_websocket_and_http_refuse_the_same_values_the_same_way(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        await w.ok("open", session="lim")
        for field, value, check in OVER:
            reply = await w.req("ask", session="lim", **{"question": "Up?", field: value})
            assert reply["type"] == "error" and reply["code"] == "too_large", (field, reply)
            assert f"field {field!r}" in reply["message"] and check(value) in reply["message"], reply
            body = {"model": "tiny", "prompt": "Up?", "session": "lim",
                    **{("prompt" if field == "question" else field): value}}
            status, got = await asyncio.to_thread(http, server, "/v1/completions", body)
            param = "prompt" if field == "question" else field
            assert (status, got["error"]["code"], got["error"]["param"]) == (400, "too_large", param), got
            assert check(value) in got["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "z" * 5000}]}
        status, got = await asyncio.to_thread(http, server, "/v1/chat/completions", chat)
        assert (status, got["error"]["param"]) == (400, "messages[0].content"), got
        registered = await w.req("register", session="lim", question={"id": "big", "text": "x" * 5000})
        assert registered["code"] == "too_large" and "question.text" in registered["message"], registered
        # at the limits: accepted
        stops = ["z" * limits.MAX_STOP_CHARS] * limits.MAX_STOPS
        answer = await w.ok("ask", session="lim", question="Up?", max_tokens=2, stop=stops)
        assert answer["type"] == "answer"
        status, got = await asyncio.to_thread(http, server, "/v1/completions", {
            "model": "tiny", "prompt": "Up?", "session": "lim", "max_tokens": 2, "stop": stops})
        assert status == 200, got
        await w.ok("close", session="lim")

    run(scenario, engine)


# -- a client that goes away takes its question with it ---------------------------------------------
def _settled(engine: Engine) -> dict:
    assert engine.wait_idle(TIMEOUT)
    return engine.stats()


def _nothing_answered(before: dict, after: dict) -> None:
    assert after["questions_answered"] == before["questions_answered"], "the abandoned question was answered"
    assert after["cells_free"] == before["cells_free"], "the abandoned question kept cells"
    assert after["questions_running"] == after["questions_waiting"] == 0


def test_a_websocket_disconnect_cancels_its_questions_in_the_engine(engine):
    async def scenario(server):
        w = await Wire.connect(server)
        await w.ok("open", session="gone")
        await w.ok("push", session="gone", lines=LINES[:5])
        before = await asyncio.to_thread(_settled, engine)
        with core_held(engine):
            await w.send("ask", session="gone", question="Where does it go next?", max_tokens=200)
            conn = next(iter(server.conns))
            await until(lambda: conn.asks, "the question is in flight")
            await w.ws.close()
            await until(lambda: not server.conns, "the server dropped the connection")
        _nothing_answered(before, await asyncio.to_thread(_settled, engine))
        assert server.quotas.asks == {}
        await asyncio.to_thread(engine.close_session, "local/gone")

    run(scenario, engine)


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_completion_whose_client_leaves_is_cancelled(engine, stream):
    async def scenario(server):
        before = await asyncio.to_thread(_settled, engine)
        body = json.dumps({"model": "tiny", "prompt": "Where next?", "session": "leave", "max_tokens": 200,
                           "stream": stream}).encode()
        with core_held(engine):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (server.port, len(body), body))
            await writer.drain()
            await until(lambda: server.quotas.asks.get("local"), "the completion is in flight")
            if stream:
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.close()
            await until(lambda: not server.quotas.asks, "the server let the completion go")
        _nothing_answered(before, await asyncio.to_thread(_settled, engine))

    engine.open_session("local/leave", tenant="local")
    try:
        engine.push("local/leave", LINES[:5])
        run(scenario, engine)
    finally:
        engine.close_session("local/leave")


def test_a_cold_ask_is_tokenized_off_the_loop_and_a_standing_id_answers_inline(engine):
    """While the tokenizer is busy (its lock held), a cold ask waits in a worker thread: the loop still
    serves every other request. A standing question asked by id needs no tokenizer at all."""
    async def scenario(server):
        w = await Wire.connect(server)
        other = await Wire.connect(server)
        await w.ok("open", session="tok")
        question = {"id": "dir", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0.0}
        await w.ok("register", session="tok", question=question)
        await w.ok("push", session="tok", lines=LINES[:3])
        await asyncio.to_thread(engine.wait_idle, TIMEOUT)
        released = threading.Event()
        release = threading.Timer(TIMEOUT / 4, lambda: (released.set(), engine.layout.lock.release()))
        engine.layout.lock.acquire()
        release.start()
        try:
            cold = await w.send("ask", session="tok", question="A question nobody asked before, 7f3a?",
                                max_tokens=1)
            assert (await other.ok("stats"))["type"] == "stats"  # the loop is free
            fast = await other.ok("ask", session="tok", question="dir")  # the fast path: no tokenizer
            assert fast["path"] == "fast" and not released.is_set()
        finally:
            release.cancel()
            if not released.is_set():
                engine.layout.lock.release()
        assert (await w.reply(cold))["type"] == "answer"
        await w.ok("close", session="tok")

    run(scenario, engine)


def test_a_question_past_the_engines_deadline_is_timeout_on_both_faces(tiny_model):
    """The engine drops an ask past its deadline (AskTimeout): the websocket says `timeout`, HTTP 504."""
    deadline = 0.2
    eng = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512, ask_timeout_s=deadline))

    async def scenario(server):
        w = await Wire.connect(server)
        await w.ok("open", session="late")
        with core_held(eng):  # nothing runs: the ask can only wait past its deadline
            asked = await w.send("ask", session="late", question="Where next?", max_tokens=2)
            await asyncio.sleep(deadline * 2)
        reply = await w.reply(asked)
        assert reply["code"] == "timeout" and "'late'" in reply["message"] and "local/" not in reply["message"]
        body = {"model": "tiny", "prompt": "Where next?", "session": "late", "max_tokens": 2}
        with core_held(eng):
            pending = asyncio.ensure_future(asyncio.to_thread(http, server, "/v1/completions", body))
            await until(lambda: server.quotas.asks.get("local"), "the completion is in flight")
            await asyncio.sleep(deadline * 2)
        status, got = await pending
        assert (status, got["error"]["code"]) == (504, "timeout"), got
        # the counters are the core's snapshot, published after the loop turn that dropped the ask settled it
        await until(lambda: eng.stats()["questions_timed_out"] >= 2, "the core published its counters")
        assert eng.stats()["questions_timed_out"] == 2
        await w.ok("close", session="late")

    try:
        run(scenario, eng)
    finally:
        eng.shutdown()


# -- quotas ----------------------------------------------------------------------------------------
def test_default_quota_with_tokens_and_a_tenants_own_table_wins(engine):
    assert QuotaBook({}, engine, auth=True).quota("bob") == DEFAULT_QUOTA
    assert all(value is not None for value in DEFAULT_QUOTA.limits().values())
    assert len(DEFAULT_QUOTA.limits()) == 5  # nothing is unlimited by default
    star = Quota(sessions=2)
    assert QuotaBook({"*": star}, engine).quota("bob") == star
    own = QuotaBook({"alice": Quota(sessions=9)}, engine)
    assert own.quota("alice") == Quota(sessions=9) and own.quota("bob") == DEFAULT_QUOTA
    assert QuotaBook({}, engine, auth=False).quota("local") == NO_AUTH_QUOTA
    assert NO_AUTH_QUOTA.asks_in_flight == DEFAULT_QUOTA.asks_in_flight


def test_asks_in_flight_count_over_all_of_a_tenants_connections(engine):
    async def scenario(server):
        first = await Wire.connect(server, "tok-a")
        await first.ok("open", session="busy")
        second = await Wire.connect(server, "tok-a")
        bob = await Wire.connect(server, "tok-b")
        await bob.ok("open", session="busy")
        with core_held(engine):
            await first.send("ask", session="busy", question="Where next?", max_tokens=2)
            await until(lambda: server.quotas.asks.get("alice") == 1, "alice's question is in flight")
            refused = await second.req("ask", session="busy", question="And then?", max_tokens=2)
            assert refused["code"] == "quota" and "asks_in_flight = 1" in refused["message"], refused
            bobs = await bob.send("ask", session="busy", question="Where next?", max_tokens=2)  # not alice's
            await first.ws.close()  # its question is cancelled, and counts no more
            await until(lambda: server.quotas.asks.get("alice") is None, "alice's question is let go")
            again = await second.send("ask", session="busy", question="And then?", max_tokens=2)
        assert (await second.reply(again))["type"] == "answer"
        assert (await bob.reply(bobs))["type"] == "answer"
        await second.ok("close", session="busy")
        await bob.ok("close", session="busy")

    run(scenario, engine, Tenants(TOKENS, {"alice": Quota(asks_in_flight=1)}))


# -- server-wide connection caps ---------------------------------------------------------------------
def test_connection_caps_refuse_handshakes_and_http_with_503(engine):
    async def refused(server, **kw) -> int:
        with pytest.raises(InvalidStatus) as err:
            await connect(server.url, **kw)
        return err.value.response.status_code

    bearer = {"additional_headers": {"Authorization": "Bearer tok-b"}}

    async def scenario(server):
        stranger = Wire(await connect(server.url))  # not authenticated yet: the one pre-auth slot
        assert await refused(server) == 503
        known = Wire(await connect(server.url, **bearer))  # a bearer header is not pre-auth
        assert (await stranger.req("hello", token="tok-a"))["type"] == "welcome"  # frees the pre-auth slot
        late = Wire(await connect(server.url))
        assert (server.caps.open, server.caps.unauthenticated) == (3, 1)
        assert await refused(server, **bearer) == 503  # three open: the total cap
        status, body = await asyncio.to_thread(http, server, "/v1/completions",
                                               {"model": "tiny", "prompt": "Up?", "max_tokens": 1}, "tok-b")
        assert (status, body["error"]["code"]) == (503, "capacity") and "max_connections = 3" in body["error"]["message"]
        await known.ws.close()
        await until(lambda: server.caps.open == 2, "the server dropped a connection")
        again = Wire(await connect(server.url, **bearer))
        assert (await again.ok("stats"))["type"] == "stats"
        for wire in (stranger, late, again):
            await wire.ws.close()
        await until(lambda: server.caps.open == server.caps.unauthenticated == 0, "every slot is released")

    run(scenario, engine, Tenants(TOKENS), max_connections=3, max_preauth_connections=1)
