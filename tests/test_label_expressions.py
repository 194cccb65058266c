"""The label language (config/expressions.py): parsing, errors that point at the token, forecasts,
buckets, and the named labels equal to their former Python predicates bar for bar on real bars."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pytest

from streamllm.config import ConfigError, parse_question
from streamllm.config import expressions as expressions_module
from streamllm.config.labels import LABELS, Bars, LabelError, parse_label, to_columns

BARS_CSV = Path("/work/shared/data/bars/btc-perp-20211231-20220201_1m.csv")


# -- the reference: the named labels as they were written in Python ----------------------


def _trend_up(bars: Bars, n: int) -> bool:
    return bars.close[-1] > bars.open[-n]


def _above_sma(bars: Bars, n: int) -> bool:
    closes = bars.close[-n:]
    return closes[-1] > sum(closes) / n


def _above_vwap(bars: Bars, n: int) -> bool | None:
    volume = bars.volume[-n:]
    total = sum(volume)
    if total <= 0:
        return None
    prices = [v if v is not None else (h + lo + c) / 3
              for v, h, lo, c in zip(bars.vwap[-n:], bars.high[-n:], bars.low[-n:], bars.close[-n:], strict=True)]
    return bars.close[-1] > sum(p * q for p, q in zip(prices, volume, strict=True)) / total


def _realized_vol(closes: list[float]) -> float:
    returns = [b / a - 1.0 for a, b in zip(closes, closes[1:], strict=False)]
    return math.sqrt(sum(r * r for r in returns) / len(returns))


def _volatility_rising(bars: Bars, n: int) -> bool | None:
    closes = bars.close[-(2 * n + 1):]
    if 0.0 in closes:
        return None
    return _realized_vol(closes[n:]) > _realized_vol(closes[: n + 1])


def _volume_spike(bars: Bars, k: float, n: int) -> bool:
    return bars.volume[-1] > k * (sum(bars.volume[-(n + 1):-1]) / n)


REFERENCE = {  # name: (predicate, bars needed, reads volume)
    "trend_up": (_trend_up, lambda n: n, False),
    "above_sma": (_above_sma, lambda n: n, False),
    "above_vwap": (_above_vwap, lambda n: n, True),
    "volatility_rising": (_volatility_rising, lambda n: 2 * n + 1, False),
    "volume_spike": (_volume_spike, lambda k, n: n + 1, True),
}


def reference_truths(text: str, columns: Bars) -> list[int | None]:
    """Per bar: the former predicate's choice index (0: true), None where it answered None."""
    spec = parse_label(text)
    predicate, needed_of, reads_volume = REFERENCE[spec.name]
    params = dict(spec.params)
    needed = needed_of(**params)
    assert needed == spec.bars_needed and reads_volume == spec.reads_volume
    out: list[int | None] = []
    names = ("open", "high", "low", "close", "volume", "vwap")
    for i in range(len(columns)):
        if i + 1 < needed:
            out.append(None)
            continue
        window = Bars(*(getattr(columns, f)[i + 1 - needed: i + 1] for f in names))
        if reads_volume and any(v != v for v in window.volume):
            out.append(None)
            continue
        truth = predicate(window, **params)
        out.append(None if truth is None else 1 - int(truth))
    return out


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    if not BARS_CSV.exists():
        pytest.skip(f"{BARS_CSV} not here")
    return pl.read_csv(BARS_CSV)


@pytest.fixture(scope="module")
def columns(frame) -> Bars:
    return to_columns(frame)


# -- the named labels are their expressions, bar for bar -------------------------------------


NAMED = ["trend_up", "above_sma", "above_vwap", "volatility_rising", "volume_spike",
         "trend_up(n=3)", "above_sma(n=7)", "above_vwap(n=50)", "volatility_rising(n=5)", "volume_spike(k=1.5, n=9)"]


