"""Pushes into a feed's session, pushed bar lines, choices that collide, and serve's start-up checks (#47).

- A session a feed owns refuses client pushes (`forbidden`, naming the session, its feed and the
  config key) unless its config says `client_pushes = true`.
- A pushed line that claims to be a bar is read back and checked before the ack (time order,
  finite prices > 0), in the feeds' words; the whole push is refused, nothing of it taken.
- Choices whose first tokens collide are a ConfigError naming the file and key before any model
  loads, and `config_error` over the websocket.
- `streamllm serve` stops with exit status 2 and one line for a port in use, a feed file that is
  missing, or colliding choices, before it loads the model.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from websockets.asyncio.client import connect

import streamllm.cli.serve as serve_cli
from feeds.synthetic import synthetic_events
from streamllm.config import ConfigError, parse_config
from streamllm.config.choices import check_choices
from streamllm.engine import Engine, EngineConfig
from streamllm.feeding.barlines import BadBarLine, check_bar_lines, read_bar_line
from streamllm.feeding.owners import feed_owners
from streamllm.feeding.render import Renderer
from streamllm.feeding.wiring import feed_file_problems, group_feeds, open_sessions
from streamllm.model.loader import load_tokenizer
from streamllm.service.server import ServerConfig, StreamServer
from streamllm.service.tenants import LOCAL

CONFIG = """
[[sessions]]
name = "eth"
instrument = "ETHUSDT"
max_context_tokens = 256

