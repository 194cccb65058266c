"""`streamllm bench abuse`: hostile clients against one server while a well-behaved one works.

    streamllm bench abuse [--json out.json] [--model tiny] [--quick]

A `streamllm serve --no-auth` subprocess (the worst case for a browser: no token) on
loopback, with a small KV pool. A well-behaved client (its own process) pushes a bar every
100 ms, asks its standing question every 100 ms and an ad-hoc question every second: first
alone (`--alone-s`), then while the hostile scenarios run (`--storm-s`). Every call has a
timeout; a call that outlives it is a hung caller.

Scenarios (each also a test: tests/test_abuse.py and the limits' own tests):
  cross_origin   websocket handshakes with a foreign Origin, a foreign Host (DNS rebinding),
                 `text/plain` and cross-origin POSTs, SSE from a foreign Origin
  oversized      frames over the limit, 200k-character questions, deeply nested JSON and
                 labels, `max_tokens` 10**12 on websocket, HTTP and register
  stop_flood     50,000 stop strings in one ask (websocket and HTTP)
  pool_fill      two long questions that each fit the free cells alone but not together,
                 then a third cold ask: all must end (answer or clear error)
  slow_sse       SSE readers that never read, on a session with fast pushes: cut, not kept
  conn_storm     connects that ask and vanish: their questions must be cancelled
  bad_pushes     pushes with impossible values: an error reply never follows a commit
  failing_disk   (in-process) an OSError injected on the ingest log's write and fsync while
                 a pusher pushes; then recovery from the folder

Keys: cross_origin_accepted, engine_deaths, hung_callers, internal_errors, acked_lost,
acked_then_error, recovery_holes (all must be 0), bystander_p99_alone_ms,
bystander_p99_storm_ms, bystander_p99_ratio (goal <= 2), and per-scenario activity counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.common import percentile, print_table, write_json
from streamllm.config.limits import MAX_QUESTION_CHARS

ROOT = Path(__file__).resolve().parents[1]
QUESTION = {"id": "trend", "text": "Is the price going up or down? Answer up or down.", "choices": ["up", "down"]}
EVIL = "http://evil.example"
TIMEOUT_S = 30.0  # a call with no reply after this long is a hung caller


def bar_line(i: int) -> str:
    return f"12:{i // 60 % 60:02d}:{i % 60:02d} 640{i % 100:02d}.5 +1.5 v{i % 7}.2 n{i % 5 + 3}"


@dataclass
class Tally:
    """What the hostile side saw; every key here ends up in the report."""

    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # each scenario's wall time

    def bad(self, key: str, what: str) -> None:
        self.counts[key] += 1
        if len(self.notes) < 40:
            self.notes.append(f"{key}: {what}")


# -- the server --------------------------------------------------------------------


def start_server(model: str, max_cells: int, max_queue: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "STREAMLLM_TOKENS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamllm.cli", "serve", "--model", model, "--port", "0", "--no-auth",
         "--max-cells", str(max_cells), "--max-queue", str(max_queue), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if " at ws://" in line:
            threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
            return proc, line.rsplit(" at ", 1)[1].strip().split()[0]
    raise RuntimeError(f"server did not start (exit {proc.wait()}):\n{''.join(seen[-20:])}")


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def http_request(url: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = TIMEOUT_S) -> tuple[int, bytes]:
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host="Host" in (headers or {}))
        for key, value in {"Content-Length": str(len(body or b"")), **(headers or {})}.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


async def http_async(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                     raw: bytes | None = None) -> tuple[int, bytes]:
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    hdrs = {"Content-Type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
    return await asyncio.to_thread(http_request, url, method, path, data, hdrs)


class Raw:
    """One websocket connection speaking the protocol by hand: any message, replies by id."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.ids = ws, 0

    @classmethod
    async def connect(cls, url: str, **kw: Any) -> Raw:
        """kw: the websockets client's (origin, host/port to reach a URL naming another host...)."""
        return cls(await connect(url, max_size=None, compression=None, open_timeout=TIMEOUT_S, **kw))

    async def call(self, message: dict[str, Any] | bytes | str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """Send; the reply with this request's id (or an id-less error), or a `closed` pseudo-reply."""
        self.ids += 1
        rid = self.ids
        if isinstance(message, dict):
            message = orjson.dumps({"id": rid, **message})
        try:
            await self.ws.send(message)  # bytes: a binary frame, which the server reads as JSON too
            async with asyncio.timeout(timeout):
                while True:
                    reply = orjson.loads(await self.ws.recv())
                    if reply.get("id") == rid or (reply.get("type") == "error" and reply.get("id") is None):
                        return reply
        except ConnectionClosed as exc:
            return {"type": "closed", "code": exc.rcvd.code if exc.rcvd else None}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()


def judge(tally: Tally, what: str, reply: dict[str, Any], ok_codes: tuple[str, ...] = ()) -> None:
    """A hostile request's reply: an error with a documented code (or a close) is right; `internal` is
    an internal error; no reply is a hung caller; an ok to something that should have been refused is
    counted as `accepted_<what>`."""
    if reply.get("type") == "error":
        if reply.get("code") == "internal":
            tally.bad("internal_errors", f"{what}: {reply.get('message')}")
        tally.counts["refused"] += 1
    elif reply.get("type") == "closed":
        tally.counts["closed"] += 1
    elif reply.get("type") in ok_codes:
        tally.counts["served"] += 1
    else:
        tally.bad("accepted_unbounded", f"{what}: {str(reply)[:120]}")


# -- scenarios -------------------------------------------------------------------------


async def cross_origin(url: str, tally: Tally, session: str) -> None:
    port = url.rsplit(":", 1)[1]
    host = url.removeprefix("ws://").rsplit(":", 1)[0]
    attempts = [("ws origin", url, {"origin": EVIL}),  # a page on another site
                ("ws rebinding host", f"ws://evil.example:{port}/", {"host": host, "port": int(port)})]
    for what, target, kw in attempts:
        try:
            raw = await Raw.connect(target, **kw)
        except (InvalidStatus, OSError, TimeoutError):
            tally.counts["cross_origin_refused"] += 1
            continue
        reply = await raw.call({"type": "stats"})  # accepted at the handshake: does it answer?
        await raw.close()
        if reply.get("type") == "stats":
            tally.bad("cross_origin_accepted", what)
        else:
            tally.counts["cross_origin_refused"] += 1
    body = orjson.dumps({"model": "x", "session": session, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})
    posts = [("text/plain POST", {"Content-Type": "text/plain"}),
             ("cross-origin JSON POST", {"Content-Type": "application/json", "Origin": EVIL}),
             ("rebinding POST", {"Content-Type": "application/json", "Host": f"evil.example:{port}"})]
    for what, headers in posts:
        status, _ = await http_async(url, "POST", "/v1/chat/completions", raw=body, headers=headers)
        if status < 400:
            tally.bad("cross_origin_accepted", f"{what}: HTTP {status}")
        else:
            tally.counts["cross_origin_refused"] += 1
    gets = [("rebinding GET /v1/sessions", "/v1/sessions", {"Host": f"evil.example:{port}"}),
            ("cross-origin SSE", f"/v1/sessions/{session}/events?once=1", {"Origin": EVIL})]
    for what, path, headers in gets:
        status = await asyncio.to_thread(_status_only, url, path, headers)
        if status < 400:
            tally.bad("cross_origin_accepted", f"{what}: HTTP {status}")
        else:
            tally.counts["cross_origin_refused"] += 1


def _status_only(url: str, path: str, headers: dict[str, str]) -> int:
    """The status line of a GET (an SSE stream never ends: read only its head)."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.putrequest("GET", path, skip_host="Host" in headers)
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


async def oversized(url: str, tally: Tally, session: str) -> None:
    raw = await Raw.connect(url)
    big = "x" * 200_000
    cases: list[tuple[str, Any]] = [
        ("200k question", {"type": "ask", "session": session, "question": big}),
        ("max_tokens 1e12", {"type": "ask", "session": session, "question": "hi", "max_tokens": 10**12}),
        ("register 200k text", {"type": "register", "session": session,
                                "question": {"id": "big", "text": big, "max_tokens": 10**12}}),
        ("register max_tokens", {"type": "register", "session": session,
                                 "question": {"id": "long", "text": "Say a lot.", "max_tokens": 10**12}}),
        ("nested label", {"type": "register", "session": session,
                          "question": {"id": "deep", "text": "Up?", "choices": ["yes", "no"],
                                       "label": "(" * 50_000 + "1" + ")" * 50_000}}),
        ("nested JSON", b"[" * 100_000 + b"]" * 100_000),
        ("bad JSON", b"{\"type\": \"ask\", "),
        ("unknown type", {"type": "drop_tables"}),
        ("2 MiB frame", {"type": "push", "session": session, "lines": ["y" * 1000] * 2100}),
    ]
    for what, message in cases:
        reply = await raw.call(message)
        judge(tally, what, reply)
        if reply.get("type") == "closed":
            await raw.close()
            raw = await Raw.connect(url)
    with contextlib.suppress(Exception):
        await raw.call({"type": "unregister", "session": session, "question_id": "long"})
    await raw.close()
    for what, body in [("HTTP 200k prompt", {"model": "x", "session": session, "prompt": big, "max_tokens": 4}),
                       ("HTTP max_tokens 1e12", {"model": "x", "session": session, "prompt": "hi",
                                                 "max_tokens": 10**12})]:
        status, data = await http_async(url, "POST", "/v1/completions", body)
        _judge_http(tally, what, status, data, expect_refused=True)
    status, data = await http_async(url, "POST", "/v1/completions", raw=b"{" * 2_000_000)
    _judge_http(tally, "HTTP 2 MB body", status, data, expect_refused=True)


def _judge_http(tally: Tally, what: str, status: int, data: bytes, expect_refused: bool) -> None:
    if status >= 500 and status != 503:
        tally.bad("internal_errors", f"{what}: HTTP {status} {data[:120]!r}")
    elif status < 400 and expect_refused:
        tally.bad("accepted_unbounded", f"{what}: HTTP {status}")
    else:
        tally.counts["refused"] += 1


async def stop_flood(url: str, tally: Tally, session: str) -> None:
    stops = [f"s{i}" for i in range(50_000)]
    raw = await Raw.connect(url)
    judge(tally, "ws 50k stops", await raw.call({"type": "ask", "session": session, "question": "hi",
                                                 "max_tokens": 4, "stop": stops}))
    await raw.close()
    status, data = await http_async(url, "POST", "/v1/completions",
                                    {"model": "x", "session": session, "prompt": "hi", "max_tokens": 4,
                                     "stop": stops})
    _judge_http(tally, "HTTP 50k stops", status, data, expect_refused=True)


async def pool_fill(url: str, tally: Tally, decode: int = 512, max_need: int | None = None) -> None:
    """Two questions that each fit the free cells alone, but not both (the pool is first filled to
    1.5x one question with a ballast session's reservation), then a third: all must end, with an
    answer or a clear error (before #44 both blocked for good, and every later cold ask with them)."""
    raw = await Raw.connect(url)
    filler = "Describe every bar in detail, with its open, high, low and close. " * 80
    for name in ("hog1", "hog2", "measure"):
        await raw.call({"type": "open", "session": name, "max_context": 2048 if name == "measure" else 512})
    for name in ("hog1", "hog2"):
        await raw.call({"type": "push", "session": name, "lines": [bar_line(i) for i in range(8)]})
    # Characters per token of this text: 300 of them pushed as a line into a scratch session.
    before = await _session(raw, "measure")
    ack = await raw.call({"type": "push", "session": "measure", "lines": [filler[:300]]})
    after = before
    while after.get("data_version", 0) < ack.get("data_version", 1):
        await asyncio.sleep(0.05)
        after = await _session(raw, "measure")
    await raw.call({"type": "close", "session": "measure"})
    chars_per_token = 300 / max(1, after["num_tokens"] - before["num_tokens"])
    # Each question needs `need` cells (prompt + decode); the pool keeps 1.5x that free: either fits
    # alone, not both. The longest question allowed sets `need`; a ballast reservation trims the pool.
    engine = (await raw.call({"type": "stats"}))["engine"]
    free, keep = int(engine["cells_free"]), int(engine["cells_total"]) // 8  # admission keeps 1/8 free
    longest = int(MAX_QUESTION_CHARS / chars_per_token) + 16 + decode
    need = min(longest, int(free / 1.5), max_need or longest)
    ballast = free - int(1.5 * need)
    while ballast > keep // 4:  # as large as admission allows (it keeps some cells free for questions)
        if (await raw.call({"type": "open", "session": "ballast", "max_context": ballast})).get("type") == "ok":
            # stats are published after a step: one line in, and the reservation shows in cells_free
            ack = await raw.call({"type": "push", "session": "ballast", "lines": [bar_line(0)]})
            while (await _session(raw, "ballast")).get("data_version", 0) < ack.get("data_version", 1):
                await asyncio.sleep(0.05)
            break
        ballast -= max(64, ballast // 10)
    free = int((await raw.call({"type": "stats"}))["engine"]["cells_free"])
    need = min(longest, int(free / 1.5))
    question = filler[: int((need - 16 - decode) * chars_per_token)]
    tally.counts["pool_fill_need_cells"] = need
    tally.counts["pool_fill_free_cells"] = int((await raw.call({"type": "stats"}))["engine"]["cells_free"])
    await raw.close()

    async def ask(session: str) -> dict[str, Any]:
        r = await Raw.connect(url)
        try:
            return await r.call({"type": "ask", "session": session, "question": question, "max_tokens": decode},
                                timeout=TIMEOUT_S * 2)
        finally:
            await r.close()

    replies = await asyncio.gather(ask("hog1"), ask("hog2"))
    for reply in replies:
        if reply.get("type") == "closed" and reply.get("code") is None:
            tally.bad("hung_callers", "pool_fill ask: no reply")
        elif reply.get("type") == "error" and reply.get("code") == "internal":
            tally.bad("internal_errors", f"pool_fill: {reply.get('message')}")
        else:
            tally.counts[f"pool_fill_{reply.get('type')}"] += 1
    after_fill = await ask("hog1")  # the pool is usable again
    if after_fill.get("type") != "answer":
        tally.bad("hung_callers" if after_fill.get("type") == "closed" else "pool_fill_after_failed",
                  str(after_fill)[:160])
    raw = await Raw.connect(url)
    tally.counts["pool_fill_preempted"] = int((await raw.call({"type": "stats"}))["engine"]["questions_preempted"])
    for name in ("hog1", "hog2", "ballast"):
        await raw.call({"type": "close", "session": name})
    await raw.close()


async def _session(raw: Raw, name: str) -> dict[str, Any]:
    return next((s for s in (await raw.call({"type": "stats"})).get("sessions", []) if s.get("name") == name), {})


async def slow_sse(url: str, tally: Tally, seconds: float, rate: float = 500.0) -> None:
    """SSE readers that never read, on a session pushed at `rate` pushes/s (a fast feed): the server
    must end their streams (queue overflow, then `close_timeout_s` for a reader that takes nothing),
    and meanwhile nothing else may suffer. The readers advertise an internet-sized MSS (536 bytes),
    yet the kernel still buffers ~100 KB per reader, and data events are small and coalesced: a
    short run rarely fills a reader's queue, so `slow_sse_cut` is reported, not required (the cut
    itself is proved exactly in tests/test_sse_slow.py)."""
    raw = await Raw.connect(url)
    await raw.call({"type": "open", "session": "firehose", "max_context": 512})
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    socks = []
    for _ in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.connect((host, int(port)))
        s.sendall(f"GET /v1/sessions/firehose/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        socks.append(s)
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic()) < t0 + seconds:
        await raw.call({"type": "push", "session": "firehose", "lines": [bar_line(i)]})
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - now))
    tally.counts["slow_sse_pushes"] = i
    await asyncio.sleep(6.0)  # the server's close_timeout_s (5 s) for a reader that takes nothing
    cut = 0
    for s in socks:  # a cut stream ends in EOF (or a reset) once what was buffered is read
        s.settimeout(1.0)
        try:
            while s.recv(1 << 16):
                pass
            cut += 1
        except TimeoutError:
            pass
        except OSError:
            cut += 1
        s.close()
    tally.counts["slow_sse_cut"] = cut
    tally.counts["slow_sse_kept"] = len(socks) - cut
    await raw.call({"type": "close", "session": "firehose"})
    await raw.close()


async def conn_storm(url: str, tally: Tally, session: str, n: int) -> None:
    """Connections that ask a long question and vanish: the server must cancel their work."""
    async def one(i: int) -> None:
        try:
            raw = await Raw.connect(url)
        except (InvalidStatus, OSError, TimeoutError):
            tally.counts["storm_refused"] += 1  # a connection cap: fine
            return
        await raw.ws.send(orjson.dumps({"type": "ask", "id": 1, "session": session,
                                        "question": f"Tell me a long story number {i}.",
                                        "max_tokens": 400}).decode())
        await raw.ws.send(orjson.dumps({"type": "hello", "id": 2}).decode())
        await raw.close()
        tally.counts["storm_connects"] += 1

    for start in range(0, n, 20):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 20))))


