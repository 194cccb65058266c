"""`streamllm bench tenants`: many sessions on one engine, measured through the engine.

Everything goes through the public API (scheduler, admission and core included), never
the runner directly; each side of a comparison gets a warm-up first.

  batched_tok_s@S / sequential_tok_s@S   S sessions each asked a free-text question of
                                         max_tokens N: all submitted at once (submit_ask)
                                         vs one at a time; generated tokens / wall time
  batching_speedup@S                     their ratio (medians of --reps)
  freshness_lag_p99_versions@S           S sessions x Q standing questions, pushed at a
                                         steady rate: pushed version minus each standing
                                         answer's data_version, sampled every 50 ms
  sustained_updates_per_s@S              the push rate actually held during that phase
  interactive_p99_ms_idle / _loaded      cold 1-token questions on an idle engine vs while
                                         every session ingests and pre-positions
  interactive_loaded_over_idle_p99       their ratio
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import wait

from bench.common import (
    SteadyPusher,
    budget_for,
    fill_session,
    market_lines,
    median,
    parse_ints,
    percentile,
    print_table,
    standing_lags,
    write_json,
)
from streamllm.config import QuestionSpec
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.model import load_model

QUESTIONS = [
    ("trend", "Is the price going up or down? Answer with one word: up or down.", ("up", "down")),
    ("vwap", "Is the last close above the average price? Answer yes or no.", ("yes", "no")),
    ("vol", "Are the price moves getting bigger? Answer yes or no.", ("yes", "no")),
    ("spike", "Is the volume of the last bar much higher than usual? Answer yes or no.", ("yes", "no")),
]
FREE = "Describe what the market did in the last bars."
COLD = "What was the last close? Answer with the number."


def specs(n: int) -> list[QuestionSpec]:
    return [QuestionSpec(i, t, choices=c, threshold=2.0, max_tokens=1, push=False) for i, t, c in QUESTIONS[:n]]


def decode_throughput(engine: Engine, sessions: list[str], max_tokens: int, reps: int) -> tuple[float, float]:
    """tokens/s of S free-text asks: all submitted at once vs one at a time (medians, after a warm-up each)."""

    def batched() -> float:
        t0 = time.perf_counter()
        futures = [engine.submit_ask(n, FREE, max_tokens=max_tokens) for n in sessions]
        done, _ = wait(futures, timeout=600)
        tokens = sum(len(f.result().tokens) for f in done)
        return tokens / (time.perf_counter() - t0)

    def sequential() -> float:
        t0 = time.perf_counter()
        tokens = sum(len(engine.ask(n, FREE, max_tokens=max_tokens, timeout=600).tokens) for n in sessions)
        return tokens / (time.perf_counter() - t0)

    engine.wait_idle()
    batched(), sequential()  # warm-up for each side
    b, s = [], []
    for _ in range(reps):
        b.append(batched())
        s.append(sequential())
    return median(b), median(s)


def cold_latencies(engine: Engine, sessions: list[str], count: int) -> list[float]:
    return [engine.ask(sessions[i % len(sessions)], COLD, max_tokens=1, timeout=600).latency_ms for i in range(count)]


def freshness(engine: Engine, sessions: list[str], lines, rate: float, seconds: float) -> tuple[list[int], float]:
    """Lags in versions (pushed minus each standing answer's data_version), sampled every 50 ms, while one
    bar a push goes to each session in turn at `rate` updates/s in total."""
    with SteadyPusher(steady_lines(engine, sessions, lines), rate) as pusher:
        end = time.perf_counter() + seconds
        lags = standing_lags(engine, sessions, lambda: time.perf_counter() < end)
    engine.wait_idle()
    return lags, pusher.updates_per_s


def steady_lines(engine: Engine, sessions: list[str], lines):
    """A SteadyPusher's push: the next line to each session in turn."""
    return lambda i: engine.push(sessions[i % len(sessions)], [next(lines)])


def run(args: argparse.Namespace) -> dict[str, float]:
    loaded = load_model(args.model)
    sizes = parse_ints(args.sessions)
    top = max(sizes)
    budget = budget_for(args.context)
    scheduler = SchedulerConfig(chunk_tokens=args.chunk, step_tokens=args.chunk * 2, cut_in_share=args.cut_in_share)
    engine = Engine(loaded, EngineConfig(max_cells=top * budget + 8192, max_context=budget, scheduler=scheduler))
    metrics: dict[str, float] = {}
    rows = []
    try:
        lines = market_lines(instruments=("BTCUSDT", "ETHUSDT", "SOLUSDT"))
        names = [f"t{i % 4}/s{i}" for i in range(top)]  # four tenants
        print(f"filling {top} sessions to {args.context} tokens ...", flush=True)
        for n in names:
            engine.open_session(n, max_context=budget)
            fill_session(engine, n, args.context, lines)
        for s in sizes:
            print(f"{s} sessions: {args.max_tokens}-token asks, all at once vs one at a time ...", flush=True)
            batched, sequential = decode_throughput(engine, names[:s], args.max_tokens, args.reps)
            metrics[f"batched_tok_s@{s}"] = batched
            metrics[f"sequential_tok_s@{s}"] = sequential
            metrics[f"batching_speedup@{s}"] = batched / sequential
        print("interactive latency on an idle engine ...", flush=True)
        cold_latencies(engine, names, 2)  # warm-up
        idle = cold_latencies(engine, names, args.asks)
        for name in names:
            for spec in specs(args.questions):
                engine.register(name, spec)
        engine.wait_idle()
        for s in sizes:
            print(f"{s} sessions x {args.questions} questions at {args.rate} updates/s for {args.seconds} s ...",
                  flush=True)
            lags, sustained = freshness(engine, names[:s], lines, args.rate, args.seconds)
            metrics[f"freshness_lag_p99_versions@{s}"] = percentile(lags, 99)
            metrics[f"freshness_lag_p50_versions@{s}"] = percentile(lags, 50)
            metrics[f"sustained_updates_per_s@{s}"] = sustained
            rows.append([s, metrics[f"batched_tok_s@{s}"], metrics[f"sequential_tok_s@{s}"],
                         metrics[f"batching_speedup@{s}"], sustained, percentile(lags, 50), percentile(lags, 99)])
        print("interactive latency while every session ingests and pre-positions ...", flush=True)
        with SteadyPusher(steady_lines(engine, names, lines), args.rate):
            time.sleep(1.0)
            loaded_lat = cold_latencies(engine, names, args.asks)
        engine.wait_idle()
        metrics["interactive_p99_ms_idle"] = percentile(idle, 99)
        metrics["interactive_p99_ms_loaded"] = percentile(loaded_lat, 99)
        metrics["interactive_p50_ms_idle"] = median(idle)
        metrics["interactive_p50_ms_loaded"] = median(loaded_lat)
        metrics["interactive_loaded_over_idle_p99"] = percentile(loaded_lat, 99) / percentile(idle, 99)
        stats = engine.stats()
        metrics["failed_steps"] = float(stats["failed_steps"])
    finally:
        engine.shutdown()
    print_table(f"bench tenants: {args.model}, sessions of {args.context} tokens, {args.questions} questions each, "
                f"{args.max_tokens}-token asks, {args.rate} updates/s",
                ["S", "batched tok/s", "sequential tok/s", "x", "updates/s", "lag p50 (versions)",
                 "lag p99 (versions)"], rows)
    print_table("interactive cold question (1 token)", ["", "idle", "loaded", "loaded/idle"],
                [["p50 ms", metrics["interactive_p50_ms_idle"], metrics["interactive_p50_ms_loaded"],
                  metrics["interactive_p50_ms_loaded"] / metrics["interactive_p50_ms_idle"]],
                 ["p99 ms", metrics["interactive_p99_ms_idle"], metrics["interactive_p99_ms_loaded"],
                  metrics["interactive_loaded_over_idle_p99"]]])
    return metrics


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench tenants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", default="1,4,16")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="tokens of data per session")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens decoded per free-text ask")
    p.add_argument("--rate", type=float, default=8.0, help="updates/s pushed (in total) in the freshness phases")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each freshness phase")
    p.add_argument("--asks", type=int, default=12)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--cut-in-share", type=float, default=SchedulerConfig().cut_in_share,
                   help="how long questions may cut into a running step of ingest, as a share of its own time "
                        "(0: they wait for it)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small contexts, short phases, 1 rep")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.max_tokens, args.seconds, args.asks, args.reps = 128, 8, 3.0, 8, 1
    metrics = run(args)
    write_json(args.json, metrics, {"bench": "tenants", "model": args.model, "context": args.context,
                                    "max_tokens": args.max_tokens, "rate": args.rate, "quick": args.quick})
    return 0
