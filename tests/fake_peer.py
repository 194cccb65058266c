"""A fake OpenAI-compatible peer for the bench tests: records every POST, answers what `reply` says."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer


def serve(reply: dict | Callable[[str, dict], dict], seen: list[dict]) -> HTTPServer:
    """A server on a free local port, already serving: each POST body goes into `seen` (with its `path`)
    and gets `reply`, or `reply(path, body)`. Call `shutdown()` when done."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **body})
            data = json.dumps(reply(self.path, body) if callable(reply) else reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
