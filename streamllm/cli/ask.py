"""`streamllm ask SESSION QUESTION`: ask a question on a session of a running server."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from typing import Any

import orjson

from streamllm.client.client import DEFAULT_URL, TOKEN_ENV, AsyncClient, ServiceError

# A standing question's id as configs name them (trend_1m, above_vwap), not a one-word question.
_ID_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[_.-][A-Za-z0-9]+)+\Z")


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("STREAMLLM_URL", DEFAULT_URL),
                        help=f"server url (default $STREAMLLM_URL or {DEFAULT_URL})")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"bearer token (default ${TOKEN_ENV}, else the token `streamllm serve` wrote for "
                             "this port on this machine: $STREAMLLM_HOME/serve-PORT.token)")


def run_command(prog: str, url: str, coro) -> tuple[bool, Any]:
    """asyncio.run(coro) for a command line tool: (True, result), or (False, None) after saying
    on stderr why the service refused or could not be reached."""
    try:
        return True, asyncio.run(coro)
    except ServiceError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"{prog}: cannot reach {url}: {exc}", file=sys.stderr)
    return False, None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamllm ask", description="Ask a question on a session of a server.")
    parser.add_argument("session")
    parser.add_argument("question", help="question text, or a standing question's id")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--min-version", type=int, default=None, help="wait until the session reaches this data_version")
    parser.add_argument("--json", action="store_true", help="print the whole answer message as JSON")
    parser.add_argument("--stream", action="store_true", help="print the answer's text as it is decoded")
    add_connection_args(parser)
    args = parser.parse_args(argv)

    # --stream prints the text as it comes, on stdout (on stderr with --json, whose stdout is the JSON alone),
    # and then not again: only what the final answer adds to it (a stop string's cut aside, nothing).
    streamed: list[str] = []
    stream_to = sys.stderr if args.json else sys.stdout

    async def run() -> dict:
        async with await AsyncClient.connect(args.url, args.token) as client:
            if not args.stream:
                return await client.ask(args.session, args.question, max_tokens=args.max_tokens,
                                        min_version=args.min_version)
            async for message in client.ask_stream(args.session, args.question, max_tokens=args.max_tokens,
                                                   min_version=args.min_version):
                if message["type"] == "token":
                    streamed.append(message["text"])
                    print(message["text"], end="", file=stream_to, flush=True)
            return message

    ok, answer = run_command("streamllm ask", args.url, run())
    if streamed and not ok:
        print(file=stream_to)
    if not ok:
        return 1
    if args.json:
        if args.stream:
            print(file=stream_to)
        print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    else:
        text, shown = answer["text"], "".join(streamed)
        if not args.stream:
            print(text)
        elif text.startswith(shown):  # the streamed text was the answer's start (or all of it)
            print(text[len(shown):])
        else:  # the final text differs from what streamed (e.g. cut at a stop string): the answer, once more
            print(f"\n{text}")
        confidence = answer.get("confidence")
        gap = f" confidence {confidence:.2f}" if isinstance(confidence, int | float) else ""
        warming = f", warming up: {answer.get('warming_up_reason') or 'not enough data yet'}" \
            if answer.get("warming_up") else ""
        print(f"[{answer['path']} path{gap}, data_version {answer['data_version']}, "
              f"{answer['latency_ms']:.1f} ms in the engine{warming}]", file=sys.stderr)
    if answer.get("path") == "cold" and _ID_LIKE.match(args.question):
        # A mistyped id, or one of another session's questions, is read as free text: say so.
        print(f"streamllm ask: note: {args.question!r} is no standing question of session {args.session!r}, "
              "so it was asked as free text (`streamllm watch SESSION` shows a session's standing questions)",
              file=sys.stderr)
    return 0
