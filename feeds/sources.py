"""Recorded sources: raw websocket captures and Parquet/CSV tables of trades, quotes, bars.

Raw captures are gzip text, one message per line: `<recv_ns> <raw json>` (the format of
../shared/data/binance-spot and of our recorder). They go through the same parser as the
live adapter, so a replay and a live session see identical events.

Tables are read with polars through a column mapping (our field -> file column); the bars
CSV of ../shared/data/bars loads as-is: `TableSource(path, "bar")`.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from feeds.events import UNKNOWN_SIDE, Bar, BookDelta, Quote, Trade, float_decimals, from_table
from feeds.wire import ParseStats, WireParser


def parser_for(venue: str, **kw: Any) -> WireParser:
    if venue == "binance":
        from feeds.binance import BinanceParser

        return BinanceParser(**kw)
    if venue == "coinbase":
        from feeds.coinbase import CoinbaseParser

        return CoinbaseParser(**kw)
    if venue == "kraken":
        from feeds.kraken import KrakenParser

        return KrakenParser(**kw)
    if venue == "alpaca":
        from feeds.alpaca import AlpacaParser

        return AlpacaParser(**kw)
    raise ValueError(f"unknown venue {venue!r} (binance, coinbase, kraken, alpaca)")


def read_capture(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """Yield (recv_ns, raw message) from a gzip capture; a line without a time is an error."""
    with gzip.open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            head, sep, raw = line.rstrip(b"\r\n").partition(b" ")
            if not sep or not head.isdigit():
                raise ValueError(f"{path}:{lineno}: expected '<recv_ns> <json>', got {line[:60]!r}")
            yield int(head), raw


@dataclass
class CaptureSource:
    """Events of a raw capture, parsed by the venue's live parser."""

    path: Path
    venue: str = "binance"
    parser: WireParser | None = None

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.parser is None:
            kw = {"symbol_hint": self.path.name.split("_")[0]} if self.venue == "binance" else {}
            self.parser = parser_for(self.venue, **kw)

    @property
    def stats(self) -> ParseStats:
        assert self.parser is not None
        return self.parser.stats

    def __iter__(self) -> Iterator[Any]:
        parse = self.parser.parse  # type: ignore[union-attr]
        for recv, raw in read_capture(self.path):
            yield from parse(raw, recv)


_KINDS = {"trade": Trade, "quote": Quote, "bar": Bar, "book": BookDelta}
# Column names tried when the mapping does not name a field.
_ALIASES: dict[str, tuple[str, ...]] = {
    "ts_event": ("ts_event", "timestamp", "time", "ts", "datetime", "date"),
    "size": ("size", "qty", "quantity", "amount", "volume"),
    "bid": ("bid", "bid_price", "bp"),
    "ask": ("ask", "ask_price", "ap"),
    "bid_size": ("bid_size", "bid_qty", "bs"),
    "ask_size": ("ask_size", "ask_qty", "as"),
}
_UNITS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def _ts_ns(col: pl.Series, unit: str | None, where: str) -> list[int]:
    if col.dtype == pl.Utf8:
        col = col.str.to_datetime(time_unit="ns", time_zone="UTC")
    if col.dtype.is_temporal():
        return col.cast(pl.Datetime("ns")).cast(pl.Int64).to_list()
    if not col.dtype.is_integer() and not col.dtype.is_float():
        raise ValueError(f"{where}: time column has type {col.dtype}, expected datetime or number")
    if unit is None:
        # Guess the unit from the magnitude of the first value (epoch 2001+).
        first = abs(float(col[0])) if len(col) else 0.0
        unit = "ns" if first > 1e17 else "us" if first > 1e14 else "ms" if first > 1e11 else "s"
    return (col.cast(pl.Float64) * _UNITS[unit]).round().cast(pl.Int64).to_list() if col.dtype.is_float() \
        else (col.cast(pl.Int64) * _UNITS[unit]).to_list()


def _dp(col: pl.Series) -> int:
    """Decimals the column needs: the most any of its first values shows."""
    sample = [v for v in col.head(2000).to_list() if v is not None and math.isfinite(v)]
    return max((float_decimals(float(v)) for v in sample), default=0)


