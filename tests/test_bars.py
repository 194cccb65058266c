"""The page's bar book never turns an acked push into an error: lines it cannot chart are skipped.

`BarBook.record` runs after the engine logged and acked the batch (service/ws.py `_push`, the
feeds' `TapSink`); an exception there used to reach the client as an error reply for a batch
the engine already held, and the client's retry then pushed it twice. A client's push is now
checked before the ack (feeding/barlines.py), so an impossible bar is refused whole instead.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect

from streamllm.engine import Engine, EngineConfig
from streamllm.service.bars import BarBook
from streamllm.service.server import ServerConfig, StreamServer

UNCHARTABLE = [
    "2024-13-01T12:00 64000.5 V 1",  # month 13
    "2024-02-30T12:00 64000.5 V 1",  # February 30th
    "0000-01-01T12:00 64000.5 V 1",  # year 0
    "2024-01-01T12:00 " + "9" * 400 + " V 1",  # a close that is not a finite number
    "25:00 64000.5 V 1",  # hour 25
    "12:61 64000.5 V 1",  # minute 61
]


def test_unchartable_lines_are_skipped_and_counted_not_raised():
    book = BarBook()
    good = ["2024-01-01T12:00 64000.5 V 1", "12:01 64001.5 V 2"]
    assert book.record("s", [good[0], *UNCHARTABLE, good[1]]) == 2
    closes, seen = book.bars("s")
    assert closes == [(1704110400.0, 64000.5), (1704110460.0, 64001.5)] and seen == 2
    assert book.unchartable("s") == len(UNCHARTABLE)
    # a bad dated line does not move the day the next undated line belongs to
    assert book.record("s", ["2024-02-30T00:00 1 V 1", "12:02 64002.5 V 3"]) == 1
    assert book.bars("s")[0][-1] == (1704110520.0, 64002.5)


@pytest.mark.parametrize("line", UNCHARTABLE[:2])
def test_a_push_with_an_impossible_date_is_refused_before_the_ack(tiny_model, line):
    """A client's line that claims to be a bar is checked before the ack (feeding/barlines.py): an impossible
    date is a `bad_field` naming the line, nothing of the push is taken, and the book never sees it."""
    engine = Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512))

    async def scenario():
        async with StreamServer(engine, None, ServerConfig(port=0)) as server, connect(server.url) as ws:
            replies = []
            for i, message in enumerate([{"type": "hello"}, {"type": "open", "session": "s"},
                                         {"type": "push", "session": "s", "lines": [line]},
                                         {"type": "push", "session": "s", "lines": ["12:00 64000.5 V 1"]}]):
                await ws.send(json.dumps({**message, "id": i}))
                replies.append(json.loads(await ws.recv()))
            return replies, server.bars.bars("local/s"), server.bars.unchartable("local/s")

    try:
        replies, (closes, seen), skipped = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        engine.shutdown()
    assert [r["type"] for r in replies] == ["welcome", "ok", "error", "ok"], replies
    assert replies[2]["code"] == "bad_field" and replies[2]["message"].startswith(f"push: lines[0] {line!r}: bad_time")
    assert replies[3]["data_version"] == 1  # the refused push took nothing
    assert seen == 1 and len(closes) == 1 and skipped == 0
