"""Normalized market events: what every parser, source and generator produces.

All timestamps are integer nanoseconds since the Unix epoch: `ts_event` is the venue's
time (when the venue gives one), `ts_recv` the local receive time. Prices and sizes are
floats plus the number of significant decimals of the venue's string (`px_dp`, `sz_dp`),
so rendering can print exactly what the venue sent without float-repr noise.

Each type has an Arrow schema; `to_table` / `from_table` convert lists of events, and
`write_parquet` / `read_parquet` round-trip any homogeneous stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

# Aggressor side of a trade: +1 buyer lifted the ask, -1 seller hit the bid, 0 unknown.
BUY, SELL, UNKNOWN_SIDE = 1, -1, 0


@dataclass(slots=True)
class Trade:
    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    price: float
    size: float
    side: int
    trade_id: int | str
    px_dp: int = 2
    sz_dp: int = 4


@dataclass(slots=True)
class Quote:
    """Best bid and offer."""

    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    bid: float
    bid_size: float
    ask: float
    ask_size: float
    px_dp: int = 2
    sz_dp: int = 4


@dataclass(slots=True)
class Bar:
    """OHLCV over [ts_open, ts_open + interval_ns). `ts_event` is the bar's close time.

    `trades == 0` marks an explicit empty interval: OHLC then all equal the previous
    close and volumes are zero, so a consumer sees the gap instead of a silent skip.
    """

    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    ts_open: int
    interval_ns: int
    open: float
    high: float
    low: float
    close: float
    volume: float
    trades: int
    buy_volume: float
    sell_volume: float
    vwap: float
    px_dp: int = 2
    sz_dp: int = 4


@dataclass(slots=True)
class BookDelta:
    """One book message: changed levels (size 0 removes a level) or a full snapshot.

    `first_seq`/`last_seq` are the venue's update ids when it gives them (else 0).
    """

    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    bids: list[tuple[float, float]]
    asks: list[tuple[float, float]]
    first_seq: int = 0
    last_seq: int = 0
    snapshot: bool = False


@dataclass(slots=True)
class Mark:
    """A futures mark price (Binance markPriceUpdate): mark, index, funding rate (NaN: unknown)."""

    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    mark: float
    index: float
    funding_rate: float
    next_funding_ns: int = 0
    px_dp: int = 2


@dataclass(slots=True)
class Liquidation:
    """A forced order (Binance forceOrder): `side` is the liquidation order's side (SELL: a
    long was closed), `price` its average fill price, `size` the quantity filled so far."""

    venue: str
    instrument: str
    ts_event: int
    ts_recv: int
    price: float
    size: float
    side: int
    px_dp: int = 2
    sz_dp: int = 4


Event = Trade | Quote | Bar | BookDelta | Mark | Liquidation
EVENT_TYPES: dict[str, type] = {"trade": Trade, "quote": Quote, "bar": Bar, "book": BookDelta, "mark": Mark,
                                "liquidation": Liquidation}

_LEVELS = pa.list_(pa.struct([("price", pa.float64()), ("size", pa.float64())]))
_COMMON = [
    ("venue", pa.dictionary(pa.int16(), pa.string())),
    ("instrument", pa.dictionary(pa.int32(), pa.string())),
    ("ts_event", pa.int64()),
    ("ts_recv", pa.int64()),
]
SCHEMAS: dict[type, pa.Schema] = {
    Trade: pa.schema(
        _COMMON
        + [
            ("price", pa.float64()),
            ("size", pa.float64()),
            ("side", pa.int8()),
            ("trade_id", pa.string()),
            ("px_dp", pa.int8()),
            ("sz_dp", pa.int8()),
        ]
    ),
    Quote: pa.schema(
        _COMMON
        + [
            ("bid", pa.float64()),
            ("bid_size", pa.float64()),
            ("ask", pa.float64()),
            ("ask_size", pa.float64()),
            ("px_dp", pa.int8()),
            ("sz_dp", pa.int8()),
        ]
    ),
    Bar: pa.schema(
        _COMMON
        + [
            ("ts_open", pa.int64()),
            ("interval_ns", pa.int64()),
            ("open", pa.float64()),
            ("high", pa.float64()),
            ("low", pa.float64()),
            ("close", pa.float64()),
            ("volume", pa.float64()),
            ("trades", pa.int64()),
            ("buy_volume", pa.float64()),
            ("sell_volume", pa.float64()),
            ("vwap", pa.float64()),
            ("px_dp", pa.int8()),
            ("sz_dp", pa.int8()),
        ]
    ),
    BookDelta: pa.schema(
        _COMMON
        + [
            ("bids", _LEVELS),
            ("asks", _LEVELS),
            ("first_seq", pa.int64()),
            ("last_seq", pa.int64()),
            ("snapshot", pa.bool_()),
        ]
    ),
    Mark: pa.schema(
        _COMMON
        + [
            ("mark", pa.float64()),
            ("index", pa.float64()),
            ("funding_rate", pa.float64()),
            ("next_funding_ns", pa.int64()),
            ("px_dp", pa.int8()),
        ]
    ),
    Liquidation: pa.schema(
        _COMMON
        + [
            ("price", pa.float64()),
            ("size", pa.float64()),
            ("side", pa.int8()),
            ("px_dp", pa.int8()),
            ("sz_dp", pa.int8()),
        ]
    ),
}


def decimals(text: str) -> int:
    """Significant decimals of a venue number string ("61837.63000000" -> 2)."""
    dot = text.find(".")
    if dot < 0:
        return 0
    return len(text.rstrip("0")) - dot - 1


def number_decimals(value: str | float) -> int:
    """Significant decimals of a venue number, sent as a string ("61837.630") or a JSON number (61837.63)."""
    return decimals(value) if isinstance(value, str) else float_decimals(value)


def float_decimals(value: float) -> int:
    """Significant decimals of a JSON float (venues like Kraken send numbers, not strings)."""
    text = repr(value)
    if "e" in text or "E" in text:
        mant, _, exp = text.lower().partition("e")
        return max(0, decimals(mant) - int(exp))
    return decimals(text)


def to_table(events: Iterable[Any], kind: type | None = None) -> pa.Table:
    """Events of one type -> Arrow table with that type's schema."""
    events = list(events)
    if kind is None:
        if not events:
            raise ValueError("to_table: empty event list needs an explicit kind")
        kind = type(events[0])
    schema = SCHEMAS[kind]
    names = [f.name for f in fields(kind)]
    columns: dict[str, list[Any]] = {n: [] for n in names}
    for ev in events:
        if type(ev) is not kind:
            raise TypeError(f"to_table: mixed event types ({kind.__name__} and {type(ev).__name__})")
        for n in names:
            columns[n].append(getattr(ev, n))
    if kind is Trade:
        columns["trade_id"] = [str(t) for t in columns["trade_id"]]
    if kind is BookDelta:
        for side in ("bids", "asks"):
            columns[side] = [[{"price": p, "size": s} for p, s in lv] for lv in columns[side]]
    return pa.Table.from_pydict(columns, schema=schema)


