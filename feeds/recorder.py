"""Recorder: `streamllm record --venue binance --symbols btcusdt,ethusdt --out DIR`.

Writes what arrives, twice:
  DIR/raw/<symbol>_<YYYYMMDD>.gz   raw messages, `<recv_ns> <raw json>` per line: the format of
                                   ../shared/data/binance-spot, replayable through the live parser
                                   (Binance messages are routed by stream symbol; other venues,
                                   and messages without a symbol, go to <venue>_<YYYYMMDD>.gz)
  DIR/parquet/<kind>/<YYYYMMDD-HHMMSS>.parquet   parsed events, one file per kind per rotation
Rotation: Parquet every `--rotate-s` seconds of receive time; raw files per UTC day.
`--url` points at another endpoint (the local replay server); `--once` stops when the
server closes instead of reconnecting; `--duration` stops after that many seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import orjson

from feeds.adapters import DEFAULT_CHANNELS, FeedAdapter
from feeds.events import write_parquet

NS = 1_000_000_000


def _date(ns: int) -> str:
    return time.strftime("%Y%m%d", time.gmtime(ns // NS))


class Recorder:
    def __init__(self, out: Path, venue: str, rotate_s: float = 300.0) -> None:
        self.out = Path(out)
        self.venue = venue
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
        symbol = self.venue
        if self.venue == "binance" and '"stream"' in text[:16]:
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                symbol = orjson.loads(text)["stream"].split("@", 1)[0]
        return f"{symbol}_{_date(recv_ns)}.gz"

    def on_raw(self, recv_ns: int, text: str) -> None:
        name = self._raw_name(recv_ns, text)
        fh = self._raw.get(name)
        if fh is None:
            path = self.raw_dir / name
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
    rec = Recorder(out, venue, rotate_s)
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


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm record", description=__doc__.split("\n")[0])
    ap.add_argument("--venue", required=True, choices=sorted(DEFAULT_CHANNELS))
    ap.add_argument("--symbols", required=True, help="comma-separated, e.g. btcusdt,ethusdt")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--channels", help="comma-separated venue channels (default: trades and quotes, "
                    "plus depth on Binance)")
    ap.add_argument("--url", help="websocket URL (e.g. the local replay server)")
    ap.add_argument("--duration", type=float, help="stop after this many seconds")
    ap.add_argument("--rotate-s", type=float, default=300.0, help="Parquet rotation (receive time)")
    ap.add_argument("--once", action="store_true", help="stop when the server closes the connection")
    ap.add_argument("--key", default=os.environ.get("APCA_API_KEY_ID"), help="API key (Alpaca; default "
                    "$APCA_API_KEY_ID, as its SDKs read it)")
    ap.add_argument("--secret", default=os.environ.get("APCA_API_SECRET_KEY"), help="API secret (Alpaca; default "
                    "$APCA_API_SECRET_KEY)")
    ap.add_argument("--jwt", help="JWT (Coinbase authenticated channels)")
    ap.add_argument("--market", default="spot", choices=("spot", "usdm", "coinm"),
                    help="binance: spot, USD-M or COIN-M futures (URL, channels and depth gap rule)")
    args = ap.parse_args(argv)
    symbols = [s.strip() for s in args.symbols.split(",") if s.strip()]
    channels = [c.strip() for c in args.channels.split(",")] if args.channels else None
    creds = {k: v for k, v in (("key", args.key), ("secret", args.secret), ("jwt", args.jwt)) if v}
    from feeds.wire import AuthError

    try:
        rec, adapter = asyncio.run(record(args.venue, symbols, args.out, channels, args.url, args.duration,
                                          args.rotate_s, args.once, creds, args.market))
    except AuthError as exc:
        print(f"streamllm record: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    st = adapter.parser.stats
    print(f"recorded {rec.raw_lines} messages, events {dict(rec.events_written)}, parse errors {st.errors}, "
          f"gaps {st.gaps}, reconnects {adapter.stats.disconnects} -> {args.out}")
    for sample in st.error_samples[:5]:
        print(f"  parse error: {sample}", file=sys.stderr)
    return 0