@pytest.mark.parametrize("text", NAMED)
def test_named_labels_equal_the_python_predicates_bar_for_bar(text, frame, columns):
    assert len(frame) > 45_000 and "vwap" not in frame.columns
    expected = reference_truths(text, columns)
    label = parse_label(text)
    assert label.truths(frame).to_list() == expected  # every one of the 45k bars
    assert sum(t is not None for t in expected) > 44_000
    # the newest-bar evaluator on bars ending at a sample of rows (objects, as pushes bring them)
    for end in range(1, len(columns) + 1, 211):
        truth = label.evaluate(Bars(*(getattr(columns, f)[max(end - 60, 0):end]
                                      for f in ("open", "high", "low", "close", "volume", "vwap"))))
        assert (None if truth is None else 1 - int(truth)) == expected[end - 1], end


def test_named_labels_keep_their_text_params_and_bars():
    assert {name: parse_label(name).bars_needed for name in LABELS} == {
        "trend_up": 10, "above_sma": 20, "above_vwap": 20, "volatility_rising": 41, "volume_spike": 21}
    spike = parse_label("volume_spike(n=5, k=2)")
    assert (spike.text, spike.name, spike.params, spike.horizon, spike.choice_count) == (
        "volume_spike(k=2.0, n=5)", "volume_spike", (("k", 2.0), ("n", 5)), 0, 2)
    assert spike.expression == "volume > 2.0 * mean(volume, 5)[-1]"
    assert parse_label(spike.text) == spike


# -- one evaluator, two ways of summing: they agree on every bar ---------------------------


DOZEN = [
    "close > ema(close, 50)",
    "range > 2 * mean(range, 20)",
    "ret(5) > 0",
    "bucket(ret(10), [-0.001, 0.001])",
    "close[+5] > close",
    "max(high, +10) > close * 1.002",
    "std(ret(1), 30) > std(ret(1), 30)[-30]",
    "min(low, +5) < low and not close > sma(close, 100)",
    "sum(volume, 15) > sum(volume, 60) / 4 * 1.1",
    "abs(change) > 3 * mean(abs(change), 50)",
    "(close - sma(close, 20))[-3] > 0 or volume > max(volume, 10)[-1]",
    "mean(close, +20) > close and ema(range, 10) > ema(range, 40)",
    "sqrt(mean(ret(1) * ret(1), 20)) > sqrt(mean(ret(1) * ret(1), 20))[-20]",
]


def test_row_by_row_and_vectorised_windows_agree_on_every_bar(frame, columns, monkeypatch):
    """Windows of a few rows (a push) are summed with Python's sum() row by row; a whole table's
    with the same additions on arrays. Forcing the row-by-row path on 45k rows must change nothing."""
    vectorised = {text: parse_label(text).truths(frame).to_list() for text in DOZEN}
    monkeypatch.setattr(expressions_module, "_SMALL_RANGE", 10**9)
    for text in DOZEN:
        label = parse_label(text)
        truths = vectorised[text]
        assert label.truths(frame).to_list() == truths, text
        assert sum(t is not None for t in truths) > 44_000, text
        for end in range(label.bars_needed, len(columns) - label.horizon, 997):  # the newest-bar path at a sample of rows
            back = label.horizon
            bars = Bars(*(getattr(columns, f)[: end + 1 + back] for f in ("open", "high", "low", "close", "volume", "vwap")))
            truth = label.evaluate_at(bars, back)
            index = None if truth is None else (1 - int(truth) if label.yes_no else truth)
            assert index == truths[end], (text, end)


# -- forecasts --------------------------------------------------------------------------


def test_a_forecast_is_judged_only_once_its_future_is_in(frame):
    label = parse_label("close[+5] > close")
    assert (label.horizon, label.bars_needed, label.text) == (5, 1, "close[+5] > close")
    bars = frame.head(100)
    assert label.evaluate(bars) is None and label.answer(bars, ("up", "down")) is None
    assert all(label.answer_at(bars, ("up", "down"), back) is None for back in range(5))
    closes = bars.get_column("close").to_list()
    for back in range(5, 30):
        expected = "up" if closes[-1 - back + 5] > closes[-1 - back] else "down"
        assert label.answer_at(bars, ("up", "down"), back) == expected
    # Nothing beyond the bars given is read: other bars after the newest change no answer.
    changed = pl.concat([bars, frame.slice(100, 20).with_columns(pl.col("close") * 2)])
    for back in range(5, 60):
        assert label.answer_at(changed, ("up", "down"), back + 20) == label.answer_at(bars, ("up", "down"), back)
    short, full = label.truths(bars).to_list(), label.truths(changed).to_list()
    assert short[:95] == full[:95] and short[95:] == [None] * 5


