from __future__ import annotations

import copy
from pathlib import Path

import pytest

from streamllm.config import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_THRESHOLD,
    ConfigError,
    FeedSpec,
    QueryConfig,
    RenderSpec,
    load_config,
    normalize_question,
    parse_config,
    parse_question,
)

QUERIES = Path(__file__).resolve().parent.parent / "queries"

GOOD = """
[[sessions]]
name = "btc"
instrument = "BTCUSDT"
feed = "binance"

[sessions.render]
mode = "bars"
bar_seconds = 5

[[sessions.questions]]
id = "trend"
text = "Is BTC trending up? Answer up or down."
choices = ["up", "down"]
threshold = 1.5
label = "trend_up(n=10)"

[[sessions]]
name = "eth"
instrument = "ETHUSDT"
feed = "csv:data/eth.csv"
system_prompt = "Bars of {instrument}."
max_context_tokens = 2048

[sessions.render]
mode = "events"

[[sessions.questions]]
id = "last"
text = "What is the last price?"
push = false
"""


def good() -> dict:
    import tomllib

    return tomllib.loads(GOOD)


def test_parse_good_config_with_defaults():
    config = parse_config(GOOD, source="good.toml")
    assert isinstance(config, QueryConfig)
    btc, eth = config.sessions
    assert btc.feed == FeedSpec("binance", None, ("btcusdt",))  # symbol from the instrument
    assert btc.render == RenderSpec("bars", 5)
    assert btc.system_prompt == DEFAULT_SYSTEM_PROMPT.replace("{instrument}", "BTCUSDT")
    trend = btc.questions[0]
    assert (trend.choices, trend.threshold, trend.max_tokens, trend.push) == (("up", "down"), 1.5, 8, True)
    assert trend.label.text == "trend_up(n=10)"
    assert eth.feed == FeedSpec("csv", Path("data/eth.csv"))  # no base dir: left relative
    assert eth.render == RenderSpec("events", None)
    assert eth.system_prompt == "Bars of ETHUSDT."
    assert eth.max_context_tokens == 2048
    last = eth.questions[0]
    assert (last.choices, last.threshold, last.max_tokens, last.label, last.push) == (
        (), DEFAULT_THRESHOLD, 48, None, False)
    assert config.session("eth") is eth
    with pytest.raises(KeyError, match="no session 'sol'"):
        config.session("sol")


def test_dict_and_text_parse_the_same():
    assert parse_config(good(), source="x") == parse_config(GOOD, source="x")


def test_feed_paths_resolve_against_the_config_folder(tmp_path):
    (tmp_path / "q.toml").write_text(GOOD)
    config = load_config(tmp_path / "q.toml")
    assert config.source == str(tmp_path / "q.toml")
    assert config.sessions[1].feed.path == tmp_path / "data" / "eth.csv"


@pytest.mark.parametrize(
    ("feed", "expected"),
    [
        ("synthetic", FeedSpec("synthetic")),
        ("replay:/data/btc.gz", FeedSpec("replay", Path("/data/btc.gz"))),
        ("okx", FeedSpec("okx", None, ("ETHUSDT",))),  # a venue's symbols: the instrument as written
        ("kraken:wss://beta-ws.kraken.com/v2", FeedSpec("kraken", None, ("ETHUSDT",), url="wss://beta-ws.kraken.com/v2")),
        ("binance:ws://127.0.0.1:9000/stream", FeedSpec("binance", None, ("ethusdt",), url="ws://127.0.0.1:9000/stream")),
        ("csv:/data/bars.csv", FeedSpec("csv", Path("/data/bars.csv"))),
    ],
)
def test_feed_forms(feed, expected):
    data = good()
    data["sessions"][1]["feed"] = feed
    assert parse_config(data).sessions[1].feed == expected


def test_feed_defaults_to_synthetic_and_binance_takes_symbols():
    data = good()
    del data["sessions"][1]["feed"]
    data["sessions"][0]["symbols"] = ["BTCUSDT", "btcfdusd"]
    config = parse_config(data)
    assert config.sessions[0].feed.symbols == ("btcusdt", "btcfdusd")
    assert config.sessions[1].feed == FeedSpec("synthetic")


def test_normalize_question_and_find_by_id_or_text():
    assert normalize_question("  Is BTC\ttrending   UP? ") == "is btc trending up?"
    btc = parse_config(GOOD).sessions[0]
    assert btc.find_question("trend").id == "trend"
    assert btc.find_question("is btc  TRENDING up?\nanswer up or down.").id == "trend"
    assert btc.find_question("Is BTC trending down?") is None


def test_parse_question_alone_for_runtime_registration():
    question = parse_question({"id": "q", "text": "Up?", "choices": ["yes", "no"]})
    assert question.max_tokens == 8
    with pytest.raises(ConfigError, match=r"^<question>: question\.threshold: must be"):
        parse_question({"id": "q", "text": "Up?", "threshold": -1})


