"""Shared wire-parsing pieces: JSON loader choice, parse statistics, RFC 3339 times.

Every venue parser follows one contract (`WireParser`): `parse(raw, ts_recv)` returns the
normalized events in one message and never raises on bad input; a malformed message is
counted in `stats` with a sample of what and why, so an adapter keeps running.
"""

from __future__ import annotations

import calendar
import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from feeds.events import Quote, number_decimals
from feeds.validate import error_kind, nonnegative, positive

# orjson parses exchange messages faster than the stdlib (`streamllm bench feeds` compares them).
Loads = Callable[[str | bytes], Any]
fast_loads: Loads = orjson.loads
stdlib_loads: Loads = json.loads

MAX_SAMPLES = 20


class AuthError(RuntimeError):
    """The venue refused our credentials; reconnecting will not help."""


class UnsupportedFormat(ValueError):
    """The message is a known format we do not read; the text says which and what is supported."""

    kind = "unsupported_format"


class VenueError(RuntimeError):
    """The venue reported an error that ends the session (bad subscription, limits)."""


@dataclass(slots=True)
class ParseStats:
    messages: int = 0
    events: int = 0
    control: int = 0
    errors: int = 0
    gaps: int = 0
    error_samples: list[str] = field(default_factory=list)
    gap_samples: list[str] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)  # bad_price, bad_bar, KeyError, ...
    gap_keys: dict[str, int] = field(default_factory=dict)  # "BTCUSDT@depth" -> gaps there
    # Records read and kept out on purpose, by kind ("block trade": not a market print). Neither an
    # error nor control: data this engine does not make events of, said so a user can count them.
    skipped: dict[str, int] = field(default_factory=dict)
    # Control messages by kind (heartbeat, subscription reply, unclosed kline, ...): read, understood,
    # no event. `control` counts them all; this says which they were, for `streamllm inspect`.
    control_kinds: dict[str, int] = field(default_factory=dict)

    def skip(self, kind: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1

    def aside(self, kind: str) -> None:
        """A control message read and set aside on purpose, named by kind."""
        self.control += 1
        self.control_kinds[kind] = self.control_kinds.get(kind, 0) + 1

    def error(self, reason: str, raw: str | bytes, kind: str = "") -> None:
        self.errors += 1
        if not kind:  # "<venue> <ExceptionClass> <detail>" -> the class
            parts = reason.split(" ", 2)
            kind = parts[1] if len(parts) > 1 else reason
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        if len(self.error_samples) < MAX_SAMPLES:
            head = raw[:120].decode("utf-8", "replace") if isinstance(raw, bytes) else raw[:120]
            self.error_samples.append(f"{reason}: {head!r}")

    def gap(self, where: str, expected: int, got: int) -> None:
        self.gaps += 1
        key = where.split(" ", 1)[0]
        self.gap_keys[key] = self.gap_keys.get(key, 0) + 1
        if len(self.gap_samples) < MAX_SAMPLES:
            self.gap_samples.append(f"{where}: expected {expected}, got {got}")

    def withdraw_gap(self, where: str, expected: int, got: int) -> None:
        """Take back a gap counted before later data showed nothing needed was lost (Binance: a break
        among updates that the next snapshot makes stale, feeds/books.py)."""
        self.gaps -= 1
        key = where.split(" ", 1)[0]
        left = self.gap_keys.get(key, 1) - 1
        if left > 0:
            self.gap_keys[key] = left
        else:
            self.gap_keys.pop(key, None)
        sample = f"{where}: expected {expected}, got {got}"
        if sample in self.gap_samples:
            self.gap_samples.remove(sample)

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "events": self.events,
            "control": self.control,
            "errors": self.errors,
            "gaps": self.gaps,
            "error_kinds": dict(self.error_kinds),
            "skipped": dict(self.skipped),
            "control_kinds": dict(self.control_kinds),
            "error_samples": list(self.error_samples),
            "gap_samples": list(self.gap_samples),
        }


# What a malformed message raises inside a parser: counted, never past it. AuthError is not one of
# them: no retry mends credentials, so it ends the connection.
PARSE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, VenueError)