def test_future_windows_read_the_next_bars_only():
    bars = [{"open": c, "high": c, "low": c, "close": c, "volume": 1.0} for c in (10, 11, 15, 9, 10, 10)]
    label = parse_label("max(high, +3) > close * 1.2")
    assert (label.horizon, label.bars_needed) == (3, 1)
    assert label.evaluate_at(bars, 5) is True  # 10 -> max(11, 15, 9)
    assert label.evaluate_at(bars, 3) is False  # 15 -> max(9, 10, 10)
    assert label.evaluate_at(bars, 2) is None  # its future is not in


# -- buckets ----------------------------------------------------------------------------


def test_bucket_picks_a_choice_by_index():
    label = parse_label("bucket(ret(1), [-0.01, 0.01])")
    assert (label.choice_count, label.bars_needed, label.yes_no) == (3, 2, False)
    choices = ("down", "flat", "up")
    bars = lambda a, b: [{"open": x, "high": x, "low": x, "close": x, "volume": 1} for x in (a, b)]  # noqa: E731
    assert [label.answer(bars(100, b), choices) for b in (98, 99.5, 100, 100.5, 105)] == [
        "down", "flat", "flat", "flat", "up"]
    edge = parse_label("bucket(close, [1, 2])")  # an edge belongs to the bucket above it
    assert [edge.evaluate([{"open": x, "high": x, "low": x, "close": x, "volume": 1}]) for x in (0.5, 1, 1.5, 2, 3)] == [
        0, 1, 1, 2, 2]
    assert label.evaluate(bars(100, 101)) == 2 and label.evaluate(bars(100, 100)[:1]) is None
    frame = pl.DataFrame(bars(100, 98) + bars(100, 105))  # returns: -2%, +2%, +5%
    assert label.truths(frame).to_list() == [None, 0, 2, 2] and label.truths(frame).dtype == pl.Int8


def test_a_bucket_question_needs_one_choice_per_bucket():
    question = {"id": "q", "text": "Move?", "label": "bucket(ret(10), [-0.001, 0.001])"}
    parsed = parse_question({**question, "choices": ["down", "flat", "up"]}, source="q.toml", key_path="q")
    assert parsed.label.choice_count == 3
    with pytest.raises(ConfigError, match="needs exactly 3 choices"):
        parse_question({**question, "choices": ["up", "down"]}, source="q.toml", key_path="q")
    with pytest.raises(ConfigError, match="exactly 2 choices"):  # a yes/no label: as before
        parse_question({**question, "label": "ret(5) > 0", "choices": ["a", "b", "c"]}, source="q.toml",
                       key_path="q")


# -- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "close > ema(close, 50)", "range > 2 * mean(range, 20)", "ret(5) > 0", "bucket(ret(10), [-0.001, 0.001])",
    "close[+5] > close", "max(high, +10) > close * 1.002"])
def test_the_issues_examples_parse_and_round_trip(text):
    label = parse_label(text)
    assert label.name == "expr" and label.params == () and label.text == text
    assert parse_label(label.text) == label


def test_bars_needed_and_horizon_are_fixed_at_parse_time():
    cases = {
        "close > ema(close, 50)": (200, 0), "ret(5) > 0": (6, 0), "change > 0": (2, 0),
        "max(high, +10) > close": (1, 10), "(close - sma(close, 20))[-3] > 0": (23, 0),
        "mean(close[+2], 5)[-10] > 0": (15, 0), "close[-3] > close[+4]": (4, 4),
        "sum(volume, +3)[-2] > 0": (3, 1),
    }
    assert {text: (parse_label(text).bars_needed, parse_label(text).horizon) for text in cases} == cases
    assert parse_label("buy_share > 0.6").reads_volume and not parse_label("vwap > close").reads_volume


