"""How a text table is laid out: its separator, its header, the published layouts without one.

Tools write tables their own way: commas, tabs (MetaTrader 5's export), semicolons with
decimal commas (European spreadsheets), pipes; names in angle brackets (`<CLOSE>`); and
some publish files with no header at all (Binance's public data, Kraken's downloadable
history). This module says which, from the first two rows, before polars reads the file;
`feeds/tables.py` then maps the columns.
"""

from __future__ import annotations

import csv
import gzip
import re
from dataclasses import dataclass
from pathlib import Path

# Published tables without a header, known by column count and checked by their cells: Binance's
# public data (data.binance.vision, "Public data": klines, trades, aggTrades; spot files have no
# header) and Kraken's downloadable history (support.kraken.com: OHLCVT per pair and interval,
# `XBTUSD_60.csv`, and time & sales, `XBTUSD.csv`; times in epoch seconds).
HEADERLESS = {  # column count -> [(venue, file kind, columns, does a first row fit?)]
    12: [("binance", "klines", ("open_time", "open", "high", "low", "close", "volume", "close_time", "quote_volume",
                                "count", "taker_buy_volume", "taker_buy_quote_volume", "ignore"), lambda c: True)],
    7: [("binance", "trades", ("id", "price", "qty", "quote_qty", "time", "is_buyer_maker", "is_best_match"),
         lambda c: _is_bool(c[5])),
        ("kraken", "OHLCVT", ("time", "open", "high", "low", "close", "volume", "trades"),
         lambda c: _epoch_s(c[0]) and c[6].isdigit())],
    8: [("binance", "aggTrades", ("agg_trade_id", "price", "qty", "first_trade_id", "last_trade_id", "transact_time",
                                  "is_buyer_maker", "is_best_match"), lambda c: _is_bool(c[6]))],
    3: [("kraken", "trades", ("time", "price", "size"), lambda c: _epoch_s(c[0]))],
}
TABLE_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".txt", ".txt.gz", ".parquet")
SNIFF_ROWS = 100  # rows read to tell the layout (the separator: the first two)
SEPARATORS = ("\t", ";", "|", ",")  # tried in this order: a comma may be a decimal comma in a ';' table
_DATE_CELL = re.compile(r"^\d{1,4}[./-]\d{1,2}[./-]\d{1,4}([ T]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?)?$|^\d{1,2}:\d{2}(:\d{2})?$")
_DECIMAL_COMMA = re.compile(r"^-?\d+,\d+$")


def column_key(name: str) -> str:
    """How a column name is matched: case-blind, MetaTrader's angle brackets off (`<CLOSE>` is close)."""
    return name.strip().strip("<>").strip().lower()


def headerless(first: list[str]) -> tuple[str, str, tuple[str, ...]] | None:
    """(venue, file kind, columns) of the published layout a headerless first row fits, else None."""
    for venue, kind, columns, fits in HEADERLESS.get(len(first), []):
        if fits(first):
            return venue, kind, columns
    return None


# Kraken names its files by pair, and its OHLCVT files by pair and interval in minutes: XBTUSD.csv,
# XXBTZUSD_60.csv. A file named otherwise in the same shape (time, price, size is common) is read in
# that layout but not credited to Kraken.
_KRAKEN_NAME = re.compile(r"[A-Z0-9]{5,12}(_\d{1,5})?\.csv(\.gz)?")


def named_as_venue(venue: str, path: Path) -> bool:
    """Whether a headerless file's name is how `venue` names its published files (Kraken only checks)."""
    return venue != "kraken" or _KRAKEN_NAME.fullmatch(path.name) is not None


def known_headerless() -> str:
    return "; ".join(f"{v} {k}: {n} columns" for n, options in sorted(HEADERLESS.items()) for v, k, _, _ in options)


SEP_NAMES = {"\t": "tabs", ";": "semicolons", "|": "pipes", ",": "commas"}


@dataclass(frozen=True, slots=True)
class Layout:
    first: list[str]  # the first row's cells
    separator: str
    decimal_comma: bool
    encoding: str  # "utf-8" or "utf-16" (MetaTrader's and Excel's "Unicode text" exports)


def _opener(path: Path):
    return gzip.open if path.name.lower().endswith(".gz") else open


def _open_text(path: Path, encoding: str):
    return _opener(path)(path, "rt", encoding=encoding, errors="replace", newline="")


def encoding_of(path: Path) -> str:
    """UTF-16 when the file starts with its byte-order mark, else UTF-8 (a UTF-8 BOM is skipped)."""
    with _opener(path)(path, "rb") as f:
        head = f.read(2)
    return "utf-16" if head in (b"\xff\xfe", b"\xfe\xff") else "utf-8"


def sniff(path: Path) -> Layout:
    """How the file is written. The separator is the first of tab, ';', '|', ',' that splits the
    first two rows alike into two or more cells; a ';' table writes decimal commas when any of its
    first SNIFF_ROWS rows does (a first bar of whole numbers says nothing)."""
    encoding = encoding_of(path)
    with _open_text(path, "utf-8-sig" if encoding == "utf-8" else encoding) as f:
        rows = [r for r in (f.readline().rstrip("\r\n") for _ in range(SNIFF_ROWS)) if r]
    sep = ","
    for cand in SEPARATORS:
        counts = {len(next(csv.reader([r], delimiter=cand))) for r in rows[:2]}
        if len(counts) == 1 and counts.pop() >= 2:
            sep = cand
            break
    cells = [[c.strip() for c in row] for row in csv.reader(rows, delimiter=sep)] or [[""]]
    # Only a ';' table: that is the convention of locales that write decimal commas, and in a tab table
    # '12,345' is as likely a thousands separator, which must not silently become 12.345.
    decimal_comma = sep == ";" and any(_DECIMAL_COMMA.match(c) for row in cells for c in row)
    return Layout(cells[0], sep, decimal_comma, encoding)


def utf8_bytes(path: Path) -> bytes:
    """A UTF-16 table as UTF-8 for polars (which reads UTF-8 only); the whole file, in memory."""
    with _open_text(path, "utf-16") as f:
        return f.read().encode("utf-8")


def _is_bool(cell: str) -> bool:
    return cell.lower() in ("true", "false")


def _epoch_s(cell: str) -> bool:
    """Epoch seconds, 2001-2286 (Kraken's times), integral or with a fraction."""
    try:
        return 1e9 <= float(cell) < 1e10
    except ValueError:
        return False


def is_data_row(cells: list[str]) -> bool:
    """A first row of numbers and booleans only is data: no header names a column like that."""
    def value(cell: str) -> bool:
        if _is_bool(cell) or _DATE_CELL.match(cell):  # a date or a time names no column
            return True
        try:
            float(cell)
        except ValueError:
            return False
        return True

    return len(cells) > 1 and all(value(c.replace(",", ".") if _DECIMAL_COMMA.match(c) else c) for c in cells)