async def bad_pushes(url: str, tally: Tally) -> None:
    """Impossible values: each push is refused before it is committed, or committed and acked."""
    raw = await Raw.connect(url)
    await raw.call({"type": "open", "session": "junk", "max_context": 512})
    bad = [["99:99 -5 +0 v0 n0"], ["00:00 1 -9999 v0"], ["12:00:00 nan +1 vinf n-1"], ["\x00\x01\x02"],
           ["2026-13-45T99:99:99 64000 +1 v1 n1"], ["12:00:01 1e308 +1e308 v1e308 n1"], [""], ["x" * 5000]]
    acked = 0  # the session's version: what was acked so far
    for lines in bad:
        reply = await raw.call({"type": "push", "session": "junk", "lines": lines})
        if reply.get("type") == "ok":
            acked = reply["data_version"]
            tally.counts["bad_push_accepted"] += 1
        elif reply.get("type") == "error":
            if reply.get("code") == "internal":
                tally.bad("internal_errors", f"push {lines[0][:20]!r}: {reply.get('message')}")
            await asyncio.sleep(0.2)  # a committed batch would show in the session's versions by now
            if (await _version(raw, "junk") or 0) > acked:
                tally.bad("acked_then_error", f"push {lines[0][:20]!r} committed, then {reply.get('code')}")
            tally.counts["bad_push_refused"] += 1
        else:
            tally.bad("hung_callers", f"push {lines[0][:20]!r}: {reply}")
    await raw.call({"type": "close", "session": "junk"})
    await raw.close()


