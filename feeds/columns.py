"""Reading a table's cells: the column mapping, times and price precision (polars).

- `parse_columns`: `--columns ts_event=time,close=Close`, refusing fields we do not have.
- `ts_ns`: a time column (epoch numbers, datetimes or text) -> ns since the epoch, UTC;
  a day/month-ambiguous date (`11/5/2019`) is refused with the `--time-format` the data proves;
  a year-first one (`2024.01.02`, MetaTrader's) is read as year, month, day.
- `infer_dp`: the fewest decimals at which every value round-trips, float32 text included.
"""

from __future__ import annotations

import math
import re
import struct

import polars as pl

FIELDS = {"ts_event", "ts_recv", "instrument", "price", "size", "side", "maker", "bid", "ask", "bid_size",
          "ask_size", "open", "high", "low", "close", "volume", "trades", "buy_volume", "sell_volume", "vwap",
          "venue", "snapshot"}
UNITS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]|$)")
_YEAR_FIRST = re.compile(r"^\s*\d{4}[./]\d{2}[./]\d{2}")  # 2024.01.02 (MetaTrader), 2024/01/02: unambiguous
_SLASHED = re.compile(r"^\s*(\d{1,2})([/.-])(\d{1,2})\2(\d{2,4})(?:[ T](\d{1,2}:\d{2}(:\d{2})?(\.\d+)?))?")


class TableFormatError(ValueError):
    """The table cannot be read as asked (ambiguous dates, missing columns): nothing is guessed."""


def parse_columns(text: str | None) -> dict[str, str]:
    """'ts_event=time,close=Close' -> {'ts_event': 'time', 'close': 'Close'}, refusing unknown fields."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        ours, sep, theirs = part.partition("=")
        ours, theirs = ours.strip(), theirs.strip()
        if not sep or not ours or not theirs:
            raise ValueError(f"--columns {text!r}: expected FIELD=COLUMN[,FIELD=COLUMN...], got {part!r}")
        if ours not in FIELDS:
            raise ValueError(f"--columns: unknown field {ours!r}; one of {', '.join(sorted(FIELDS))}")
        out[ours] = theirs
    return out


def infer_dp(values: list[float], float32: bool = False, max_dp: int = 12) -> int:
    """Fewest decimals at which every value round-trips (within the column's float precision).

    Text written from float32 (Yahoo's CSVs: 1248.810059 for 1248.81) is caught too: when every
    sampled value is exactly the float32 of a shorter decimal printed at the column's decimals,
    the shorter decimals are the data's."""
    sample = [v for v in values[:2000] if v is not None and math.isfinite(v)]
    dp = _round_trip_dp(sample, 2.0**-23 if float32 else 1e-12, max_dp)
    if float32 or dp == 0:
        return dp
    short = _round_trip_dp(sample, 2.0**-23, dp)
    if short < dp and all(round(_f32(round(v, short)), dp) == v for v in sample):
        return short
    return dp


def _round_trip_dp(sample: list[float], rel: float, max_dp: int) -> int:
    for dp in range(max_dp + 1):
        scale = 10.0**dp
        if all((v == 0 or round(v * scale) != 0) and abs(v * scale - round(v * scale)) <= 1e-9 + rel * abs(v * scale)
               for v in sample):
            return dp
    return max_dp


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _slashed_format(values: list[str], where: str) -> None:
    """Refuse day/month-ambiguous dates; say which order the data proves when it does."""
    first = next((v for v in values if v), "")
    m = _SLASHED.match(first)
    if not m:
        return
    a_max = b_max = 0
    for v in values:
        mv = _SLASHED.match(v or "")
        if mv:
            a_max, b_max = max(a_max, int(mv.group(1))), max(b_max, int(mv.group(3)))
    sep, year = m.group(2), "%Y" if len(m.group(4)) == 4 else "%y"
    clock = " %H:%M" + (":%S" if m.group(6) else "") + ("%.f" if m.group(7) else "") if m.group(5) else ""
    day_first = f"%d{sep}%m{sep}{year}{clock}"
    month_first = f"%m{sep}%d{sep}{year}{clock}"
    if a_max > 12:
        hint = f"the data shows a day above 12 first: pass --time-format '{day_first}'"
    elif b_max > 12:
        hint = f"the data shows a day above 12 second: pass --time-format '{month_first}'"
    else:
        hint = f"pass --time-format '{month_first}' (month first) or '{day_first}' (day first)"
    raise TableFormatError(f"{where}: dates like {first!r} do not say whether day or month comes first; {hint}")


def ts_ns(col: pl.Series, where: str, unit: str | None = None, time_format: str | None = None,
          tz: str | None = None, notes: list[str] | None = None) -> list[int | None]:
    """A time column -> ns since the epoch (UTC); None where the cell is empty."""
    if col.dtype == pl.Utf8:
        if time_format is not None and _ISO_DATE.match(next(iter(col.drop_nulls().head(1).to_list()), "")):
            # ISO 8601 says its own order: a format given for the other tables of one command
            # (month-first Yahoo dates beside ISO bars) applies only to text it fits.
            try:
                col.head(100).str.to_datetime(format=time_format, time_unit="ns", strict=True)
            except Exception:
                time_format = None
        if time_format is None and _YEAR_FIRST.match(next(iter(col.drop_nulls().head(1).to_list()), "")):
            col = col.str.replace(r"^\s*(\d{4})[./](\d{2})[./](\d{2})", "${1}-${2}-${3}")
        if time_format is None:
            _slashed_format(col.head(5000).to_list(), where)
        try:
            col = col.str.to_datetime(format=time_format, time_unit="ns", strict=True)
        except Exception as exc:  # polars' own message says which value failed
            raise TableFormatError(f"{where}: cannot read times like {col.drop_nulls().head(1).to_list()} "
                                   f"({str(exc).splitlines()[0]}); pass --time-format") from exc
    if col.dtype.is_temporal():
        if col.dtype == pl.Date:
            col = col.cast(pl.Datetime("ns"))
        if getattr(col.dtype, "time_zone", None) is None:
            if tz is None and notes is not None and len(col):
                notes.append(f"{where}: times carry no zone; read as UTC (pass --tz to say otherwise)")
            col = col.dt.replace_time_zone(tz or "UTC")
        return col.dt.convert_time_zone("UTC").dt.replace_time_zone(None).cast(pl.Datetime("ns")).cast(pl.Int64).to_list()
    if not col.dtype.is_integer() and not col.dtype.is_float():
        raise TableFormatError(f"{where}: time column has type {col.dtype}, expected datetime, text or number")
    if unit is None:
        # Guess the unit from the magnitude of the first value (epoch 2001+).
        first = next((abs(float(v)) for v in col.head(100).to_list() if v is not None), 0.0)
        unit = "ns" if first > 1e17 else "us" if first > 1e14 else "ms" if first > 1e11 else "s"
    if unit not in UNITS:
        raise ValueError(f"{where}: time unit {unit!r}: one of {', '.join(UNITS)}")
    # Non-finite or out-of-range times become empty cells, counted per row as missing_value.
    scale, x = UNITS[unit], pl.col("t")
    ok = x.abs() <= (2**63 - 1) // scale
    if col.dtype.is_float():
        ok, scaled = ok & x.is_finite(), (x * scale).round()
    else:
        x = x.cast(pl.Int64, strict=False)
        ok, scaled = x.is_not_null() & (x.abs() <= (2**63 - 1) // scale), x * scale
    frame = pl.DataFrame({"t": col})
    return frame.select(pl.when(ok).then(scaled).otherwise(None).cast(pl.Int64, strict=False)).to_series().to_list()
