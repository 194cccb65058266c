"""`streamllm bench server [--json out.json]`: ask round trips over loopback websockets.

A server (`streamllm serve --model tiny --port 0`, no config) runs in its own process;
this process is the client. One session gets data and a standing question with choices
and threshold 0, so once pre-positioned the gate always fires: asking it by id at the
current data version takes the fast path (checked on every answer). Measured per ask,
send to answer, by the client:

  e2e_fast_ms_p50 / _p99 / asks_per_s         1 client, sequential asks
  e2e_fast_ms_p50_c50 / _p99_c50 / asks_per_s_c50   50 connections asking at once
  stats_ms_p50                                a `stats` round trip (protocol cost, no question)
  engine_fast_ms_p50                          the engine's own latency_ms on the same answers

Medians over `--reps` repetitions. The client and the server share this machine's cores
(and, here, other people's jobs): the figures include both sides' Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from streamllm.service.client import AsyncClient

LINES = [f"12:{i // 60:02d}:{i % 60:02d} 640{i % 100:02d}.5 +1.5 v{i % 7}.2 n{i % 5 + 3}" for i in range(64)]
QUESTION = {"id": "trend", "text": "Is the price going up or down? Answer up or down.",
            "choices": ["up", "down"], "threshold": 0.0}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamllm.cli", "serve", "--model", model, "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None
    for line in proc.stdout:
        if " at ws://" in line:
            return proc, line.rsplit(" at ", 1)[1].strip()
    raise RuntimeError(f"server did not start (exit {proc.wait()})")


async def prepare(url: str) -> None:
    async with await AsyncClient.connect(url) as c:
        await c.open("bench")
        version = (await c.push("bench", LINES))["data_version"]
        await c.register("bench", QUESTION)
        while not any(a["question_id"] == "trend" and a["data_version"] == version
                      for a in (await c.subscribe("bench", data=False))["standing"]):
            await asyncio.sleep(0.01)


async def ask_loop(client: AsyncClient, n: int, out: list[float], engine_ms: list[float]) -> int:
    not_fast = 0
    for _ in range(n):
        t0 = time.perf_counter()
        answer = await client.ask("bench", "trend")
        out.append((time.perf_counter() - t0) * 1000)
        engine_ms.append(answer["latency_ms"])
        not_fast += answer["path"] != "fast"
    return not_fast


async def run_clients(url: str, clients: int, asks: int) -> dict[str, Any]:
    conns = [await AsyncClient.connect(url) for _ in range(clients)]
    try:
        for c in conns:  # warm-up: connection, code paths, allocator
            await ask_loop(c, 5, [], [])
        lat: list[float] = []
        engine_ms: list[float] = []
        t0 = time.perf_counter()
        not_fast = sum(await asyncio.gather(*(ask_loop(c, asks, lat, engine_ms) for c in conns)))
        wall = time.perf_counter() - t0
        stats_ms: list[float] = []
        if clients == 1:
            for _ in range(asks):
                t1 = time.perf_counter()
                await conns[0].stats()
                stats_ms.append((time.perf_counter() - t1) * 1000)
    finally:
        for c in conns:
            await c.aclose()
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "asks_per_s": len(lat) / wall, "not_fast": not_fast,
            "engine_p50": pct(engine_ms, 0.5), "stats_p50": pct(stats_ms, 0.5) if stats_ms else None}


def measure(url: str, asks_1: int, clients: int, asks_n: int, reps: int) -> dict[str, float]:
    one, many = [], []
    for _ in range(reps):
        one.append(asyncio.run(run_clients(url, 1, asks_1)))
        many.append(asyncio.run(run_clients(url, clients, asks_n)))

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "e2e_fast_ms_p50": med(one, "p50"), "e2e_fast_ms_p99": med(one, "p99"), "asks_per_s": med(one, "asks_per_s"),
        f"e2e_fast_ms_p50_c{clients}": med(many, "p50"), f"e2e_fast_ms_p99_c{clients}": med(many, "p99"),
        f"asks_per_s_c{clients}": med(many, "asks_per_s"),
        "stats_ms_p50": med(one, "stats_p50"), "engine_fast_ms_p50": med(one, "engine_p50"),
        "answers_not_fast": sum(r["not_fast"] for r in one + many),
        "asks_per_client_1": asks_1, "clients": clients, "asks_per_client_n": asks_n, "reps": reps,
        "cpus": os.cpu_count() or 0,
    }


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm bench server", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the flat metric report here")
    ap.add_argument("--model", default="tiny", help="model the server loads (default tiny: the fast path needs no model call)")
    ap.add_argument("--url", help="measure an already running server instead of starting one")
    ap.add_argument("--asks", type=int, default=500, help="sequential asks of the single client")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--asks-per-client", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model)
    try:
        asyncio.run(prepare(url))
        report = measure(url, args.asks, args.clients, args.asks_per_client, args.reps)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"bench server: {args.model} model, {platform.processor() or platform.machine()}, {report['cpus']} cpus, "
          f"median of {args.reps} reps; client and server share the machine")
    width = max(map(len, report))
    for key, value in report.items():
        print(f"  {key:<{width}}  {value:.3f}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    if report["answers_not_fast"]:
        print(f"warning: {report['answers_not_fast']} answers did not take the fast path", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
