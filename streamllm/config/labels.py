"""Ground-truth labels: named predicates over the most recent bars.

A label is written like a call, `trend_up(n=10)`, in a question's `label` key. Every
label is a yes/no predicate on the last bars; a labelled question has exactly two
choices and **`choices[0]` is the answer when the predicate holds, `choices[1]` when
it does not** (so `trend_up` pairs with `["up", "down"]` or `["yes", "no"]`).
With too few bars a label answers None (unknown), never a guess; so does a label that reads
volume (`reads_volume`) on bars whose volume is unknown (NaN: a bar table without volume).

Bars are duck-typed: objects with `open, high, low, close, volume` (and optionally
`vwap`), dicts with those keys, or a polars DataFrame with those columns; oldest
first.
"""

from __future__ import annotations

import ast
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BAR_FIELDS = ("open", "high", "low", "close", "volume")

# Bounds checked before the text reaches Python's parser, which answers a deep enough nesting with
# MemoryError or RecursionError instead of a SyntaxError. The longest label is some 30 characters
# (`volume_spike(k=3.0, n=20)`) and needs one bracket: `name(...)`.
MAX_LABEL_CHARS = 200
MAX_LABEL_DEPTH = 4  # brackets ( [ { inside one another


class LabelError(ValueError):
    """A label text that does not parse, or names an unknown label or parameter."""


@dataclass(frozen=True, slots=True)
class Bars:
    """Columns of the last bars, oldest first; `vwap` holds None where a bar has none."""

    open: list[float]
    high: list[float]
    low: list[float]
    close: list[float]
    volume: list[float]
    vwap: list[float | None]

    def __len__(self) -> int:
        return len(self.close)


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
    name: str
    doc: str
    params: tuple[ParamDef, ...]
    bars_needed: Callable[..., int]  # (**params) -> minimum number of bars
    predicate: Callable[..., bool | None]  # (Bars, **params) -> truth; None when undefined
    reads_volume: bool = False  # bars without volume (NaN: a table with no volume column) leave it unknown


@dataclass(frozen=True, slots=True)
class LabelSpec:
    """A parsed label: a definition plus its parameter values (in definition order).

    `bars_needed` is fixed when the label is parsed: the engine reads it to say an answer is
    warming up, and answering must never call into a label's functions."""

    name: str
    params: tuple[tuple[str, int | float], ...]
    bars_needed: int  # the fewest bars the label can judge (the definition's bars_needed(**params))

    @property
    def definition(self) -> LabelDef:
        return LABELS[self.name]

    @property
    def text(self) -> str:
        """Canonical text, every parameter spelled out: `trend_up(n=10)`."""
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.params)})"

    def evaluate(self, bars: Any) -> bool | None:
        """The predicate on the last bars; None when there are too few bars."""
        needed = self.bars_needed
        columns = to_columns(bars, last=needed)
        if len(columns) < needed:
            return None
        if self.definition.reads_volume and any(v != v for v in columns.volume):
            return None  # volume unknown (NaN): no truth to give, never a guess
        return self.definition.predicate(columns, **dict(self.params))

    def answer(self, bars: Any, choices: Sequence[str]) -> str | None:
        """The expected answer among two choices: choices[0] when true, choices[1] when false."""
        truth = self.evaluate(bars)
        if truth is None:
            return None
        return choices[0] if truth else choices[1]


# -- bars ------------------------------------------------------------------------------


def _field(bar: Any, name: str) -> Any:
    if isinstance(bar, Mapping):
        return bar.get(name)
    return getattr(bar, name, None)


def to_columns(bars: Any, last: int | None = None) -> Bars:
    """The last `last` bars (all when None) as float columns; raises TypeError on bad bars."""
    if isinstance(bars, Bars):
        return bars if last is None else _tail_columns(bars, last)
    if hasattr(bars, "columns") and hasattr(bars, "tail") and hasattr(bars, "get_column"):
        return _polars_columns(bars if last is None else bars.tail(last))
    if not isinstance(bars, Sequence):
        bars = list(bars)
    if last is not None:
        bars = bars[-last:] if last > 0 else bars[:0]
    cols: dict[str, list[Any]] = {name: [] for name in (*BAR_FIELDS, "vwap")}
    for i, bar in enumerate(bars):
        for name in BAR_FIELDS:
            value = _field(bar, name)
            if value is None:
                raise TypeError(f"bar {i} of the last {len(bars)} has no {name!r}: {bar!r}")
            cols[name].append(float(value))
        vwap = _field(bar, "vwap")
        cols["vwap"].append(None if vwap is None or vwap != vwap else float(vwap))
    return Bars(**cols)


def _tail_columns(bars: Bars, last: int) -> Bars:
    start = max(len(bars) - last, 0)
    return Bars(*(getattr(bars, name)[start:] for name in (*BAR_FIELDS, "vwap")))


def _polars_columns(frame: Any) -> Bars:
    missing = [name for name in BAR_FIELDS if name not in frame.columns]
    if missing:
        raise TypeError(f"bars frame lacks columns {missing}; has {list(frame.columns)}")
    cols = {name: [float(v) for v in frame.get_column(name).to_list()] for name in BAR_FIELDS}
    if "vwap" in frame.columns:
        cols["vwap"] = [None if v is None or v != v else float(v) for v in frame.get_column("vwap")]
    else:
        cols["vwap"] = [None] * len(cols["close"])
    return Bars(**cols)


