"""The Python client, `streamllm ask` / `watch`, and `streamllm serve` end to end on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamllm.cli import ask as client_cli
from streamllm.client.client import AsyncClient, Client, ServiceError
from streamllm.client.watch import WatchState
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import Tenant, Tenants

ROOT = Path(__file__).resolve().parents[1]
LINES = [f"12:00:{i:02d} 640{i:02d}.5 +1.5 v{i}.2" for i in range(20)]
needs_standing = pytest.mark.skipif(not hasattr(Engine, "register"), reason="engine has no register() yet")


@pytest.fixture(scope="module")
def served(tiny_model, serve_in_thread):
    """A server on its own loop in a thread, so blocking clients can run in the test thread."""
    engine = Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=1024, scheduler=SchedulerConfig(chunk_tokens=64)))
    tenants = Tenants({"tok-a": Tenant("alice")})
    try:
        with serve_in_thread(StreamServer(engine, tenants, ServerConfig(port=0))) as server:
            yield server
    finally:
        engine.shutdown()


@needs_standing
def test_async_client_requests_and_events(served):
    async def scenario():
        async with await AsyncClient.connect(served.url, token="tok-a") as c:
            assert c.welcome["tenant"] == "alice"
            await c.open("ac")
            assert (await c.push("ac", LINES[:3]))["data_version"] == 1
            snapshot = await c.subscribe("ac")
            assert snapshot["standing"] == []
            await c.register("ac", {"id": "dir", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0})
            events = c.events()
            event = await asyncio.wait_for(anext(events), 10)
            while event["type"] != "standing":
                event = await asyncio.wait_for(anext(events), 10)
            assert event["question_id"] == "dir" and event["session"] == "ac"
            # concurrent requests on one connection are matched to their replies by id
            answers = await asyncio.gather(c.ask("ac", "dir"), c.ask("ac", "Anything?", max_tokens=2), c.stats())
            assert answers[0]["path"] == "fast" and answers[1]["path"] == "cold" and answers[2]["type"] == "stats"
            with pytest.raises(ServiceError) as err:
                await c.ask("nope", "q")
            assert err.value.code == "unknown_session"
            await c.unsubscribe("ac")
            await c.unregister("ac", "dir")
            await c.close("ac")

    asyncio.run(scenario())


def test_async_client_auth_failure_and_close(served):
    async def scenario():
        with pytest.raises(ServiceError) as err:
            await AsyncClient.connect(served.url, token="wrong")
        assert err.value.code == "unauthorized"
        c = await AsyncClient.connect(served.url, token="tok-a")
        await c.aclose()
        with pytest.raises(ServiceError) as err:
            await c.stats()
        assert err.value.code == "closed"
        assert [e async for e in c.events()] == []  # the event stream ends with the connection

    asyncio.run(scenario())


def test_sync_client_and_ask_cli(served, capsys):
    with Client(served.url, token="tok-a") as c:
        c.open("sync")
        ack = c.push("sync", LINES[:4])
        answer = c.ask("sync", "Up?", max_tokens=2, min_version=ack["data_version"])
        assert answer["path"] == "cold" and answer["data_version"] == 1
        assert c.welcome["tenant"] == "alice"
        with pytest.raises(ServiceError, match="unknown_session"):
            c.push("other", ["x"])
        code = client_cli.main(["sync", "Up?", "--url", served.url, "--token", "tok-a", "--max-tokens", "2"])
        out = capsys.readouterr()
        assert code == 0 and "cold path" in out.err and "data_version 1" in out.err
        assert "free text" not in out.err
        code = client_cli.main(["sync", "above_vwap", "--url", served.url, "--token", "tok-a", "--max-tokens", "2"])
        out = capsys.readouterr()  # an id the session does not have: answered, with a note saying how
        assert code == 0 and "'above_vwap' is no standing question of session 'sync'" in out.err
        code = client_cli.main(["sync", "Up?", "--url", served.url, "--token", "nope"])
        assert code == 1 and "unauthorized" in capsys.readouterr().err
        c.close_session("sync")


def test_watch_state_table():
    state = WatchState("btc")
    state.snapshot({"data_version": 3, "standing": [
        {"question_id": "trend", "text": "up", "path": "fast", "confidence": 2.5, "data_version": 3,
         "updated_at": 100.0, "threshold": 2.0, "threshold_source": "config"}]})
    state.apply({"type": "data", "session": "btc", "data_version": 4})
    state.apply({"type": "standing", "question_id": "vol", "text": "no", "path": "entry", "confidence": 0.4,
                 "data_version": 4, "updated_at": 101.0, "threshold": None, "threshold_source": "head",
                 "calibration": {
                     "samples": 31, "scored": 40, "precision": 0.97, "coverage": 1.0, "accuracy": 0.968,
                     "threshold": None, "target": 0.9, "confidence": 0.5, "base_rate": 0.62}})
    state.apply({"type": "standing", "question_id": "zz", "text": "The", "path": "gate", "confidence": 0.7,
                 "data_version": 4, "updated_at": 101.0, "calibration": {
                     "samples": 20, "scored": 20, "precision": 1.0, "coverage": 0.9, "accuracy": 0.95,
                     "threshold": 0.5, "target": None, "confidence": None}})
    state.apply({"type": "standing", "question_id": "early", "text": "down", "path": "entry", "confidence": 0.0,
                 "data_version": 4, "updated_at": 101.0, "warming_up": True, "threshold": 0.41,
                 "threshold_source": "auto", "warming_up_reason": "its head reads the last 24 lines; the session has 4 so far"})
    table = state.table(now=102.0)
    cells = {col.header: list(col._cells) for col in table.columns}
    assert cells["question"] == ["early", "trend", "vol", "zz"]
    # a guess before its history is in says so; a push = false free-text question's first token is no answer
    assert cells["answer"] == ["warming up", "up", "no", "ask to decode"]
    assert cells["path"] == ["entry", "fast", "entry", "not pushed"]
    assert cells["confidence"] == ["-", "2.50", "0.40", "-"]
    assert cells["threshold"] == ["0.41 auto", "2.00 config", "closed head", "-"]  # which one, and whose
    assert cells["right (live)"] == ["-", "-", "97% of 31, base 62%", "95% of 20"]
    assert cells["gate"] == ["-", "-", "closed", "90% at 100%"]
    assert "early is warming up: its head reads the last 24 lines; the session has 4 so far" in str(table.caption)
    # "trend" stayed "up" at data_version 4 (events carry changed texts only): not behind until a snapshot says so
    assert cells["data_version"] == ["4", "3", "4", "4"] and cells["age"] == ["1.0s", "2.0s", "1.0s", "1.0s"]
    assert "data_version 4" in str(table.title) and state.stale
    state.snapshot({"data_version": 5, "standing": [
        {"question_id": "trend", "text": "up", "path": "fast", "confidence": 2.5, "data_version": 5, "updated_at": 100.0},
        {"question_id": "vol", "text": "no", "path": "entry", "confidence": 0.4, "data_version": 4, "updated_at": 101.0}]})
    cells = {col.header: list(col._cells) for col in state.table(now=102.0).columns}
    assert cells["data_version"][1:3] == ["5", "4 (behind)"] and not state.stale  # vol's entry lags the data


def test_serve_starts_from_config_and_stops_on_sigterm(tmp_path, monkeypatch):
    """Without tokens, serve makes a local token (as Jupyter does): a 0600 file in the state folder that
    the client finds by the URL's port, printed once in the page's URL; the file goes when it stops."""
    monkeypatch.setenv("STREAMLLM_HOME", str(tmp_path / "home"))  # the subprocess's and this client's
    monkeypatch.delenv("STREAMLLM_TOKEN", raising=False)
    config = tmp_path / "demo.toml"
    config.write_text('[[sessions]]\nname = "btc"\ninstrument = "BTCUSDT"\nfeed = "synthetic"\n'
                      '[sessions.render]\nbar_seconds = 1\n'
                      '[[sessions.questions]]\nid = "trend"\ntext = "Up or down?"\nchoices = ["up", "down"]\n')
    env = {**os.environ, "STREAMLLM_TOKENS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "streamllm.cli", "serve", "--config", str(config), "--model",
                             "tiny", "--port", "0", "--speed", "20", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None
        head = proc.stdout.readline()
        assert head.startswith("streamllm serving tiny"), head + proc.stderr.read()
        url = head.rsplit(" at ", 1)[1].strip()
        summary = "".join(proc.stdout.readline() for _ in range(6))  # dtype, auth, session, registered, page, try
        assert "session btc" in summary and "feed synthetic" in summary
        token_file = tmp_path / "home" / f"serve-{url.rsplit(':', 1)[1]}.token"
        assert f"a local token (tenant 'local', admin) in {token_file}" in summary
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32 and f"{url.replace('ws://', 'http://')}/?token={token} " in summary

        async def ask() -> tuple[dict, dict, dict]:
            async with await AsyncClient.connect(url) as c:  # no token given: the file's
                while (stats := await c.stats())["sessions"][0]["data_version"] < 2:  # the feed is attached
                    await asyncio.sleep(0.1)
                return c.welcome, stats, await c.ask("btc", "trend")

        welcome, stats, answer = asyncio.run(asyncio.wait_for(ask(), 60))
        assert welcome["auth"] and welcome["tenant"] == "local" and welcome["admin"]
        assert "engine" in stats  # the one local user sees the engine-wide figures, as without tokens
        assert answer["session"] == "btc" and answer["data_version"] >= 2
        with pytest.raises(ServiceError, match="unauthorized"):  # anyone without the file is refused
            Client(url, token="not-the-local-token", timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopping" in proc.stderr.read()
        assert not token_file.exists()
    finally:
        proc.kill()
        proc.wait()


def test_serve_refuses_public_host_without_tokens(capsys, monkeypatch):
    from streamllm.cli.serve import main as cli_main

    monkeypatch.delenv("STREAMLLM_TOKENS", raising=False)
    assert cli_main(["--host", "0.0.0.0", "--model", "tiny"]) == 2
    assert "refusing --host 0.0.0.0 without tokens" in capsys.readouterr().err


def test_watch_keeps_running_through_a_quiet_market(served):
    """`streamllm watch` once drew one table and gave up after 0.35 s of silence: it must keep
    watching (here for 1.5 s with no event at all) and end only when told."""
    from streamllm.client.watch import watch

    Client(served.url, token="tok-a").open("quiet")
    t0 = time.monotonic()
    code = asyncio.run(watch(served.url, "tok-a", "quiet", duration_s=1.5))
    assert code == 0 and time.monotonic() - t0 >= 1.4


def test_ask_stream_prints_the_answer_once(served, capsys):
    """`streamllm ask --stream` printed the streamed text on stderr and the answer again on stdout:
    a terminal showed it twice. The stream is the answer's text, on stdout, once."""
    with Client(served.url, token="tok-a") as c:
        c.open("streamed")
        c.push("streamed", LINES[:4])
        whole = c.ask("streamed", "What next?", max_tokens=4, min_version=1)["text"]
    args = ["streamed", "What next?", "--url", served.url, "--token", "tok-a", "--max-tokens", "4", "--min-version", "1"]
    assert client_cli.main([*args, "--stream"]) == 0
    out = capsys.readouterr()
    assert whole and out.out == whole + "\n" and whole not in out.err and "cold path" in out.err
    assert client_cli.main([*args, "--stream", "--json"]) == 0  # stdout is the JSON alone; the stream went to stderr
    out = capsys.readouterr()
    assert out.out.startswith("{") and out.err.startswith(whole)
