"""`streamllm bench faults`: crash recovery, snapshots, fuzzing and a websocket load run.

    streamllm bench faults [--json out.json] [--model tiny] [--load-s 20] [--fuzz-cases 3000] [--dtype bfloat16]

1. crash: a `streamllm serve --log-dir` subprocess takes concurrent pushes and is SIGKILLed
   mid-flight; it is restarted on the same log and every acked batch is looked up (by
   version and content) in what the restarted server holds.
2. restore vs replay: one session rebuilt from its log, and the same session restored
   from a snapshot (wall time of each, session fully computed).
3. fuzz: seeded random and mutated inputs into the wire parsers, the protocol decoder and
   the config parser; anything but the documented error types is an uncaught error.
4. load: clients pushing, asking and subscribing over loopback for `--load-s`, then
   acked lines vs the sessions and the log; server RSS growth over the run.
5. durability (bench/durability.py, in-process): simulated power loss per flush policy,
   recovery after 1 hour vs 1 minute of feed-equivalent data with checkpoints, a replay
   feed restarted mid-way (duplicates), more sessions than the pool holds (auto eviction):
   a session restored from disk must answer bit for bit as it did before its eviction
   (`evicted_restore_logit_diff` == 0, in every dtype: the restore lays its cells out in
   the runs they had live, engine/kv.py `lay_out`).

The fuzzer and its corpora: bench/fuzz.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json
from bench.fuzz import fuzz
from streamllm.model.dtype import DTYPE_CHOICES
from streamllm.model.dtype import ENV_VAR as DTYPE_ENV

ROOT = Path(__file__).resolve().parents[1]
QUESTION = {"id": "trend", "text": "Up or down?", "choices": ["up", "down"]}


# -- 1. crash and recover ---------------------------------------------------------


def start_server(model: str, log_dir: Path, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "STREAMLLM_TOKENS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "streamllm.cli", "serve", "--model", model, "--port", "0",
                             "--log-dir", str(log_dir), "--log-level", "WARNING", *(extra or [])],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    assert proc.stdout is not None
    head = proc.stdout.readline()
    if not head.startswith("streamllm serving"):
        proc.kill()
        raise RuntimeError(f"server did not start: {head!r}")
    return proc, head.rsplit(" at ", 1)[1].strip()


async def _push_and_kill(url: str, proc: subprocess.Popen, sessions: list[str], kill_after: int) -> dict:
    from streamllm.client.client import AsyncClient

    acked: dict[str, dict[int, list[str]]] = {s: {} for s in sessions}
    async with await AsyncClient.connect(url) as c:
        for s in sessions:
            await c.open(s)
            await c.register(s, QUESTION)
    clients = [await AsyncClient.connect(url) for _ in sessions for _ in range(2)]
    killed = asyncio.Event()
    errors: list[str] = []

    async def pusher(c: Any, s: str, k: int) -> None:
        i = 0
        while not killed.is_set():
            lines = [f"{s} w{k} b{i} l{j} C 640{i % 90:02d}.{j}" for j in range(4)]
            try:
                ack = await c.push(s, lines)
            except Exception as exc:
                if "capacity" in str(exc) and not killed.is_set():  # compaction catching up: push it again
                    await asyncio.sleep(0.05)
                    continue
                if not killed.is_set():  # not the kill: a real failure of the run
                    errors.append(f"{type(exc).__name__}: {exc}")
                return
            acked[s][ack["data_version"]] = lines
            i += 1
            if sum(len(v) for v in acked.values()) >= kill_after and not killed.is_set():
                proc.send_signal(signal.SIGKILL)
                killed.set()

    await asyncio.gather(*(pusher(c, sessions[i // 2], i % 2) for i, c in enumerate(clients)))
    for c in clients:
        with contextlib.suppress(Exception):
            await c.aclose()
    if errors:
        raise RuntimeError(f"pushes failed before the kill: {errors[:3]}")
    return acked


def crash_and_recover(model: str, work: Path, kill_after: int) -> dict[str, float]:
    from streamllm.client.client import AsyncClient
    from streamllm.durability.log_reader import read_session, session_folders

    log_dir = work / "crash-log"
    sessions = ["btc", "eth", "sol"]
    proc, url = start_server(model, log_dir)
    try:
        acked = asyncio.run(_push_and_kill(url, proc, sessions, kill_after))
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    t0 = time.perf_counter()
    proc, url = start_server(model, log_dir)
    startup_s = time.perf_counter() - t0
    try:
        report = next((ln for ln in iter(proc.stdout.readline, "") if "ingest log" in ln), "")  # type: ignore[union-attr]

        async def stats() -> dict:
            async with await AsyncClient.connect(url) as c:
                return {s["name"]: s for s in (await c.stats())["sessions"]}

        held = asyncio.run(stats())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = {read_session(f).name: read_session(f) for f in session_folders(log_dir)}
    acked_events = recovered = 0
    for s in sessions:
        batches = {r.data_version: r.lines for r in logged[f"local/{s}"].records if r.kind == "push"}
        pushed = held[s]["pushed_version"]
        for version, lines in acked[s].items():
            acked_events += len(lines)
            if version <= pushed and batches.get(version) == lines:
                recovered += len(lines)
    replay_s = float(report.split(" in ")[1].split("s")[0]) if " in " in report else float("nan")
    return {"events_acked": acked_events, "events_recovered": recovered, "crash_restart_s": startup_s,
            "crash_log_replay_s": replay_s}


# -- 2. restore vs replay ------------------------------------------------------------


def restore_vs_replay(model: str, work: Path, lines: int) -> dict[str, float]:
    from bench.common import market_lines
    from streamllm.config import parse_question
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.recovery import recover
    from streamllm.durability.snapshot import restore_session, save_session
    from streamllm.engine import Engine, EngineConfig
    from streamllm.model import load_model

    loaded = load_model(model, progress=False)
    log_dir, snap = work / "rr-log", work / "rr.safetensors"
    config = EngineConfig(max_cells=32768, max_context=8192)
    eng = Engine(loaded, config, ingest_log=IngestLog(log_dir))
    eng.open_session("s")
    eng.register("s", parse_question(QUESTION))
    source = market_lines()
    pushed = 0
    while pushed < lines:
        batch = [next(source) for _ in range(8)]
        eng.push("s", batch)
        pushed += len(batch)
    eng.wait_idle()
    tokens = eng.session_info("s").num_tokens
    save_session(eng, "s", snap)
    eng.shutdown()
    eng.ingest_log.close()

    eng = Engine(loaded, config)
    report = recover(eng, IngestLog(log_dir))
    replay_s = report.replay_s + report.ingest_s
    eng.shutdown()
    eng = Engine(loaded, config)
    t0 = time.perf_counter()
    restore_session(eng, snap)
    restore_s = time.perf_counter() - t0
    eng.shutdown()
    return {"recovery_replay_s": replay_s, "snapshot_restore_s": restore_s, "restore_speedup": replay_s / restore_s,
            "rr_lines": lines, "rr_tokens": tokens, "snapshot_mb": snap.stat().st_size / 1e6}


# -- 4. load ------------------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load_run(url: str, seconds: float, clients: int, pid: int | None = None) -> dict[str, Any]:
    """`clients` connections: each owns a session, pushes, asks and subscribes; a watcher reads all."""
    from streamllm.client.client import AsyncClient

    sent = {"push": 0, "ask": 0, "replies": 0, "errors": 0, "events": 0}
    acked: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    rss: list[float] = []

    async def worker(k: int) -> None:
        name = f"load{k}"
        async with await AsyncClient.connect(url) as c:
            await c.open(name, max_context=2048)
            await c.register(name, QUESTION)
            await c.subscribe(name)
            acked[name] = 0
            i = 0
            while time.monotonic() < deadline:
                lines = [f"{name} b{i} l{j} C 640{i % 90:02d}.{j}" for j in range(4)]
                try:
                    ack = await c.push(name, lines)
                    acked[name] += ack["lines"]
                    sent["push"] += 1
                    sent["replies"] += 1
                    if i % 5 == 0:
                        await c.ask(name, "trend" if i % 10 == 0 else "Last close?", max_tokens=2)
                        sent["ask"] += 1
                        sent["replies"] += 1
                except Exception as exc:  # capacity while compaction catches up: a counted error reply
                    sent["errors"] += 1
                    if "capacity" not in str(exc):
                        raise
                    await asyncio.sleep(0.05)
                i += 1
            while True:  # drain our subscription's events that arrived meanwhile
                try:
                    await asyncio.wait_for(c.events().__anext__(), 0.01)
                    sent["events"] += 1
                except (TimeoutError, StopAsyncIteration):
                    break

    async def sampler() -> None:
        while pid is not None and time.monotonic() < deadline:
            rss.append(_rss_mb(pid))
            await asyncio.sleep(0.5)

    t0 = time.perf_counter()
    await asyncio.gather(sampler(), *(worker(k) for k in range(clients)))
    elapsed = time.perf_counter() - t0
    async with await AsyncClient.connect(url) as c:
        stats = {s["name"]: s for s in (await c.stats())["sessions"]}
    held = {name: stats[name]["lines_ingested"] + stats[name]["backlog_lines"] for name in acked}
    lost = sum(max(0, acked[n] - held[n]) for n in acked)
    return {"load_msgs_per_s": sent["replies"] / elapsed, "load_pushes": sent["push"], "load_asks": sent["ask"],
            "load_error_replies": sent["errors"], "load_lines_acked": sum(acked.values()), "load_lost": lost,
            "acked": acked, "rss": rss}


def load(model: str, work: Path, seconds: float, clients: int) -> dict[str, float]:
    from streamllm.durability.log_reader import pushed_lines

    log_dir = work / "load-log"
    proc, url = start_server(model, log_dir, ["--log-flush", "interval"])
    try:
        time.sleep(0.5)
        rss0 = _rss_mb(proc.pid)
        out = asyncio.run(load_run(url, seconds, clients, proc.pid))
        rss1 = _rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = pushed_lines(log_dir)
    log_lost = sum(max(0, n - len(logged.get(f"local/{name}", []))) for name, n in out["acked"].items())
    return {k: v for k, v in out.items() if k not in ("acked", "rss")} | {
        "load_lost": out["load_lost"] + log_lost, "load_log_lost": log_lost, "rss_growth_mb": rss1 - rss0,
        "rss_start_mb": rss0, "load_s": seconds, "load_clients": clients}


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamllm bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--json", help="write the metrics here")
    parser.add_argument("--load-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--fuzz-cases", type=int, default=6000)
    parser.add_argument("--kill-after", type=int, default=400, help="acked batches before SIGKILL")
    parser.add_argument("--replay-lines", type=int, default=240)
    parser.add_argument("--bounded-reps", type=int, default=5, help="repetitions of the 1 min / 1 h recovery runs")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="the engines' dtype, in process and in the servers it starts (default: auto)")
    args = parser.parse_args(argv)
    if args.dtype != "auto":
        os.environ[DTYPE_ENV] = args.dtype  # read by every engine, the `serve` subprocesses' too
    work = Path(tempfile.mkdtemp(prefix="streamllm-faults-"))
    metrics: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        metrics |= crash_and_recover(args.model, work, args.kill_after)
        metrics |= restore_vs_replay(args.model, work, args.replay_lines)
        metrics |= fuzz(args.fuzz_cases)
        metrics |= load(args.model, work, args.load_s, args.clients)
        from bench.durability import run_all

        metrics |= run_all(args.model, work / "durability", bounded_reps=args.bounded_reps)
        metrics["total_s"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    samples = metrics.pop("uncaught_samples", [])
    rows = [[k, v] for k, v in metrics.items()]
    print_table(f"bench faults ({args.model})", ["metric", "value"], rows)
    for s in samples:
        print("uncaught:", s)
    write_json(args.json, metrics, {"model": args.model, "machine": machine(), "args": vars(args)})
    ok = metrics["events_acked"] == metrics["events_recovered"] and metrics["uncaught_errors"] == 0 \
        and metrics["load_lost"] == 0 and metrics["power_loss_events_lost"] == 0 \
        and metrics["replay_feed_duplicates_after_restart"] == 0 and metrics["auto_evictions"] > 0 \
        and metrics["evicted_restore_logit_diff"] == 0 and metrics["recovery_ratio_1h_vs_1min"] <= 2
    return 0 if ok else 1