def _mutate(path: str, value=None, delete: bool = False) -> dict:
    """good() with the value at a dotted path (`sessions.0.questions.0.choices`) set or deleted."""
    data = copy.deepcopy(good())
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if delete:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return data


Q = "sessions.0.questions.0"
BAD_CONFIGS = [
    # (path to change, new value or DELETE, key path in the error, words of the problem)
    ("sessions", [], "sessions", "at least one session"),
    ("sessions", "btc", "sessions", "expected an array of tables, got a string"),
    ("sessions.0", 3, "sessions[0]", "expected a table, got an integer"),
    ("sessions.0.nmae", "x", "sessions[0].nmae", "unknown key; did you mean 'name'?"),
    ("sessions.0.colour", "x", "sessions[0].colour", "unknown key; allowed: name, instrument"),
    ("sessions.0.name", "DELETE", "sessions[0].name", "missing (required: a string)"),
    ("sessions.0.name", "my btc", "sessions[0].name", "no spaces"),
    ("sessions.1.name", "btc", "sessions[1].name", "duplicate session name 'btc'"),
    ("sessions.0.instrument", "  ", "sessions[0].instrument", "must not be empty"),
    ("sessions.0.feed", "binanse", "sessions[0].feed", "unknown feed 'binanse' (did you mean 'binance'?)"),
    ("sessions.0.feed", "csv:", "sessions[0].feed", "'csv' needs a path"),
    ("sessions.0.feed", "binance:btc", "sessions[0].feed", "after 'binance': a websocket endpoint (ws://... or "
     "wss://...), got 'btc'"),
    ("sessions.0.feed", "synthetic:7", "sessions[0].feed", "'synthetic' takes no path"),
    ("sessions.0.feed", "bitmex", "sessions[0].feed", "unknown feed 'bitmex'; use 'synthetic', a venue (binance, "
     "bybit, coinbase, kraken, kraken-futures, okx, alpaca"),
    ("sessions.1.symbols", ["ethusdt"], "sessions[1].symbols", "only for live venues and 'cryptofeed'"),
    ("sessions.0.symbols", [], "sessions[0].symbols", "expected non-empty strings"),
    ("sessions.0.render", "bars", "sessions[0].render", "expected a table, got a string"),
    ("sessions.0.render.mode", "candles", "sessions[0].render.mode", "unknown mode 'candles'"),
    ("sessions.0.render.bar_seconds", 0, "sessions[0].render.bar_seconds", "must be >= 1, got 0"),
    ("sessions.0.render.bar_seconds", 2.5, "sessions[0].render.bar_seconds", "expected an integer, got a float"),
    ("sessions.1.render.bar_seconds", 5, "sessions[1].render.bar_seconds", "only with mode = 'bars'"),
    ("sessions.0.render.bar_secs", 5, "sessions[0].render.bar_secs", "did you mean 'bar_seconds'?"),
    ("sessions.0.render.changes", "pips", "sessions[0].render.changes", "unknown unit 'pips'; use 'price' or 'bp'"),
    ("sessions.1.render.changes", "bp", "sessions[1].render.changes", "only with mode = 'bars'"),
    ("sessions.0.max_context_tokens", 10, "sessions[0].max_context_tokens", "must be >= 128"),
    ("sessions.0.max_context_tokens", True, "sessions[0].max_context_tokens", "got a boolean"),
    ("sessions.0.system_prompt", 1, "sessions[0].system_prompt", "expected a string, got an integer"),
    ("sessions.0.questions", {"id": "x"}, "sessions[0].questions", "expected an array of tables"),
    (f"{Q}.txt", "x", "sessions[0].questions[0].txt", "did you mean 'text'?"),
    (f"{Q}.id", "DELETE", "sessions[0].questions[0].id", "missing (required: a string)"),
    (f"{Q}.text", "", "sessions[0].questions[0].text", "must not be empty"),
    (f"{Q}.choices", ["up"], "sessions[0].questions[0].choices", "needs 2 to 16 choices, got 1"),
    (f"{Q}.choices", "up", "sessions[0].questions[0].choices", "expected a list of strings, got a string"),
    (f"{Q}.choices", ["up", 3], "sessions[0].questions[0].choices[1]", "expected a non-empty string"),
    (f"{Q}.choices", ["up", " down"], "sessions[0].questions[0].choices[1]", "without surrounding spaces"),
    (f"{Q}.choices", ["up", "Up"], "sessions[0].questions[0].choices[1]", "repeats choices[0]"),
    (f"{Q}.choices", ["down", "up"], "sessions[0].questions[0].label", "look inverted"),
    (f"{Q}.choices", ["up", "down", "flat"], "sessions[0].questions[0].label", "exactly 2 choices"),
    (f"{Q}.choices", "DELETE", "sessions[0].questions[0].label", "exactly 2 choices"),
    (f"{Q}.threshold", -0.5, "sessions[0].questions[0].threshold", "must be a finite logit gap >= 0"),
    (f"{Q}.threshold", float("nan"), "sessions[0].questions[0].threshold", "finite"),
    (f"{Q}.threshold", "2", "sessions[0].questions[0].threshold", 'expected a number or "auto:P"'),
    (f"{Q}.threshold", "auto:1.5", "sessions[0].questions[0].threshold", "0.5 <= P < 1"),
    (f"{Q}.threshold", "auto", "sessions[0].questions[0].threshold", 'e.g. "auto:0.9"'),
    (f"{Q}.threshold", True, "sessions[0].questions[0].threshold", "got a boolean"),
    (f"{Q}.max_tokens", 0, "sessions[0].questions[0].max_tokens", "must be >= 1"),
    (f"{Q}.push", "yes", "sessions[0].questions[0].push", "expected true or false"),
    (f"{Q}.label", "trend(n=10)", "sessions[0].questions[0].label", "did you mean 'trend_up'?"),
    (f"{Q}.label", "trend_up(window=3)", "sessions[0].questions[0].label", "unknown parameter 'window'"),
    (f"{Q}.label", "trend_up(n=-3)", "sessions[0].questions[0].label", "must be >= 1, got -3"),
    (f"{Q}.label", 3, "sessions[0].questions[0].label", "expected a string, got an integer"),
    ("sessions.1.questions.0.id", "bad id", "sessions[1].questions[0].id", "no spaces"),
]


