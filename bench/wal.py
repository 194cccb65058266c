"""`streamllm bench wal`: our Arrow ingest log against stdlib sqlite3 on the same records.

    streamllm bench wal [--json out.json] [--appends 400] [--reps 3]

Same workload for both: one session, records of 3 market lines each, appended one at a
time (one ack each), then read back in order. Policies side by side:

    ours batch      fsync per record            sqlite WAL synchronous=FULL    (power-loss safe)
    ours interval   flush per record, fsync     sqlite WAL synchronous=NORMAL  (process-crash safe;
                    every 50 ms                                                  WAL fsynced at checkpoints)

Reported: appends/s (median of `--reps`), the ratio ours/sqlite per policy, and the time
to read every record back (recovery's read side). Then the engine's real shape: 4
sessions appending from 4 threads at the power-loss-safe policy (ours: a file and an
fsync per session, in parallel; sqlite: one database, one writer at a time). Machines
are shared: ratios only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json


def _lines(v: int) -> list[str]:
    return [f"12:{v // 60 % 60:02d}:{v % 60:02d} BTCUSDT O 640{v % 90:02d}.5 H 641 L 639 C 640{v % 90:02d}.2 V {j}.5"
            for j in range(3)]


def ours(folder: Path, flush: str, n: int) -> tuple[float, float]:
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.log_reader import read_session

    log = IngestLog(folder, flush=flush)
    log.record_open("s", "sys", 4096)
    t0 = time.perf_counter()
    for v in range(1, n + 1):
        log.record_push("s", v, _lines(v))
    append_s = time.perf_counter() - t0
    log.close()
    t0 = time.perf_counter()
    got = read_session(log.folder("s")).records
    read_s = time.perf_counter() - t0
    assert len(got) == n + 1
    return n / append_s, read_s


def sqlite(folder: Path, synchronous: str, n: int) -> tuple[float, float]:
    folder.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(folder / "log.db", isolation_level=None)  # autocommit: one transaction per append
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute("CREATE TABLE log (id INTEGER PRIMARY KEY, kind TEXT, session TEXT, data_version INTEGER, "
               "lines TEXT, recv_ns INTEGER, meta TEXT)")
    db.execute("INSERT INTO log VALUES (NULL, 'open', 's', 0, '[]', 0, ?)", (json.dumps({"system": "sys"}),))
    t0 = time.perf_counter()
    for v in range(1, n + 1):
        db.execute("INSERT INTO log VALUES (NULL, 'push', 's', ?, ?, ?, '{}')",
                   (v, json.dumps(_lines(v)), time.time_ns()))
    append_s = time.perf_counter() - t0
    db.close()
    t0 = time.perf_counter()
    db = sqlite3.connect(folder / "log.db")
    rows = [(k, s, v, json.loads(ln), r, json.loads(m)) for k, s, v, ln, r, m in
            db.execute("SELECT kind, session, data_version, lines, recv_ns, meta FROM log WHERE session = 's' "
                       "ORDER BY id")]
    read_s = time.perf_counter() - t0
    db.close()
    assert len(rows) == n + 1
    return n / append_s, read_s


def concurrent(folder: Path, kind: str, n: int, sessions: int = 4) -> float:
    """`sessions` threads, one session each, n power-loss-safe appends each: total appends/s."""
    import threading

    from streamllm.durability.ingest_log import IngestLog

    folder.mkdir(parents=True, exist_ok=True)
    log = IngestLog(folder / "ours", flush="batch") if kind == "ours" else None
    if kind == "sqlite":
        db = sqlite3.connect(folder / "log.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE log (id INTEGER PRIMARY KEY, session TEXT, data_version INTEGER, lines TEXT)")
        db.close()

    def work(k: int) -> None:
        name = f"s{k}"
        if log is not None:
            log.record_open(name, "sys", 4096)
            for v in range(1, n + 1):
                log.record_push(name, v, _lines(v))
            return
        db = sqlite3.connect(folder / "log.db", isolation_level=None, timeout=60, check_same_thread=False)
        db.execute("PRAGMA synchronous=FULL")
        for v in range(1, n + 1):
            db.execute("INSERT INTO log VALUES (NULL, ?, ?, ?)", (name, v, json.dumps(_lines(v))))
        db.close()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if log is not None:
        log.close()
    return sessions * n / (time.perf_counter() - t0)


def compare(appends: int, reps: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="streamllm-wal-"))
    out: dict[str, float] = {}
    try:
        runs: dict[str, list[tuple[float, float]]] = {}
        for rep in range(reps):  # interleaved, so drift on a shared machine hits both alike
            for name, fn, arg, n in (("ours_batch", ours, "batch", appends),
                                     ("sqlite_full", sqlite, "FULL", appends),
                                     ("ours_interval", ours, "interval", 10 * appends),
                                     ("sqlite_normal", sqlite, "NORMAL", 10 * appends)):
                runs.setdefault(name, []).append(fn(work / f"{name}-{rep}", arg, n))
            for kind in ("ours", "sqlite"):
                runs.setdefault(f"{kind}_4sessions", []).append((concurrent(work / f"c-{kind}-{rep}", kind,
                                                                            appends // 2), 0.0))
        for name, got in runs.items():
            out[f"wal_{name}_appends_per_s"] = statistics.median(a for a, _ in got)
            if "4sessions" not in name:
                out[f"wal_{name}_read_s"] = statistics.median(r for _, r in got)
        out["wal_ratio_4sessions_batch_vs_sqlite_full"] = out["wal_ours_4sessions_appends_per_s"] / out[
            "wal_sqlite_4sessions_appends_per_s"]
        out["wal_ratio_batch_vs_sqlite_full"] = out["wal_ours_batch_appends_per_s"] / out[
            "wal_sqlite_full_appends_per_s"]
        out["wal_ratio_interval_vs_sqlite_normal"] = out["wal_ours_interval_appends_per_s"] / out[
            "wal_sqlite_normal_appends_per_s"]
        out["wal_read_ratio_ours_vs_sqlite"] = out["wal_ours_interval_read_s"] / out["wal_sqlite_normal_read_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamllm bench wal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--appends", type=int, default=400, help="fsync policies; 10x for the others")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    metrics: dict[str, Any] = compare(args.appends, args.reps)
    print_table("bench wal: Arrow ingest log vs sqlite3 (WAL)", ["metric", "value"],
                [[k, round(v, 4)] for k, v in metrics.items()])
    write_json(args.json, metrics, {"machine": machine(), "args": vars(args)})
    return 0
