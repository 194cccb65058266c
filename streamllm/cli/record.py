"""`streamllm record --venue V --symbols S,... --out DIR`: record a live venue to raw captures and Parquet."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from feeds import recorder
from feeds.adapters import DEFAULT_CHANNELS
from feeds.recorder import record
from feeds.wire import AuthError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm record", description=recorder.__doc__.split("\n")[0])
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