@pytest.mark.parametrize(("path", "value", "key_path", "problem"), BAD_CONFIGS,
                         ids=[f"{c[2]}:{c[3][:20]}" for c in BAD_CONFIGS])
def test_bad_configs_name_file_key_and_problem(path, value, key_path, problem):
    data = _mutate(path, delete=True) if value == "DELETE" else _mutate(path, value)
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="bad.toml")
    error = info.value
    assert (error.source, error.key_path) == ("bad.toml", key_path), str(error)
    assert problem in error.problem, str(error)
    assert str(error).startswith(f"bad.toml: {key_path}: ")


def test_duplicate_question_id_and_text_within_a_session():
    data = good()
    questions = data["sessions"][0]["questions"]
    questions.append(dict(questions[0], text="Another?"))
    with pytest.raises(ConfigError, match=r"sessions\[0\]\.questions\[1\]\.id: duplicate question id 'trend'"):
        parse_config(data)
    questions[1] = dict(questions[0], id="trend2", text="  is btc trending UP?  answer up or DOWN. ")
    with pytest.raises(ConfigError, match=r"questions\[1\]\.text: same text as question 'trend'"):
        parse_config(data)
    data["sessions"][1]["questions"].append(dict(questions[0]))  # same id in another session: fine
    del questions[1]
    parse_config(data)


def test_unknown_top_level_key_and_toml_syntax_errors():
    with pytest.raises(ConfigError, match=r"^x\.toml: session: unknown key; did you mean 'sessions'\?"):
        parse_config("[[session]]\nname = 'a'\n", source="x.toml")
    with pytest.raises(ConfigError, match=r"^x\.toml: invalid TOML: .*line 2"):
        parse_config("[[sessions]]\nname = \n", source="x.toml")
    with pytest.raises(ConfigError, match="sessions: missing \\(required: an array of tables\\)"):
        parse_config("", source="x.toml")


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: cannot read"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("path", sorted(QUERIES.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_examples_load(path):
    config = load_config(path)
    assert config.sessions
    for session in config.sessions:
        assert session.questions
        for question in session.questions:
            if question.label is not None:
                assert len(question.choices) == 2


def test_shipped_examples_are_the_promised_ones():
    names = {p.name for p in QUERIES.glob("*.toml")}
    assert {"crypto.toml", "bars.toml", "demo.toml"} <= names
    crypto = load_config(QUERIES / "crypto.toml")
    assert [s.feed.kind for s in crypto.sessions] == ["binance", "binance"]
    assert {s.render for s in crypto.sessions} == {RenderSpec("bars", 5, "bp")}
    demo = load_config(QUERIES / "demo.toml")
    assert len(demo.sessions) == 2 and all(s.feed.kind == "synthetic" for s in demo.sessions)
    bars = load_config(QUERIES / "bars.toml")
    feed = bars.sessions[0].feed
    assert feed.kind == "csv" and feed.path.name == "btc-perp-20211231-20220201_1m.csv"
    assert feed.path.parent.parent.name == "data" and feed.path.parent.name == "bars"


@pytest.mark.parametrize("name", ["bars.toml", "crypto.toml", "demo.toml"])
def test_shipped_adapters_fit_their_configs(name):
    """Each shipped config's adapter has a head for every labelled choice question, tuned on the
    lines its sessions write: a config retuned without its heads (or the reverse) fails here,
    not at a user's `serve`."""
    from streamllm.model.adapter import check_sessions, load_adapter

    config = load_config(QUERIES / name)
    adapter = load_adapter(config.adapter)
    check_sessions(adapter, config.sessions, config.source)
    for spec in config.sessions:
        for q in spec.questions:
            if q.choices and q.label is not None:
                assert adapter.head_for(q.text, q.choices) is not None, (spec.name, q.id)
