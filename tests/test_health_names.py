"""/health names each session once (#47): the local user's `btc`, not `local/btc` in the feeds and `btc`
in the queue depths; another tenant's sessions by the engine's key, so two tenants' `btc` stay apart."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from streamllm.client.client import Client
from streamllm.engine import Engine, EngineConfig
from streamllm.service.server import ServerConfig, StreamServer, health_name


class BehindFeed:
    """A feed as /health sees it (FeedRunner.health): its sessions by their engine keys, one behind."""

    def health(self, backlog_lines: Any, max_backlog: int) -> tuple[dict[str, Any], list[str]]:
        names = ["local/btc", "local/btc2", "alice/btc"]
        entry = {"feed": "synthetic", "sessions": names, "state": "running", "restarts": 0, "last_error": None,
                 "events": 9, "lag_s": 0.1, "ingest_backlog_lines": {n: backlog_lines(n) for n in names}}
        return entry, ["feed synthetic: ingest is behind (local/btc 300 lines, local/btc2 301 lines)"]


@pytest.fixture(scope="module")
def server(tiny_model, serve_in_thread):
    engine = Engine(tiny_model, EngineConfig(max_cells=2048, block_size=8, max_context=256))
    try:
        with serve_in_thread(StreamServer(engine, config=ServerConfig(port=0))) as served:
            yield served
    finally:
        engine.shutdown()


def test_health_names_each_session_once(server):
    with Client(server.url) as client:  # no tokens: the one local user
        client.open("btc")
    server.feeds.append(BehindFeed())
    try:
        health = server.health(private=True)
    finally:
        server.feeds.clear()
    assert "local/" not in orjson.dumps(health).decode(), health
    (feed,) = health["feeds"]
    assert feed["sessions"] == ["btc", "btc2", "alice/btc"] and set(feed["ingest_backlog_lines"]) == set(feed["sessions"])
    assert health["queue_depths"] == {"btc": 0}
    assert "feed synthetic: ingest is behind (btc 300 lines, btc2 301 lines)" in health["reasons"]
    assert [health_name(n) for n in ("local/btc", "alice/btc", "btc")] == ["btc", "alice/btc", "btc"]
