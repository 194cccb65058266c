"""`streamllm watch SESSION`: a live table of a session's standing answers on a running server."""

from __future__ import annotations

import argparse

from streamllm.cli.ask import add_connection_args, run_command
from streamllm.client.watch import watch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamllm watch", description="Live table of a session's standing answers.")
    parser.add_argument("session")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    add_connection_args(parser)
    args = parser.parse_args(argv)
    try:
        ok, code = run_command("streamllm watch", args.url, watch(args.url, args.token, args.session, args.duration))
    except KeyboardInterrupt:
        return 0
    return code if ok else 1
