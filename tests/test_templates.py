"""Session templates (#46): one config block for many instruments, fed over few connections.

- A `[[templates]]` block over 100 symbols (a symbols file with comments) reads as 100 plain
  sessions with their own names, instruments and venue subscriptions, and the same render
  settings and questions; serve's `open_sessions` opens all 100 in an engine (tiny model).
- A venue group subscribes its symbols over as few connections as the venue allows (Binance:
  1024 streams a connection; OKX: requests under its length limit).
- The loopback replay server serves several symbols over one combined Binance connection; the
  feed path serve uses demultiplexes them so each session gets its own symbol's bars only.
- Mistakes name the file, the key and what is wrong.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import orjson
import pytest

import feeds.adapters as adapters
from feeds import binance, okx
from feeds.events import BUY, SELL, Trade
from feeds.server import ReplayServer
from streamllm.config import ConfigError, load_config, parse_config
from streamllm.config.choices import check_choices
from streamllm.engine import Engine, EngineConfig
from streamllm.feeding.attach import Attachment, AttachSpec, attach
from streamllm.feeding.owners import feed_owners
from streamllm.feeding.wiring import (
    build_attachments,
    feed_events,
    feed_file_problems,
    group_feeds,
    open_sessions,
    venue_adapters,
)
from streamllm.service.tenants import LOCAL

TEMPLATE = """
[[sessions]]
name = "btc"
instrument = "BTCUSDT"
feed = "binance"
max_context_tokens = 128

[[templates]]
symbols_file = "lists/market.txt"
feed = "binance"
max_context_tokens = 128
system_prompt = "Bars of {instrument}."

[templates.render]
bar_seconds = 60
changes = "bp"

[[templates.questions]]
id = "trend"
text = "Up or down?"
choices = ["up", "down"]
label = "trend_up(n=3)"
"""


def symbols(count: int) -> list[str]:
    return [f"S{i:03d}USDT" for i in range(count)]


def write_template(tmp_path, count: int, extra: str = ""):
    (tmp_path / "lists").mkdir(exist_ok=True)
    lines = ["# a market", ""] + [f"{s}  # listed" if i % 7 == 0 else s for i, s in enumerate(symbols(count))]
    (tmp_path / "lists" / "market.txt").write_text("\n".join(lines) + "\n" + extra)
    (tmp_path / "market.toml").write_text(TEMPLATE)
    return tmp_path / "market.toml"


def test_a_template_of_100_symbols_is_100_sessions_with_their_own_feeds(tmp_path):
    config = load_config(write_template(tmp_path, 100))
    made = [s for s in config.sessions if s.template]
    assert [s.name for s in config.sessions[:1]] == ["btc"] and len(made) == 100
    for i, (spec, symbol) in enumerate(zip(made, symbols(100), strict=True)):
        assert spec.name == symbol.lower() and spec.instrument == symbol
        assert spec.feed.kind == "binance" and spec.feed.symbols == (symbol.lower(),)
        assert spec.system_prompt == f"Bars of {symbol}."
        assert spec.render.bar_seconds == 60 and spec.render.changes == "bp" and spec.max_context_tokens == 128
        assert [q.id for q in spec.questions] == ["trend"] and spec.questions is made[0].questions
        assert spec.template == "templates[0]" and spec.key_path == f"templates[0].symbols_file:{i + 3}"
    # serve's wiring: one venue group, one connection for all 101 (303 streams of 1024), each session owned
    [group] = group_feeds(config, None)
    assert len(group.sessions) == 101
    [adapter] = venue_adapters(group)
    assert adapter.symbols == ["btcusdt"] + [s.lower() for s in symbols(100)]
    owners = feed_owners(config, [group], LOCAL)
    assert owners[LOCAL.engine_name("s042usdt")].where.endswith("market.toml: templates[0]")


def test_serve_opens_the_100_sessions_of_a_template(tmp_path, tiny_model):
    config = load_config(write_template(tmp_path, 100))
    engine = Engine(tiny_model, EngineConfig(max_cells=101 * 128 + 8192, block_size=8, max_context=128))
    try:
        registered = open_sessions(engine, LOCAL, config)
        assert registered == 100
        opened = {info.name for info in engine.list_sessions()}
        assert opened == {LOCAL.engine_name(s.name) for s in config.sessions}
        assert [q.id for q in engine.standing_questions(LOCAL.engine_name("s099usdt"))] == ["trend"]
    finally:
        engine.shutdown()


def test_a_venue_group_uses_as_few_connections_as_the_venue_allows():
    config = parse_config({"templates": [{"symbols": symbols(700), "feed": "binance", "max_context_tokens": 128}]})
    [group] = group_feeds(config, None)
    shards = [a.symbols for a in venue_adapters(group)]  # 700 x 3 streams: 341 symbols (1023 streams) a connection
    assert [len(s) for s in shards] == [341, 341, 18]
    assert sum(shards, []) == [s.lower() for s in symbols(700)]
    requests = binance.subscribe_messages(shards[0], adapters.channels_for("binance"))
    assert [len(r["params"]) for r in requests] == [200] * 5 + [23]  # 4 a second, under Binance's 5
    assert sum((r["params"] for r in requests), []) == binance.stream_names(shards[0], ["trade", "bookTicker",
                                                                                         "depth@100ms"])
    okx_requests = okx.subscribe_messages([f"S{i:03d}-USDT" for i in range(700)], ["trades", "tickers"])
    assert len(okx_requests) == 2 and sum(len(r["args"]) for r in okx_requests) == 1400
    assert all(len(orjson.dumps(r)) <= okx.MAX_SUBSCRIBE_BYTES for r in okx_requests)


# -- a combined stream from the loopback server, demultiplexed ------------------------------------

LEVELS = {"BTCUSDT": 50_000.0, "ETHUSDT": 3_000.0, "SOLUSDT": 100.0, "DOGEUSDT": 0.1}


def market_trades() -> list[Trade]:
    """Five minutes of trades of four symbols, interleaved, each at its own price level."""
    out, t0 = [], 1_700_000_000 * 10**9
    for k in range(300):
        for j, (symbol, level) in enumerate(LEVELS.items()):
            ts = t0 + k * 10**9 + j * 1000
            price = round(level * (1 + 0.001 * math.sin(k / 7 + j)), 4)
            out.append(Trade("binance", symbol, ts, ts + 5 * 10**6, price, 1.0 + (k % 3), BUY if k % 2 else SELL,
                             k * 10 + j, 4, 1))
    return out


class Recorder:
    """A sink that keeps each session's pushed lines (ingest always keeps up)."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}

    def push(self, session: str, lines: list[str], **_: object) -> None:
        self.lines.setdefault(session, []).extend(lines)

    def backlog(self, session: str) -> int:
        return 0