async def _version(raw: Raw, session: str) -> int | None:
    stats = await raw.call({"type": "stats"})
    for s in stats.get("sessions", []):
        if s.get("name") == session:
            return int(s["pushed_version"])  # the core's view: a push shows once the core has taken it
    return None


# -- the well-behaved client (its own process) -----------------------------------------------


def bystander_main(url: str, phase: Any, stop: Any, out: Any) -> None:
    out.put(asyncio.run(_bystander(url, phase, stop)))


async def _bystander(url: str, phase: Any, stop: Any) -> dict[str, Any]:
    from streamllm.client.client import AsyncClient, ServiceError

    lat: dict[str, list[tuple[int, float]]] = {"standing": [], "cold": []}  # (phase, ms)
    errors: list[str] = []
    hung = acked_lines = 0
    last_version = 0
    async with await AsyncClient.connect(url) as c:
        await c.open("calm", max_context=1024)
        ack = await c.push("calm", [bar_line(i) for i in range(32)])
        acked_lines += 32
        await c.register("calm", QUESTION)
        while not any(a["question_id"] == "trend" and a["data_version"] == ack["data_version"]
                      for a in (await c.subscribe("calm", data=False))["standing"]):
            await asyncio.sleep(0.02)
        await c.unsubscribe("calm")

        async def timed(kind: str, coro: Any) -> None:
            nonlocal hung
            t0, during = time.perf_counter(), phase.value
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    await coro
            except TimeoutError:
                hung += 1
                return
            except ServiceError as exc:
                errors.append(f"{kind}: {exc}")
                return
            lat[kind].append((during, (time.perf_counter() - t0) * 1000))

        i, cold = 32, None
        next_cold = time.monotonic()
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    ack = await c.push("calm", [bar_line(i)])
                acked_lines += 1
                last_version = ack["data_version"]
            except TimeoutError:
                hung += 1
            except ServiceError as exc:
                errors.append(f"push: {exc}")
            i += 1
            await timed("standing", c.ask("calm", "trend"))
            if t0 >= next_cold and (cold is None or cold.done()):
                cold = asyncio.create_task(timed("cold", c.ask("calm", "What was the last close?", max_tokens=8)))
                next_cold = t0 + 1.0
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
        if cold is not None:
            await cold
        stats = await c.stats()
    info = next((s for s in stats["sessions"] if s["name"] == "calm"), {})
    return {"lat": lat, "errors": errors, "hung": hung, "acked_lines": acked_lines, "last_version": last_version,
            "session": info}