[[sessions]]
name = "sol"
instrument = "SOLUSDT"
max_context_tokens = 256
client_pushes = true
[sessions.render]
changes = "price"
"""


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=512))
    yield eng
    eng.shutdown()


def exchange(engine, messages, config=None):
    """Send each message on one connection of a fresh server; the replies, in order."""
    async def scenario():
        async with StreamServer(engine, None, ServerConfig(port=0)) as server:
            if config is not None:
                await asyncio.to_thread(open_sessions, engine, LOCAL, config)
                server.feed_owners.update(feed_owners(config, group_feeds(config, None), LOCAL))
            async with connect(server.url) as ws:
                replies = []
                for i, message in enumerate([{"type": "hello"}, *messages]):
                    await ws.send(json.dumps({**message, "id": i}))
                    replies.append(json.loads(await ws.recv()))
                return replies[1:]

    return asyncio.run(asyncio.wait_for(scenario(), 20))


# -- 1. a feed's session refuses client pushes unless its config allows them ----------------------

def test_a_feed_session_refuses_client_pushes_unless_its_config_allows_them(engine):
    config = parse_config(CONFIG, source="queries/x.toml")
    assert [s.client_pushes for s in config.sessions] == [False, True]
    try:
        refused, allowed = exchange(engine, [
            {"type": "push", "session": "eth", "lines": ["00:00 1 -9999 v0"]},
            {"type": "push", "session": "sol", "lines": ["12:00 150.5 +0.5 v3"]}], config)
    finally:
        for info in engine.list_sessions():
            engine.close_session(info.name)
    assert refused["type"] == "error" and refused["code"] == "forbidden", refused
    for words in ("'eth'", "feed 'synthetic'", "queries/x.toml: sessions[0].client_pushes = true"):
        assert words in refused["message"], refused["message"]
    assert allowed["type"] == "ok" and allowed["data_version"] == 1, allowed


def test_client_pushes_must_be_a_boolean():
    with pytest.raises(ConfigError) as caught:
        parse_config(CONFIG.replace("client_pushes = true", 'client_pushes = "yes"'), source="x.toml")
    assert caught.value.key_path == "sessions[1].client_pushes" and "true or false" in caught.value.problem


# -- 2. pushed bar lines are checked before the ack -------------------------------------------------

def test_every_rendered_bar_reads_back_to_its_bar():
    """The reader inverts the renderer: open/high/low from the change and offsets, in both units."""
    events = [e for e in synthetic_events(seed=3, duration_s=600) if e.instrument == "ETHUSDT"]
    from feeds.bars import bars

    for changes in ("price", "bp"):
        renderer = Renderer(changes=changes)
        ohlc = list(bars(events, 5))
        lines = [renderer.render(b) for b in ohlc]
        assert check_bar_lines(lines, None, changes) is not None
        for bar, line in zip(ohlc, lines, strict=True):
            read = read_bar_line(line, changes)
            tolerance = 0.011 if changes == "price" else bar.close * 1e-3  # bp: two significant digits
            assert read.close == pytest.approx(bar.close, abs=0.006), line
            if bar.trades:
                for got, want in ((read.open, bar.open), (read.high, bar.high), (read.low, bar.low)):
                    assert got == pytest.approx(want, abs=tolerance), (line, bar)


@pytest.mark.parametrize(("lines", "last", "index", "words"), [
    (["00:00 1 -9999 v0"], 14 * 3600 + 32 * 60, 0, "bad_time: time='00:00' is before the previous bar (14:32:00)"),
    (["12:00 100 +1", "11:59 100 +0"], None, 1, "is before the previous bar (12:00:00)"),
    (["2024-01-02T00:00 100 +1", "2024-01-01T23:59 100 +1"], None, 1, "is before the previous bar (2024-01-02T00:00:00)"),
    (["12:00 -5 +1"], None, 0, "bad_close: close=-5.0 must be a finite number > 0"),
    (["12:00 5 +10 v1"], None, 0, "bad_change: change=10.0 puts the previous close at -5"),
    (["12:00 5 +1 l-9"], None, 0, "bad_low: low=-5.0 must be a finite number > 0"),
    (["12:00 5 +1 v-2"], None, 0, "bad_volume: volume=-2.0 must be a finite number >= 0"),
    (["note", "25:00 5 +1"], None, 1, "bad_time: time='25:00' is not a time of day"),
    (["2024-02-30T12:00 5 +1"], None, 0, "bad_time: date='2024-02-30' is not a calendar date"),
    (["12:00 " + "9" * 400 + " +1"], None, 0, "bad_close: close=inf must be a finite number > 0"),
])
def test_a_bad_bar_line_is_named_with_the_feeds_words(lines, last, index, words):
    with pytest.raises(BadBarLine) as caught:
        check_bar_lines(lines, last, "price")
    assert caught.value.index == index and words in str(caught.value), str(caught.value)
    assert str(caught.value).startswith(f"lines[{index}] ")


def test_free_text_and_bars_in_order_pass():
    lines = ["funding in 5 minutes", "23:58 100 +1 v2", "23:59 101 +1 h+1 v3 (2 bars to 23:59)",
             "23:59 101 no trades", "2024-01-02T00:00 102 +1 v1", "00:01 102.5 +0.5", "00:01:30 buy 102.5 0.2"]
    assert check_bar_lines(lines, None, "price") == 1704153660.0
    # a client's own session: the unit is unknown, so only the time, the close and the volume count
    assert check_bar_lines(["12:00 5 +10 v1"], None, None) == 43200.0


def test_a_bad_bar_refuses_the_whole_push_before_the_ack(engine):
    try:
        replies = exchange(engine, [
            {"type": "open", "session": "mine"},
            {"type": "push", "session": "mine", "lines": ["12:00 64000.5 +1.5 v3.2", "12:01 64010 +9.5 v1.1"]},
            {"type": "push", "session": "mine", "lines": ["00:00 1 -9999 v0"]},
            {"type": "push", "session": "mine", "lines": ["12:02 63990 -20 v5", "12:03 -1 +1 v1"]},
            {"type": "push", "session": "mine", "lines": ["12:02 63990 -20 v5", "a note"]}])
    finally:
        engine.close_session("local/mine")
    opened, first, back, negative, after = replies
    assert first["type"] == "ok" and first["data_version"] == 1
    assert back["type"] == "error" and back["code"] == "bad_field", back
    assert back["message"].startswith("push: lines[0] '00:00 1 -9999 v0': bad_time: time='00:00' is before "
                                      "the previous bar (12:01:00)"), back["message"]  # the last push's last bar
    assert negative["code"] == "bad_field" and negative["message"] == (
        "push: lines[1] '12:03 -1 +1 v1': bad_close: close=-1.0 must be a finite number > 0")
    assert after["type"] == "ok" and after["data_version"] == 2  # nothing of the refused push was taken


# -- 3. choices whose first tokens collide ----------------------------------------------------------

BIG = """
[[sessions]]
name = "btc"
instrument = "BTCUSDT"
[[sessions.questions]]
id = "trend"
text = "Up or down?"
choices = ["up", "down"]
[[sessions.questions]]
id = "size"
text = "How big was the last bar?"
choices = ["big", "bigger"]
"""


def test_colliding_choices_are_a_config_error_naming_file_and_key():
    config = parse_config(BIG, source="queries/x.toml")
    with pytest.raises(ConfigError) as caught:
        check_choices(config, load_tokenizer("tiny"))
    assert str(caught.value).startswith("queries/x.toml: sessions[0].questions[1].choices: question 'size': "
                                        "choices 'big' and 'bigger' can both start with token")
    check_choices(parse_config(BIG.replace('"bigger"', '"small"'), source="ok.toml"), load_tokenizer("tiny"))


def test_colliding_choices_over_the_websocket_are_config_error(engine):
    question = {"id": "size", "text": "How big?", "choices": ["big", "bigger"]}
    try:
        _, reply = exchange(engine, [{"type": "open", "session": "q"},
                                     {"type": "register", "session": "q", "question": question}])
    finally:
        engine.close_session("local/q")
    assert reply["type"] == "error" and reply["code"] == "config_error", reply
    assert reply["message"].startswith("register: question.choices: question 'size': choices 'big' and 'bigger'")


# -- 4. serve checks before it loads the model ------------------------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("serve loaded the model before its start-up checks")
    monkeypatch.setattr(serve_cli, "load_model", refuse)
    monkeypatch.delenv("STREAMLLM_TOKENS", raising=False)


def test_serve_refuses_a_port_in_use_before_loading_the_model(no_model, capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_cli.main(["--model", "tiny", "--no-auth", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"streamllm serve: cannot listen on 127.0.0.1:{port}: the port is in use (another streamllm "
                   "serve? pick one with --port, 0 for any free one)"], err


def test_serve_refuses_a_missing_feed_file_before_loading_the_model(no_model, capsys, tmp_path):
    present = tmp_path / "bars.csv"
    present.write_text("time,open,high,low,close,volume\n")
    config = tmp_path / "x.toml"
    config.write_text('[[sessions]]\nname = "a"\ninstrument = "X"\nfeed = "csv:bars.csv"\n\n'
                      '[[sessions]]\nname = "b"\ninstrument = "Y"\nfeed = "replay:gone.csv.gz"\n')
    assert serve_cli.main(["--model", "tiny", "--no-auth", "--port", "0", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"streamllm serve: {config}: sessions[1].feed: replay file {tmp_path / 'gone.csv.gz'}: "
                   "no such file"], err
    loaded = parse_config(config.read_text(), source="x.toml", base_dir=tmp_path)  # --feed names itself
    assert feed_file_problems(group_feeds(loaded, None), loaded) == [
        f"x.toml: sessions[1].feed: replay file {tmp_path / 'gone.csv.gz'}: no such file"]
    with pytest.raises(ValueError, match="replay:"):  # an override without a path never gets this far
        serve_cli.parse_feed_override("replay:")


def test_serve_refuses_colliding_choices_before_loading_the_model(no_model, capsys, tmp_path):
    config = tmp_path / "x.toml"
    config.write_text(BIG)
    assert serve_cli.main(["--model", "tiny", "--no-auth", "--port", "0", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"streamllm serve: {config}: sessions[0].questions[1].choices: "
                                               "question 'size': choices 'big' and 'bigger'"), err


def test_serve_gives_the_server_its_feed_owners(monkeypatch, tmp_path, capsys):
    """serve hands ws.py the map of feed-owned sessions (the start is cut short once it is built)."""
    built = []

    async def no_listen(self):
        built.append(self)
        raise OSError("test: not listening")

    monkeypatch.setattr(StreamServer, "start", no_listen)
    monkeypatch.delenv("STREAMLLM_TOKENS", raising=False)
    config = tmp_path / "x.toml"
    config.write_text(CONFIG)
    assert serve_cli.main(["--model", "tiny", "--no-auth", "--port", "0", "--config", str(config)]) == 2
    owners = built[0].feed_owners
    assert {name: (o.feed, o.client_pushes, o.changes) for name, o in owners.items()} == {
        "local/eth": ("synthetic", False, "price"), "local/sol": ("synthetic", True, "price")}
    assert owners["local/eth"].where == f"{config}: sessions[0]"
    assert "cannot listen" in capsys.readouterr().err
