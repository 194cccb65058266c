"""/health is 503 `failing` while every engine step fails (a broken forward: a bad driver, a device that
went away), not `ok` or `degraded`; one failed step (one bad question) only degrades it, and a step that
succeeds again ends the failing state."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from streamllm.engine import Engine, EngineConfig
from streamllm.service.server import FAILING_STEPS, ServerConfig, StreamServer


def _get_health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait(predicate, what: str, timeout: float = 20.0) -> None:
    for _ in range(int(timeout * 50)):
        if predicate():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def test_health_is_failing_while_every_step_fails_and_recovers_after(tiny_model, serve_in_thread, monkeypatch):
    # A budget far above what the test pushes: no compaction copy may swap the pushed lines away
    # without a forward (with a 141-token system prompt at max_context 256 one cut them all).
    engine = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=1024))
    try:
        with serve_in_thread(StreamServer(engine, config=ServerConfig(port=0))) as server:
            engine.open_session("s")
            engine.push("s", ["12:00 BTCUSDT C 64000.5"])
            assert engine.wait_idle(30)
            assert _get_health(server.http_url)[0] == 200

            real = engine.core.runner.execute

            def broken(works, **_):
                raise RuntimeError("CUDA error: device-side assert (injected)")

            monkeypatch.setattr(engine.core.runner, "execute", broken)
            for i in range(FAILING_STEPS + 1):  # each push is a step that fails
                engine.push("s", [f"12:0{i + 1} BTCUSDT C 6400{i}.5"])
                _wait(lambda n=i: engine.health().failed_steps > n, "a failed step")
            status, body = _get_health(server.http_url)
            assert status == 503 and body["status"] == "failing", body
            assert any("engine steps all failed" in r and "device-side assert" in r for r in body["reasons"]), body

            monkeypatch.setattr(engine.core.runner, "execute", real)
            engine.push("s", ["12:09 BTCUSDT C 64009.5"])
            _wait(lambda: engine.health().failing_in_a_row == 0, "a step that succeeds")
            status, body = _get_health(server.http_url)
            assert status == 200 and body["status"] == "degraded", body  # the failures are still counted
    finally:
        engine.shutdown()
