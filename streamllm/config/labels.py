"""Ground-truth labels: expressions over the bars, or a named label of the standard library.

A question's `label` key is either a named label written like a call, `trend_up(n=10)`, or an
expression of the label language (config/expressions.py, docs/questions.md), `close > ema(close, 50)`,
`max(high, +10) > close * 1.002`, `bucket(ret(10), [-0.001, 0.001])`. A yes/no label picks
**`choices[0]` when true, `choices[1]` when false**; a bucket picks `choices[index]`.

A label reads the `bars_needed` bars up to the one it judges and, a forecast, `horizon` bars after
it. With too few bars, an unknown column (volume NaN: a table without volume) or a future not in
yet, it answers None (unknown), never a guess.

Bars are duck-typed: objects with `open, high, low, close, volume` (and optionally `vwap`,
`trades`, `buy_volume` or `buy_share`), dicts with those keys, or a polars DataFrame with those
columns; oldest first.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamllm.config.expressions import (
    VOLUME_COLUMNS,
    LabelError,
    Node,
    compile_expression,
    did_you_mean,
    evaluate_rows,
    located,
    parse_eval,
    reach,
)

__all__ = ["BAR_FIELDS", "LABELS", "MAX_LABEL_CHARS", "MAX_LABEL_DEPTH", "Bars", "LabelDef", "LabelError",
           "LabelSpec", "ParamDef", "parse_label", "to_columns"]

BAR_FIELDS = ("open", "high", "low", "close", "volume")

# Bounds checked before the text reaches Python's parser, which answers a deep enough nesting with
# MemoryError or RecursionError instead of a SyntaxError. Real expressions are well inside them
# (`sqrt(mean(ret(1) * ret(1), 20)) > sqrt(mean(ret(1) * ret(1), 20)[-20])` nests 4 deep).
MAX_LABEL_CHARS = 300
MAX_LABEL_DEPTH = 8  # brackets ( [ { inside one another


@dataclass(frozen=True, slots=True)
class Bars:
    """Columns of the last bars, oldest first; None where a bar lacks an optional field
    (`vwap`, `trades`, `buy_share`)."""

    open: list[float]
    high: list[float]
    low: list[float]
    close: list[float]
    volume: list[float]
    vwap: list[float | None]
    trades: list[float | None] | None = None  # None: no bar has them
    buy_share: list[float | None] | None = None

    def __len__(self) -> int:
        return len(self.close)


_ALL_FIELDS = (*BAR_FIELDS, "vwap", "trades", "buy_share")


@dataclass(frozen=True, slots=True)
class ParamDef:
    name: str
    kind: type  # int or float
    default: int | float
    minimum: int | float  # inclusive

    def coerce(self, value: Any, label: str) -> int | float:
        ok_type = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type) or not math.isfinite(value):
            kind = "an integer" if self.kind is int else "a number"
            raise LabelError(f"label {label!r}: parameter {self.name} must be {kind}, got {value!r}")
        if value < self.minimum:
            raise LabelError(
                f"label {label!r}: parameter {self.name} must be >= {self.minimum}, got {value!r}"
            )
        return self.kind(value)


@dataclass(frozen=True, slots=True)
class LabelDef:
    """A named label of the standard library: an expression with parameters."""

    name: str
    doc: str
    params: tuple[ParamDef, ...]
    expression: Callable[..., str]  # (**params) -> the label's expression text


@dataclass(frozen=True, slots=True)
class LabelSpec:
    """A parsed label. Everything but the truths is fixed when it is parsed: the engine reads
    `bars_needed` to say an answer is warming up, and answering never calls into a label."""

    text: str  # canonical: `trend_up(n=10)`, or the expression as ast.unparse writes it
    name: str  # the standard library's name, or "expr"
    params: tuple[tuple[str, int | float], ...]  # a named label's parameters, in definition order
    bars_needed: int  # bars up to and including the judged one that the label reads
    horizon: int = 0  # bars after the judged one it reads (a forecast); 0 judges the present
    choice_count: int = 2  # a yes/no label: 2; bucket(x, edges): len(edges) + 1
    reads_volume: bool = False  # unknown on bars without volume (NaN: a table with no volume column)
    expression: str = ""  # what is evaluated (a named label's expression with its parameters)
    node: Node | None = field(default=None, compare=False, repr=False)

    @property
    def reach(self) -> int:
        """Bars before the judged one its value mostly rests on (an ema's n, not its warm-up): how many
        lines a head learned for it should read (engine/standing/learning.py)."""
        return reach(self._node())

    @property
    def yes_no(self) -> bool:
        """A yes/no label (True -> choices[0]); False for a bucket (index -> choices[index])."""
        return self._node().kind == "bool"

    # -- the newest bar ------------------------------------------------------------------

    def evaluate(self, bars: Any) -> bool | int | None:
        """Truth at the newest bar: a yes/no label's bool, a bucket's index; None with too few bars,
        or for a forecast (its future is not in)."""
        if self.horizon:
            return None
        return self.evaluate_at(bars, 0)

    def answer(self, bars: Any, choices: Sequence[str]) -> str | None:
        """The expected answer at the newest bar: choices[0] when true, choices[1] when false;
        a bucket's choices[index]."""
        return self._choice(self.evaluate(bars), choices)

    # -- a bar `back` bars before the newest ---------------------------------------------

    def evaluate_at(self, bars: Any, back: int) -> bool | int | None:
        """Truth at bars[-1 - back], reading bars up to the newest only; None while its future is
        not in (back < horizon) or with too few bars before it."""
        if back < 0:
            raise ValueError(f"back must be >= 0, got {back}")
        if back < self.horizon:
            return None
        if not _is_frame(bars) and not isinstance(bars, Bars | Sequence):
            bars = list(bars)
        length = bars.height if _is_frame(bars) else len(bars)
        if length < self.bars_needed + back:
            return None
        # Only the rows the label reads: bars_needed up to the judged bar, horizon after it.
        start = length - back - self.bars_needed
        columns = bar_arrays(_rows(bars, start, start + self.bars_needed + self.horizon))
        row = self.bars_needed - 1
        value = float(evaluate_rows(self._node(), columns, row, row)[0])
        if value != value:
            return None
        return value == 1.0 if self.yes_no else int(value)

    def answer_at(self, bars: Any, choices: Sequence[str], back: int) -> str | None:
        """The expected answer for the bar `back` bars before the newest (see evaluate_at)."""
        return self._choice(self.evaluate_at(bars, back), choices)

    # -- a whole table ------------------------------------------------------------------

    def truths(self, frame: Any) -> Any:
        """Every row's choice index (polars Int8; a yes/no label's 0 is true), null where unknown:
        warm-up rows, forecast rows whose future is beyond the table, unknown columns."""
        import polars as pl

        columns = bar_arrays(frame)
        length = len(columns["close"])
        values = evaluate_rows(self._node(), columns, 0, length - 1) if length else np.zeros(0)
        if self.yes_no:
            values = 1.0 - values  # true -> choices[0]
        values[: min(self.bars_needed - 1, length)] = np.nan
        if self.horizon:
            values[max(length - self.horizon, 0):] = np.nan
        return pl.Series("truth", values, dtype=pl.Float64).fill_nan(None).cast(pl.Int8)

    def _node(self) -> Node:
        assert self.node is not None, "a LabelSpec comes from parse_label"
        return self.node

    def _choice(self, truth: bool | int | None, choices: Sequence[str]) -> str | None:
        if truth is None:
            return None
        if isinstance(truth, bool):
            return choices[0] if truth else choices[1]
        return choices[truth]


# -- bars ------------------------------------------------------------------------------


def _field(bar: Any, name: str) -> Any:
    if isinstance(bar, Mapping):
        return bar.get(name)
    return getattr(bar, name, None)


def _known(value: Any) -> float | None:
    return None if value is None or value != value else float(value)


def _trades(bar: Any) -> float | None:
    count = _field(bar, "trades")  # feeds' Bar: -1 where the table had no count
    return None if count is None or count != count or count < 0 else float(count)


def _buy_share(bar: Any, volume: float) -> float | None:
    share = _field(bar, "buy_share")
    if share is not None:
        return _known(share)
    buy = _field(bar, "buy_volume")
    if buy is None or buy != buy or not volume > 0:
        return None
    return float(buy) / volume


def _is_frame(bars: Any) -> bool:
    return hasattr(bars, "columns") and hasattr(bars, "tail") and hasattr(bars, "get_column")


def to_columns(bars: Any, last: int | None = None) -> Bars:
    """The last `last` bars (all when None) as float columns; raises TypeError on bad bars."""
    if isinstance(bars, Bars):
        return bars if last is None else _tail_columns(bars, last)
    if _is_frame(bars):
        return _polars_columns(bars if last is None else bars.tail(last))
    if not isinstance(bars, Sequence):
        bars = list(bars)
    if last is not None:
        bars = bars[-last:] if last > 0 else bars[:0]
    cols: dict[str, list[Any]] = {name: [] for name in _ALL_FIELDS}
    for i, bar in enumerate(bars):
        for name in BAR_FIELDS:
            value = _field(bar, name)
            if value is None:
                raise TypeError(f"bar {i} of the last {len(bars)} has no {name!r}: {bar!r}")
            cols[name].append(float(value))
        cols["vwap"].append(_known(_field(bar, "vwap")))
        cols["trades"].append(_trades(bar))
        cols["buy_share"].append(_buy_share(bar, cols["volume"][-1]))
    return Bars(**cols)


def _rows(bars: Any, start: int, stop: int) -> Any:
    """Rows start..stop-1 of bars of any accepted kind (a frame, `Bars` or a sequence)."""
    if _is_frame(bars):
        return bars.slice(start, stop - start)
    if isinstance(bars, Bars):
        return Bars(*(None if (col := getattr(bars, name)) is None else col[start:stop] for name in _ALL_FIELDS))
    return bars[start:stop]


def _tail_columns(bars: Bars, last: int) -> Bars:
    return _rows(bars, max(len(bars) - last, 0), len(bars))


def _polars_columns(frame: Any) -> Bars:
    arrays = _frame_arrays(frame)
    cols: dict[str, Any] = {name: arrays[name].tolist() for name in BAR_FIELDS}
    for name in ("vwap", "trades", "buy_share"):
        cols[name] = [None if v != v else v for v in arrays[name].tolist()]
    return Bars(**cols)


def _frame_arrays(frame: Any) -> dict[str, np.ndarray]:
    missing = [name for name in BAR_FIELDS if name not in frame.columns]
    if missing:
        raise TypeError(f"bars frame lacks columns {missing}; has {list(frame.columns)}")

    def column(name: str) -> np.ndarray:
        return frame.get_column(name).cast(float).to_numpy().astype(np.float64, copy=True)

    nan = np.full(frame.height, np.nan)
    out = {name: column(name) for name in BAR_FIELDS}
    out["vwap"] = column("vwap") if "vwap" in frame.columns else nan
    out["trades"] = column("trades") if "trades" in frame.columns else nan.copy()
    out["trades"][out["trades"] < 0] = np.nan
    if "buy_share" in frame.columns:
        out["buy_share"] = column("buy_share")
    elif "buy_volume" in frame.columns:
        with np.errstate(divide="ignore", invalid="ignore"):
            out["buy_share"] = np.where(out["volume"] > 0, column("buy_volume") / out["volume"], np.nan)
    else:
        out["buy_share"] = nan.copy()
    return out


def bar_arrays(bars: Any, last: int | None = None) -> dict[str, np.ndarray]:
    """Every column of the label language as float arrays (NaN: unknown) for the last `last` bars."""
    if _is_frame(bars):
        out = _frame_arrays(bars if last is None else bars.tail(last))
    else:
        cols = to_columns(bars, last)
        out = {name: np.array(getattr(cols, name), dtype=np.float64) for name in BAR_FIELDS}
        length = len(cols)
        for name in ("vwap", "trades", "buy_share"):
            values = getattr(cols, name)
            out[name] = (np.full(length, np.nan) if values is None else
                         np.array([np.nan if v is None else v for v in values], dtype=np.float64))
    high, low, close = out["high"], out["low"], out["close"]
    # A bar without its own vwap contributes its typical price (h + l + c) / 3 (above_vwap's rule).
    out["vwap"] = np.where(np.isnan(out["vwap"]), (high + low + close) / 3, out["vwap"])
    out["range"] = high - low
    out["change"] = np.concatenate(([np.nan], np.diff(close))) if len(close) else close.copy()
    return out


# -- the standard library ---------------------------------------------------------------


def _trend_up(n: int) -> str:
    # Net move across the window: last close against the open of the first of the n bars.
    return "close > open" if n == 1 else f"close > open[-{n - 1}]"


def _volatility_rising(n: int) -> str:
    # RMS of simple close-to-close returns (no demeaning: robust on short windows); ret() is
    # unknown next to a zero close, so a zero close anywhere in the 2n + 1 leaves it unknown.
    rms = f"sqrt(mean(ret(1) * ret(1), {n}))"
    return f"{rms} > {rms}[-{n}]"


_N = ParamDef("n", int, 10, 1)
LABELS: dict[str, LabelDef] = {
    label.name: label
    for label in (
        LabelDef("trend_up", "last close > open of the first of the last n bars", (_N,), _trend_up),
        LabelDef("above_sma", "last close > mean close of the last n bars", (ParamDef("n", int, 20, 1),),
                 lambda n: f"close > sma(close, {n})"),
        LabelDef("above_vwap",
                 "last close > volume-weighted price of the last n bars (bar vwap, else typical price)",
                 (ParamDef("n", int, 20, 1),),
                 lambda n: f"close > sum(vwap * volume, {n}) / sum(volume, {n})"),
        LabelDef("volatility_rising", "RMS close-to-close return of the last n returns > that of the n before",
                 (ParamDef("n", int, 20, 1),), _volatility_rising),
        LabelDef("volume_spike", "last bar volume > k times the mean volume of the n bars before it",
                 (ParamDef("k", float, 3.0, 0.0), ParamDef("n", int, 20, 1)),
                 lambda k, n: f"volume > {k!r} * mean(volume, {n})[-1]"),
    )
}


# -- parsing ---------------------------------------------------------------------------


def _check_size(text: str) -> None:
    if len(text) > MAX_LABEL_CHARS:
        raise LabelError(f"label {text[:40]!r}... is {len(text)} characters, over the limit of "
                         f"{MAX_LABEL_CHARS}; write it like 'trend_up(n=10)'")
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth -= 1
    if deepest > MAX_LABEL_DEPTH:
        raise LabelError(f"label {text[:40]!r}... nests brackets {deepest} deep, over the limit of "
                         f"{MAX_LABEL_DEPTH}; write it like 'trend_up(n=10)'")


def parse_label(text: str) -> LabelSpec:
    """Parse a named label, `name` or `name(k=v, ...)` (keyword arguments, number literals only),
    or an expression of the label language; raises LabelError saying what and where."""
    if not isinstance(text, str) or not text.strip():
        raise LabelError(f"label must be a non-empty string like 'trend_up(n=10)', got {text!r}")
    _check_size(text)
    source = text.strip()
    try:
        node = parse_eval(source)
    except (RecursionError, MemoryError):  # the bounds above keep these away
        raise LabelError(f"label {text!r} does not parse; write it like 'trend_up(n=10)'") from None
    except SyntaxError:
        compile_expression(source, named=LABELS)  # raises, pointing at the error
        raise AssertionError("unreachable") from None
    if isinstance(node, ast.Name) and node.id in LABELS:
        return _named(source, node.id, [])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name in LABELS:
            if node.args:
                raise located(source, f"label {text!r}: pass parameters by name, like 'trend_up(n=10)'",
                              node.args[0].col_offset)
            return _named(source, name, node.keywords)
        if node.keywords and name not in ("bucket",):
            raise located(source, f"unknown label {name!r}{did_you_mean(name, LABELS)}; known: "
                                  f"{', '.join(LABELS)}", node.col_offset)
    return _expression(source, compile_expression(source, node, named=LABELS))


def _named(source: str, name: str, keywords: list[ast.keyword]) -> LabelSpec:
    definition = LABELS[name]
    known = {p.name: p for p in definition.params}
    values: dict[str, int | float] = {}
    for keyword in keywords:
        where = keyword.col_offset
        if keyword.arg is None:
            raise located(source, f"label {source!r}: '**' is not allowed", where)
        param = known.get(keyword.arg)
        if param is None:
            hint = did_you_mean(keyword.arg, known) or f" ({name} takes {', '.join(known) or 'none'})"
            raise located(source, f"label {source!r}: unknown parameter {keyword.arg!r}{hint}", where)
        if keyword.arg in values:
            raise located(source, f"label {source!r}: parameter {keyword.arg} given twice", where)
        try:
            value = ast.literal_eval(keyword.value)
        except ValueError:
            raise located(source, f"label {source!r}: parameter {keyword.arg} must be a number literal, "
                                  f"got {ast.unparse(keyword.value)!r}", keyword.value.col_offset) from None
        try:
            values[keyword.arg] = param.coerce(value, source)
        except LabelError as exc:
            raise located(source, str(exc), keyword.value.col_offset) from None
    params = tuple((p.name, values.get(p.name, p.default)) for p in definition.params)
    expression = definition.expression(**dict(params))
    spec = _expression(expression, compile_expression(expression))
    text = f"{name}({', '.join(f'{k}={v}' for k, v in params)})"
    return LabelSpec(text, name, params, spec.bars_needed, spec.horizon, spec.choice_count,
                     spec.reads_volume, expression, spec.node)


def _expression(source: str, node: Node) -> LabelSpec:
    text = ast.unparse(parse_eval(source))
    choices = len(node.value) + 1 if node.kind == "choice" else 2
    return LabelSpec(text, "expr", (), node.past + 1, node.future, choices,
                     bool(node.reads & VOLUME_COLUMNS), text, node)

