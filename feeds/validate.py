"""Value checks at the source: an impossible number is refused with the field it came in.

A parser or table reader calls these before it builds an event; the `BadValue` it raises
is a `ValueError`, so the parsers' one except clause counts it (`ParseStats.error`, kind
`bad_<field>`, or `bad_bar` for a bar whose fields contradict each other) and the stream
goes on. The comparisons are written `0.0 < x < INF`, which is False for NaN too, so one
test per number covers negative, zero, NaN and infinite values.
"""

from __future__ import annotations

import math
from typing import Any

from feeds.events import BUY, SELL, UNKNOWN_SIDE

INF = math.inf


class BadValue(ValueError):
    """A value no venue can mean: `field` names it, `kind` is how errors are counted."""

    def __init__(self, field: str, value: Any, rule: str, kind: str = "") -> None:
        self.field = field
        self.kind = kind or f"bad_{field}"
        super().__init__(f"{self.kind}: {field}={value!r} {rule}")


def positive(field: str, x: float) -> float:
    if 0.0 < x < INF:
        return x
    raise BadValue(field, x, "must be a finite number > 0")


def price(field: str, x: float, signed: bool = False, kind: str = "") -> float:
    """A price read from a recorded file: > 0, or with `signed` (--signed-prices) any finite number
    (futures that went below zero, as WTI's May 2020 contract did; calendar spreads; power
    markets). The one rule for tables, DBN files and their bars."""
    if signed:
        if -INF < x < INF:
            return x
        raise BadValue(field, x, "must be a finite number", kind)
    if 0.0 < x < INF:
        return x
    raise BadValue(field, x, "must be a finite number > 0 (--signed-prices reads a market that goes below zero)",
                   kind)


def nonnegative(field: str, x: float) -> float:
    if 0.0 <= x < INF:
        return x
    raise BadValue(field, x, "must be a finite number >= 0")


def flag(field: str, value: Any) -> bool:
    if value is True or value is False:
        return value
    raise BadValue(field, value, "must be true or false")


def check_bar(o: float, h: float, lo: float, c: float, v: float, signed: bool = False) -> None:
    """Refuse a bar whose numbers cannot be: counted as `bad_bar`, naming the field. Prices are
    > 0 unless `signed` (see `price`)."""
    for name, x in (("open", o), ("high", h), ("low", lo), ("close", c)):
        price(name, x, signed, "bad_bar")
    if not 0.0 <= v < INF:
        raise BadValue("volume", v, "must be a finite number >= 0", "bad_bar")
    if h < lo:
        raise BadValue("high", h, f"is below low {lo!r}", "bad_bar")
    if not lo <= c <= h:
        raise BadValue("close", c, f"is outside [low {lo!r}, high {h!r}]", "bad_bar")
    if not lo <= o <= h:
        raise BadValue("open", o, f"is outside [low {lo!r}, high {h!r}]", "bad_bar")


# Aggressor side as venues and tables spell it.
SIDE_WORDS: dict[str, int] = {
    "buy": BUY, "b": BUY, "buyer": BUY, "bid": BUY, "1": BUY, "+1": BUY,
    "sell": SELL, "s": SELL, "seller": SELL, "ask": SELL, "a": SELL, "offer": SELL, "-1": SELL,  # A: Databento's ask
    "": UNKNOWN_SIDE, "0": UNKNOWN_SIDE, "unknown": UNKNOWN_SIDE, "n": UNKNOWN_SIDE, "none": UNKNOWN_SIDE,
}


def side_of(value: Any, field: str = "side") -> int:
    """BUYER/SELLER, buy/sell, B/S or B/A, bid/ask, 1/-1 (0, N or empty: unknown) -> BUY/SELL/UNKNOWN_SIDE."""
    if value is None:
        return UNKNOWN_SIDE
    if isinstance(value, bool):
        raise BadValue(field, value, "is a boolean: map a maker flag with columns side=~COLUMN")
    if isinstance(value, int | float):
        if value in (1, -1, 0):
            return int(value)
        raise BadValue(field, value, "must be 1 (buy), -1 (sell) or 0 (unknown)")
    side = SIDE_WORDS.get(str(value).strip().lower())
    if side is None:
        raise BadValue(field, value, "is not a side (buy/sell, BUYER/SELLER, B/S, bid/ask, 1/-1)")
    return side


def error_kind(exc: BaseException) -> str:
    """How a parse error is counted: `bad_<field>`/`bad_bar` for values, else the exception's class."""
    return getattr(exc, "kind", "") or type(exc).__name__