# -- the failing disk (in-process: the OSError is injected at the log's file calls) ---------------


def failing_disk(model: str, pushes: int = 60) -> dict[str, int]:
    """Pushes while the ingest log's write and fsync fail for a while (OSError injected at the system
    calls on its segment files), then recovery from the folder: every acked batch is there, once, in
    order, and nothing reads as a hole. A fsync failure under `batch` abandons the segment; under
    `interval` it stops the log (docs/reliability.md)."""
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.recovery import recover
    from streamllm.engine import Engine, EngineConfig

    out: Counter = Counter()
    fault = {"write": False, "fsync": False}
    real_write, real_fsync = os.write, os.fsync

    def segment(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").endswith(".arrow")
        except OSError:
            return False

    def write(fd: int, data: Any) -> int:
        if fault["write"] and segment(fd):  # a full disk: part of the record lands, then ENOSPC
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(28, "No space left on device (injected)")
        return real_write(fd, data)

    def fsync(fd: int) -> None:
        if fault["fsync"] and segment(fd):
            raise OSError(5, "Input/output error (injected)")
        real_fsync(fd)

    acked: list[tuple[int, str]] = []
    with tempfile.TemporaryDirectory() as folder:
        os.write, os.fsync = write, fsync  # the log's system calls on its segment files
        log = IngestLog(folder, flush="batch")
        engine = Engine(model, EngineConfig(max_cells=8192), ingest_log=log)
        try:
            engine.open_session("disk", max_context=1024)
            for i in range(pushes):
                fault["write"] = pushes // 4 <= i < pushes // 4 + 5  # the segment is cut back and abandoned
                fault["fsync"] = pushes // 2 <= i < pushes // 2 + 5  # the cut cannot be proved: the log stops
                line = bar_line(i)
                try:
                    ack = engine.push("disk", [line])
                except Exception:  # a failed push is an error, never an ack
                    out["disk_push_errors"] += 1
                    continue
                acked.append((ack.data_version, line))
            fault["write"] = fault["fsync"] = False
            out["disk_pushes_acked"] = len(acked)
            health = engine.health()
            out["disk_engine_alive"] = int(health.alive)
            out["disk_log_failure_reported"] = int(health.log_failure is not None)
            engine.wait_idle(60)
        finally:
            fault["write"] = fault["fsync"] = False
            os.write, os.fsync = real_write, real_fsync
            engine.shutdown()
            log.close()
        log2 = IngestLog(folder, flush="batch")
        engine2 = Engine(model, EngineConfig(max_cells=8192), ingest_log=log2)
        try:
            report = recover(engine2, log2)
            out["recovery_holes"] = len(report.holes)
            out["recovery_failed"] = len(report.failed)
            try:
                info = engine2.session_info("disk")
            except KeyError:  # not opened: everything acked is lost
                out["acked_lost"] = len(acked)
            else:
                # One line per push: what recovery holds beyond the acked pushes came from failed ones.
                out["acked_lost"] = (max(0, len(acked) - info.lines_ingested)
                                     + sum(v > info.data_version for v, _ in acked))
                out["disk_unacked_recovered"] = max(0, info.lines_ingested - len(acked))
        finally:
            engine2.shutdown()
            log2.close()
    return dict(out)


# -- the run ---------------------------------------------------------------------------------


SCENARIOS = ("cross_origin", "oversized", "stop_flood", "bad_pushes", "conn_storm", "slow_sse", "pool_fill")


async def storm(url: str, seconds: float, tally: Tally, phase: Any, skip: tuple[str, ...] = (),
                pool_fill_args: tuple[int, int | None] = (512, None)) -> None:
    """Each scenario in turn (`phase` tells the bystander which one it is living through), then the
    check that nothing of the hostile clients is left running in the engine."""
    raw = await Raw.connect(url)
    await raw.call({"type": "open", "session": "target", "max_context": 1024})
    await raw.call({"type": "push", "session": "target", "lines": [bar_line(i) for i in range(16)]})
    await raw.close()
    runs = {
        "cross_origin": lambda: cross_origin(url, tally, "target"),
        "oversized": lambda: oversized(url, tally, "target"),
        "stop_flood": lambda: stop_flood(url, tally, "target"),
        "bad_pushes": lambda: bad_pushes(url, tally),
        "conn_storm": lambda: conn_storm(url, tally, "target", 60 if seconds < 20 else 200),
        "slow_sse": lambda: slow_sse(url, tally, max(4.0, seconds / 3)),
        "pool_fill": lambda: pool_fill(url, tally, *pool_fill_args),
    }
    for index, name in enumerate(SCENARIOS, 1):
        if name in skip:
            continue
        phase.value = index
        t0 = time.perf_counter()
        try:
            await runs[name]()
        except Exception as exc:
            tally.bad("scenario_errors", f"{name}: {type(exc).__name__}: {exc}")
        tally.seconds[name] = time.perf_counter() - t0
        await asyncio.sleep(0.5)
    phase.value = len(SCENARIOS) + 1  # after: the engine must be back to the bystander alone
    orphans = 0
    for _ in range(50):  # the bystander has at most one cold ask in flight
        raw = await Raw.connect(url)
        engine = (await raw.call({"type": "stats"})).get("engine", {})
        await raw.close()
        orphans = max(0, int(engine.get("questions_running", 0)) + int(engine.get("questions_waiting", 0)) - 1)
        if not orphans:
            break
        await asyncio.sleep(0.1)
    tally.counts["storm_orphaned_asks"] = orphans


def run_abuse(model: str = "tiny", *, alone_s: float = 5.0, storm_s: float = 15.0, max_cells: int = 8192,
              max_queue: int = 64, disk: bool = True, skip: tuple[str, ...] = (),
              pool_fill_args: tuple[int, int | None] = (512, None)) -> tuple[dict[str, Any], list[str]]:
    """Returns (the report's keys, notes on everything counted against the server). skip: scenarios
    to leave out (tests/test_abuse.py leaves out slow_sse, which tests/test_sse_slow.py proves exactly).
    pool_fill_args: (tokens each pool-filling question decodes, the most cells it may need)."""
    proc, url = start_server(model, max_cells, max_queue)
    tally = Tally()
    ctx = mp.get_context("spawn")
    phase, stop, out = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    by = ctx.Process(target=bystander_main, args=(url, phase, stop, out), daemon=True)
    try:
        by.start()
        time.sleep(alone_s)
        asyncio.run(storm(url, storm_s, tally, phase, skip, pool_fill_args))
        time.sleep(1.0)
        stop.set()
        result = out.get(timeout=TIMEOUT_S * 3)
        by.join(10)
        status, body = http_request(url, "GET", "/health")
        health = orjson.loads(body) if body else {}
        deaths = int(proc.poll() is not None or health.get("status") == "failing")
    finally:
        stop.set()
        if by.is_alive():
            by.kill()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
    lat = result["lat"]
    during = range(1, len(SCENARIOS) + 1)
    calm = [ms for kind in lat for p, ms in lat[kind] if p == 0]
    busy = [ms for kind in lat for p, ms in lat[kind] if p in during]
    session = result["session"]
    lost = max(0, result["acked_lines"] - int(session.get("lines_ingested", result["acked_lines"])))
    c = tally.counts
    metrics: dict[str, Any] = {
        "cross_origin_accepted": c["cross_origin_accepted"],
        "engine_deaths": deaths,
        "hung_callers": c["hung_callers"] + result["hung"],
        "internal_errors": c["internal_errors"] + sum("internal" in e for e in result["errors"]),
        "acked_lost": lost,
        "acked_then_error": c["acked_then_error"],
        "recovery_holes": 0,
        "recovery_failed": 0,
        "accepted_unbounded": c["accepted_unbounded"],
        "scenario_errors": c["scenario_errors"],
        "bystander_errors": len(result["errors"]),
        "bystander_asks": len(calm) + len(busy),
        "bystander_p99_alone_ms": percentile(calm, 99),
        "bystander_p99_storm_ms": percentile(busy, 99),
        "bystander_standing_p99_alone_ms": percentile([ms for p, ms in lat["standing"] if p == 0], 99),
        "bystander_standing_p99_storm_ms": percentile([ms for p, ms in lat["standing"] if p in during], 99),
        "bystander_cold_p99_alone_ms": percentile([ms for p, ms in lat["cold"] if p == 0], 99),
        "bystander_cold_p99_storm_ms": percentile([ms for p, ms in lat["cold"] if p in during], 99),
        **{f"bystander_{kind}_max_{name}_ms": max([ms for p, ms in lat[kind] if p == i], default=float("nan"))
           for i, name in enumerate(SCENARIOS, 1) for kind in lat},
        **{k: v for k, v in c.items() if k.startswith(("cross_origin_refused", "slow_sse", "storm_", "pool_",
                                                        "bad_push", "refused", "closed"))},
    }
    metrics["bystander_p99_ratio"] = metrics["bystander_p99_storm_ms"] / metrics["bystander_p99_alone_ms"]
    metrics.update({f"scenario_{name}_s": round(sec, 2) for name, sec in tally.seconds.items()})
    notes = tally.notes + [f"bystander: {e}" for e in result["errors"][:10]]
    if disk:
        t0 = time.perf_counter()
        d = failing_disk(model)
        metrics["scenario_failing_disk_s"] = round(time.perf_counter() - t0, 2)
        metrics["recovery_holes"] = d.pop("recovery_holes", 0)
        metrics["recovery_failed"] = d.pop("recovery_failed", 0)
        metrics["acked_lost"] += d.pop("acked_lost", 0)
        metrics["internal_errors"] += d.pop("internal_errors", 0)
        metrics.update(d)
    return metrics, notes


MUST_BE_ZERO = ("cross_origin_accepted", "engine_deaths", "hung_callers", "internal_errors", "acked_lost",
                "acked_then_error", "recovery_holes", "recovery_failed", "accepted_unbounded", "scenario_errors")


def cli_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamllm bench abuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--quick", action="store_true", help="shorter phases (about 40 s in all)")
    parser.add_argument("--alone-s", type=float, default=10.0)
    parser.add_argument("--storm-s", type=float, default=30.0)
    parser.add_argument("--max-cells", type=int, default=8192, help="the server's KV pool (small on purpose)")
    args = parser.parse_args(argv)
    alone, storm_s = (4.0, 12.0) if args.quick else (args.alone_s, args.storm_s)
    print(f"bench abuse: {args.model}, {alone:.0f} s alone, {storm_s:.0f} s under attack, then a failing disk",
          flush=True)
    metrics, notes = run_abuse(args.model, alone_s=alone, storm_s=storm_s, max_cells=args.max_cells)
    print_table("bench abuse (must be 0)", ["key", "value"], [[k, metrics[k]] for k in MUST_BE_ZERO])
    print_table("the well-behaved client", ["key", "value"],
                [[k, metrics[k]] for k in metrics if k.startswith("bystander")])
    print_table("activity", ["key", "value"],
                [[k, v] for k, v in metrics.items() if k not in MUST_BE_ZERO and not k.startswith("bystander")])
    for note in notes:
        print("  ", note)
    write_json(args.json, metrics, {"model": args.model, "alone_s": alone, "storm_s": storm_s})
    return 1 if any(metrics[k] for k in MUST_BE_ZERO) else 0


if __name__ == "__main__":
    raise SystemExit(cli_main())
