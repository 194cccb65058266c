"""Databento DBN files (`.dbn`, `.dbn.zst`) read with Databento's own `databento-dbn` package.

The standard format of CME and US equities history. Records map to our events:

  trades (rtype MBP_0)   Trade: `side` is the aggressor (B buy, A sell, N unknown)
  tbbo                   Trade (the BBO before it is not an event of its own)
  mbp-1                  action T -> Trade; other actions -> Quote when the top of book changed
  bbo-1s/1m, cbbo        Quote of the top of book at the interval's end
  ohlcv-1s/1m/1h/1d      Bar (`ts_event` of the record is the interval's open)
  symbol mappings        instrument ids -> symbols (also from the file's metadata)

Prices are fixed-point integers scaled by 1e-9; a price's decimals are those of that
integer, so rendering shows exactly what the venue sent. An undefined price (an empty
side of the book) or an impossible value is a counted error; a file cut mid-record keeps
every whole record before the cut and counts `truncated_file`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import databento_dbn as dbn

from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, Quote, Trade
from feeds.validate import BadValue, check_bar, error_kind, price
from feeds.wire import ParseStats

SCALE = 1e-9
UNDEF = dbn.UNDEF_PRICE
_SIDES = {dbn.Side.BID: BUY, dbn.Side.ASK: SELL, dbn.Side.NONE: UNKNOWN_SIDE}
_BAR_NS = {"ohlcv-1s": 1_000_000_000, "ohlcv-1m": 60_000_000_000, "ohlcv-1h": 3_600_000_000_000,
           "ohlcv-1d": 86_400_000_000_000, "ohlcv-eod": 86_400_000_000_000}
CHUNK = 1 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def price_dp(raw: int) -> int:
    """Decimals of a 1e-9 fixed-point price: 4500250000000 -> 2 (4500.25)."""
    frac = raw % 1_000_000_000
    if frac == 0:
        return 0
    dp = 9
    while frac % 10 == 0:
        frac //= 10
        dp -= 1
    return dp


@dataclass
class DbnSource:
    """Events of a DBN file; `stats` counts records, events and errors by kind."""

    path: Path
    venue: str = ""  # default: the file's dataset (e.g. GLBX.MDP3)
    stats: ParseStats = field(default_factory=ParseStats)
    schema: str = ""
    symbols: dict[int, str] = field(default_factory=dict)
    _px_dp: dict[int, int] = field(default_factory=dict)
    _tob: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    _frac_dp: dict[int, int] = field(default_factory=dict)  # decimals per fractional part, cached
    signed_prices: bool = False  # prices at or below zero are read (CME's CL in April 2020, spreads)

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    def _decoder(self, head: bytes) -> Any:
        zst = head[:4] == ZSTD_MAGIC  # by content, not name: a .dbn may be compressed and vice versa
        return dbn.DBNDecoder(compression=dbn.Compression.ZSTD if zst else dbn.Compression.NONE)

    def __iter__(self) -> Iterator[Any]:
        read = 0
        with open(self.path, "rb") as fh:
            dec = self._decoder(fh.read(4))
            fh.seek(0)
            while True:
                chunk = fh.read(CHUNK)
                if not chunk:
                    break
                read += len(chunk)
                try:
                    dec.write(chunk)
                    records = dec.decode()
                except Exception as exc:  # DBNError: a bad header or record; nothing after it is readable
                    self.stats.error(f"{self.path}: not readable as DBN after {read} bytes "
                                     f"({self.stats.messages} records): {exc}", chunk[:60], "bad_dbn")
                    return
                yield from self._records(records)
        left = len(dec.buffer())
        if left:
            self.stats.error(f"{self.path}: ends mid-record ({left} bytes after record {self.stats.messages}); "
                             "the records before are kept", b"", "truncated_file")

    def _records(self, records: list[Any]) -> Iterator[Any]:
        handlers, stats = self._handlers, self.stats
        for rec in records:
            handler = handlers.get(type(rec))
            if handler is None:
                if isinstance(rec, dbn.Metadata):
                    self._metadata(rec)
                    continue
                handler = self._other
            stats.messages += 1
            try:
                ev = handler(rec)
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                stats.error(f"{self.path} record {stats.messages}: {exc}", str(rec)[:120], error_kind(exc))
                continue
            if ev is not None:
                stats.events += 1
                yield ev

    @property
    def _handlers(self) -> dict[type, Any]:
        h = self.__dict__.get("_h")
        if h is None:
            h = self.__dict__["_h"] = {
                dbn.TradeMsg: self._trade, dbn.MBP1Msg: self._mbp1, dbn.CMBP1Msg: self._mbp1,
                dbn.BBOMsg: self._bbo, dbn.CBBOMsg: self._bbo, dbn.OHLCVMsg: self._ohlcv,
                dbn.SymbolMappingMsg: self._mapping,
            }
        return h

    def _metadata(self, md: Any) -> None:
        self.schema = str(md.schema) if md.schema is not None else ""
        if not self.venue:  # every DBN stream starts with its metadata: set before any record
            self.venue = str(md.dataset or "") or "databento"
        for raw_symbol, intervals in (md.mappings or {}).items():
            for iv in intervals:
                sym = str(iv["symbol"])
                if sym.isdigit():  # raw symbol -> instrument id
                    self.symbols[int(sym)] = raw_symbol

    def _symbol(self, iid: int) -> str:
        return self.symbols.get(iid) or str(iid)

    def _px(self, field_name: str, raw: int, iid: int) -> float:
        if raw == UNDEF:
            raise BadValue(field_name, "UNDEF_PRICE", "is undefined (an empty side of the book)", "undefined_price")
        price(field_name, raw * SCALE, self.signed_prices)
        frac = raw % 1_000_000_000
        dp = self._frac_dp.get(frac)
        if dp is None:
            dp = self._frac_dp[frac] = price_dp(raw) if len(self._frac_dp) < 100_000 else 9
        if dp > self._px_dp.get(iid, -1):
            self._px_dp[iid] = dp
        return raw * SCALE

    def _trade(self, r: Any) -> Trade:
        iid = r.instrument_id
        px = self._px("price", r.price, iid)
        if r.size <= 0:
            raise BadValue("size", r.size, "must be > 0")
        return Trade(self.venue, self.symbols.get(iid) or str(iid), r.ts_event, r.ts_recv, px, float(r.size),
                     _SIDES.get(r.side, UNKNOWN_SIDE), r.sequence or self.stats.messages, self._px_dp[iid], 0)

    def _mbp1(self, r: Any) -> Trade | Quote | None:
        if r.action == dbn.Action.TRADE:
            return self._trade(r)
        return self._quote(r, r.ts_event, changed_only=True)

    def _bbo(self, r: Any) -> Quote | None:
        return self._quote(r, r.ts_recv, changed_only=False)  # ts_recv: the end of the interval

    def _quote(self, r: Any, ts: int, changed_only: bool) -> Quote | None:
        iid = r.instrument_id
        tob = (r.bid_px_00, r.bid_sz_00, r.ask_px_00, r.ask_sz_00)
        if changed_only and self._tob.get(iid) == tob:
            return None  # a book event below the top: the quote did not change
        self._tob[iid] = tob
        bid, ask = self._px("bid", tob[0], iid), self._px("ask", tob[2], iid)
        return Quote(self.venue, self._symbol(iid), ts, r.ts_recv, bid, float(tob[1]), ask, float(tob[3]),
                     self._px_dp[iid], 0)

    def _ohlcv(self, r: Any) -> Bar:
        iid = r.instrument_id
        iv = _BAR_NS.get(str(r.rtype))
        if iv is None:
            raise ValueError(f"unsupported OHLCV rtype {r.rtype}")
        o, h, lo, c = (self._px(n, getattr(r, n), iid) for n in ("open", "high", "low", "close"))
        check_bar(o, h, lo, c, float(r.volume), self.signed_prices)
        nan = float("nan")
        return Bar(self.venue, self._symbol(iid), r.ts_event + iv, r.ts_event + iv, r.ts_event, iv, o, h, lo, c,
                   float(r.volume), -1, nan, nan, nan, self._px_dp[iid], 0)

    def _mapping(self, r: Any) -> None:
        out_sym = str(r.stype_out_symbol)
        self.symbols[r.instrument_id] = str(r.stype_in_symbol) if out_sym.isdigit() else out_sym
        self.stats.aside("symbol mapping")
        return None

    def _other(self, r: Any) -> None:
        self.stats.aside(type(r).__name__)  # definitions, statistics, status, ...: not market events here
        return None
