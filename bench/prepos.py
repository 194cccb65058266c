"""`streamllm bench prepos`: what pre-positioning buys a standing question, per path.

In one run, per context size N, on one session:
  fast_ms_p50/p99@N   standing question whose gate fires: answered from the ready
                      distribution, no model call (in process, >= 200 asks)
  entry_ms_p50@N      standing question whose gate does not fire: decoding resumes from
                      the pre-paid entry (the first ask after a fresh update: a repeat at the
                      same version reads the decoded answer the engine keeps)
  cold_ms_p50@N       the same question asked ad hoc: prefill it on the session, then decode
  prepos_tokens_per_update   idle compute spent per data update on re-positioning entries
"""

from __future__ import annotations

import argparse
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
from streamllm.engine import Engine, EngineConfig
from streamllm.model import load_model

FAST = QuestionSpec("direction", "Is the price going up or down? Answer with one word: up or down.",
                    choices=("up", "down"), threshold=0.0, max_tokens=1)
ENTRY_TEXT = "Describe the last bar in a few words."
ENTRY = QuestionSpec("describe", ENTRY_TEXT, threshold=1e9, max_tokens=4)  # gate never fires
COLD_TEXT = "Describe the last bar in a few words, please."  # same shape, not standing


def wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def run(args: argparse.Namespace) -> dict[str, float]:
    contexts = parse_ints(args.contexts)
    loaded = load_model(args.model)
    max_context = budget_for(max(contexts))
    engine = Engine(loaded, EngineConfig(max_cells=max_context + 8192, max_context=max_context))
    metrics: dict[str, float] = {}
    rows = []
    try:
        engine.open_session("bench")
        engine.register("bench", FAST)
        engine.register("bench", ENTRY)
        lines = market_lines()
        for n in contexts:
            held = fill_session(engine, "bench", n, lines)
            engine.wait_idle()
            print(f"context {held}: {args.fast_asks} fast, {args.slow_asks} entry and cold asks ...", flush=True)
            fast = [wall_ms(lambda: engine.ask("bench", FAST.id)) for _ in range(args.fast_asks)]
            paths = {engine.ask("bench", FAST.id).path, engine.ask("bench", ENTRY.id).path,
                     engine.ask("bench", COLD_TEXT, max_tokens=ENTRY.max_tokens).path}
            assert paths == {"fast", "entry", "cold"}, paths
            entry = []
            for _ in range(args.slow_asks):  # one bar (the session grows by a line), then the first ask
                engine.push("bench", [next(lines)])
                engine.wait_idle()
                entry.append(wall_ms(lambda: engine.ask("bench", ENTRY.id)))
            cold = [wall_ms(lambda: engine.ask("bench", COLD_TEXT, max_tokens=ENTRY.max_tokens))
                    for _ in range(args.slow_asks)]
            metrics[f"fast_ms_p50@{n}"] = median(fast)
            metrics[f"fast_ms_p99@{n}"] = percentile(fast, 99)
            metrics[f"entry_ms_p50@{n}"] = median(entry)
            metrics[f"cold_ms_p50@{n}"] = median(cold)
            metrics[f"entry_over_cold@{n}"] = median(entry) / median(cold)
            rows.append([n, held, median(fast), percentile(fast, 99), median(entry), median(cold),
                         median(entry) / median(cold)])
        # idle compute per update: push one bar, let ingest and re-positioning finish
        before_tokens, before_entries = engine.prepos.entry_tokens, engine.runner.tokens_computed
        ingest_before = engine.session_info("bench").num_tokens
        t0 = time.perf_counter()
        for _ in range(args.updates):
            engine.push("bench", [next(lines)])
            engine.wait_idle()
        per_update_ms = (time.perf_counter() - t0) * 1000 / args.updates
        ingested = engine.session_info("bench").num_tokens - ingest_before
        metrics["prepos_tokens_per_update"] = (engine.prepos.entry_tokens - before_tokens) / args.updates
        metrics["idle_tokens_per_update"] = (engine.runner.tokens_computed - before_entries - ingested) / args.updates
        metrics["update_ms"] = per_update_ms
    finally:
        engine.shutdown()
    print_table(f"bench prepos: {args.model}", ["N", "held", "fast_p50", "fast_p99", "entry_p50", "cold_p50",
                                                "entry/cold"], rows)
    print(f"per update: {metrics['prepos_tokens_per_update']:.0f} entry tokens, "
          f"{metrics['idle_tokens_per_update']:.0f} idle tokens in all, {metrics['update_ms']:.0f} ms push -> idle")
    return metrics


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench prepos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--fast-asks", type=int, default=400)
    p.add_argument("--slow-asks", type=int, default=10)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    metrics = run(args)
    write_json(args.json, metrics, {"bench": "prepos", "model": args.model})
    return 0
