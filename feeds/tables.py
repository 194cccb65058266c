"""Trades, quotes and bars from Parquet or CSV tables (polars), checked row by row.

A column mapping names the file's column for each of our fields where the aliases do not
find it (`--columns ts_event=time,close=Close`). What the source decides, so the renderer
never has to guess:

- Times: epoch numbers (unit from magnitude, or `ts_unit`), datetimes, or strings. A string
  like `11/5/2019 9:30` could be 11 May or 5 November: it is refused with a request for
  `--time-format` (naming the order the data proves, when a day above 12 proves one).
  Times without a zone are read in `tz` (default UTC, and `notes` says so).
- Missing cells (a row cut mid-line) and impossible values are counted errors naming the
  row and field (`missing_value`, `bad_price`, `bad_bar`, ...); the row is left out.
- Precision: the fewest decimals at which every sampled value round-trips, so float32 or
  Arrow float noise (0.029499000000000000915) renders as 0.029499; `precision` overrides.
- Bars: the interval is the most common spacing of the table's bars unless given, so hourly
  or daily tables need no flag. A pandas index written out (an unnamed first column) is the
  time column when no column is named like one.
- A side column may say BUYER/SELLER, buy/sell, B/S, bid/ask or 1/-1; a maker flag column
  (`is_buyer_maker`) maps too. A table without either leaves the side unknown, never "sell".
- Layouts as tools write them: UTF-8 or UTF-16 text; a comma, tab (MetaTrader), semicolon or pipe between cells
  (a semicolon table may write decimal commas); names in angle brackets (`<CLOSE>`); a
  date and a time of day in two columns (`<DATE>` `2024.01.02`, `<TIME>` `00:00:00`); a
  real-volume column of zeros beside a tick-volume one (MetaTrader's forex) reads the ticks;
  bars with no volume column at all (FX brokers' OHLC) read volume as unknown (NaN), and
  `notes` warns of that and of a volume column that is all zero.
- Headerless tables are read only in published layouts (Binance's public data, Kraken's
  downloadable OHLCVT and trades), each recognized by its column count *and* its cells;
  any other first row of data is refused with a request for a header.

Cells are read by `feeds/columns.py` (times, precision, the column mapping); the file's separator,
header and headerless layouts are told by `feeds/layouts.py`.
"""

from __future__ import annotations

import io
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from feeds.book_table import book_deltas
from feeds.columns import TableFormatError, infer_dp, ts_ns
from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, BookDelta, Quote, Trade, from_table
from feeds.layouts import (
    SEP_NAMES,
    TABLE_SUFFIXES,
    column_key,
    headerless,
    is_data_row,
    known_headerless,
    named_as_venue,
    sniff,
    utf8_bytes,
)
from feeds.validate import BadValue, check_bar, nonnegative, positive, price, side_of
from feeds.wire import ParseStats

KINDS = {"trade": Trade, "quote": Quote, "bar": Bar, "book": BookDelta}
# Column names tried when the mapping does not name a field.
ALIASES: dict[str, tuple[str, ...]] = {
    # window_start / sip_timestamp: Polygon's flat files; created_time: OKX's trade history; Gmt time: Dukascopy.
    "ts_event": ("ts_event", "timestamp", "time", "ts", "datetime", "date", "open_time", "transact_time",
                 "window_start", "sip_timestamp", "created_time", "gmt time"),
    "volume": ("volume", "vol", "real_volume"),
    "price": ("price", "px", "last"),
    "size": ("size", "qty", "quantity", "amount", "volume"),
    "trades": ("trades", "count", "number_of_trades", "num_trades", "trade_count", "transactions"),
    "buy_volume": ("buy_volume", "taker_buy_volume", "taker_buy_base_asset_volume", "taker_buy_base_volume"),
    "side": ("side", "aggressor", "aggressor_side", "taker_side"),
    "maker": ("is_buyer_maker", "isBuyerMaker", "buyer_maker", "is_buyer_market_maker"),
    # bid_amount, bids[0].price: Tardis.dev's quotes and book_snapshot_N files (their top level is the quote).
    "bid": ("bid", "bid_price", "bp", "bid_px_00", "bids[0].price"),
    "ask": ("ask", "ask_price", "ap", "ask_px_00", "asks[0].price"),
    "bid_size": ("bid_size", "bid_qty", "bs", "bid_sz_00", "bid_amount", "bids[0].amount"),
    "ask_size": ("ask_size", "ask_qty", "as", "ask_sz_00", "ask_amount", "asks[0].amount"),
    "instrument": ("instrument", "symbol", "ticker", "instrument_name", "instrument_id"),
    "ts_recv": ("ts_recv", "local_timestamp", "receive_time", "recv_time"),  # local_timestamp: Tardis.dev
    "venue": ("venue", "exchange"),
    "snapshot": ("is_snapshot", "snapshot"),
}
BOOK_COLUMNS = {"is_snapshot", "side", "price", "amount"}  # a book table: one changed level a row (Tardis.dev)
# A first column with one of these names is a dataframe's index written out (pandas' to_csv writes
# it with an empty header): when no time alias matches, it is the time column.
INDEX_NAMES = ("", "Unnamed: 0", "index", "__index_level_0__")
# Columns that hold a tick count where a forex source has no real volume (MetaTrader's <TICKVOL>).
TICK_VOLUME = ("tickvol", "tick_volume", "ticks")
NO_VOLUME = math.nan  # the one NaN object a table without a volume column fills its bars with
_TIME_OF_DAY = re.compile(r"^\s*\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?\s*$")


