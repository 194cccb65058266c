from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl
import pytest

from streamllm.config import ConfigError, parse_question
from streamllm.config.labels import (
    LABELS,
    MAX_LABEL_CHARS,
    MAX_LABEL_DEPTH,
    LabelError,
    parse_label,
    to_columns,
)


@dataclass(slots=True)
class Bar:
    open: float
    high: float
    low: float
    close: float
    volume: float
    vwap: float | None = None


def bars_from_closes(closes: list[float], volume: float = 1.0) -> list[Bar]:
    """Each bar opens at the previous close (the first opens at its own close)."""
    opens = [closes[0], *closes[:-1]]
    return [Bar(o, max(o, c), min(o, c), c, volume) for o, c in zip(opens, closes, strict=True)]


# -- parsing ---------------------------------------------------------------------------


def test_parse_fills_defaults_and_canonical_text():
    assert parse_label("trend_up").text == "trend_up(n=10)"
    assert parse_label(" trend_up( n = 3 ) ").text == "trend_up(n=3)"
    spec = parse_label("volume_spike(n=5, k=2)")
    assert spec.params == (("k", 2.0), ("n", 5))  # definition order, k coerced to float
    assert isinstance(spec.params[0][1], float)
    assert spec.bars_needed == 6


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trend_upp(n=3)", "unknown label 'trend_upp' (did you mean 'trend_up'?)"),
        ("trend_up(m=3)", "unknown parameter 'm'"),
        ("trend_up(n=3, n=4)", "given twice"),
        ("trend_up(3)", "pass parameters by name"),
        ("trend_up(n=0)", "parameter n must be >= 1, got 0"),
        ("trend_up(n=2.5)", "parameter n must be an integer, got 2.5"),
        ("trend_up(n=true)", "must be a number literal"),
        ("trend_up(n=True)", "parameter n must be an integer, got True"),
        ("trend_up(n='3')", "parameter n must be an integer, got '3'"),
        ("trend_up(n=abc)", "must be a number literal, got 'abc'"),
        ("volume_spike(k=-1)", "parameter k must be >= 0.0"),
        ("volume_spike(k=inf)", "must be a number literal"),
        ("trend_up(n=3", "does not parse"),
        ("x.y(n=1)", "does not parse"),
        ("", "non-empty string"),
    ],
)
def test_parse_errors_are_precise(text, message):
    with pytest.raises(LabelError) as info:
        parse_label(text)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trend_up(n=" + "-" * 100_000 + "1)", f"100013 characters, over the limit of {MAX_LABEL_CHARS}"),
        ("(" * 100_000, f"over the limit of {MAX_LABEL_CHARS}"),  # was MemoryError from ast.parse
        ("trend_up(n=" + "(" * 50 + "1" + ")" * 50 + ")", f"51 deep, over the limit of {MAX_LABEL_DEPTH}"),
        ("[" * MAX_LABEL_DEPTH + "{1}" + "]" * MAX_LABEL_DEPTH,
         f"{MAX_LABEL_DEPTH + 1} deep, over the limit of {MAX_LABEL_DEPTH}"),
    ],
)
def test_oversized_or_deeply_nested_labels_are_refused_before_parsing(text, message):
    with pytest.raises(LabelError) as info:
        parse_label(text)
    assert message in str(info.value) and len(str(info.value)) < 200  # quotes a prefix, not the text
    # in a question: a config error at its key path
    with pytest.raises(ConfigError) as info:
        parse_question({"id": "q", "text": "Up?", "choices": ["up", "down"], "label": text},
                       source="q.toml", key_path="sessions[0].questions[3]")
    assert "sessions[0].questions[3].label" in str(info.value) and message in str(info.value)


def test_labels_at_the_bounds_still_parse():
    at_depth = "trend_up(n=" + "(" * (MAX_LABEL_DEPTH - 1) + "7" + ")" * (MAX_LABEL_DEPTH - 1) + ")"
    assert parse_label(at_depth).params == (("n", 7),)
    padded = "trend_up(n=7)".center(MAX_LABEL_CHARS)
    assert len(padded) == MAX_LABEL_CHARS and parse_label(padded).params == (("n", 7),)


# -- values on hand-made bars ----------------------------------------------------------


def test_trend_up_compares_last_close_with_open_n_bars_back():
    bars = bars_from_closes([100, 101, 99, 102])  # opens: 100, 100, 101, 99
    assert parse_label("trend_up(n=3)").evaluate(bars) is True  # 102 > open[-3] = 100
    assert parse_label("trend_up(n=1)").evaluate(bars) is True  # 102 > 99
    falling = bars_from_closes([100, 101, 99, 98])
    assert parse_label("trend_up(n=2)").evaluate(falling) is False  # 98 > 101? no
    flat = bars_from_closes([100, 100, 100])
    assert parse_label("trend_up(n=3)").evaluate(flat) is False  # ties are not up


