"""The HTTP faces of the service over real loopback: the OpenAI-compatible API (with the
official `openai` client), its errors, the SSE stream of standing answers, websocket token
streaming and bearer tokens. One server (tiny engine) on its own loop in a thread."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamllm.client.client import AsyncClient, ServiceError
from streamllm.config import parse_question
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants

LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2 n{i + 3}" for i in range(40)]
TENANTS = Tenants({"tok-a": Tenant("alice"), "tok-ro": Tenant("alice", read_only=True), "tok-b": Tenant("bob")})
SURE = {"id": "sure", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0.0}
NEVER = {"id": "never", "text": "Higher or lower?", "choices": ["higher", "lower"], "threshold": 1e9}


@pytest.fixture(scope="module")
def served(tiny_model, serve_in_thread, tmp_path_factory):
    # as `serve --spill-dir` builds it: idle sessions can go to disk
    engine = ResidentEngine(Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=1024, scheduler=SchedulerConfig(chunk_tokens=64))),
                            tmp_path_factory.mktemp("spill"))
    engine.open_session("alice/btc", tenant="alice")
    engine.push("alice/btc", LINES[:6])
    for q in (SURE, NEVER):
        engine.register("alice/btc", parse_question(q, source="test", key_path="question"))
    try:
        with serve_in_thread(StreamServer(engine, TENANTS, ServerConfig(port=0, max_message_bytes=4096))) as server:
            _wait_standing(engine, "alice/btc", 1)
            yield server
    finally:
        engine.shutdown()


def _wait_standing(engine: ResidentEngine, name: str, version: int) -> None:
    assert engine.wait_idle(30)
    answers = {a.question_id: a for a in engine.standing(name)}
    assert {"sure", "never"} <= set(answers) and all(a.data_version == version for a in answers.values())


def client(served: StreamServer, token: str = "tok-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key=token, max_retries=0, timeout=30)


def http(served: StreamServer, method: str, path: str, body: bytes | dict | None = None,
         token: str | None = "tok-a", headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(served.http_url + path, data=data, method=method, headers=headers or {})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        assert b"Traceback" not in raw
        return exc.code, json.loads(raw)


def test_openai_client_models_chat_and_completions(served):
    c = client(served)
    assert [m.id for m in c.models.list()] == ["tiny"]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Up?"}], max_tokens=4,
                                     extra_body={"session": "btc", "min_version": 1})
    ext = chat.model_extra["streamllm"]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert ext["path"] == "cold" and ext["session"] == "btc" and ext["data_version"] == 1
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 0
    # the same question over the websocket protocol: the same greedy answer
    ws_answer = asyncio.run(_ws_ask(served, "Up?", max_tokens=4, min_version=1))
    assert chat.choices[0].message.content == ws_answer["text"]
    assert chat.choices[0].finish_reason == ws_answer["finish_reason"]
    # a standing question by id: the fast path (gate threshold 0), no model call
    fast = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sure"}],
                                     extra_body={"session": "btc", "question_id": "sure"})
    assert fast.model_extra["streamllm"]["path"] == "fast" and fast.choices[0].message.content in ("up", "down")
    assert fast.model_extra["streamllm"]["tokens_computed"] == 0 and fast.usage.prompt_tokens == 0
    entry = c.completions.create(model="tiny", prompt="never", extra_body={"session": "btc", "question_id": "never"})
    assert entry.model_extra["streamllm"]["path"] == "entry" and entry.model_extra["streamllm"]["confidence"] < 1e9
    comp = c.completions.create(model="tiny", prompt="Up?", max_tokens=4, extra_body={"session": "btc"})
    assert comp.object == "text_completion" and comp.choices[0].text == ws_answer["text"]


def test_streamed_chunks_add_up_to_the_whole_answer(served):
    c = client(served)
    whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Describe it."}],
                                      max_tokens=6, extra_body={"session": "btc", "min_version": 1})
    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe it."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"session": "btc", "min_version": 1}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    content_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content_chunks) >= 2  # token by token, not one blob
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
    assert final.model_extra["streamllm"]["path"] == "cold" and chunks[-1].usage.completion_tokens >= 1
    # completions stream; the fast path streams its answer as one chunk
    fast = list(c.completions.create(model="tiny", prompt="sure", stream=True,
                                     extra_body={"session": "btc", "question_id": "sure"}))
    assert "".join(ch.choices[0].text for ch in fast) in ("up", "down")
    assert fast[-1].model_extra["streamllm"]["path"] == "fast"


def test_stateless_request_uses_a_temporary_session(served):
    c = client(served)
    before = set(served.engine.engine.sessions)
    out = c.chat.completions.create(model="tiny", max_tokens=3, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello?"}])
    assert out.model_extra["streamllm"]["path"] == "cold" and out.model_extra["streamllm"]["session"] is None
    streamed = list(c.completions.create(model="tiny", prompt="Hello?", max_tokens=3, stream=True))
    assert streamed[-1].model_extra["streamllm"]["data_version"] == 0
    assert set(served.engine.engine.sessions) == before  # the temporary sessions are closed again


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    (b"{not json", 400, None, "bad_json"),
    (b"[1, 2]", 400, None, "bad_json"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "bad_field"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages", "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "bad_field"),
    ({"model": "tiny", "messages": [{"role": "system", "content": "x"}]}, 400, "messages", "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}, 400, "max_tokens",
     "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens",
     "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream",
     "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "session": "a/b"}, 400, "session",
     "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "session": "nope"}, 404, None,
     "unknown_session"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "question_id": "sure"}, 400,
     "question_id", "bad_field"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "session": "btc", "question_id": "what"},
     404, "question_id", "unknown_question"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, 413, None, "too_large"),
])
def test_bad_requests_get_openai_shaped_errors(served, body, status, param, code):
    got, reply = http(served, "POST", "/v1/chat/completions", body)
    error = reply["error"]
    assert (got, error["param"], error["code"]) == (status, param, code), reply
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")


def test_auth_errors_and_unknown_endpoints(served):
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for token in (None, "wrong"):
        got, reply = http(served, "POST", "/v1/chat/completions", ask, token=token)
        assert got == 401 and reply["error"]["type"] == "authentication_error"
    # read-only: may ask its tenant's sessions, may not open one (a stateless request would)
    got, reply = http(served, "POST", "/v1/chat/completions", ask, token="tok-ro")
    assert got == 403 and reply["error"]["type"] == "permission_error"
    got, reply = http(served, "POST", "/v1/chat/completions", {**ask, "session": "btc"}, token="tok-ro")
    assert got == 200 and reply["streamllm"]["session"] == "btc"
    # another tenant's session looks exactly like a missing one
    got, reply = http(served, "POST", "/v1/chat/completions", {**ask, "session": "btc"}, token="tok-b")
    assert got == 404 and reply["error"]["code"] == "unknown_session"
    assert http(served, "GET", "/v1/nothing")[0] == 404
    got, reply = http(served, "GET", "/v1/chat/completions")
    assert got == 405 and reply["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(served).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        client(served, "wrong").models.list()


def test_sse_events_match_the_websocket_subscription(served):
    engine = served.engine

    async def scenario() -> None:
        async with await AsyncClient.connect(served.url, token="tok-a") as ws:
            snapshot = await ws.subscribe("btc")
            events = await asyncio.to_thread(_read_sse, served, "/v1/sessions/btc/events", 2,
                                             lambda: engine.push("alice/btc", LINES[6:8]))
            kind, first = events[0]
            assert kind == "snapshot" and first["session"] == "btc"
            assert first["standing"] == snapshot["standing"] and first["data_version"] == snapshot["data_version"]
            kind, data = events[1]
            assert kind == "data" and data == {"type": "data", "session": "btc", "data_version": 2}
            async for event in ws.events():  # the websocket saw the same data event
                if event["type"] == "data":
                    assert event == data
                    break

    asyncio.run(asyncio.wait_for(scenario(), 30))
    _wait_standing(engine, "alice/btc", 2)
    assert http(served, "GET", "/v1/sessions/nope/events")[0] == 404
    assert http(served, "GET", "/v1/sessions/btc/events", token=None)[0] == 401
    got, listing = http(served, "GET", "/v1/sessions")
    assert got == 200 and [s["name"] for s in listing["data"]] == ["btc"]
    assert {q["id"] for q in listing["data"][0]["questions"]} == {"sure", "never"}


def _read_sse(served: StreamServer, path: str, count: int, after_first) -> list[tuple[str, dict]]:
    req = urllib.request.Request(served.http_url + path, headers={"Authorization": "Bearer tok-a"})
    out: list[tuple[str, dict]] = []
    with urllib.request.urlopen(req, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        kind = None
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                out.append((kind, json.loads(line[6:])))
                if len(out) == 1:
                    after_first()
                if len(out) == count:
                    return out
    return out


async def _ws_ask(served: StreamServer, question: str, **kw) -> dict:
    async with await AsyncClient.connect(served.url, token="tok-a") as c:
        return await c.ask("btc", question, **kw)


def test_websocket_token_streaming_and_bearer_at_connect(served):
    async def scenario() -> None:
        # Authorization: Bearer at connect stands in for hello
        async with connect(served.url, additional_headers={"Authorization": "Bearer tok-a"}) as ws:
            await ws.send(json.dumps({"type": "stats", "id": 1}))
            stats = json.loads(await ws.recv())
            assert stats["type"] == "stats" and stats["tenant"] == "alice"
        with pytest.raises(InvalidStatus) as refused:
            await connect(served.url, additional_headers={"Authorization": "Bearer wrong"})
        assert refused.value.response.status_code == 401
        async with connect(served.url, additional_headers={"Authorization": "Bearer tok-ro"}) as ws:
            await ws.send(json.dumps({"type": "push", "id": 1, "session": "btc", "lines": ["x"]}))
            assert json.loads(await ws.recv())["code"] == "forbidden"

        async with await AsyncClient.connect(served.url, token="tok-a") as c:
            whole = await c.ask("btc", "What now?", max_tokens=6)
            messages = [m async for m in c.ask_stream("btc", "What now?", max_tokens=6,
                                                      min_version=whole["data_version"])]
            tokens, answer = messages[:-1], messages[-1]
            assert answer["type"] == "answer" and all(m["type"] == "token" for m in tokens) and len(tokens) >= 2
            assert "".join(m["text"] for m in tokens) == answer["text"] == whole["text"]
            fast = [m async for m in c.ask_stream("btc", "sure")]
            assert [m["type"] for m in fast] == ["token", "answer"] and fast[0]["text"] == fast[1]["text"]
            with pytest.raises(ServiceError, match="unknown_session"):
                _ = [m async for m in c.ask_stream("nope", "x")]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_blocking_client_and_ask_cli_stream(served, capsys):
    from streamllm.cli import ask as client_cli
    from streamllm.client.client import Client

    with Client(served.url, token="tok-a") as c:
        messages = list(c.ask_stream("btc", "What now?", max_tokens=5))
    assert messages[-1]["type"] == "answer" and len(messages) >= 3
    assert "".join(m["text"] for m in messages[:-1]) == messages[-1]["text"]
    assert client_cli.main(["btc", "What now?", "--url", served.url, "--token", "tok-a", "--stream",
                                "--max-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == messages[-1]["text"].strip() and "cold path" in out.err


def test_an_evicted_session_is_restored_off_the_loop_on_ask(served):
    engine = served.engine
    engine.open_session("alice/idle", tenant="alice")
    engine.push("alice/idle", LINES[:4])
    assert engine.wait_idle(30)
    engine.evict_session("alice/idle")
    assert "alice/idle" not in engine.engine.sessions
    restored_on: list[str] = []
    original = engine.engine.import_session

    def spy(state, name: str):
        restored_on.append(threading.current_thread().name)
        return original(state, name)

    engine.engine.import_session = spy
    try:
        answer = asyncio.run(asyncio.wait_for(_ws_ask_on(served, "idle", "Up?", max_tokens=2), 30))
    finally:
        del engine.engine.import_session
    assert answer["data_version"] == 1 and "alice/idle" in engine.engine.sessions
    assert restored_on and "streamllm-restore" in restored_on[0]  # a worker thread, not the server's loop
    engine.close_session("alice/idle")


async def _ws_ask_on(served: StreamServer, session: str, question: str, **kw) -> dict:
    async with await AsyncClient.connect(served.url, token="tok-a") as c:
        return await c.ask(session, question, **kw)
