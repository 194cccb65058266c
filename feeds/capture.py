"""Raw websocket captures: one message per line, with the time it was received.

  ours (../shared/data/binance-spot, feeds/recorder.py)   gzip, `<recv_ns> <raw json>`
  cryptofeed's raw logs (`raw_data_collection`, files     plain text or gzip,
  named like COINBASE.ws.28.0)                            `<recv_seconds>: <raw json>`; its
                                                          `wss://... <->` connection and `<-`
                                                          sent-message lines are not messages

A capture goes through the same parser as the live adapter, so a replay and a live session
see identical events.

A damaged file never ends a replay with a bare traceback: a truncated gzip stream, a file
that is not gzip at all, or a line without a receive time is counted in the parser's stats
(kinds `truncated_file`, `not_gzip`, `bad_line`) with the file name and how far it got,
and every message read before the damage is kept.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feeds.coinbase_exchange import TYPES as EXCHANGE_TYPES
from feeds.wire import ParseStats, UnsupportedFormat, WireParser, epoch_ns, fast_loads, parser_for

OnError = Callable[[str, str, bytes], None]  # (kind, message, sample)


def read_capture(path: str | Path, on_error: OnError | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield (recv_ns, raw message). Without `on_error` any damage raises ValueError naming the
    file; with it, damage is reported there and reading goes on (or stops, at a broken stream)."""
    lineno, nbytes = 0, 0

    def fail(kind: str, text: str, sample: bytes) -> None:
        if on_error is None:
            raise ValueError(text)
        on_error(kind, text, sample)

    try:
        with _open(Path(path)) as fh:
            for line in fh:
                lineno += 1
                nbytes += len(line)
                head, sep, raw = line.rstrip(b"\r\n").partition(b" ")
                if not head and not sep:
                    continue  # a blank line (cryptofeed ends its logs with some)
                if head.isdigit() and sep:
                    yield int(head), raw
                elif head.endswith(b":") and sep and _SECONDS.fullmatch(head[:-1]):
                    yield epoch_ns(head[:-1].decode()), raw  # cryptofeed: '1618678132.9348202: {...}'
                elif head.startswith(_LOG_LINES):
                    continue  # cryptofeed: a connection opened, or a message we sent
                else:
                    fail("bad_line", f"{path}:{lineno}: expected '<recv_ns> <json>' (or cryptofeed's "
                         f"'<recv_seconds>: <json>'), got {line[:60]!r}", line)
    except gzip.BadGzipFile as exc:
        fail("not_gzip", f"{path}: not a gzip capture ({exc}); read {lineno} lines first", b"")
    except (EOFError, zlib.error, OSError) as exc:
        fail("truncated_file", f"{path}: gzip stream ends early or is corrupt after line {lineno} "
             f"({nbytes} bytes uncompressed): {type(exc).__name__}: {exc}; the {lineno} lines before are kept", b"")


_SECONDS = re.compile(rb"\d{9,10}(\.\d+)?")
_LOG_LINES = (b"wss://", b"ws://", b"https://", b"http://")


def _open(path: Path) -> Any:
    """A .gz capture is gzip (else the not_gzip error below); another name is read as gzip when it
    starts like one, else as plain text (cryptofeed writes its raw logs uncompressed)."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def sniff_venue(raw: bytes) -> str:
    """The venue whose wire format one message is in; UnsupportedFormat says what it is otherwise."""
    msg: Any = fast_loads(raw)
    if isinstance(msg, list):
        if msg and isinstance(msg[0], dict) and "T" in msg[0]:
            return "alpaca"
        if len(msg) >= 4 and isinstance(msg[-2], str) and isinstance(msg[-1], str):
            return "kraken-v1"  # [channelID, payload, ..., channelName, pair]
        raise UnsupportedFormat(f"a JSON array that is neither Alpaca's nor Kraken v1's: {raw[:60]!r}")
    if not isinstance(msg, dict):
        raise UnsupportedFormat(f"a capture message is a JSON object or array, got {type(msg).__name__}")
    if "stream" in msg or "e" in msg or "lastUpdateId" in msg or ("u" in msg and "b" in msg):
        return "binance"
    if msg.keys() == {"result", "id"}:
        return "binance"  # its reply to SUBSCRIBE, often a capture's first line
    if "channel" in msg and "events" in msg:
        return "coinbase"
    if "channel" in msg or "method" in msg:
        return "kraken"
    if "topic" in msg or "conn_id" in msg:  # {"topic": "publicTrade.BTCUSDT", "type", "ts", "data"}; op replies
        return "bybit"  # v5, or the API before it (feeds/bybit_before_v5.py)
    if "arg" in msg or ("event" in msg and ("code" in msg or "connId" in msg)):
        return "okx"  # {"arg": {"channel", "instId"}, "data"}; its events carry arg, code or connId
    if "feed" in msg or msg.get("event") in ("info", "subscribed", "unsubscribed", "alert"):
        return "kraken-futures"  # {"feed": "trade", "product_id": ...}; it greets with {"event": "info"}
    if "event" in msg:
        return "kraken-v1"
    if msg.get("type") in EXCHANGE_TYPES:
        return "coinbase-exchange"
    raise UnsupportedFormat("not a capture of a supported venue (binance spot/usdm/coinm, coinbase advanced "
                            f"trade or exchange ws-feed, kraken v2 or v1, kraken futures, okx v5, bybit v5, alpaca): first message keys {sorted(msg)[:8]}")


def detect_venue(path: str | Path, probe: int = 20) -> str:
    """Sniff the first readable messages of a capture; raises ValueError with what it saw."""
    last: Exception | str | None = None

    def damaged(kind: str, text: str, sample: bytes) -> None:
        nonlocal last
        last = text

    for i, (_, raw) in enumerate(read_capture(path, on_error=damaged)):
        if i >= probe:
            break
        try:
            return sniff_venue(raw)
        except UnsupportedFormat as exc:
            raise ValueError(f"{path}: {exc}") from exc
        except ValueError as exc:
            last = exc
    if isinstance(last, str):
        raise ValueError(last)
    raise ValueError(f"{path}: no readable message to tell the venue from" + (f" ({last})" if last else ""))


@dataclass
class CaptureSource:
    """Events of a raw capture, parsed by the venue's live parser (`venue="auto"` sniffs it)."""

    path: Path
    venue: str = "binance"
    parser: WireParser | None = None
    market: str = "spot"  # binance only: spot, usdm or coinm

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.parser is None:
            if self.venue == "auto":
                self.venue = detect_venue(self.path)
            kw: dict[str, Any] = {}
            if self.venue == "binance":
                kw = {"symbol_hint": self.path.name.split("_")[0], "market": self.market}
            self.parser = parser_for(self.venue, **kw)

    @property
    def stats(self) -> ParseStats:
        assert self.parser is not None
        return self.parser.stats

    def _damage(self, kind: str, text: str, sample: bytes) -> None:
        self.stats.error(text, sample or text.encode(), kind)

    def __iter__(self) -> Iterator[Any]:
        parse = self.parser.parse  # type: ignore[union-attr]
        for recv, raw in read_capture(self.path, self._damage):
            yield from parse(raw, recv)