def guess_kind(columns: list[str]) -> str:
    names = {column_key(c) for c in columns}
    if {"open", "high", "low", "close"} <= names:
        return "bar"
    if names >= BOOK_COLUMNS:
        return "book"
    if names & {"bid", "bid_price", "bp", "bid_px_00", "bids[0].price"}:
        return "quote"
    return "trade"


@dataclass
class TableSource:
    """Trades, quotes or bars from Parquet or CSV via polars; bad rows are counted in `stats`.

    Fields the file lacks get "unknown" values (side 0, trade count -1, NaN VWAP and side
    split). Files written by `feeds.events.write_parquet` load with no mapping at all.
    """

    path: Path
    kind: str = "bar"  # or "auto": bar with open/high/low/close, quote with bid, else trade
    columns: Mapping[str, str] = field(default_factory=dict)
    venue: str = "file"
    instrument: str = ""
    ts_unit: str | None = None
    bar_interval_s: float | None = None  # None: the most common spacing of the table's own bars
    bar_time: str = "open"  # does the bar's time column mark its open or its close?
    time_format: str | None = None
    tz: str | None = None
    precision: tuple[int, int] | None = None  # (price, size) decimals; None: inferred
    signed_prices: bool = False  # prices at or below zero are read, not refused (feeds/validate.price)
    stats: ParseStats = field(default_factory=ParseStats)
    notes: list[str] = field(default_factory=list)
    _named: bool = field(default=False, init=False, repr=False)  # the caller gave the instrument

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._named = bool(self.instrument)
        if self.kind not in KINDS and self.kind != "auto":
            raise ValueError(f"TableSource kind {self.kind!r}: one of {sorted(KINDS)} or auto")
        if not self.instrument:
            self.instrument = self.path.name.split("_")[0].split(".")[0].upper()

    def _frame(self) -> pl.DataFrame:
        name = self.path.name.lower()
        try:
            if name.endswith(".parquet"):
                return pl.read_parquet(self.path)
            if name.endswith(TABLE_SUFFIXES):
                lay = sniff(self.path)
                source = self.path if lay.encoding == "utf-8" else io.BytesIO(utf8_bytes(self.path))
                if lay.encoding != "utf-8" or lay.separator != ",":
                    self.notes.append(f"{self.path}: " + ", ".join(
                        ([f"{lay.encoding.upper()} text"] if lay.encoding != "utf-8" else [])
                        + [f"cells separated by {SEP_NAMES[lay.separator]}"]
                        + (["numbers with a decimal comma"] if lay.decimal_comma else [])))
                read = dict(infer_schema_length=10_000, separator=lay.separator, decimal_comma=lay.decimal_comma)
                if not is_data_row(lay.first):
                    return pl.read_csv(source, try_parse_dates=False, **read)
                venue, kind, columns = self._headerless(lay.first)
                if named_as_venue(venue, self.path):
                    self.notes.append(f"{self.path}: no header; read as {venue.capitalize()} public data ({kind})")
                    if self.venue == "file":
                        self.venue = venue
                    if not self._named:  # BTCUSDT-1m-2024-08-08.csv, XBTUSD_60.csv
                        self.instrument = self.path.name.split("-" if venue == "binance" else "_")[0].split(".")[0].upper()
                else:  # the layout fits, the name is not the venue's
                    self.notes.append(f"{self.path}: no header; read in {venue.capitalize()}'s {kind} layout "
                                      f"({', '.join(columns)}), venue not assumed from it")
                    if not self._named:
                        self.instrument = self.path.name.split(".")[0]
                return pl.read_csv(source, has_header=False, new_columns=list(columns), **read)
        except TableFormatError:
            raise
        except Exception as exc:  # polars/IO errors: name the file, keep the cause
            raise TableFormatError(f"{self.path}: cannot read as a table: {str(exc).splitlines()[0]}") from exc
        raise TableFormatError(f"{self.path}: expected one of {', '.join(TABLE_SUFFIXES)}")

    def _headerless(self, first: list[str]) -> tuple[str, str, tuple[str, ...]]:
        found = headerless(first)
        if found is None:
            raise TableFormatError(
                f"{self.path}: the first row {','.join(first)[:80]!r} is data, not a header; headerless tables are "
                f"read only in published layouts ({known_headerless()}); add a header row naming the columns")
        return found

    def _col(self, df: pl.DataFrame, name: str, required: bool = True) -> pl.Series | None:
        if name in self.columns:
            if self.columns[name] not in df.columns:
                raise TableFormatError(f"{self.path}: mapped column {self.columns[name]!r} for {name} not in {df.columns}")
            return df[self.columns[name]]
        keys = _by_key(df)
        for alias in ALIASES.get(name, (name,)):
            if alias.lower() in keys:
                return df[keys[alias.lower()]]
        if name == "ts_event" and df.columns and df.columns[0] in INDEX_NAMES:
            self.notes.append(f"{self.path}: times read from the unnamed first column (a dataframe's index)")
            return df[df.columns[0]]
        if required:
            raise TableFormatError(f"{self.path}: no column for {self.kind} field {name!r} (columns {df.columns}); "
                                   f"pass --columns {name}=COLUMN")
        return None

    def events(self) -> list[Any]:
        df = self._frame()
        if self.kind == "auto":
            self.kind = guess_kind([*df.columns, *self.columns])  # a mapped field is there too
        kind = KINDS[self.kind]
        if {"venue", "instrument", "ts_event", "ts_recv"} <= set(df.columns):
            try:
                return from_table(df.to_arrow(), kind)  # our own schema
            except (ValueError, TypeError, KeyError) as exc:
                raise TableFormatError(f"{self.path}: looks like our own {self.kind} schema but: {exc}") from exc
        where = str(self.path)
        t = self._date_and_time(df)
        t = self._col(df, "ts_event") if t is None else t
        assert t is not None
        ts = ts_ns(t, f"{where} column {t.name!r}", self.ts_unit, self.time_format, self.tz, self.notes)
        recv_col = self._col(df, "ts_recv", required=False)
        recv = ts if recv_col is None else ts_ns(recv_col, where, self.ts_unit, self.time_format, self.tz)
        inst_col = self._col(df, "instrument", required=False)
        insts = inst_col.cast(pl.Utf8).to_list() if inst_col is not None else [self.instrument] * len(ts)
        venue_col = self._col(df, "venue", required=False)
        if venue_col is not None and self.venue == "file" and venue_col.n_unique() == 1 and venue_col[0]:
            self.venue = str(venue_col[0])  # Tardis.dev's exchange column: binance-futures, deribit, ...
        self.stats.messages = len(ts)
        rows = getattr(self, "_" + self.kind)(df, ts, recv, insts, recv_col is not None)
        self.stats.events = len(rows)
        return rows

    def _date_and_time(self, df: pl.DataFrame) -> pl.Series | None:
        """A date column and a time-of-day column (MetaTrader's <DATE> <TIME>, many brokers' Date,Time)
        are one time: joined as "DATE TIME" text. None when the table writes one time column."""
        if "ts_event" in self.columns:
            return None
        keys = _by_key(df)
        date, time_ = keys.get("date"), keys.get("time")
        if date is None or time_ is None or df[time_].dtype != pl.Utf8 or df[date].dtype != pl.Utf8:
            return None
        sample = df[time_].drop_nulls().head(100).to_list()
        if not sample or not all(_TIME_OF_DAY.match(v) for v in sample):
            return None
        self.notes.append(f"{self.path}: times joined from columns {date!r} and {time_!r}")
        joined = df.select(pl.concat_str([pl.col(date).str.strip_chars(), pl.col(time_).str.strip_chars()],
                                         separator=" ")).to_series()
        return joined.alias(f"{date} {time_}")

    def _volume(self, df: pl.DataFrame) -> tuple[list[Any], bool]:
        """The bars' volume; a real-volume column of zeros beside a tick-volume one reads the ticks
        (MetaTrader writes <VOL> 0 for forex, where only <TICKVOL> counts anything). A table with no
        volume at all (FX brokers' OHLC exports) reads as volume unknown (NaN), said in `notes`; one
        whose volumes are all zero is read as written, with a warning there."""
        keys = _by_key(df)
        ticks = next((keys[k] for k in TICK_VOLUME if k in keys), None)
        col = self._col(df, "volume", required="volume" in self.columns)
        if ticks is not None and "volume" not in self.columns and (col is None or _all_zero(col)):
            self.notes.append(f"{self.path}: volume read from {ticks!r} (a tick count, not traded units)"
                              + ("" if col is None else f": {col.name!r} is all zero"))
            col = df[ticks]
        if col is None:
            self.notes.append(f"{self.path}: warning: no volume column (columns {df.columns}): every bar's volume is "
                              "unknown, so questions about volume cannot be answered on these bars "
                              "(pass --columns volume=COLUMN if one holds it)")
            return [NO_VOLUME] * df.height, False
        if df.height and _all_zero(col):
            self.notes.append(f"{self.path}: warning: volume column {col.name!r} is all zero: questions about volume "
                              "would only score their base rate on these bars")
        return self._floats(col, "volume")

    # --- per kind: columns -> checked rows ---
    def _num(self, df: pl.DataFrame, name: str, required: bool = True) -> tuple[list[Any] | None, bool]:
        col = self._col(df, name, required)
        return (None, False) if col is None else self._floats(col, name)

    def _floats(self, col: pl.Series, name: str) -> tuple[list[Any], bool]:
        """A column's values as floats, and whether it was float32 (its text precision)."""
        try:
            return col.cast(pl.Float64).to_list(), col.dtype == pl.Float32
        except Exception as exc:
            raise TableFormatError(f"{self.path}: column {col.name!r} ({name}) is not numeric: {exc}") from exc

    def _bad(self, i: int, exc: Exception, kind: str = "") -> None:
        line = f"row {i + 1}"
        self.stats.error(f"{self.path} {line}: {exc}", line, kind or getattr(exc, "kind", "") or "bad_row")

    def _missing(self, i: int, named: dict[str, Any]) -> bool:
        gone = [k for k, v in named.items() if v is None]
        if gone:
            self.stats.error(f"{self.path} row {i + 1}: missing {', '.join(gone)}", f"row {i + 1}", "missing_value")
        return bool(gone)

    def _sides(self, df: pl.DataFrame, n: int) -> list[Any]:
        col = self._col(df, "side", required=False)
        if col is not None:
            if col.dtype == pl.Boolean:
                raise TableFormatError(f"{self.path}: side column {col.name!r} is boolean; if it is a maker flag "
                                       f"pass --columns maker={col.name}")
            return col.to_list()
        maker = self._col(df, "maker", required=False)
        if maker is None:
            return [UNKNOWN_SIDE] * n
        return [("m", v) for v in maker.to_list()]

    def _trade(self, df, ts, recv, insts, _has_recv) -> list[Trade]:
        (px, f32p), (sz, f32s) = self._num(df, "price"), self._num(df, "size")
        assert px is not None and sz is not None
        sides = self._sides(df, len(ts))
        pdp, sdp = self.precision or (infer_dp(px, f32p), infer_dp(sz, f32s))
        out, v = [], self.venue
        for i in range(len(ts)):
            if self._missing(i, {"ts_event": ts[i], "price": px[i], "size": sz[i]}):
                continue
            try:
                s = sides[i]
                side = (_maker(s[1]) if isinstance(s, tuple) else side_of(s))
                out.append(Trade(v, insts[i], ts[i], recv[i], price("price", px[i], self.signed_prices),
                                 positive("size", sz[i]), side, i, pdp, sdp))
            except BadValue as exc:
                self._bad(i, exc)
        return out

    def _quote(self, df, ts, recv, insts, _has_recv) -> list[Quote]:
        (b, f1), (a, f2) = self._num(df, "bid"), self._num(df, "ask")
        (bs, f3), (as_, _) = self._num(df, "bid_size", False), self._num(df, "ask_size", False)
        assert b is not None and a is not None
        n, sized = len(ts), bs is not None and as_ is not None
        if not sized:  # a table of prices only: sizes unknown (NaN), not zero; the lines leave them out
            bs, as_ = [math.nan] * n, [math.nan] * n
        assert bs is not None and as_ is not None
        pdp = self.precision[0] if self.precision else max(infer_dp(b, f1), infer_dp(a, f2))
        sdp = self.precision[1] if self.precision else (max(infer_dp(bs, f3), infer_dp(as_, f3)) if sized else 0)
        size = nonnegative if sized else (lambda _field, x: x)
        out = []
        for i in range(n):
            if self._missing(i, {"ts_event": ts[i], "bid": b[i], "ask": a[i], "bid_size": bs[i], "ask_size": as_[i]}):
                continue
            try:
                out.append(Quote(self.venue, insts[i], ts[i], recv[i], price("bid", b[i], self.signed_prices),
                                 size("bid_size", bs[i]), price("ask", a[i], self.signed_prices),
                                 size("ask_size", as_[i]), pdp, sdp))
            except BadValue as exc:
                self._bad(i, exc)
        return out

    def _book(self, df, ts, recv, insts, _has_recv) -> list[BookDelta]:
        (px, _), (sz, _) = self._num(df, "price"), self._num(df, "size")
        side = self._col(df, "side")
        snap = self._col(df, "snapshot")
        assert px is not None and sz is not None and side is not None and snap is not None
        return book_deltas(self.venue, ts, recv, insts, side.to_list(), px, sz, snap.to_list(), self._bad)

    def _bar(self, df, ts, recv, insts, has_recv) -> list[Bar]:
        cols = {k: self._num(df, k) for k in ("open", "high", "low", "close")} | {"volume": self._volume(df)}
        o, h, lo, c, vol = (cols[k][0] for k in ("open", "high", "low", "close", "volume"))
        no_volume = bool(vol) and vol[0] is NO_VOLUME  # the table has none: NaN, unknown (a NaN cell is still refused)
        n, nan = len(ts), math.nan
        cnt_col = self._col(df, "trades", required=False)
        cnt = cnt_col.cast(pl.Int64).to_list() if cnt_col is not None else [-1] * n
        buy, sell, vwap = (self._num(df, k, False)[0] or [nan] * n for k in ("buy_volume", "sell_volume", "vwap"))
        f32 = any(cols[k][1] for k in ("open", "high", "low", "close"))
        pdp, sdp = self.precision or (max(infer_dp(x, f32) for x in (o, h, lo, c)), infer_dp(vol, cols["volume"][1]))
        iv = round(self.bar_interval_s * 1_000_000_000) if self.bar_interval_s else self._spacing(ts, insts)
        shift = iv if self.bar_time == "open" else 0
        out = []
        for i in range(n):
            if self._missing(i, {"ts_event": ts[i], "open": o[i], "high": h[i], "low": lo[i], "close": c[i],
                                 "volume": vol[i]}):
                continue
            try:
                check_bar(o[i], h[i], lo[i], c[i], 0.0 if no_volume else vol[i], self.signed_prices)
            except BadValue as exc:
                self._bad(i, exc)
                continue
            close_ns = ts[i] + shift
            out.append(Bar(self.venue, insts[i], close_ns, recv[i] if has_recv else max(recv[i], close_ns),
                           close_ns - iv, iv, o[i], h[i], lo[i], c[i], vol[i], -1 if cnt[i] is None else cnt[i],
                           _nan(buy[i]), _nan(sell[i]), _nan(vwap[i]), pdp, sdp))
        return out

    def _spacing(self, ts: list[int | None], insts: list[str]) -> int:
        """The bar interval the table shows: the most common gap between an instrument's consecutive
        bars (daily bars over weekends: still a day). One bar alone says nothing: 60 s, noted."""
        last: dict[str, int] = {}
        gaps: Counter[int] = Counter()
        for t, inst in zip(ts[:20_000], insts[:20_000], strict=False):
            if t is None:
                continue
            prev = last.get(inst)
            if prev is not None and t > prev:
                gaps[t - prev] += 1
            last[inst] = t
        if not gaps:
            self.notes.append(f"{self.path}: too few bars to see their interval; taken as 60 s")
            return 60_000_000_000
        return gaps.most_common(1)[0][0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.events())


def _by_key(df: pl.DataFrame) -> dict[str, str]:
    """The frame's column names by how they are matched (`column_key`)."""
    return {column_key(c): c for c in df.columns}


def _all_zero(col: pl.Series) -> bool:
    return not (col.cast(pl.Float64, strict=False).fill_null(0) != 0).any()


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _maker(value: Any) -> int:
    """Buyer-is-maker flag -> aggressor side (the buyer made: the seller took)."""
    if value is True or value is False:
        return SELL if value else BUY
    text = str(value).strip().lower()
    if text in ("true", "1", "t"):
        return SELL
    if text in ("false", "0", "f"):
        return BUY
    raise BadValue("maker", value, "must be true or false")