def from_table(table: pa.Table, kind: type) -> list[Any]:
    """Arrow table (our schema, or any table with those column names) -> events."""
    names = [f.name for f in fields(kind)]
    missing = [n for n in names if n not in table.column_names and n not in ("px_dp", "sz_dp")]
    if missing:
        raise ValueError(f"from_table: {kind.__name__} table lacks columns {missing}")
    cols = {n: table.column(n).to_pylist() for n in names if n in table.column_names}
    out = []
    for i in range(table.num_rows):
        kw = {n: c[i] for n, c in cols.items()}
        if kind is Trade:
            kw["trade_id"] = _trade_id(kw["trade_id"])
        if kind is BookDelta:
            kw["bids"] = [(lv["price"], lv["size"]) for lv in kw["bids"]]
            kw["asks"] = [(lv["price"], lv["size"]) for lv in kw["asks"]]
        out.append(kind(**kw))
    return out


def _trade_id(text: str) -> int | str:
    # Integer ids (Binance, Kraken, Alpaca) come back as ints; zero-padded ids stay strings.
    if text.isdigit() and (text == "0" or text[0] != "0"):
        return int(text)
    return text


def write_parquet(events: Iterable[Any], path: str | Path, kind: type | None = None) -> int:
    table = to_table(events, kind)
    pq.write_table(table, str(path), compression="zstd")
    return table.num_rows


def read_parquet(path: str | Path, kind: type) -> list[Any]:
    return from_table(pq.read_table(str(path)), kind)
