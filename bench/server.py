"""`streamllm bench server [--json out.json] [--before REV]`: the service's round trips over loopback.

Servers (`streamllm serve --model tiny --port 0`, no config) run in their own processes.
One session gets data and a standing question with choices and threshold 0, so once
pre-positioned the gate always fires: asking it by id takes the fast path (checked on
every answer). Measured by the clients, send to answer:

  e2e_fast_ms_p50 / _p99       websocket, `--clients` (50) clients, each in its own process,
                               each asking every `--interval-ms` (jittered start), all at once
  e2e_fast_ms_p50_1client      one client asking in sequence (the protocol's floor)
  stats_ms_p50                 a `stats` round trip (protocol cost, no question)
  http_fast_ms_p50 / _p99      the same standing question via POST /v1/chat/completions
                               (`question_id`, non-streamed, one keep-alive connection)
  first_token_ms_p50           a streamed ad-hoc question (cold path) on `--stream-model`
  answer_ms_p50                ... and its whole answer, same asks (websocket `ask_stream`)

`--before REV` also runs the server of git revision REV (extracted with `git archive`) and
reports its websocket figures as `before_*`, repetitions interleaved with the current
server's in the same run, so both see the same machine. Medians over `--reps`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamllm.client.client import AsyncClient
from streamllm.client.local_token import find_token

ROOT = Path(__file__).resolve().parents[1]
LINES = [f"12:{i // 60:02d}:{i % 60:02d} 640{i % 100:02d}.5 +1.5 v{i % 7}.2 n{i % 5 + 3}" for i in range(64)]
QUESTION = {"id": "trend", "text": "Is the price going up or down? Answer up or down.",
            "choices": ["up", "down"], "threshold": 0.0}
AD_HOC = "Describe the last bar in a few words."


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def start_server(model: str, tree: Path = ROOT) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "STREAMLLM_TOKENS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamllm.cli", "serve", "--model", model, "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if " at ws://" in line:
            return proc, line.rsplit(" at ", 1)[1].strip()
    raise RuntimeError(f"server did not start (exit {proc.wait()})")


def checkout(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` (the 'before' server), without touching the work tree."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def prepare(url: str) -> None:
    async with await AsyncClient.connect(url) as c:
        await c.open("bench")
        version = (await c.push("bench", LINES))["data_version"]
        await c.register("bench", QUESTION)
        while not any(a["question_id"] == "trend" and a["data_version"] == version
                      for a in (await c.subscribe("bench", data=False))["standing"]):
            await asyncio.sleep(0.01)


# -- websocket: one client in sequence, and N client processes at once ---------------------


async def sequential(url: str, asks: int) -> dict[str, float]:
    async with await AsyncClient.connect(url) as c:
        for _ in range(20):
            await c.ask("bench", "trend")
        lat, stats_ms, not_fast = [], [], 0
        for _ in range(asks):
            t0 = time.perf_counter()
            answer = await c.ask("bench", "trend")
            lat.append((time.perf_counter() - t0) * 1000)
            not_fast += answer["path"] != "fast"
        for _ in range(asks):
            t0 = time.perf_counter()
            await c.stats()
            stats_ms.append((time.perf_counter() - t0) * 1000)
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "stats_p50": pct(stats_ms, 0.5), "not_fast": not_fast}


def _client_process(url: str, asks: int, interval_s: float, seed: int, barrier: Any, out: Any) -> None:
    async def run() -> tuple[list[float], int]:
        async with await AsyncClient.connect(url) as c:
            for _ in range(5):  # warm-up: connection, code paths
                await c.ask("bench", "trend")
            await asyncio.to_thread(barrier.wait, 120)
            rng = random.Random(seed)
            lat, not_fast = [], 0
            next_at = time.perf_counter() + rng.random() * interval_s
            for _ in range(asks):
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t0 = time.perf_counter()
                answer = await c.ask("bench", "trend")
                lat.append((time.perf_counter() - t0) * 1000)
                not_fast += answer["path"] != "fast"
                next_at += interval_s
            return lat, not_fast

    try:
        out.put(asyncio.run(run()))
    except Exception as exc:  # report, never hang the parent
        out.put(exc)


def concurrent(url: str, clients: int, asks: int, interval_s: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(url, asks, interval_s, i, barrier, out), daemon=True)
             for i in range(clients)]
    for proc in procs:
        proc.start()
    barrier.wait(120)
    t0 = time.perf_counter()
    results = [out.get(timeout=300) for _ in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.join(30)
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} client processes failed: {failed[0]!r}")
    lat = [x for r in results for x in r[0]]
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "asks_per_s": len(lat) / wall,
            "not_fast": sum(r[1] for r in results)}


# -- HTTP and streaming -------------------------------------------------------------------


def http_fast(url: str, model: str, asks: int) -> dict[str, float]:
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=30)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "trend"}],
                       "session": "bench", "question_id": "trend"}).encode()
    token = find_token(url)  # serve's local token (a server without tokens ignores it)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    lat, not_fast = [], 0
    for i in range(asks + 20):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, headers)
        response = conn.getresponse()
        data = json.loads(response.read())
        if i >= 20:  # warm-up first
            lat.append((time.perf_counter() - t0) * 1000)
            not_fast += response.status != 200 or data["streamllm"]["path"] != "fast"
    conn.close()
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "not_fast": not_fast}


async def streamed(url: str, asks: int, max_tokens: int) -> dict[str, float]:
    first, whole, tokens = [], [], []
    async with await AsyncClient.connect(url) as c:
        for i in range(asks + 1):
            t0 = time.perf_counter()
            t_first = None
            n = 0
            async for message in c.ask_stream("bench", AD_HOC, max_tokens=max_tokens):
                if message["type"] == "token":
                    n += 1
                    t_first = t_first or time.perf_counter()
                else:
                    assert message["path"] == "cold", message
            if i:  # the first ask warms up
                first.append(((t_first or time.perf_counter()) - t0) * 1000)
                whole.append((time.perf_counter() - t0) * 1000)
                tokens.append(n)
    return {"first_token_ms_p50": statistics.median(first), "answer_ms_p50": statistics.median(whole),
            "stream_token_events_p50": statistics.median(tokens)}


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm bench server", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the flat metric report here")
    ap.add_argument("--model", default="tiny", help="model of the fast-path servers (the fast path needs no model call)")
    ap.add_argument("--before", metavar="REV", help="also measure the server of this git revision (e.g. main)")
    ap.add_argument("--asks", type=int, default=300, help="sequential asks of the single client, per rep")
    ap.add_argument("--clients", type=int, default=50, help="client processes asking at once")
    ap.add_argument("--asks-per-client", type=int, default=40)
    ap.add_argument("--interval-ms", type=float, default=50.0, help="each client's pace (50 clients x 20/s = 1000/s)")
    ap.add_argument("--http-asks", type=int, default=300)
    ap.add_argument("--stream-model", default="smollm2-135m", help="model for first_token_ms ('' to skip)")
    ap.add_argument("--stream-asks", type=int, default=5)
    ap.add_argument("--stream-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        try:
            if args.before:
                servers["before"] = start_server(args.model, checkout(args.before, Path(tmp)))
            servers["after"] = start_server(args.model)
            for _, url in servers.values():
                asyncio.run(prepare(url))
            rows: dict[str, dict[str, list[dict]]] = {k: {"one": [], "many": []} for k in servers}
            for _ in range(args.reps):  # interleaved: before and after see the same machine
                for key, (_, url) in servers.items():
                    rows[key]["one"].append(asyncio.run(sequential(url, args.asks)))
                    rows[key]["many"].append(concurrent(url, args.clients, args.asks_per_client,
                                                        args.interval_ms / 1000))
            for key, row in rows.items():
                prefix = "" if key == "after" else "before_"

                def med(rs: list[dict], k: str) -> float:
                    return statistics.median(r[k] for r in rs)

                report |= {f"{prefix}e2e_fast_ms_p50": med(row["many"], "p50"),
                           f"{prefix}e2e_fast_ms_p99": med(row["many"], "p99"),
                           f"{prefix}asks_per_s": med(row["many"], "asks_per_s"),
                           f"{prefix}e2e_fast_ms_p50_1client": med(row["one"], "p50"),
                           f"{prefix}e2e_fast_ms_p99_1client": med(row["one"], "p99"),
                           f"{prefix}stats_ms_p50": med(row["one"], "stats_p50"),
                           f"{prefix}answers_not_fast": sum(r["not_fast"] for r in row["one"] + row["many"])}
            if args.before:
                report["e2e_fast_p50_after_over_before"] = report["e2e_fast_ms_p50"] / report["before_e2e_fast_ms_p50"]
                report["e2e_fast_p99_after_over_before"] = report["e2e_fast_ms_p99"] / report["before_e2e_fast_ms_p99"]
            reps = [http_fast(servers["after"][1], args.model, args.http_asks) for _ in range(args.reps)]
            report |= {"http_fast_ms_p50": statistics.median(r["p50"] for r in reps),
                       "http_fast_ms_p99": statistics.median(r["p99"] for r in reps),
                       "http_answers_not_fast": sum(r["not_fast"] for r in reps)}
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    if args.stream_model:
        proc, url = start_server(args.stream_model)
        try:
            asyncio.run(prepare(url))
            report |= asyncio.run(streamed(url, args.stream_asks, args.stream_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    report |= {"clients": args.clients, "interval_ms": args.interval_ms, "asks_per_client": args.asks_per_client,
               "reps": args.reps, "cpus": os.cpu_count() or 0}
    print(f"bench server: {args.model} model (stream: {args.stream_model or '-'}), "
          f"{platform.processor() or platform.machine()}, {report['cpus']} cpus, median of {args.reps} reps; "
          "clients and servers share the machine")
    width = max(map(len, report))
    for key, value in report.items():
        print(f"  {key:<{width}}  {value:.3f}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    if any(report.get(k) for k in ("answers_not_fast", "before_answers_not_fast", "http_answers_not_fast")):
        print("warning: some answers did not take the fast path", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
