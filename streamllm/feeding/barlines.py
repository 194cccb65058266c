"""Rendered bar lines read back and checked: what a pushed line that claims to be a bar must hold.

A line claims to be a bar when it starts as feeding/render.py writes one and as the page's
chart reads it (service/bars.py): `[YYYY-MM-DDT]HH:MM[:SS][-HH:MM[:SS]] CLOSE ...`. Such a
line is read back into its bar, with the renderer's rules run backwards:

    close   as written
    prev    close - change (`changes = "bp"`: close / (1 + change / 10^4))
    open    prev + o (prev when there is no `o`)
    high    max(open, close) + h        low   min(open, close) + l  (l is written negative)
    volume  `v` with K/M/B units (`v?`: unknown)

and checked as the feeds check a bar (feeds/validate.py, the same wording): a real time of
day and calendar date, prices finite and > 0, volume >= 0, and not before the session's last
bar (the renderer dates the first line of each UTC day, so an undated line earlier than the
last bar goes back in time). Where the change unit is unknown (a session a client opened)
only the close and volume are checked. Tokens after the bar's own (a summary's
`(12 bars to 23:14)`, a client's note) are left alone, and lines that do not start like a bar
(trades, quotes, free text) are not bars: nothing here refuses them.
"""

from __future__ import annotations

import calendar
import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Any

from feeds.validate import BadValue, check_bar, nonnegative, positive

DAY_S = 86_400
# The chart's pattern (service/bars.py): a date, the open's clock, a span's end, the close.
BAR_HEAD = re.compile(r"(?:(\d{4})-(\d\d)-(\d\d)[T ])?((\d\d):(\d\d)(?::(\d\d))?)(?:-[\d:]+)? (-?\d+(?:\.\d+)?)(?= |$)")
_NUMBER = r"([+-]\d+(?:\.\d+)?)"
_CHANGE = re.compile(_NUMBER + r"\Z")
_OFFSET = re.compile(r"([ohl])" + _NUMBER + r"\Z")
_VOLUME = re.compile(r"v(-?\d+(?:\.\d+)?)([KMB]?)\Z")
_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9}


class BadBarLine(ValueError):
    """A pushed line that claims to be a bar and cannot be one: `index` in the batch and why."""

    def __init__(self, index: int, line: str, cause: BadValue) -> None:
        self.index, self.cause = index, cause
        shown = line if len(line) <= 60 else line[:57] + "..."
        super().__init__(f"lines[{index}] {shown!r}: {cause}")


@dataclass(frozen=True, slots=True)
class BarLine:
    midnight: int | None  # unix seconds of the line's date, None for an undated line
    seconds: int  # the open's time of day
    clock: str  # the time as written
    close: float
    open: float | None  # None: the change unit is unknown, so open/high/low are not read
    high: float | None
    low: float | None
    volume: float | None  # None: not written or unknown (`v?`)

    def time_after(self, last: float | None) -> float:
        """Unix seconds of the bar's open; an undated line is on the day of `last` (1970-01-01 without one)."""
        day = self.midnight if self.midnight is not None else (0 if last is None else int(last // DAY_S) * DAY_S)
        return float(day + self.seconds)


def read_bar_line(line: str, changes: str | None = "price") -> BarLine | None:
    """The bar a rendered line states, checked on its own (BadValue naming the field); None when
    the line does not claim to be a bar. `changes`: "price", "bp", or None when unknown."""
    m = BAR_HEAD.match(line)
    if m is None:
        return None
    year, month, mday, clock, hh, mm, ss, close_text = m.groups()
    midnight = None
    if year is not None:
        y, mo, d = int(year), int(month), int(mday)
        if not (y >= 1970 and 1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1]):
            raise BadValue("date", f"{year}-{month}-{mday}", "is not a calendar date (from 1970)", "bad_time")
        midnight = calendar.timegm((y, mo, d, 0, 0, 0))
    if int(hh) > 23 or int(mm) > 59 or int(ss or 0) > 59:
        raise BadValue("time", clock, "is not a time of day (00:00 to 23:59:59)", "bad_time")
    close = positive("close", float(close_text))
    words = line[m.end():].split()
    volume = _volume(words)
    if changes is None or not words or not _CHANGE.match(words[0]):  # `no trades`, or a unit not known
        return BarLine(midnight, int(hh) * 3600 + int(mm) * 60 + int(ss or 0), clock, close, None, None, None, volume)
    move = _mover(changes)
    change = float(words[0])
    prev = _previous(close, change, changes)
    offsets = {}
    for word in words[1:]:
        o = _OFFSET.match(word)
        if o is not None and o.group(1) not in offsets:
            offsets[o.group(1)] = float(o.group(2))
    open_ = positive("open", prev + move(offsets.get("o", 0.0), prev))
    top, bottom = max(open_, close), min(open_, close)
    high = positive("high", top + move(offsets.get("h", 0.0), prev))
    low = positive("low", bottom + move(offsets.get("l", 0.0), prev))
    check_bar(open_, high, low, close, 0.0 if volume is None else volume)
    return BarLine(midnight, int(hh) * 3600 + int(mm) * 60 + int(ss or 0), clock, close, open_, high, low, volume)


def _volume(words: list[str]) -> float | None:
    for word in words:
        v = _VOLUME.match(word)
        if v is not None:
            return nonnegative("volume", float(v.group(1)) * _UNITS[v.group(2)])
    return None


def _mover(changes: str):
    if changes == "bp":
        return lambda x, ref: x * abs(ref) / 1e4
    return lambda x, _ref: x


def _previous(close: float, change: float, changes: str) -> float:
    """The previous close a line's change implies (the open, when the line writes no `o`)."""
    if changes == "bp":
        scale = 1 + change / 1e4
        prev = close / scale if scale > 0 else -math.inf
    else:
        prev = close - change
    if not 0.0 < prev < math.inf:
        raise BadValue("change", change, f"puts the previous close at {prev:g} (close {close:g}): prices must be "
                                         "finite numbers > 0")
    return prev


def check_bar_lines(lines: list[Any], last: float | None, changes: str | None = "price") -> float | None:
    """Check each line of a batch that claims to be a bar, in order after `last` (unix seconds of the
    session's last bar open, None for none); BadBarLine for the first that is wrong. Returns the
    new last bar time."""
    for index, line in enumerate(lines):
        if not isinstance(line, str):  # the engine refuses it, naming it
            continue
        try:
            bar = read_bar_line(line, changes)
            if bar is None:
                continue
            t = bar.time_after(last)
            if last is not None and t < last:
                raise BadValue("time", bar.clock if bar.midnight is None else line.split(" ", 1)[0],
                               f"is before the previous bar ({_when(last, bar.midnight is None)}); bars go "
                               "in time order, and the first bar of a new day carries its date "
                               "(YYYY-MM-DDTHH:MM), as the feeds write it", "bad_time")
        except BadValue as exc:
            raise BadBarLine(index, line, exc) from None
        last = t
    return last


def _when(t: float, undated: bool) -> str:
    stamp = dt.datetime.fromtimestamp(t, dt.UTC)
    return stamp.strftime("%H:%M:%S") if undated or t < DAY_S else stamp.strftime("%Y-%m-%dT%H:%M:%S")
