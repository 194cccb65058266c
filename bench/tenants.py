"""`streamllm bench tenants`: many sessions on one model, in one run.

  batched_tok_s@S / sequential_tok_s@S   S branches decoding together in one forward per
                                         step vs the same work one sequence per forward
  grouped_prefill_speedup@E              E entries on one long session prefilled in one pass
                                         that reads the shared prefix once (cascade) vs one
                                         by one; ungrouped_batched_speedup@E isolates batching
  prepos_ms_per_update@S                 one new bar for each of S sessions x Q standing
                                         questions: ingest + re-positioning, wall time
  max_updates_per_s@S                    session updates per second that rate sustains
  freshness_lag_p99_ms@S                 push -> refreshed entries of every standing question,
                                         with updates back to back (the highest rate)
  interactive_p99_ms_idle / _loaded      cold questions on an idle engine vs while every
                                         session ingests and pre-positions
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.common import (
    budget_for,
    fill_session,
    market_lines,
    median,
    parse_ints,
    percentile,
    print_table,
    write_json,
)
from streamllm.config import QuestionSpec
from streamllm.engine import Engine
from streamllm.engine.runner import Work
from streamllm.model import load_model

QUESTIONS = [
    ("trend", "Is the price going up or down? Answer with one word: up or down.", ("up", "down")),
    ("vwap", "Is the last close above the average price? Answer yes or no.", ("yes", "no")),
    ("vol", "Are the price moves getting bigger? Answer yes or no.", ("yes", "no")),
    ("spike", "Is the volume of the last bar much higher than usual? Answer yes or no.", ("yes", "no")),
]


def specs(n: int) -> list[QuestionSpec]:
    return [QuestionSpec(i, t, choices=c, threshold=2.0, max_tokens=1, push=False) for i, t, c in QUESTIONS[:n]]


def decode_throughput(engine: Engine, sessions: list[str], steps: int) -> tuple[float, float]:
    """tokens/s decoding one branch per session: all in one forward per step, then one at a time."""
    runner, manager = engine.runner, engine.store.manager
    def fork_all(core):
        out = []
        for name in sessions:
            s = core.sessions[name]
            table = core.store.fork(s.table, s.num_computed)
            manager.append(table, steps + 1)
            out.append((table, s.num_computed))
        return out

    branches = engine.call(fork_all)
    try:
        def run(batched: bool) -> float:
            t0 = time.perf_counter()
            for i in range(steps):
                works = [Work(t, [17], base + i, "last") for t, base in branches]
                if batched:
                    runner.execute(works)
                else:
                    for w in works:
                        runner.execute([w])
            return len(branches) * steps / (time.perf_counter() - t0)

        run(True)  # warm-up
        return run(True), run(False)
    finally:
        engine.call(lambda _core: [manager.free(table) for table, _ in branches])


def grouped_prefill(engine: Engine, name: str, entries: int, reps: int) -> tuple[float, float, float]:
    """ms to prefill `entries` questions on a session: grouped, batched without grouping, one by one."""
    runner, manager = engine.runner, engine.store.manager
    s = engine.sessions[name]
    qs = [engine.layout.question_ids(f"{text} (variant {i})") for i in range(entries) for _, text, _ in QUESTIONS][:entries]

    def once(mode: str) -> float:
        def fork_all(core):
            tables = [core.store.fork(s.table, s.num_computed) for _ in qs]
            for t, q in zip(tables, qs, strict=True):
                manager.append(t, len(q))
            return tables

        tables = engine.call(fork_all)
        works = [Work(t, q, s.num_computed, "last") for t, q in zip(tables, qs, strict=True)]
        runner.grouped = mode == "grouped"
        t0 = time.perf_counter()
        if mode == "one_by_one":
            for w in works:
                runner.execute([w])
        else:
            runner.execute(works)
        ms = (time.perf_counter() - t0) * 1000
        runner.grouped = True
        engine.call(lambda _core: [manager.free(t) for t in tables])
        return ms

    modes = ("grouped", "batched", "one_by_one")
    times = {m: [] for m in modes}
    for _ in range(reps):
        for m in modes:
            times[m].append(once(m))
    return median(times["grouped"]), median(times["batched"]), median(times["one_by_one"])


def cold_latencies(engine: Engine, sessions: list[str], count: int) -> list[float]:
    out = []
    for i in range(count):
        out.append(engine.ask(sessions[i % len(sessions)], "What was the last close? Answer with the number.",
                              max_tokens=1).latency_ms)
    return out


def update_rounds(engine: Engine, sessions: list[str], lines, rounds: int, rate_hz: float | None,
                  stop: threading.Event | None = None) -> tuple[float, list[float]]:
    """Push one bar to every session per round; returns (ms per round, freshness lags in ms)."""
    lags: list[float] = []
    pushed_at: dict[tuple[str, int], float] = {}
    round_ms = []
    for _ in range(rounds):
        if stop is not None and stop.is_set():
            break
        t0 = time.perf_counter()
        acks = {name: engine.push(name, [next(lines)]) for name in sessions}
        for name, ack in acks.items():
            pushed_at[(name, ack.data_version)] = t0
        engine.wait_idle()
        done = time.perf_counter()
        for name, ack in acks.items():
            for st in engine.prepos.standing(name):
                if st.ready is not None and st.ready.data_version >= ack.data_version:
                    lags.append((done - pushed_at[(name, ack.data_version)]) * 1000)
        round_ms.append((done - t0) * 1000)
        if rate_hz:
            time.sleep(max(0.0, 1 / rate_hz - (time.perf_counter() - t0)))
    return median(round_ms), lags


def run(args: argparse.Namespace) -> dict[str, float]:
    loaded = load_model(args.model)
    sizes = parse_ints(args.sessions)
    top = max(sizes)
    session_budget, long_budget = budget_for(args.context), budget_for(args.long_context)
    engine = Engine(loaded, max_cells=top * session_budget + long_budget + 16384, max_context=session_budget,
                    chunk_tokens=args.chunk, step_tokens=args.chunk * 2)
    metrics: dict[str, float] = {}
    rows = []
    try:
        lines = market_lines(instruments=("BTCUSDT", "ETHUSDT", "SOLUSDT"))
        names = [f"t{i % 4}/s{i}" for i in range(top)]  # four tenants
        print(f"filling {top} sessions to {args.context} tokens ...", flush=True)
        for n in names:
            engine.open_session(n, max_context=session_budget)
            fill_session(engine, n, args.context, lines)
        for s in sizes:
            print(f"{s} sessions: decode batched vs sequential ...", flush=True)
            batched, sequential = decode_throughput(engine, names[:s], args.decode_steps)
            metrics[f"batched_tok_s@{s}"] = batched
            metrics[f"sequential_tok_s@{s}"] = sequential
            metrics[f"batching_speedup@{s}"] = batched / sequential
        print("interactive latency on an idle engine ...", flush=True)
        idle = cold_latencies(engine, names, args.asks)
        for name in names:
            for spec in specs(args.questions):
                engine.register(name, spec)
        engine.wait_idle()
        for s in sizes:
            print(f"{s} sessions x {args.questions} questions: updates ...", flush=True)
            ms, lags = update_rounds(engine, names[:s], lines, args.rounds, None)
            metrics[f"prepos_ms_per_update@{s}"] = ms
            metrics[f"max_updates_per_s@{s}"] = s * 1000 / ms
            metrics[f"freshness_lag_p99_ms@{s}"] = percentile(lags, 99)
            rows.append([s, metrics[f"batched_tok_s@{s}"], metrics[f"sequential_tok_s@{s}"],
                         metrics[f"batching_speedup@{s}"], ms, metrics[f"max_updates_per_s@{s}"],
                         metrics[f"freshness_lag_p99_ms@{s}"]])
        print("interactive latency while every session ingests and pre-positions ...", flush=True)
        stop = threading.Event()
        feeder = threading.Thread(target=update_rounds, args=(engine, names, lines, 10_000, None, stop), daemon=True)
        feeder.start()
        time.sleep(1.0)
        loaded_lat = cold_latencies(engine, names, args.asks)
        stop.set()
        feeder.join()
        metrics["interactive_p99_ms_idle"] = percentile(idle, 99)
        metrics["interactive_p99_ms_loaded"] = percentile(loaded_lat, 99)
        metrics["interactive_p50_ms_idle"] = median(idle)
        metrics["interactive_p50_ms_loaded"] = median(loaded_lat)
        metrics["interactive_loaded_over_idle_p99"] = percentile(loaded_lat, 99) / percentile(idle, 99)
        print(f"grouped prefill: {args.entries} entries on a {args.long_context}-token session ...", flush=True)
        engine.open_session("long", max_context=long_budget)
        fill_session(engine, "long", args.long_context, lines)
        g, b, one = grouped_prefill(engine, "long", args.entries, args.reps)
        e = args.entries
        metrics[f"grouped_prefill_ms@{e}"] = g
        metrics[f"batched_prefill_ms@{e}"] = b
        metrics[f"one_by_one_prefill_ms@{e}"] = one
        metrics[f"grouped_prefill_speedup@{e}"] = one / g
        metrics[f"grouping_over_batching@{e}"] = b / g
        stats = engine.stats()
        metrics["idle_preempted_steps"] = float(stats["idle_preempted"])
    finally:
        engine.shutdown()
    print_table(f"bench tenants: {args.model}, sessions of {args.context} tokens, {args.questions} questions each",
                ["S", "batched tok/s", "sequential tok/s", "x", "update ms", "updates/s", "fresh p99 ms"], rows)
    print_table("interactive cold question (1 token)", ["", "idle", "loaded", "loaded/idle"],
                [["p50 ms", metrics["interactive_p50_ms_idle"], metrics["interactive_p50_ms_loaded"],
                  metrics["interactive_p50_ms_loaded"] / metrics["interactive_p50_ms_idle"]],
                 ["p99 ms", metrics["interactive_p99_ms_idle"], metrics["interactive_p99_ms_loaded"],
                  metrics["interactive_loaded_over_idle_p99"]]])
    print_table(f"prefill of {e} entries on {args.long_context} tokens", ["grouped ms", "batched ms", "one by one ms",
                                                                          "speedup"], [[g, b, one, one / g]])
    return metrics


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench tenants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", default="1,4,16")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--context", type=int, default=512, help="tokens of data per session")
    p.add_argument("--long-context", type=int, default=4096, help="session size for the grouped-prefill test")
    p.add_argument("--entries", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--asks", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args(argv)
    metrics = run(args)
    write_json(args.json, metrics, {"bench": "tenants", "model": args.model, "context": args.context})
    return 0