class CountingParser:
    """The WireParser contract, kept once: every message counted, its events counted, and a bad one
    counted in `stats` with a sample named `<label> <Exception> <detail>` instead of raised. A venue's
    parser writes `_read(raw, ts_recv)` (its messages' events) and sets `label`."""

    label = ""  # how error samples name the format: binance, coinbase-exchange, ...

    def __init__(self, loads: Loads = fast_loads) -> None:
        self.loads = loads
        self.stats = ParseStats()

    def parse(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        self.stats.messages += 1
        try:
            out = self._read(raw, ts_recv)
        except PARSE_ERRORS as exc:
            self.stats.error(f"{self.label} {type(exc).__name__} {exc}", raw, error_kind(exc))
            return []
        self.stats.events += len(out)
        return out

    def _read(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        raise NotImplementedError

    def _object(self, raw: str | bytes) -> dict[str, Any]:
        """The message as a JSON object, as most venues send them; anything else is a ValueError."""
        msg = self.loads(raw)
        if not isinstance(msg, dict):
            raise ValueError(f"{self.label} messages are JSON objects, got {type(msg).__name__}")
        return msg


class OpenCandles:
    """Candles a venue resends as they fill (Coinbase candles, Kraken ohlc, OKX's before `confirm`):
    one is closed once a later one of the same key begins; a late resend of one closed is dropped."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[Any, tuple[Any, Any]] = {}  # key -> (start, the candle as last sent)

    def closed(self, key: Any, start: Any, candle: Any) -> Any:
        """The candle that this one, starting at `start`, closes (None if none); this one is then the open one."""
        pending = self._open.get(key)
        if pending is not None and start < pending[0]:
            return None
        self._open[key] = (start, candle)
        if pending is None or start == pending[0]:
            return None
        return pending[1]


class WireParser(Protocol):
    venue: str
    stats: ParseStats

    def parse(self, raw: str | bytes, ts_recv: int) -> list[Any]: ...


class SeqTracker:
    """Per-key contiguous sequence check: reports a gap when next != last + 1."""

    __slots__ = ("last", "stats")

    def __init__(self, stats: ParseStats) -> None:
        self.last: dict[str, int] = {}
        self.stats = stats

    def check(self, key: str, first: int, last: int | None = None) -> bool:
        prev = self.last.get(key)
        end = first if last is None else last
        if prev is not None and end <= prev:
            return True  # stale or already covered (e.g. by a snapshot): nothing missing
        self.last[key] = end
        # A range update may overlap what we have (Binance: U <= prev+1 <= u after a snapshot).
        if prev is not None and first > prev + 1:
            self.stats.gap(key, prev + 1, first)
            return False
        return True

    def reset(self) -> None:
        self.last.clear()


def text_quote(venue: str, instrument: str, ts_event: int, ts_recv: int, bid: str | float,
               bid_size: str | float | None, ask: str | float, ask_size: str | float | None) -> Quote:
    """A Quote from the numbers venues send (decimal strings, or JSON numbers as Kraken Futures sends
    them), checked (prices > 0, sizes >= 0) and at the decimals shown. Sizes may be left out (None:
    Coinbase tickers before 2022, Kraken v1 spreads before 2020, Kraken Futures' ticker_lite): then
    both are unknown, NaN."""
    if bid_size is None or ask_size is None:
        bq, aq, sz_dp = math.nan, math.nan, 4
    else:
        bq, aq = nonnegative("bid_size", float(bid_size)), nonnegative("ask_size", float(ask_size))
        sz_dp = max(number_decimals(bid_size), number_decimals(ask_size))
    return Quote(venue, instrument, ts_event, ts_recv, positive("bid", float(bid)), bq, positive("ask", float(ask)),
                 aq, max(number_decimals(bid), number_decimals(ask)), sz_dp)


_SECONDS_CACHE: dict[str, int] = {}


def epoch_ns(text: str) -> int:
    """'1618678142.557535' (seconds since the epoch, as Kraken v1 and cryptofeed's raw logs write
    them) -> ns, exactly: read as a float the last digits would be rounded away."""
    whole, dot, frac = text.strip().partition(".")
    if not whole.isdigit() or (dot and not (frac.isdigit() or frac == "")):
        raise ValueError(f"not seconds since the epoch: {text!r}")
    return int(whole) * 1_000_000_000 + int(frac[:9].ljust(9, "0") or 0)


def rfc3339_ns(text: str) -> int:
    """'2023-02-09T20:19:35.39625135Z' -> ns since epoch, keeping all nine digits.

    datetime.fromisoformat drops below microseconds; venues send nanoseconds.
    """
    if len(text) < 20 or text[10] not in "T ":
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    head = text[:19]
    secs = _SECONDS_CACHE.get(head)
    if secs is None:
        secs = calendar.timegm(
            (int(head[0:4]), int(head[5:7]), int(head[8:10]), int(head[11:13]), int(head[14:16]), int(head[17:19]))
        )
        if len(_SECONDS_CACHE) > 100_000:
            _SECONDS_CACHE.clear()
        _SECONDS_CACHE[head] = secs
    rest = text[19:]
    frac_ns = 0
    if rest.startswith("."):
        end = 1
        while end < len(rest) and rest[end].isdigit():
            end += 1
        digits = rest[1:end][:9]
        frac_ns = int(digits.ljust(9, "0")) if digits else 0
        rest = rest[end:]
    offset = 0
    if rest and rest not in ("Z", "z"):
        sign = 1 if rest[0] == "+" else -1
        hh, _, mm = rest[1:].partition(":")
        offset = sign * (int(hh) * 3600 + int(mm or 0) * 60)
    return (secs - offset) * 1_000_000_000 + frac_ns


# Each wire format's parser, imported when first asked for (a replay of one venue loads only its own).
PARSERS = {
    "binance": ("feeds.binance", "BinanceParser"),
    "bybit": ("feeds.bybit", "BybitParser"),
    "coinbase": ("feeds.coinbase", "CoinbaseParser"),
    "coinbase-exchange": ("feeds.coinbase_exchange", "CoinbaseExchangeParser"),
    "kraken": ("feeds.kraken", "KrakenParser"),
    "kraken-v1": ("feeds.kraken_v1", "KrakenV1Parser"),
    "kraken-futures": ("feeds.kraken_futures", "KrakenFuturesParser"),
    "okx": ("feeds.okx", "OkxParser"),
    "alpaca": ("feeds.alpaca", "AlpacaParser"),
}


def parser_for(venue: str, **kw: Any) -> WireParser:
    if venue not in PARSERS:
        raise ValueError(f"unknown venue {venue!r} ({', '.join(PARSERS)})")
    module, name = PARSERS[venue]
    return getattr(importlib.import_module(module), name)(**kw)
