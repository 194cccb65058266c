"""Recorder: `streamllm record --venue binance --symbols btcusdt,ethusdt --out DIR`.

Writes what arrives, twice:
  DIR/raw/<symbol>_<YYYYMMDD>.gz   raw messages, `<recv_ns> <raw json>` per line: the format of
                                   ../shared/data/binance-spot, replayable through the live parser
                                   (Binance messages are routed by stream symbol; other venues,
                                   and messages without a symbol, go to <venue>_<YYYYMMDD>.gz)
  DIR/parquet/<kind>/<YYYYMMDD-HHMMSS>.parquet   parsed events, one file per kind per rotation
Rotation: Parquet every `--rotate-s` seconds of receive time; raw files per UTC day.
File names never come from the venue unchecked: a symbol names its own file only when it is
one of the subscribed symbols and a plain name (letters, digits, `-_.`, no `..`); any other
message goes to the venue's file, so nothing a venue sends can write outside `--out`.
`--url` points at another endpoint (the local replay server); `--once` stops when the
server closes instead of reconnecting; `--duration` stops after that many seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import orjson

from feeds.adapters import FeedAdapter
from feeds.events import write_parquet

NS = 1_000_000_000
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def plain_name(name: str) -> bool:
    """A file name that stays where it is put: letters, digits and `-_.`, never `..` or a leading dot."""
    return bool(PLAIN_NAME.fullmatch(name)) and ".." not in name and not name.startswith(".")


def _date(ns: int) -> str:
    return time.strftime("%Y%m%d", time.gmtime(ns // NS))


class Recorder:
    def __init__(self, out: Path, venue: str, rotate_s: float = 300.0, symbols: list[str] | None = None) -> None:
        """symbols: those subscribed; a message routed to any other symbol goes to the venue's file."""
        if not plain_name(venue):
            raise ValueError(f"venue {venue!r} cannot name a file: letters, digits and -_. only")
        self.out = Path(out)
        self.venue = venue
        self.symbols = None if symbols is None else {s.lower() for s in symbols}
        self.rotate_ns = int(rotate_s * NS)
        self.raw_dir = self.out / "raw"
        self.raw_dir.mkdir(parents=True, exist_ok=True)
        self._raw: dict[str, IO[str]] = {}
        self._events: dict[str, list[Any]] = defaultdict(list)
        self._window_start: int | None = None
        self.raw_lines = 0
        self.events_written: dict[str, int] = defaultdict(int)
        self.files: list[Path] = []

    def _raw_name(self, recv_ns: int, text: str) -> str:
        name = self.venue
        if self.venue == "binance" and '"stream"' in text[:16]:
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                symbol = orjson.loads(text)["stream"].split("@", 1)[0]
                if plain_name(symbol) and (self.symbols is None or symbol.lower() in self.symbols):
                    name = symbol
        return f"{name}_{_date(recv_ns)}.gz"

    def on_raw(self, recv_ns: int, text: str) -> None:
        name = self._raw_name(recv_ns, text)
        fh = self._raw.get(name)
        if fh is None:
            path = self.raw_dir / name
            if path.resolve().parent != self.raw_dir.resolve():  # plain_name already keeps it there
                raise ValueError(f"raw file {name!r} would land outside {self.raw_dir}")
            fh = self._raw[name] = gzip.open(path, "at", encoding="utf-8")  # noqa: SIM115 (closed in close())
            self.files.append(path)
        fh.write(f"{recv_ns} {text}\n")
        self.raw_lines += 1

    def on_event(self, ev: Any) -> None:
        if self._window_start is None:
            self._window_start = ev.ts_recv
        elif ev.ts_recv - self._window_start >= self.rotate_ns:
            self.rotate()
            self._window_start = ev.ts_recv
        self._events[type(ev).__name__.lower()].append(ev)

    def rotate(self) -> None:
        if self._window_start is None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self._window_start // NS))
        for kind, evs in self._events.items():
            if not evs:
                continue
            folder = self.out / "parquet" / kind
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{stamp}.parquet"
            write_parquet(evs, path)
            self.files.append(path)
            self.events_written[kind] += len(evs)
        self._events.clear()

    def close(self) -> None:
        self.rotate()
        for fh in self._raw.values():
            fh.close()
        self._raw.clear()


async def record(
    venue: str,
    symbols: list[str],
    out: Path,
    channels: list[str] | None = None,
    url: str | None = None,
    duration_s: float | None = None,
    rotate_s: float = 300.0,
    once: bool = False,
    credentials: dict[str, str] | None = None,
    market: str = "spot",
) -> tuple[Recorder, FeedAdapter]:
    rec = Recorder(out, venue, rotate_s, symbols)
    adapter = FeedAdapter(venue, symbols, channels, url=url, credentials=credentials,
                          max_reconnects=0 if once else None, on_raw=rec.on_raw, market=market)

    async def consume() -> None:
        async for ev in adapter.events():
            rec.on_event(ev)

    try:
        task = asyncio.create_task(consume())
        done, _ = await asyncio.wait({task}, timeout=duration_s)
        if not done:
            adapter.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            task.result()  # re-raise AuthError and friends
    finally:
        rec.close()
    return rec, adapter
