"""Venues' REST kline/candle answers saved as JSON files, read as bars by the live adapters' own parsers.

Each response is turned into the websocket message the venue's parser already reads, so a bar
from a saved REST answer and one from the live feed are made by the same code:

  Binance  GET /api/v3/klines (/fapi/v1/klines)   [[openTime, o, h, l, c, v, closeTime, quoteVol,
                                                     trades, takerBuyBase, takerBuyQuote, ignore], ...]
                                                   -> kline events (feeds/binance.py)
  Kraken   GET /0/public/OHLC                      {"error": [], "result": {PAIR: [[time, o, h, l, c,
                                                     vwap, volume, count], ...], "last": id}}
                                                   -> v2 `ohlc` messages (feeds/kraken.py)
  Bybit    GET /v5/market/kline                    {"retCode": 0, "result": {"symbol", "category",
                                                     "list": [[start, o, h, l, c, volume, turnover], ...]}}
                                                   (newest first) -> `kline.I.S` messages (feeds/bybit.py)
  OKX      GET /api/v5/market/candles               {"code": "0", "data": [[ts, o, h, l, c, vol, volCcy,
                                                     volCcyQuote, confirm], ...]} (newest first)
                                                   -> `candleN` messages (feeds/okx.py)
  Coinbase GET /api/v3/brokerage/.../candles       {"candles": [{"start", "low", "high", "open", "close",
                                                     "volume"}, ...]} (newest first) -> `candles` (feeds/coinbase.py)

A REST answer holds the candle still filling when it was asked for. What says a candle is closed
is the venue's: OKX's `confirm`; Kraken documents its last entry as the frame not yet committed,
and its parser (as Coinbase's) emits a candle once a later one begins, so the newest is held back;
Binance and Bybit candles count as closed when they ended by the file's modification time (when
the answer was saved). Candles left out are counted in `stats` as skipped on purpose.

The instrument: the response's own (Kraken's pair, Bybit's symbol), else `instrument`, else the
file name's first `_`-separated part (`btcusdt_1m.json` -> BTCUSDT). The interval: the venue's
(Binance's open and close times), else the most common spacing of the candles, else `bar_interval_s`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feeds.binance import BinanceParser
from feeds.bybit import BybitParser
from feeds.coinbase import CANDLE_NS, CoinbaseParser
from feeds.kraken import KrakenParser
from feeds.okx import OkxParser
from feeds.wire import ParseStats, UnsupportedFormat

S = 1_000_000_000
MS = 1_000_000
SUPPORTED = ("Binance klines, Kraken OHLC, Bybit v5 kline, OKX v5 candles, Coinbase Advanced Trade candles")


def sniff_rest(doc: Any) -> str:
    """The venue whose REST candle answer `doc` is; UnsupportedFormat (or the venue's own error) otherwise."""
    if isinstance(doc, list):
        if doc and all(isinstance(r, list) and len(r) >= 11 for r in doc[:5]):
            return "binance"
        if doc and all(isinstance(r, list) and len(r) == 6 for r in doc[:5]):
            raise UnsupportedFormat("this looks like Coinbase Exchange's REST candles ([time, low, high, open, close, "
                                    f"volume]), which no live adapter reads; read are {SUPPORTED}")
    elif isinstance(doc, dict):
        if "error" in doc and isinstance(doc.get("result"), dict):
            if doc["error"]:
                raise ValueError(f"kraken answered with an error: {doc['error']}")
            return "kraken"
        if "retCode" in doc:
            if doc["retCode"] != 0:
                raise ValueError(f"bybit answered with an error: {doc['retCode']} {doc.get('retMsg', '')}")
            return "bybit"
        if "code" in doc and "data" in doc:
            if str(doc["code"]) != "0":
                raise ValueError(f"okx answered with an error: {doc['code']} {doc.get('msg', '')}")
            return "okx"
        if isinstance(doc.get("candles"), list):
            return "coinbase"
    raise UnsupportedFormat(f"not a REST kline/candle answer this reads ({SUPPORTED})")


def _spacing(starts_ns: list[int]) -> int | None:
    """The most common gap between consecutive candle starts (ns), None with fewer than two."""
    ordered = sorted(set(starts_ns))
    gaps = Counter(b - a for a, b in zip(ordered, ordered[1:], strict=False))
    return gaps.most_common(1)[0][0] if gaps else None


@dataclass
class RestSource:
    """Bars of one saved REST kline/candle answer (a .json file), by the venue's live parser."""

    path: Path
    instrument: str = ""
    bar_interval_s: float | None = None
    venue: str = ""
    stats: ParseStats = field(default_factory=ParseStats)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    def _symbol(self) -> str:
        return (self.instrument or self.path.name.split("_")[0].split(".")[0]).upper()

    def _interval(self, starts_ns: list[int]) -> int:
        spaced = _spacing(starts_ns)
        if spaced is not None:
            return spaced
        if self.bar_interval_s:
            return round(self.bar_interval_s * S)
        raise ValueError(f"{self.path}: one candle says nothing of its interval; pass the bar interval")

    def events(self) -> list[Any]:
        try:
            doc = json.loads(self.path.read_bytes())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path}: not JSON ({exc})") from exc
        try:
            self.venue = sniff_rest(doc)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}") from exc
        as_of = os.stat(self.path).st_mtime_ns  # when the answer was saved
        bars = getattr(self, "_" + self.venue)(doc, as_of)
        self.stats.events = len(bars)
        return bars

    def _parse(self, parser: Any, messages: list[dict[str, Any]], ts_recv: int) -> list[Any]:
        out: list[Any] = []
        for msg in messages:
            out += parser.parse(json.dumps(msg), ts_recv)
        self._merge(parser.stats)
        return out

    def _merge(self, stats: ParseStats) -> None:
        self.stats.messages += stats.messages
        self.stats.errors += stats.errors
        self.stats.error_samples += stats.error_samples
        for kind, n in stats.error_kinds.items():
            self.stats.error_kinds[kind] = self.stats.error_kinds.get(kind, 0) + n
        for kind, n in stats.control_kinds.items():
            self.stats.control_kinds[kind] = self.stats.control_kinds.get(kind, 0) + n
        self.stats.control += stats.control

    def _binance(self, rows: list[list[Any]], as_of: int) -> list[Any]:
        symbol = self._symbol()
        messages = [{"e": "kline", "E": r[6], "s": symbol, "k": {
            "t": r[0], "T": r[6], "s": symbol, "i": "", "f": -1, "L": -1, "o": r[1], "c": r[4], "h": r[2], "l": r[3],
            "v": r[5], "n": r[8], "x": (r[6] + 1) * MS <= as_of, "q": r[7], "V": r[9], "Q": r[10], "B": "0"}}
            for r in sorted(rows, key=lambda r: r[0])]
        return self._parse(BinanceParser(symbol_hint=symbol), messages, as_of)

    def _kraken(self, doc: dict[str, Any], as_of: int) -> list[Any]:
        pairs = [k for k, v in doc["result"].items() if k != "last" and isinstance(v, list)]
        if len(pairs) != 1:
            raise ValueError(f"{self.path}: kraken OHLC answer with {len(pairs)} pairs ({pairs}); one is read")
        pair, rows = pairs[0], sorted(doc["result"][pairs[0]], key=lambda r: int(r[0]))
        interval = self._interval([int(r[0]) * S for r in rows])
        minutes = interval // (60 * S)
        if minutes * 60 * S != interval:
            raise ValueError(f"{self.path}: kraken candles {interval / S:g} s apart; its OHLC intervals are whole minutes")
        candles = [{"symbol": pair, "open": float(r[1]), "high": float(r[2]), "low": float(r[3]), "close": float(r[4]),
                    "vwap": float(r[5]), "volume": float(r[6]), "trades": int(r[7]), "interval": minutes,
                    "interval_begin": dt.datetime.fromtimestamp(int(r[0]), dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000000000Z"),
                    "timestamp": ""} for r in rows]
        out = self._parse(KrakenParser(), [{"channel": "ohlc", "type": "snapshot", "data": candles}], as_of)
        if candles:
            self.stats.aside("open candle (the newest; Kraken: not yet committed)")
        return out

    def _bybit(self, doc: dict[str, Any], as_of: int) -> list[Any]:
        result = doc["result"]
        symbol = result.get("symbol") or self._symbol()
        rows = sorted(result["list"], key=lambda r: int(r[0]))
        interval = self._interval([int(r[0]) * MS for r in rows])
        if interval % (60 * S):
            raise ValueError(f"{self.path}: bybit klines {interval / S:g} s apart; kline intervals are whole minutes")
        minutes = str(interval // (60 * S))
        data = [{"start": int(r[0]), "end": int(r[0]) + interval // MS - 1, "interval": minutes, "open": r[1],
                 "close": r[4], "high": r[2], "low": r[3], "volume": r[5], "turnover": r[6],
                 "confirm": int(r[0]) * MS + interval <= as_of, "timestamp": int(r[0])} for r in rows]
        open_ = sum(not d["confirm"] for d in data)
        for _ in range(open_):
            self.stats.aside("unclosed kline")
        return self._parse(BybitParser(), [{"topic": f"kline.{minutes}.{symbol}", "type": "snapshot", "ts": as_of // MS,
                                            "data": data}], as_of)

    def _okx(self, doc: dict[str, Any], as_of: int) -> list[Any]:
        inst = self._symbol() if not self.instrument else self.instrument
        rows = sorted(doc["data"], key=lambda r: int(r[0]))
        interval = self._interval([int(r[0]) * MS for r in rows])
        channel = f"candle{interval // S}s" if interval % (60 * S) else f"candle{interval // (60 * S)}m"
        for r in rows:
            if len(r) >= 9 and r[8] != "1":
                self.stats.aside("unclosed kline")
        return self._parse(OkxParser(), [{"arg": {"channel": channel, "instId": inst}, "data": rows}], as_of)

    def _coinbase(self, doc: dict[str, Any], as_of: int) -> list[Any]:
        product = self._symbol() if not self.instrument else self.instrument
        candles = [{**c, "product_id": c.get("product_id", product)} for c in doc["candles"]]
        interval = self._interval([int(c["start"]) * S for c in candles])
        saved = dt.datetime.fromtimestamp(as_of // S, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        bars = self._parse(CoinbaseParser(), [{"channel": "candles", "timestamp": saved,
                                               "events": [{"type": "snapshot", "candles": candles}]}], as_of)
        if candles:
            self.stats.aside("open candle (the newest, held as the live feed holds it)")
        if interval != CANDLE_NS:  # the websocket's candles are 5 minutes; REST asks for its granularity
            bars = [dataclasses.replace(b, ts_event=b.ts_open + interval, interval_ns=interval,
                                        ts_recv=max(b.ts_recv, b.ts_open + interval)) for b in bars]
        return bars

    def __iter__(self) -> Iterator[Any]:
        return iter(self.events())