def test_too_few_bars_is_unknown_never_a_guess():
    bars = bars_from_closes([1.0, 2.0, 3.0])
    assert parse_label("trend_up(n=4)").evaluate(bars) is None
    assert parse_label("trend_up(n=4)").answer(bars, ("up", "down")) is None
    assert parse_label("volatility_rising(n=1)").evaluate(bars) is False  # needs 3, has 3: +100% then +50%
    assert parse_label("volatility_rising(n=2)").evaluate(bars) is None  # needs 5
    assert parse_label("volume_spike(n=3)").evaluate(bars) is None  # needs 4
    assert parse_label("above_vwap(n=4)").evaluate([]) is None


def test_answer_maps_true_to_first_choice():
    label = parse_label("trend_up(n=2)")
    assert label.answer(bars_from_closes([1, 2, 3]), ("up", "down")) == "up"
    assert label.answer(bars_from_closes([3, 2, 1]), ("up", "down")) == "down"
    assert label.answer(bars_from_closes([3, 2, 1]), ("yes", "no")) == "no"


def test_above_sma():
    bars = bars_from_closes([10, 20, 30, 18])
    assert parse_label("above_sma(n=4)").evaluate(bars) is False  # 18 > 19.5? no
    assert parse_label("above_sma(n=2)").evaluate(bars) is False  # 18 > 24? no
    assert parse_label("above_sma(n=1)").evaluate(bars) is False  # 18 > 18? no
    assert parse_label("above_sma(n=4)").evaluate(bars_from_closes([10, 20, 30, 21])) is True


def test_above_vwap_weights_by_volume_and_uses_bar_vwap_when_present():
    bars = [Bar(10, 12, 9, 10.5, 1), Bar(10, 11, 9, 10, 3)]  # typical 10.5 and 10
    # vwap = (10.5 * 1 + 10 * 3) / 4 = 10.125; last close 10 -> below
    assert parse_label("above_vwap(n=2)").evaluate(bars) is False
    bars[1].close = 10.2  # typical (11 + 9 + 10.2) / 3 = 10.0667; vwap = 10.05 -> above
    assert parse_label("above_vwap(n=2)").evaluate(bars) is True
    bars[1].vwap = 10.3  # own vwap wins: (10.5 + 30.9) / 4 = 10.35 -> below
    assert parse_label("above_vwap(n=2)").evaluate(bars) is False
    no_volume = [Bar(10, 10, 10, 10, 0)] * 3
    assert parse_label("above_vwap(n=3)").evaluate(no_volume) is None


def test_volatility_rising_compares_rms_returns_of_adjacent_windows():
    # returns: +1%, -1% (rms 1%) then +2%, 0% (rms ~1.41%) -> rising
    closes = [100.0, 101.0, 99.99, 101.9898, 101.9898]
    assert parse_label("volatility_rising(n=2)").evaluate(bars_from_closes(closes)) is True
    calm_after = [100.0, 102.0, 99.96, 100.0, 100.01]  # ~2%, ~2% then ~0.04%, 0.01%
    assert parse_label("volatility_rising(n=2)").evaluate(bars_from_closes(calm_after)) is False
    # Prices below zero (WTI, April 2020) are moves like any other; a zero close has no return.
    below = [-10.0, -10.1, -9.9, -9.0, -11.0]
    assert parse_label("volatility_rising(n=2)").evaluate(bars_from_closes(below)) is True
    assert parse_label("volatility_rising(n=2)").evaluate(bars_from_closes([1.0, 0.0, 1.0, 2.0, 1.0])) is None


def test_volume_spike_is_strictly_more_than_k_times_the_baseline():
    volumes = [2.0, 4.0, 3.0, 9.0]  # baseline of the 3 before = 3
    bars = [Bar(1, 1, 1, 1, v) for v in volumes]
    assert parse_label("volume_spike(k=2.9, n=3)").evaluate(bars) is True
    assert parse_label("volume_spike(k=3, n=3)").evaluate(bars) is False  # 9 > 9? no
    assert parse_label("volume_spike(k=2, n=1)").evaluate(bars) is True  # 9 > 6


def test_bars_as_dicts_and_polars_frame_give_the_same_answers():
    objects = bars_from_closes([100, 101, 103, 102, 104, 107, 106, 110, 108, 111, 115])
    dicts = [{"open": b.open, "high": b.high, "low": b.low, "close": b.close, "volume": b.volume}
             for b in objects]
    frame = pl.DataFrame(dicts)
    for name in LABELS:
        label = parse_label(f"{name}(n=3)")
        answers = {label.evaluate(objects), label.evaluate(dicts), label.evaluate(frame)}
        assert len(answers) == 1, name


def test_bad_bars_name_the_missing_field():
    with pytest.raises(TypeError, match="has no 'volume'"):
        parse_label("trend_up(n=1)").evaluate([{"open": 1, "high": 1, "low": 1, "close": 1}])
    with pytest.raises(TypeError, match="lacks columns"):
        to_columns(pl.DataFrame({"close": [1.0]}))


def test_columns_take_only_the_tail_and_nan_vwap_means_none():
    bars = [Bar(1, 1, 1, float(i), 1, math.nan if i == 3 else 2.0) for i in range(5)]
    columns = to_columns(bars, last=2)
    assert columns.close == [3.0, 4.0]
    assert columns.vwap == [None, 2.0]
