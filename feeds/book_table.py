"""Order book tables: one changed price level a row, as Tardis.dev's `incremental_book_L2` CSVs
(exchange, symbol, timestamp, local_timestamp, is_snapshot, side, price, amount) and tables
like it are written.

A row's amount is the level's new size, not a change; 0 removes the level. Rows of one
instrument at one time are one `BookDelta`. A run of snapshot rows is one snapshot: the book
starts again there (Tardis: when is_snapshot turns true after updates, the book held so far
is void), and it stays one event even where its rows carry several times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from feeds.events import BookDelta
from feeds.validate import BadValue, nonnegative, positive

BIDS = frozenset({"bid", "bids", "buy", "b"})
ASKS = frozenset({"ask", "asks", "sell", "a", "offer"})
TRUE = frozenset({"true", "1", "t", "yes"})
FALSE = frozenset({"false", "0", "f", "no"})


def flag(value: Any) -> bool:
    """is_snapshot as written: a boolean, or true/false, 1/0, t/f, yes/no."""
    if value is True or value is False:
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise BadValue("is_snapshot", value, "must be true or false")


def book_deltas(venue: str, ts: Sequence[int | None], recv: Sequence[int | None], insts: Sequence[str],
                sides: Sequence[Any], prices: Sequence[float | None], sizes: Sequence[float | None],
                snapshots: Sequence[Any], bad: Callable[[int, Exception], None]) -> list[BookDelta]:
    """Rows -> BookDeltas in the order each began; `bad(row, error)` hears of each row not read."""
    out: list[BookDelta] = []
    open_: dict[str, tuple[BookDelta, int]] = {}  # instrument -> its delta being filled, and that delta's time
    for i in range(len(ts)):
        try:
            t, p, q = ts[i], prices[i], sizes[i]
            if t is None or p is None or q is None:
                raise BadValue("row", None, "is missing a time, price or amount", "missing_value")
            snapshot = flag(snapshots[i])
            side = str(sides[i]).strip().lower()
            if side not in BIDS and side not in ASKS:
                raise BadValue("side", sides[i], "is not a book side (bid/ask, buy/sell)")
            level = (positive("price", p), nonnegative("size", q))
        except BadValue as exc:
            bad(i, exc)
            continue
        inst = insts[i]
        current = open_.get(inst)
        joins = current is not None and current[0].snapshot == snapshot and (snapshot or current[1] == t)
        if not joins:
            delta = BookDelta(venue, inst, t, recv[i] if recv[i] is not None else t, [], [], 0, 0, snapshot)
            out.append(delta)
            current = open_[inst] = (delta, t)
        assert current is not None
        (current[0].bids if side in BIDS else current[0].asks).append(level)
    return out