def test_reach_counts_the_bars_a_value_rests_on():
    # bars_needed - 1, except that an ema counts the 2n bars of 98% of its weights, not its 4n warm-up; the
    # future never counts
    cases = {"close > ema(close, 50)": 99, "ret(5) > 0": 5, "change > 0": 1, "max(high, +10) > close": 0,
             "(close - sma(close, 20))[-3] > 0": 22, "close[-3] > close[+4]": 3, "close[+5] > close": 0,
             "ema(close[-2], 10) > close": 21, "bucket(ret(10), [-0.001, 0.001])": 10}
    assert {text: parse_label(text).reach for text in cases} == cases


@pytest.mark.parametrize(("text", "message", "column"), [
    ("clsoe > 3", "unknown column 'clsoe' (did you mean 'close'?)", 1),
    ("close > smaa(close, 5)", "unknown function 'smaa' (did you mean 'sma'?)", 9),
    ("close > sma(close)", "sma(x, n) takes 2 arguments, got 1", 9),
    ("close > sma(close, 2.5)", "window must be an integer literal", 20),
    ("close > sma(close, -5)", "a window counts bars", 20),
    ("close > sma(close, +0)", "a window of 0 bars reads nothing", 20),
    ("close > sum(close, 5001)", "over the limit of 5000", 20),
    ("close > sma(close, 3000)[-3000]", "reads 6000 bars, over the limit of 5000", 9),
    ("bucket(close, [3, 2])", "bucket edges must increase strictly: 2 after 3", 19),
    ("(close > open) > 1", "comparison of a yes/no with a number", 2),
    ("close > open and volume", "'and' needs a yes/no", 18),
    ("close ** 2 > 1", "operator '**' is not part of the label language", 7),
    ("close[3] > 1", "write [-3] for bars ago or [+3] for bars ahead", 7),
    ("close > open[-n]", "an offset must be an integer literal", 14),
    ("close > (open", "does not parse", 9),
    ("close + 1", "a label is yes/no", 1),
    ("close.real > 1", "does not parse", 1),
    ("close > 'a'", "is not a number", 9),
    ("ema(close, +5) > 0", "looks back only", 12),
    ("close > trend_up(n=3)", "named label 'trend_up' cannot be part of an expression", 9),
])
def test_errors_point_at_the_token(text, message, column):
    with pytest.raises(LabelError) as info:
        parse_label(text)
    first, shown, caret = str(info.value).split("\n")
    assert message in first and first.endswith(f"at column {column}"), first
    assert shown == f"  {text}" and caret == "  " + " " * (column - 1) + "^"


def test_a_bucket_has_no_more_buckets_than_a_question_has_choices():
    from streamllm.config import MAX_CHOICES

    assert expressions_module.MAX_BUCKET_EDGES == MAX_CHOICES - 1
    edges = ", ".join(str(i) for i in range(MAX_CHOICES))
    with pytest.raises(LabelError, match=f"at most {MAX_CHOICES - 1} edges"):
        parse_label(f"bucket(close, [{edges}])")


def test_named_label_errors_point_at_the_parameter():
    with pytest.raises(LabelError) as info:
        parse_label("trend_up(n=0)")
    assert "parameter n must be >= 1, got 0 at column 12" in str(info.value)


# -- columns and unknowns -----------------------------------------------------------------