async def first(events, count: int):
    """The first `count` events of a live stream (the server replays again after a reconnect)."""
    n = 0
    async for ev in events:
        yield ev
        n += 1
        if n == count:
            return


@pytest.mark.parametrize("streams_per_connection", [1024, 6])
def test_a_combined_stream_feeds_each_session_its_own_symbol(monkeypatch, streams_per_connection):
    monkeypatch.setitem(adapters.MAX_STREAMS_PER_CONNECTION, "binance", streams_per_connection)
    trades = market_trades()

    async def scenario():
        async with ReplayServer(events=trades) as server:
            config = parse_config({"templates": [{
                "name": "m-{symbol}", "symbols": list(LEVELS), "feed": f"binance:{server.url}/stream",
                "max_context_tokens": 128, "render": {"bar_seconds": 60}}]})
            [group] = group_feeds(config, None)
            sink = Recorder()
            attachments = build_attachments(sink, LOCAL, group)
            await asyncio.wait_for(attach(first(feed_events(group, None, 0), len(trades)), attachments), 30)
            return sink, attachments, server.connections

    sink, attachments, connections = asyncio.run(scenario())
    assert connections == (1 if streams_per_connection == 1024 else 2)  # 3 channels: 2 symbols a connection
    for symbol in LEVELS:
        own = [t for t in trades if t.instrument == symbol]
        solo = Recorder()
        asyncio.run(attach(own, [Attachment(solo, AttachSpec.of(solo_spec(symbol), session="solo"))]))
        got = sink.lines[LOCAL.engine_name(f"m-{symbol.lower()}")]
        assert len(got) >= 4 and got == solo.lines["solo"][:len(got)]  # its own bars, in order, nobody else's
    for a in attachments:
        assert a.accounted() == a.stats.events_in == len(trades)
        assert a.stats.ignored == len(trades) - len(trades) // len(LEVELS)


def solo_spec(symbol: str):
    config = parse_config({"templates": [{"name": "m-{symbol}", "symbols": [symbol], "feed": "binance",
                                          "max_context_tokens": 128, "render": {"bar_seconds": 60}}]})
    return config.sessions[0]


# -- mistakes name the file and the key -----------------------------------------------------------

def template(**keys):
    return {"templates": [{"feed": "binance", "max_context_tokens": 128, **keys}]}


