"""`streamllm bench scale --replicas 1,2 [--json F] [--model tiny]`: serve --ray's cluster, measured.

One local Ray cluster with every CPU of the machine; for each replica count N, a fresh
ClusterEngine whose replicas share the CPUs (`cpus_per_replica = cpus // N`, torch threads
to match), `--sessions` sessions (placed by free cells) with one standing question each:

  throughput_updates_per_s@N    batches (--lines each) pushed through the front door by one thread per
                                session, all ingested and their standing question pre-positioned
                                again, per second (median of --reps)
  cpus_per_replica@N            what each replica had: on a 2-core machine the gain is bounded by cores
  route_overhead_ms_p50         a fast-path answer (gate fires: choices, threshold 0) through the front
                                door (ClusterEngine.ask: a Ray actor call) minus the same ask on an Engine
                                in this process; both p50 of --asks, also reported raw
  replica_kill_events_lost      with the largest N >= 2: pushes run on every session (at --kill-load of
                                the measured updates/s) while replica 0 is killed; acked batches missing after its recovery + events the surviving
                                replicas published that their subscribers did not get (the goal is 0)
  replica_recovery_s            replica 0 down -> serving again, as the front door saw it
  replica_respawn_s             ... of which Ray took to start its new process (kill -> constructor starts)
  replica_restart_init_s        ... and its constructor (model load + recovery from its log)
  replica_unavailable_ms_max    the slowest push refused while it was down (fail fast, never hang)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import median, parse_ints, percentile, print_table, write_json

QUESTION = {"id": "trend", "text": "Is the price going up or down? Answer up or down.", "choices": ["up", "down"],
            "threshold": 0.0}


def bar_lines(i: int, n: int = 2) -> list[str]:
    return [f"12:{(i // 60) % 60:02d}:{i % 60:02d} 640{(i + k) % 100:02d}.5 +1.{k} v{i % 7}.2 n{k + 3}" for k in range(n)]


def engine_config(args: argparse.Namespace) -> Any:
    from streamllm.engine import EngineConfig

    return EngineConfig(max_cells=args.sessions * args.max_context * 2 + 4096, block_size=16,
                        max_context=args.max_context)


def open_sessions(engine: Any, sessions: int, max_context: int) -> list[str]:
    from streamllm.config import parse_question

    spec = parse_question(QUESTION, source="bench scale")
    names = [f"s{i}" for i in range(sessions)]
    for name in names:
        engine.open_session(name, max_context=max_context)
        engine.register(name, spec)
        engine.push(name, bar_lines(0, 8))
    engine.wait_idle(300)
    return names


def throughput(engine: Any, names: list[str], batches: int, start: int, lines: int) -> float:
    """Updates per second: `batches` pushes per session through the front door (one pushing thread
    per session, as feeds would), until every batch is ingested and the standing question re-positioned."""

    def feed(name: str) -> None:
        for b in range(batches):
            engine.push(name, bar_lines(start + b, lines))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=feed, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not engine.wait_idle(120):
        stuck = {name: engine.session_info(name) for name in names}
        raise RuntimeError(f"the engine did not go idle within 120 s after the pushes: {stuck}; {engine.stats()}")
    return len(names) * batches / (time.perf_counter() - t0)


def fast_asks_ms(engine: Any, name: str, asks: int) -> list[float]:
    engine.ask(name, "trend")  # warm
    out = []
    for _ in range(asks):
        t0 = time.perf_counter()
        answer = engine.ask(name, "trend")
        out.append((time.perf_counter() - t0) * 1000)
        assert answer.path == "fast", f"expected the fast path, got {answer.path}"
    return out


def kill_run(cluster: Any, names: list[str], seconds: float, rate: float) -> dict[str, float]:
    """Push to every session at `rate` updates/s in all while replica 0 is killed; count what was lost."""
    import ray

    from streamllm.engine.outputs import ReplicaUnavailable

    delivered: dict[str, list[int]] = {n: [] for n in names}
    cluster.wait_idle(300)
    since = {n: cluster.session_info(n).data_version for n in names}  # what was published before is not counted
    subs = [cluster.subscribe_data(n, lambda _s, v, n=n: delivered[n].append(v)) for n in names]
    acked: dict[str, int] = {}
    refused_ms: list[float] = []
    stop = threading.Event()

    def pusher() -> None:
        i = 10_000
        while not stop.is_set():
            for name in names:
                t0 = time.perf_counter()
                try:
                    acked[name] = cluster.push(name, bar_lines(i)).data_version
                except ReplicaUnavailable as exc:
                    refused_ms.append((time.perf_counter() - t0) * 1000)
                    if refused_ms[-1] > 5000:
                        print(f"  slow refusal {name} on {cluster.placement.get(name)}: {exc}", flush=True)
            i += 1
            time.sleep(len(names) / rate)

    victim = cluster.replicas[0]
    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    time.sleep(seconds / 3)
    killed_at = time.time()
    ray.kill(victim.actor, no_restart=False)
    end = time.monotonic() + 120
    while (victim.state != "up" or victim.last_recovery_s is None) and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(seconds / 3)
    stop.set()
    thread.join()
    cluster.wait_idle(300)
    time.sleep(1.0)  # the pumps' last polls
    for sub in subs:
        sub.close()
    lost = 0
    for name in names:
        info = cluster.session_info(name)
        home = cluster.replicas[cluster.placement.get(name)]
        if home is victim:
            lost += max(0, acked.get(name, 0) - info.data_version)  # acked batches that did not come back
        else:
            published = [a[1] for kind, a in cluster._call(home, "journal_of", name) if kind == "data" and a[1] > since[name]]
            lost += len(set(published) - set(delivered[name]))
    return {"replica_kill_events_lost": lost, "replica_recovery_s": victim.last_recovery_s or float("nan"),
            "replica_restart_init_s": victim.info.get("start_s", float("nan")),
            "replica_respawn_s": victim.info.get("init_at", float("nan")) - killed_at,
            "replica_unavailable_ms_max": max(refused_ms, default=0.0), "replica_kill_pushes_refused": len(refused_ms)}


def phase(what: str, t0: float) -> None:
    print(f"  [{time.perf_counter() - t0:6.1f} s] {what}", flush=True)


def run(args: argparse.Namespace) -> dict[str, float]:
    import ray

    from streamllm.engine import Engine
    from streamllm.model import load_model
    from streamllm.scale.cluster import ClusterEngine

    cpus = os.cpu_count() or 1
    report: dict[str, float] = {}
    rows = []
    t_run = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        local = Engine(load_model(args.model), engine_config(args), dtype=args.dtype)
        open_sessions(local, 1, args.max_context)
        local_ms = fast_asks_ms(local, "s0", args.asks)
        local.shutdown()
        phase("in-process fast path measured", t_run)
        for n in args.replicas:
            per = max(1, cpus // n)
            with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
                t0 = time.perf_counter()
                cluster = ClusterEngine(args.model, engine_config(args), dtype=args.dtype, replicas=n, log_dir=Path(tmp),
                                        cpus_per_replica=per, poll_s=0.5,
                                        checkpoint_versions=args.checkpoint_versions)
                start_s = time.perf_counter() - t0
                phase(f"{n} replica(s) up", t_run)
                try:
                    names = open_sessions(cluster, args.sessions, args.max_context)
                    reps = [throughput(cluster, names, args.batches, 100 + r * args.batches, args.lines)
                            for r in range(args.reps)]
                    phase(f"{n} replica(s): throughput measured", t_run)
                    report[f"throughput_updates_per_s@{n}"] = median(reps)
                    report[f"cpus_per_replica@{n}"] = per
                    report[f"cluster_start_s@{n}"] = start_s
                    rows.append([n, per, [h.info.get("torch_threads") for h in cluster.replicas],
                                 cluster.placement.counts(), median(reps), start_s])
                    if n == min(args.replicas):
                        front_ms = fast_asks_ms(cluster, names[0], args.asks)
                        report["fast_ms_p50_front_door"] = percentile(front_ms, 50)
                        report["fast_ms_p50_in_process"] = percentile(local_ms, 50)
                        report["route_overhead_ms_p50"] = percentile(front_ms, 50) - percentile(local_ms, 50)
                    if n == max(args.replicas) and n >= 2 and not args.no_kill:
                        # Half the measured capacity: a pace the replicas sustain, so what recovery
                        # replays is the log, not a backlog the pusher piled up.
                        rate = args.kill_load * report[f"throughput_updates_per_s@{n}"]
                        report["replica_kill_push_rate"] = rate
                        report |= kill_run(cluster, names, args.kill_seconds, rate)
                        phase(f"{n} replicas: kill run done", t_run)
                finally:
                    cluster.shutdown()
                    phase(f"{n} replica(s) shut down", t_run)
    finally:
        ray.shutdown()
    counts = args.replicas
    if len(counts) >= 2:
        lo, hi = min(counts), max(counts)
        report[f"throughput_ratio@{hi}/{lo}"] = report[f"throughput_updates_per_s@{hi}"] / \
            report[f"throughput_updates_per_s@{lo}"]
    print_table(f"bench scale ({args.model}, {args.sessions} sessions, {args.batches} pushes of {args.lines} lines x {args.reps} reps, "
                f"{cpus} CPUs)", ["replicas", "cpus/replica", "torch threads", "sessions/replica", "updates/s",
                                  "start s"], rows)
    print_table("front door", ["metric", "value"], [[k, v] for k, v in report.items() if "@" not in k])
    return report


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm bench scale", description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=parse_ints, default=[1, 2], help="replica counts, e.g. 1,2")
    ap.add_argument("--model", default="tiny", help="tiny (default) or smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=None,
                    help="per session (default 16384 on tiny, 4096 otherwise: no compaction during the run)")
    ap.add_argument("--batches", type=int, default=30, help="pushes per session per throughput rep")
    ap.add_argument("--lines", type=int, default=2, help="bar lines per push")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--asks", type=int, default=300, help="fast-path asks, front door and in process")
    ap.add_argument("--kill-seconds", type=float, default=6.0, help="pushing around the kill (split in thirds)")
    ap.add_argument("--kill-load", type=float, default=0.5,
                    help="push rate during the kill run, as a fraction of the measured updates/s")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--checkpoint-versions", type=int, default=0,
                    help="replicas snapshot each session every N versions (bounds the log replay at recovery)")
    ap.add_argument("--json", type=Path, help="write the flat metric report here")
    args = ap.parse_args(argv)
    if args.max_context is None:
        args.max_context = 16384 if args.model == "tiny" else 4096
    if not args.replicas or min(args.replicas) < 1:
        ap.error("--replicas: counts >= 1, e.g. 1,2")
    report = run(args)
    write_json(args.json, report, {"model": args.model, "sessions": args.sessions, "replicas": args.replicas,
                                   "batches": args.batches, "lines": args.lines, "reps": args.reps,
                                   "checkpoint_versions": args.checkpoint_versions})
    return 0