def test_optional_columns_and_unknown_values():
    bar = {"open": 10.0, "high": 12.0, "low": 9.0, "close": 11.0, "volume": 4.0}
    assert parse_label("vwap > 10.6").evaluate([bar]) is True  # no vwap: typical price 10.667
    assert parse_label("vwap > 10.6").evaluate([{**bar, "vwap": 10.5}]) is False
    assert parse_label("trades > 0").evaluate([bar]) is None  # absent: unknown, never a guess
    assert parse_label("trades > 0").evaluate([{**bar, "trades": -1}]) is None  # feeds' "no count"
    assert parse_label("trades > 0").evaluate([{**bar, "trades": 3}]) is True
    assert parse_label("buy_share > 0.6").evaluate([{**bar, "buy_volume": 3.0}]) is True  # 3 / 4
    assert parse_label("buy_share > 0.6").evaluate([{**bar, "buy_volume": 3.0, "volume": 0.0}]) is None
    assert parse_label("volume > 1").evaluate([{**bar, "volume": math.nan}]) is None
    assert parse_label("close / (high - high) > 1").evaluate([bar]) is None  # division by zero: unknown
    # three-valued logic: an unknown side decides nothing the other side does not
    assert parse_label("trades > 0 or close > 10").evaluate([bar]) is True
    assert parse_label("trades > 0 and close > 100").evaluate([bar]) is False
    assert parse_label("trades > 0 and close > 10").evaluate([bar]) is None
    assert parse_label("1 < close < 100").evaluate([bar]) is True  # chained: 1 < close and close < 100


def test_a_push_sized_evaluation_is_fast():
    import time

    bars = [{"open": 100.0 + i % 7, "high": 102.0 + i % 7, "low": 99.0, "close": 100.5 + i % 5, "volume": 1.0}
            for i in range(100)]
    label = parse_label("close > ema(close, 20) and std(ret(1), 20) > 0")
    start = time.perf_counter()
    for _ in range(20):
        label.evaluate(bars)
    assert (time.perf_counter() - start) / 20 < 0.005


def test_vectorised_sums_replay_pythons_compensated_sum(monkeypatch):
    """From Python 3.12 sum() of floats is Neumaier-compensated; the array path replays the same
    steps (checked here against a scalar transcription, which matches sum() on CPython 3.12 and 3.13)."""
    import numpy as np

    def scalar(values: list[float]) -> float:
        total, compensation = values[0], 0.0
        for x in values[1:]:
            t = total + x
            compensation += (total - t) + x if abs(total) >= abs(x) else (x - t) + total
            total = t
        return total + compensation if compensation != 0 and math.isfinite(compensation) else total

    rng = np.random.default_rng(3)
    values = rng.lognormal(10, 3, 4000) * rng.choice([-1.0, 1.0], 4000)
    monkeypatch.setattr(expressions_module, "_COMPENSATED_SUM", True)
    vectorised = expressions_module._window_sums(values, 25, len(values) - 24)
    assert vectorised.tolist() == [scalar(values[i:i + 25].tolist()) for i in range(len(values) - 24)]
    if sum([1e100, 1.0, -1e100]) == 1.0:  # this Python sums so: the very same bits
        assert vectorised.tolist() == [sum(values[i:i + 25].tolist()) for i in range(len(values) - 24)]


def test_label_parses_run_one_at_a_time_and_survive_cpythons_ast_depth_race(monkeypatch):
    """CPython 3.11's AST constructor keeps its recursion depth interpreter-wide (python/cpython#106905):
    sessions restored on several threads parsed labels at once and one failed with a SystemError."""
    import threading
    import time

    from streamllm.config import expressions

    real, inside, most = expressions._parse, [0], [0]

    def watched(text, mode="exec"):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # lets the other threads in, were they not held off
        inside[0] -= 1
        return real(text, mode=mode)

    monkeypatch.setattr(expressions, "_parse", watched)
    threads = [threading.Thread(target=parse_label, args=("close > ema(close, 50)",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1

    failures = iter([SystemError("AST constructor recursion depth mismatch (before=51, after=40)")])

    def racing(text, mode="exec"):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(text, mode=mode)

    monkeypatch.setattr(expressions, "_parse", racing)
    assert parse_label("ret(5) > 0").text == parse_label("ret(5) > 0").text  # tried again, then parsed
    monkeypatch.setattr(expressions, "_parse", lambda text, mode="exec": (_ for _ in ()).throw(SystemError("other")))
    with pytest.raises(SystemError, match="other"):
        expressions.parse_eval("ret(5) > 0")
