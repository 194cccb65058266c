"""`streamllm record --venue V --symbols S,... --out DIR`: record a live venue to raw captures and Parquet.

Credentials come from files or the environment, never the command line (argv is visible to
every user of the machine in `ps` and lands in shell histories):

    --key-file F     or $STREAMLLM_API_KEY     (Alpaca: also $APCA_API_KEY_ID, as its SDKs read it)
    --secret-file F  or $STREAMLLM_API_SECRET  (Alpaca: also $APCA_API_SECRET_KEY)
    --jwt-file F     or $STREAMLLM_API_JWT     (Coinbase authenticated channels)

`--key`, `--secret` and `--jwt` still work but are deprecated: each use prints a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import stat
import sys
from pathlib import Path

from feeds import recorder
from feeds.adapters import DEFAULT_CHANNELS
from feeds.recorder import record
from feeds.wire import AuthError

# (name, our environment variable, the venue SDK's, what it is)
SECRETS = (("key", "STREAMLLM_API_KEY", "APCA_API_KEY_ID", "API key (Alpaca)"),
           ("secret", "STREAMLLM_API_SECRET", "APCA_API_SECRET_KEY", "API secret (Alpaca)"),
           ("jwt", "STREAMLLM_API_JWT", None, "JWT (Coinbase authenticated channels)"))


def read_secret(path: Path, flag: str) -> str:
    """A secret from a file (one line; surrounding whitespace dropped); warns when others may read it."""
    try:
        value = path.read_text(encoding="utf-8").strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read: {exc}") from None
    if not value:
        raise ValueError(f"{flag} {path}: the file is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"streamllm record: warning: {path} may be read by other users (mode {stat.S_IMODE(mode):o}); "
              f"chmod 600 {path}", file=sys.stderr)
    return value


def credentials(args: argparse.Namespace) -> dict[str, str]:
    """key / secret / jwt from --NAME-file, the deprecated --NAME (with a warning), or the environment."""
    creds = {}
    for name, env, vendor_env, _ in SECRETS:
        path, given = getattr(args, f"{name}_file"), getattr(args, name)
        if path is not None and given:
            raise ValueError(f"--{name} and --{name}-file both given: keep --{name}-file")
        if given:
            print(f"streamllm record: warning: --{name} puts a secret in the command line, where every user of "
                  f"this machine can read it (ps, /proc) and your shell history keeps it; it is deprecated: "
                  f"use --{name}-file FILE or ${env}", file=sys.stderr)
        value = read_secret(path, f"--{name}-file") if path is not None else (
            given or os.environ.get(env) or (os.environ.get(vendor_env) if vendor_env else None))
        if value:
            creds[name] = value
    return creds


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
    for name, env, vendor_env, what in SECRETS:
        default = f"${env}" + (f", else ${vendor_env}" if vendor_env else "")
        ap.add_argument(f"--{name}-file", type=Path, metavar="FILE", help=f"file holding the {what} (default {default})")
        ap.add_argument(f"--{name}", help=f"the {what} itself: deprecated, argv is visible to every user "
                        f"(use --{name}-file or ${env})")
    ap.add_argument("--market", default="spot", choices=("spot", "usdm", "coinm"),
                    help="binance: spot, USD-M or COIN-M futures (URL, channels and depth gap rule)")
    args = ap.parse_args(argv)
    symbols = [s.strip() for s in args.symbols.split(",") if s.strip()]
    channels = [c.strip() for c in args.channels.split(",")] if args.channels else None
    try:
        creds = credentials(args)
    except ValueError as exc:
        print(f"streamllm record: {exc}", file=sys.stderr)
        return 2
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
