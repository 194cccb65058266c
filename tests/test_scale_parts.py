"""The parts of serve --ray that need no Ray: placement table, event journal, error mapping,
and the promise that without --ray nothing imports Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamllm.engine.outputs import ReplicaUnavailable
from streamllm.scale.journal import EventJournal
from streamllm.scale.placement import PlacementError, PlacementTable
from streamllm.service import protocol as p
from streamllm.service.errors import engine_error
from streamllm.service.httpauth import from_engine

ROOT = Path(__file__).resolve().parent.parent

PLAIN_SERVE = r"""
import asyncio, json, sys
from websockets.asyncio.client import connect
from streamllm.engine import Engine, EngineConfig
from streamllm.model import load_model
from streamllm.service.server import ServerConfig, StreamServer
import streamllm.scale, streamllm.scale.handle, streamllm.scale.placement, streamllm.cli.sessions
import streamllm.cli.serve, streamllm.service.admin

async def main():
    engine = Engine(load_model("tiny"), EngineConfig(max_cells=2048, block_size=8, max_context=512), dtype="float32")
    async with StreamServer(engine, None, ServerConfig(port=0)) as server:
        async with connect(server.url) as ws:
            for msg in ({"type": "hello", "id": 1}, {"type": "open", "id": 2, "session": "a"},
                        {"type": "push", "id": 3, "session": "a", "lines": ["12:00 1 +1"]},
                        {"type": "ask", "id": 4, "session": "a", "question": "Up?", "max_tokens": 1, "min_version": 1}):
                await ws.send(json.dumps(msg))
                reply = json.loads(await ws.recv())
                assert reply["type"] != "error", reply
    engine.shutdown()

asyncio.run(main())
print("ray imported:", "ray" in sys.modules)
"""


def test_a_plain_serve_never_imports_ray():
    out = subprocess.run([sys.executable, "-c", PLAIN_SERVE], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ray imported: False"), out.stdout


def test_serve_refuses_ray_options_without_ray(capsys):
    from streamllm.cli.serve import main

    assert main(["--replicas", "3", "--model", "tiny"]) == 2
    assert "need --ray" in capsys.readouterr().err
    assert main(["--ray", "--replicas", "0", "--model", "tiny"]) == 2


def test_unavailable_is_a_stable_error_code_and_http_503():
    exc = ReplicaUnavailable("session 'alice/btc': its replica (1) is restarting", replica=1)
    code, message = engine_error(exc, "push")
    assert code == p.UNAVAILABLE == "unavailable" and code in p.ERROR_CODES
    assert "'btc'" in message and "alice" not in message  # engine names are shown as the client's names
    api = from_engine(exc, "ask")
    assert api.status == 503 and api.code == "unavailable"


def test_placement_table_is_durable_and_reconciles_with_the_replicas(tmp_path):
    path = tmp_path / "placement.json"
    table = PlacementTable(path, replicas=2)
    table.place("a", 0)
    table.place("b", 1)
    table.place("c", 1)
    table.remove("c")
    again = PlacementTable(path, replicas=2)  # what a restarted front door reads
    assert {n: again.get(n) for n in again.names()} == {"a": 0, "b": 1} and again.counts() == [1, 1]
    # A front door that died mid-move left "a" on both replicas (the table says 0); "b" vanished
    # from replica 1; replica 1 also holds "d" the table never heard of.
    changes, duplicates = again.reconcile({0: ["a"], 1: ["a", "d"]})
    assert duplicates == [("a", 1)]
    assert {n: again.get(n) for n in again.names()} == {"a": 0, "d": 1}
    assert any("b: gone" in c for c in changes) and any(c.startswith("d:") for c in changes)
    # Replicas that did not answer keep their sessions.
    again.place("e", 1)
    again.reconcile({0: ["a"]})
    assert again.get("e") == 1
    assert json.loads(path.read_text())["sessions"] == {"a": 0, "d": 1, "e": 1}
    # Fewer replicas than the table knows: the sessions beyond are forgotten, and said so.
    smaller = PlacementTable(path, replicas=1)
    changes, _ = smaller.reconcile({0: ["a"]})
    assert smaller.names() == ["a"] and any("beyond" in c for c in changes)


def test_placement_table_errors_name_the_file(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text("{not json")
    with pytest.raises(PlacementError, match="placement.json"):
        PlacementTable(path, 2)
    path.write_text(json.dumps({"format": "streamllm-placement", "sessions": {"a": -1}}))
    with pytest.raises(PlacementError, match="session 'a'"):
        PlacementTable(path, 2)


def test_event_journal_long_poll_order_and_gaps():
    journal = EventJournal(maxlen=4)
    assert journal.since(0, 0.0).events == ()
    threading.Timer(0.05, journal.append, ("s", "data", "s", 1)).start()
    t0 = time.monotonic()
    batch = journal.since(0, 5.0)  # wakes on the append, not after the timeout
    assert time.monotonic() - t0 < 4.0
    assert [(e.seq, e.args) for e in batch.events] == [(1, ("s", 1))] and batch.next_seq == 1 and not batch.gap
    for v in range(2, 8):
        journal.append("s", "data", "s", v)
    late = journal.since(1, 0.0)  # the journal keeps 4: events 2 and 3 are gone
    assert late.gap and [e.args[1] for e in late.events] == [4, 5, 6, 7] and late.next_seq == 7
    assert journal.since(5, 0.0).events[0].seq == 6 and not journal.since(5, 0.0).gap
    assert EventJournal().incarnation != journal.incarnation
