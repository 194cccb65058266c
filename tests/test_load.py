"""Load over loopback websockets: concurrent pushes, asks and subscriptions, then an audit.

What the clients were acknowledged must be what the sessions hold and what the ingest
log holds, line for line; the run is bounded (a few seconds) and nothing is lost.
"""

from __future__ import annotations

import asyncio

from bench.faults import load_run
from streamllm.durability.ingest_log import IngestLog
from streamllm.durability.log_reader import pushed_lines
from streamllm.engine import Engine, EngineConfig
from streamllm.service.server import ServerConfig, StreamServer


def test_concurrent_clients_lose_nothing_acknowledged(tiny_model, tmp_path):
    engine = Engine(tiny_model, EngineConfig(max_cells=32768, max_context=2048), ingest_log=IngestLog(tmp_path, flush="interval", fsync_ms=20))

    async def run() -> dict:
        async with StreamServer(engine, config=ServerConfig(port=0)) as server:
            return await asyncio.wait_for(load_run(server.url, seconds=6, clients=6), 60)

    try:
        out = asyncio.run(run())
        assert out["load_pushes"] > 50 and out["load_asks"] > 5 and out["load_lost"] == 0
        logged = pushed_lines(tmp_path)
        for name, lines in out["acked"].items():
            session = engine.sessions[f"local/{name}"]
            assert session.lines_ingested + session.backlog_lines == lines  # the engine holds every acked line
            assert len(logged[f"local/{name}"]) == lines  # and so does the log
        engine.check_integrity()
    finally:
        engine.shutdown()
        engine.ingest_log.close()
