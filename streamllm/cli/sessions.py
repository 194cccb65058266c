"""`streamllm sessions ...`: operator commands against a running front door (`serve --ray`).

    streamllm sessions move NAME --to REPLICA [--tenant T] [--url ws://127.0.0.1:8765] [--token T]
    streamllm sessions replicas [--url ...]

They talk HTTP to the server's admin routes (service/admin.py) with the standard library:
no torch, no Ray on the operator's side. With tokens they need an admin token; without
--token or $STREAMLLM_TOKEN they use the local token `serve` wrote for that port on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from streamllm.client.local_token import find_token

DEFAULT_URL = "ws://127.0.0.1:8765"
TOKEN_ENV = "STREAMLLM_TOKEN"


def http_base(url: str) -> str:
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            return http + url[len(ws):].rstrip("/")
    return url.rstrip("/")


def request(url: str, path: str, token: str | None, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(http_base(url) + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    token = find_token(url, token)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = str(exc)
        raise RuntimeError(f"{exc.code}: {message}") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamllm sessions", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    move = sub.add_parser("move", help="move a session to another replica (snapshot + restore)")
    move.add_argument("name")
    move.add_argument("--to", type=int, required=True, help="the target replica's index")
    move.add_argument("--tenant", help="whose session NAME is (default: the admin token's own tenant)")
    replicas = sub.add_parser("replicas", help="list the replicas: state, sessions, restarts, last recovery")
    for p in (move, replicas):
        p.add_argument("--url", default=os.environ.get("STREAMLLM_URL", DEFAULT_URL),
                       help=f"server url (default $STREAMLLM_URL or {DEFAULT_URL})")
        p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    try:
        if args.command == "move":
            body = {"to": args.to, **({"tenant": args.tenant} if args.tenant else {})}
            out = request(args.url, f"/v1/admin/sessions/{args.name}/move", args.token, body)
            print(f"moved {out['session']}: replica {out['from']} -> {out['to']} at data_version "
                  f"{out['data_version']} in {out['seconds']:.2f} s")
        else:
            for r in request(args.url, "/v1/admin/replicas", args.token)["data"]:
                rec = "" if r["last_recovery_s"] is None else f", last recovery {r['last_recovery_s']:.2f} s"
                print(f"replica {r['replica']}: {r['state']}, {r['sessions']} sessions, {r['restarts']} restarts{rec}")
    except (RuntimeError, OSError) as exc:
        print(f"streamllm sessions {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0
