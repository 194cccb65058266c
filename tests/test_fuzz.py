"""Fuzzing with hypothesis: wire parsers, protocol messages (decoder and live server), config files.

No exception escapes but the documented ones (`AuthError` from a venue refusing
credentials, `ProtocolError`, `ConfigError`), and every rejected input is counted with
a code or message.
"""

from __future__ import annotations

import contextlib
import json
import random

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from bench.fuzz import SAMPLES, mutate, mutated_config
from feeds.wire import AuthError, parser_for
from streamllm.config import ConfigError, parse_config
from streamllm.engine import Engine, EngineConfig
from streamllm.service import protocol as p
from streamllm.service.server import StreamServer

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
VENUES = sorted(SAMPLES)


def dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # stdlib: integers past 64 bits reach the parsers too


def check_parser(venue: str, raw: bytes | str) -> None:
    parser = parser_for(venue)
    try:
        out = parser.parse(raw, 1)
    except AuthError:
        return  # documented: credentials refused, reconnecting cannot help
    assert isinstance(out, list) and parser.stats.messages == 1
    if parser.stats.errors:
        assert parser.stats.error_samples and venue in parser.stats.error_samples[0].lower()
    if not out and not parser.stats.control and not parser.stats.errors:
        # silently dropped: only for data the parser deliberately holds back (open klines/candles, stale depth)
        assert parser.stats.gaps == 0


@FUZZ
@given(venue=st.sampled_from(VENUES), raw=st.binary(max_size=200) | st.text(max_size=200))
def test_parsers_survive_arbitrary_bytes(venue, raw):
    check_parser(venue, raw)


@FUZZ
@given(venue=st.sampled_from(VENUES), value=json_values)
def test_parsers_survive_arbitrary_json(venue, value):
    check_parser(venue, dumps(value))


@FUZZ
@given(venue=st.sampled_from(VENUES), seed=st.integers(0, 2**32), which=st.integers(0, 10))
def test_parsers_survive_mutated_real_messages(venue, seed, which):
    samples = SAMPLES[venue]
    check_parser(venue, mutate(random.Random(seed), samples[which % len(samples)]))


def test_non_json_is_always_a_counted_error():
    for venue in VENUES:
        parser = parser_for(venue)
        assert parser.parse(b"\x00not json{", 1) == [] and parser.stats.errors == 1


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300) | json_values.map(dumps))
def test_protocol_decode_raises_only_protocol_errors(raw):
    try:
        req = p.decode(raw, 256)
    except p.ProtocolError as exc:
        assert exc.code in p.ERROR_CODES and exc.message
        return
    assert req.type in p.CLIENT_TYPES


@FUZZ
@given(text=st.text(max_size=400))
def test_config_arbitrary_text_raises_only_config_errors(text):
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="fuzz.toml")
    assert str(err.value).startswith("fuzz.toml")


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_config_mutated_sample_raises_only_config_errors(seed):
    try:
        parse_config(mutated_config(random.Random(seed)), source="fuzz.toml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.toml")


@FUZZ
@given(value=json_values)
def test_config_arbitrary_structures_raise_only_config_errors(value):
    with contextlib.suppress(ConfigError):
        parse_config({"sessions": [value]} if not isinstance(value, dict) else value, source="fuzz")


# -- the live server: fuzzed messages never kill the connection or the engine ----------------


@pytest.fixture(scope="module")
def live_server(tiny_model, serve_in_thread):
    engine = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=512))
    server = StreamServer(engine)
    server.config.port = 0
    server.config.max_message_bytes = 4096
    try:
        with serve_in_thread(server), connect(server.url, max_size=None) as ws:
            ws.send(orjson.dumps({"type": "open", "id": 0, "session": "btc"}).decode())
            assert orjson.loads(ws.recv(10))["type"] == "ok"
            yield server, ws
    finally:
        engine.shutdown()


message_fields = st.fixed_dictionaries(
    {"type": st.sampled_from(p.CLIENT_TYPES), "id": st.integers(1, 10**6)},
    optional={"session": st.sampled_from(["btc", "nope", "", "a/b", 3]) | st.text(max_size=5),
              "lines": st.lists(st.text(max_size=10), max_size=3) | json_values,
              "question": st.sampled_from(["Up?", ""]) | json_values,
              "max_tokens": st.integers(-3, 600) | json_values, "min_version": st.integers(-1, 99),
              "stop": json_values, "question_id": json_values, "max_context": st.integers(-5, 10**9) | json_values,
              "token": json_values, "data": json_values},
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(msg=message_fields)
def test_server_replies_to_every_fuzzed_message_and_counts_its_errors(live_server, msg):
    server, ws = live_server
    if msg["type"] == "close" and msg.get("session") == "btc":
        msg["session"] = "nope"  # keep the shared session for the next examples
    before = sum(s.value for m in server.metrics.errors.collect() for s in m.samples if s.name.endswith("_total"))
    ws.send(dumps(msg).decode())
    while True:  # data and standing events may interleave; ours echoes the id, or has none when unreadable
        reply = orjson.loads(ws.recv(10))
        if reply.get("id") == msg["id"] or (reply["type"] == "error" and "id" not in reply):
            break
    after = sum(s.value for m in server.metrics.errors.collect() for s in m.samples if s.name.endswith("_total"))
    if reply["type"] == "error":
        assert reply["code"] in p.ERROR_CODES and reply["code"] != p.INTERNAL and reply["message"]
        assert after == before + 1  # every refusal is counted
    else:
        assert reply["type"] in ("ok", "welcome", "answer", "stats") and after == before
    if msg["type"] == "open" and reply["type"] == "ok":  # keep the pool free for the next examples
        ws.send(orjson.dumps({"type": "close", "id": -1, "session": msg["session"]}).decode())
        while orjson.loads(ws.recv(30)).get("id") != -1:
            pass
