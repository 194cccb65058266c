"""Recorded sources: which reader a file needs, and one call that opens them all.

  *.gz, NAME.ws.N.M          raw websocket capture (feeds.capture; the second: cryptofeed's raw logs),
                             venue sniffed or given
  *.dbn, *.dbn.zst           Databento DBN (feeds.dbn): trades, MBP-1/BBO, OHLCV
  *.csv, *.tsv, *.txt (.gz), *.parquet  trades, quotes or bars table (feeds.tables), kind from its columns
  *.json                     a venue's REST kline/candle answer, saved (feeds.rest): bars

Each source has `stats` (a `ParseStats`): damaged lines, impossible values and missing
cells are counted there by kind, never raised past the source. A file that cannot be read
as asked at all (unknown format, ambiguous dates) raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feeds.capture import CaptureSource, read_capture
from feeds.columns import parse_columns
from feeds.rest import RestSource
from feeds.tables import TABLE_SUFFIXES, TableSource

__all__ = ["CaptureSource", "ReadOptions", "TableSource", "open_recorded", "open_source", "read_capture"]


@dataclass
class ReadOptions:
    """How to read recorded files: the CLI's --market, --columns, --time-format, --tz."""

    market: str = "spot"
    columns: Mapping[str, str] = field(default_factory=dict)
    time_format: str | None = None
    tz: str | None = None
    venue: str = "auto"  # captures: sniffed from the first messages
    instrument: str = ""  # tables without an instrument column
    bar_interval_s: float | None = None  # bar tables: None reads the interval from the bars' spacing
    signed_prices: bool = False  # tables: read prices at or below zero (futures spreads, WTI 2020)


_CRYPTOFEED_LOG = re.compile(r"\.ws\.\d+\.\d+$")  # cryptofeed's raw logs: BINANCE.ws.1.0, KRAKEN.ws.48.0


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".dbn", ".dbn.zst")):
        return "dbn"
    if name.endswith(TABLE_SUFFIXES):
        return "table"
    if name.endswith(".json"):
        return "rest"
    if name.endswith(".gz") or _CRYPTOFEED_LOG.search(name):
        return "capture"
    raise ValueError(f"{path}: unknown file format; expected a capture (.gz, or cryptofeed's NAME.ws.N.M), Databento DBN (.dbn, .dbn.zst), "
                     f"a table ({', '.join(TABLE_SUFFIXES)}), or a venue's REST kline/candle answer (.json)")


def open_source(path: str | Path, opts: ReadOptions | None = None, *, what: str = "feed") -> Any:
    """The source for one file (iterable of events, with `stats`)."""
    opts = opts or ReadOptions()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no file {path}")
    fmt = file_format(path)
    if fmt == "capture":
        return CaptureSource(path, venue=opts.venue, market=opts.market)
    if fmt == "rest":
        return RestSource(path, instrument=opts.instrument, bar_interval_s=opts.bar_interval_s)
    if fmt == "dbn":
        from feeds.dbn import DbnSource

        return DbnSource(path, signed_prices=opts.signed_prices)
    return TableSource(path, kind="auto", columns=dict(opts.columns), time_format=opts.time_format, tz=opts.tz,
                       instrument=opts.instrument, bar_interval_s=opts.bar_interval_s,
                       signed_prices=opts.signed_prices)


def open_recorded(paths: list[str | Path], opts: ReadOptions | None = None, *,
                  what: str = "feed") -> list[Iterable[Any]]:
    """Event streams for recorded files, each in receive order; merge them with feeds.replay.merge.
    Tables are read whole here, so a table that cannot be read fails before any replay starts."""
    sources: list[Iterable[Any]] = []
    for name in paths:
        src = open_source(name, opts, what=what)
        if isinstance(src, TableSource | RestSource):
            sources.append(_Loaded(src))  # read now: format errors surface before the replay
        else:
            sources.append(src)
    return sources


class _Loaded:
    """A table read once, iterable many times, keeping its stats and notes."""

    def __init__(self, table: TableSource | RestSource) -> None:
        self.table = table
        self.rows = table.events()
        self.stats = table.stats
        self.notes = table.notes
        self.path = table.path

    def __iter__(self):
        return iter(self.rows)


def read_options(args: Any, **kw: Any) -> ReadOptions:
    columns = getattr(args, "columns", None)  # one string, or a list from a repeated --columns
    opts = ReadOptions(market=getattr(args, "market", None) or "spot",
                       columns=parse_columns(",".join(columns) if isinstance(columns, list) else columns),
                       time_format=getattr(args, "time_format", None), tz=getattr(args, "tz", None),
                       signed_prices=bool(getattr(args, "signed_prices", False)))
    return dataclasses.replace(opts, **kw)