@pytest.mark.parametrize(("data", "key", "problem"), [
    (template(symbols=["BTCUSDT", "ETHUSDT", "btcusdt"]), "templates[0].symbols[2]",
     "symbol 'btcusdt' repeats templates[0].symbols[0]"),
    (template(symbols=[]), "templates[0].symbols", "needs at least one symbol"),
    (template(symbols=["BTC USDT"]), "templates[0].symbols[0]", "is not a symbol"),
    (template(symbols=["A"], symbols_file="x.txt"), "templates[0].symbols", "one of them"),
    (template(), "templates[0].symbols", "one of them"),
    (template(symbols=["A", "B"], name="fixed"), "templates[0].name", "put {symbol} in it"),
    (template(symbols=["A"], name="{sym}"), "templates[0].name", "the only placeholder is {symbol}"),
    (template(symbols=["A"], names="x"), "templates[0].names", "did you mean 'name'?"),
    ({"sessions": [{"name": "eth", "instrument": "ETHUSDT"}], **template(symbols=["BTC", "ETH"])},
     "templates[0].symbols[1]", "makes session name 'eth', which sessions[0].name already names"),
    (template(symbols=["BTC-USDT", "BTC/USDT"]), "templates[0].symbols[1]",
     "makes session name 'btc-usdt', which templates[0].symbols[0] already names"),
    (template(symbols=["A"], questions=[{"id": "q", "text": "Up?", "choices": ["up"]}]),
     "templates[0].questions[0].choices", "needs 2 to 16 choices"),
    ({"model": {}}, "sessions", "or [[templates]] for one session per symbol"),
    ({"templates": []}, "sessions", "needs at least one session"),
])
def test_template_mistakes_name_the_key(data, key, problem):
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source="queries/m.toml")
    assert caught.value.key_path == key and problem in caught.value.problem, str(caught.value)
    assert str(caught.value).startswith("queries/m.toml: ")


def test_symbols_file_mistakes_name_the_file_and_line(tmp_path):
    path = write_template(tmp_path, 3, extra="S001USDT\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key_path == "templates[0].symbols_file"
    assert f"{tmp_path / 'lists' / 'market.txt'} line 6: symbol 'S001USDT' repeats" in caught.value.problem
    (tmp_path / "lists" / "market.txt").write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="has no symbols"):
        load_config(path)
    (tmp_path / "lists" / "market.txt").write_text("BTCUSDT\nETH USDT # two words\n")
    with pytest.raises(ConfigError, match=r"market.txt line 2: 'ETH USDT' is not a symbol"):
        load_config(path)
    (tmp_path / "lists" / "market.txt").unlink()
    with pytest.raises(ConfigError, match=r"templates\[0\].symbols_file: cannot read .*market.txt"):
        load_config(path)


def test_the_shipped_market_config_validates(tiny_model):
    config = load_config(Path(__file__).parent.parent / "queries" / "market.toml")
    assert len(config.sessions) == 20 and config.sessions[0].name == "btcusdt"
    assert {s.feed.kind for s in config.sessions} == {"binance"}
    assert all(len(s.questions) == 3 for s in config.sessions)
    check_choices(config, tiny_model.tokenizer)  # the tokenizer tells every question's choices apart
    [group] = group_feeds(config, None)
    assert len(venue_adapters(group)) == 1


def test_other_venues_keep_their_spelling_and_messages_name_the_template(tmp_path):
    config = parse_config({"templates": [
        {"symbols": ["BTC/USD", "ETH/USD"], "feed": "kraken", "name": "k.{symbol}", "max_context_tokens": 128},
        {"symbols": ["BTC-USDT-SWAP"], "feed": "okx:wss://ws.okx.com:8443/ws/v5/business", "max_context_tokens": 128},
        {"symbols": ["BTCUSDT", "ETHUSDT"], "feed": "csv:bars/missing.csv", "max_context_tokens": 128},
    ]}, source="m.toml", base_dir=tmp_path)
    kraken, okx_swap = config.sessions[1], config.sessions[2]
    assert (kraken.name, kraken.instrument, kraken.feed.symbols) == ("k.eth-usd", "ETH/USD", ("ETH/USD",))
    assert (okx_swap.name, okx_swap.feed.symbols, okx_swap.feed.url) == (
        "btc-usdt-swap", ("BTC-USDT-SWAP",), "wss://ws.okx.com:8443/ws/v5/business")
    groups = group_feeds(config, None)
    assert [len(g.sessions) for g in groups] == [2, 1, 2]  # one source per venue endpoint or file
    assert feed_file_problems(groups, config) == [
        f"m.toml: templates[2].feed: csv file {tmp_path / 'bars' / 'missing.csv'}: no such file"]