@dataclass
class TableSource:
    """Trades, quotes or bars from Parquet or CSV via polars.

    `columns` maps our field names to the file's column names where they differ; fields
    the file lacks get "unknown" values (side 0, trade count -1, NaN VWAP and side split).
    Files written by `feeds.events.write_parquet` load with no mapping at all.
    """

    path: Path
    kind: str = "bar"
    columns: Mapping[str, str] = field(default_factory=dict)
    venue: str = "file"
    instrument: str = ""
    ts_unit: str | None = None
    bar_interval_s: float = 60.0
    bar_time: str = "open"  # does the bar's time column mark its open or its close?

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.kind not in _KINDS:
            raise ValueError(f"TableSource kind {self.kind!r}: one of {sorted(_KINDS)}")
        if not self.instrument:
            self.instrument = self.path.name.split("_")[0].split(".")[0].upper()

    def _frame(self) -> pl.DataFrame:
        if self.path.suffix == ".parquet":
            return pl.read_parquet(self.path)
        if self.path.suffix in (".csv", ".txt") or self.path.name.endswith(".csv.gz"):
            return pl.read_csv(self.path, try_parse_dates=False)
        raise ValueError(f"{self.path}: expected .parquet or .csv")

    def _col(self, df: pl.DataFrame, name: str, required: bool = True) -> pl.Series | None:
        if name in self.columns:
            if self.columns[name] not in df.columns:
                raise ValueError(f"{self.path}: mapped column {self.columns[name]!r} for {name} not in {df.columns}")
            return df[self.columns[name]]
        for alias in _ALIASES.get(name, (name,)):
            if alias in df.columns:
                return df[alias]
        if required:
            raise ValueError(f"{self.path}: no column for {self.kind} field {name!r} (columns {df.columns}); "
                             f"pass columns={{'{name}': '<column>'}}")
        return None

    def events(self) -> list[Any]:
        df = self._frame()
        kind = _KINDS[self.kind]
        if {"venue", "instrument", "ts_event", "ts_recv"} <= set(df.columns):
            return from_table(df.to_arrow(), kind)  # our own schema
        where = str(self.path)
        ts = _ts_ns(self._col(df, "ts_event"), self.ts_unit, where)  # type: ignore[arg-type]
        recv_col = self._col(df, "ts_recv", required=False)
        recv = _ts_ns(recv_col, self.ts_unit, where) if recv_col is not None else ts
        inst_col = self._col(df, "instrument", required=False)
        insts = inst_col.cast(pl.Utf8).to_list() if inst_col is not None else [self.instrument] * len(ts)
        v, n = self.venue, len(ts)

        def floats(name: str, default: float | None = None) -> list[float]:
            col = self._col(df, name, required=default is None)
            return [default] * n if col is None else col.cast(pl.Float64).to_list()  # type: ignore[list-item]

        if self.kind == "trade":
            px, sz = floats("price"), floats("size")
            side_col = self._col(df, "side", required=False)
            sides = side_col.cast(pl.Int8).to_list() if side_col is not None else [UNKNOWN_SIDE] * n
            pdp, sdp = _dp(pl.Series(px)), _dp(pl.Series(sz))
            return [Trade(v, insts[i], ts[i], recv[i], px[i], sz[i], sides[i], i, pdp, sdp) for i in range(n)]
        if self.kind == "quote":
            b, a, bs, as_ = floats("bid"), floats("ask"), floats("bid_size", 0.0), floats("ask_size", 0.0)
            pdp, sdp = max(_dp(pl.Series(b)), _dp(pl.Series(a))), _dp(pl.Series(bs))
            return [Quote(v, insts[i], ts[i], recv[i], b[i], bs[i], a[i], as_[i], pdp, sdp) for i in range(n)]
        if self.kind == "bar":
            nan = math.nan
            o, h, lo, c, vol = floats("open"), floats("high"), floats("low"), floats("close"), floats("volume")
            cnt_col = self._col(df, "trades", required=False)
            cnt = cnt_col.cast(pl.Int64).to_list() if cnt_col is not None else [-1] * n
            buy, sell, vwap = floats("buy_volume", nan), floats("sell_volume", nan), floats("vwap", nan)
            pdp = max(_dp(pl.Series(x)) for x in (o, h, lo, c))
            sdp = _dp(pl.Series(vol))
            iv = round(self.bar_interval_s * 1_000_000_000)
            shift = iv if self.bar_time == "open" else 0
            out = []
            for i in range(n):
                close_ns = ts[i] + shift
                out.append(Bar(v, insts[i], close_ns, max(recv[i], close_ns) if recv_col is None else recv[i],
                               close_ns - iv, iv, o[i], h[i], lo[i], c[i], vol[i], cnt[i], buy[i], sell[i],
                               vwap[i], pdp, sdp))
            return out
        raise ValueError(f"{where}: book deltas load only from our own Parquet schema")

    def __iter__(self) -> Iterator[Any]:
        return iter(self.events())


def open_recorded(paths: list[str | Path], *, what: str = "feed") -> list[Iterable[Any]]:
    """Event streams for recorded files: gzip captures through their venue's parser, tables
    (CSV/Parquet) by kind guessed from the name (trades, quotes, else bars). Merge them with
    feeds.replay.merge. A missing file is an error naming it."""
    sources: list[Iterable[Any]] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"{what}: no file {path}")
        if path.name.endswith(".gz"):
            sources.append(CaptureSource(path))
        else:
            kind = next((k for k in ("trade", "quote") if k in path.name.lower()), "bar")
            sources.append(TableSource(path, kind=kind).events())
    return sources