# -- the labels ------------------------------------------------------------------------


def _trend_up(bars: Bars, n: int) -> bool:
    # Net move across the window: last close against the open of the first of the n bars.
    return bars.close[-1] > bars.open[-n]


def _above_sma(bars: Bars, n: int) -> bool:
    closes = bars.close[-n:]
    return closes[-1] > sum(closes) / n


def _above_vwap(bars: Bars, n: int) -> bool | None:
    # A bar without its own vwap contributes its typical price (h + l + c) / 3.
    volume = bars.volume[-n:]
    total = sum(volume)
    if total <= 0:
        return None  # no traded volume: vwap undefined
    prices = [
        v if v is not None else (h + lo + c) / 3
        for v, h, lo, c in zip(bars.vwap[-n:], bars.high[-n:], bars.low[-n:], bars.close[-n:],
                               strict=True)
    ]
    vwap = sum(p * q for p, q in zip(prices, volume, strict=True)) / total
    return bars.close[-1] > vwap


def _realized_vol(closes: list[float]) -> float:
    # Root mean square of simple close-to-close returns (no demeaning: robust on short windows).
    returns = [b / a - 1.0 for a, b in zip(closes, closes[1:], strict=False)]
    return math.sqrt(sum(r * r for r in returns) / len(returns))


def _volatility_rising(bars: Bars, n: int) -> bool | None:
    closes = bars.close[-(2 * n + 1):]
    if 0.0 in closes:
        return None  # a return from a zero close is undefined (a bad print, or a spread crossing zero)
    return _realized_vol(closes[n:]) > _realized_vol(closes[: n + 1])


def _volume_spike(bars: Bars, k: float, n: int) -> bool:
    baseline = sum(bars.volume[-(n + 1):-1]) / n
    return bars.volume[-1] > k * baseline


_N = ParamDef("n", int, 10, 1)
LABELS: dict[str, LabelDef] = {
    label.name: label
    for label in (
        LabelDef(
            "trend_up",
            "last close > open of the first of the last n bars",
            (_N,),
            lambda n: n,
            _trend_up,
        ),
        LabelDef(
            "above_sma",
            "last close > mean close of the last n bars",
            (ParamDef("n", int, 20, 1),),
            lambda n: n,
            _above_sma,
        ),
        LabelDef(
            "above_vwap",
            "last close > volume-weighted price of the last n bars (bar vwap, else typical price)",
            (ParamDef("n", int, 20, 1),),
            lambda n: n,
            _above_vwap,
            reads_volume=True,
        ),
        LabelDef(
            "volatility_rising",
            "RMS close-to-close return of the last n returns > that of the n before",
            (ParamDef("n", int, 20, 1),),
            lambda n: 2 * n + 1,
            _volatility_rising,
        ),
        LabelDef(
            "volume_spike",
            "last bar volume > k times the mean volume of the n bars before it",
            (ParamDef("k", float, 3.0, 0.0), ParamDef("n", int, 20, 1)),
            lambda k, n: n + 1,
            _volume_spike,
            reads_volume=True,
        ),
    )
}


# -- parsing ---------------------------------------------------------------------------


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    """Parse `name` or `name(k=v, ...)` (keyword arguments, number literals only)."""
    if not isinstance(text, str) or not text.strip():
        raise LabelError(f"label must be a non-empty string like 'trend_up(n=10)', got {text!r}")
    _check_size(text)
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):  # the bounds above keep the last two away
        raise LabelError(f"label {text!r} does not parse; write it like 'trend_up(n=10)'") from None
    if isinstance(node, ast.Name):
        name, keywords = node.id, []
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.args:
            raise LabelError(f"label {text!r}: pass parameters by name, like 'trend_up(n=10)'")
        name, keywords = node.func.id, node.keywords
    else:
        raise LabelError(f"label {text!r} does not parse; write it like 'trend_up(n=10)'")
    definition = LABELS.get(name)
    if definition is None:
        raise LabelError(
            f"unknown label {name!r}{_did_you_mean(name, LABELS)}; known: {', '.join(LABELS)}"
        )
    known = {p.name: p for p in definition.params}
    values: dict[str, int | float] = {}
    for keyword in keywords:
        if keyword.arg is None:
            raise LabelError(f"label {text!r}: '**' is not allowed")
        param = known.get(keyword.arg)
        if param is None:
            hint = _did_you_mean(keyword.arg, known) or f" ({name} takes {', '.join(known) or 'none'})"
            raise LabelError(f"label {text!r}: unknown parameter {keyword.arg!r}{hint}")
        if keyword.arg in values:
            raise LabelError(f"label {text!r}: parameter {keyword.arg} given twice")
        try:
            value = ast.literal_eval(keyword.value)
        except ValueError:
            raise LabelError(
                f"label {text!r}: parameter {keyword.arg} must be a number literal, "
                f"got {ast.unparse(keyword.value)!r}"
            ) from None
        values[keyword.arg] = param.coerce(value, text)
    params = tuple((p.name, values.get(p.name, p.default)) for p in definition.params)
    return LabelSpec(name, params, definition.bars_needed(**dict(params)))
