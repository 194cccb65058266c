"""A server killed with SIGKILL mid-push comes back with every acknowledged event, and answers again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from streamllm.client.client import AsyncClient
from streamllm.durability.log_reader import read_session, session_folders

ROOT = Path(__file__).resolve().parents[1]
QUESTION = {"id": "trend", "text": "Up or down?", "choices": ["up", "down"]}


def start_server(log_dir: Path, flush: str = "batch") -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "STREAMLLM_TOKENS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "streamllm.cli", "serve", "--model", "tiny", "--port", "0",
                             "--log-dir", str(log_dir), "--log-flush", flush, "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert proc.stdout is not None
    head = proc.stdout.readline()
    assert head.startswith("streamllm serving tiny"), head + (proc.stderr.read() if proc.poll() is not None else "")
    return proc, head.rsplit(" at ", 1)[1].strip()


def read_until(proc: subprocess.Popen, prefix: str) -> str:
    assert proc.stdout is not None
    for _ in range(20):
        line = proc.stdout.readline()
        if prefix in line:
            return line
    raise AssertionError(f"no {prefix!r} line")


async def push_until_killed(url: str, proc: subprocess.Popen, sessions: list[str], kill_after: int) -> dict:
    """Pushers on every session (two in flight each); SIGKILL once `kill_after` batches are acked."""
    acked: dict[str, dict[int, list[str]]] = {s: {} for s in sessions}
    async with await AsyncClient.connect(url) as c:
        for s in sessions:
            await c.open(s)
            await c.register(s, QUESTION)
    clients = [await AsyncClient.connect(url) for _ in sessions]
    killed = asyncio.Event()

    async def pusher(c: AsyncClient, s: str, k: int) -> None:
        i = 0
        while not killed.is_set():
            lines = [f"{s} w{k} b{i} l{j} C 640{i % 90:02d}.{j}" for j in range(3)]
            try:
                ack = await c.push(s, lines)
            except Exception:
                return  # the server died under us: this batch was never acknowledged
            acked[s][ack["data_version"]] = lines
            i += 1
            if sum(len(v) for v in acked.values()) >= kill_after and not killed.is_set():
                proc.send_signal(signal.SIGKILL)  # mid-flight: other pushes are on the wire
                killed.set()

    tasks = [pusher(c, s, k) for c, s in zip(clients, sessions, strict=True) for k in range(2)]
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for c in clients:
        with contextlib.suppress(Exception):  # the server is gone
            await c.aclose()
    return acked


def test_sigkill_mid_push_loses_no_acknowledged_event_and_answers_resume(tmp_path):
    log_dir = tmp_path / "log"
    sessions = ["btc", "eth"]
    proc, url = start_server(log_dir)
    try:
        acked = asyncio.run(push_until_killed(url, proc, sessions, kill_after=60))
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert sum(len(v) for v in acked.values()) >= 60

    proc, url = start_server(log_dir)
    try:
        report = read_until(proc, "ingest log")
        assert "recovered 2 sessions" in report

        async def check() -> dict:
            async with await AsyncClient.connect(url) as c:
                stats = {s["name"]: s for s in (await c.stats())["sessions"]}
                sub = await c.subscribe("btc")
                answer = await c.ask("btc", "trend")
                ack = await c.push("btc", ["after restart C 64000"])
                # the standing entry is pre-positioned again on new data: fast or entry path, not cold
                fresh = await c.ask("btc", "trend", min_version=ack["data_version"])
                return {"stats": stats, "sub": sub, "answer": answer, "fresh": fresh, "ack": ack}

        got = asyncio.run(asyncio.wait_for(check(), 60))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = {read_session(f).name: read_session(f) for f in session_folders(log_dir)}
    for s in sessions:
        batches = {r.data_version: r.lines for r in logged[f"local/{s}"].records if r.kind == "push"}
        for version, lines in acked[s].items():  # every acked batch, at its version, with its content
            assert batches.get(version) == lines, (s, version)
        info = got["stats"][s]
        recovered = max(v for v in batches if v <= info["pushed_version"])
        assert info["pushed_version"] >= max(acked[s]) and recovered >= max(acked[s])
        assert info["lines_ingested"] + info["backlog_lines"] == 3 * info["pushed_version"]
    assert got["answer"]["data_version"] >= max(acked["btc"])  # the tiny model is random: no text check
    assert got["ack"]["data_version"] == got["stats"]["btc"]["pushed_version"] + 1
    assert [a["question_id"] for a in got["sub"]["standing"]] == ["trend"]  # standing answers are back
    assert got["fresh"]["path"] in ("fast", "entry") and got["fresh"]["data_version"] == got["ack"]["data_version"]
