"""`streamllm bench compaction`: the two ways a session compacts, side by side on the same bars.

    streamllm bench compaction --bars 400 --context 2048 --json compaction.json

Two engines, one per method (engine/compaction.py `CompactionPolicy.method`), each with one session of
the bars config (queries/bars.toml: its render, system prompt and four questions the shipped series heads
answer) plus questions the model answers itself (no head, `learn = false`), under a context budget small
enough that the session compacts every dozen bars or so:

  shift      the retained lines keep the cells the session computed, their keys turned to the new
             positions: no forward pass, and the retained lines keep what they read before the cut;
  recompute  a background copy runs the retained lines through the model again after the prefix:
             exactly a fresh session of those lines, at the price of their prefill.

The same recorded bars go to both, one bar at a time, alternating between the engines bar by bar (so a
machine that speeds up or slows down does so for both). Per method: push -> fresh (every standing answer
at the new version) and push -> idle per bar (p50 / p99 ms), compactions, and tokens the copies computed
per ingested token. Per question: accuracy against its label beside the base rate, per method, and how
often the two methods give the same answer after the first compaction (before it they are one computation).
"""

from __future__ import annotations

import argparse
import time

from bench.capacity import CONFIG
from bench.common import BTC_BARS, percentile, print_table, write_json
from feeds.tables import TableSource
from streamllm.config import load_config, parse_question
from streamllm.engine import CompactionPolicy, Engine, EngineConfig
from streamllm.feeding.attach import Attachment, AttachSpec
from streamllm.model import load_model
from streamllm.model.adapter import pick_adapter

METHODS = ("shift", "recompute")
# Decided by the model itself: texts no shipped head answers, labels the expressions of two shipped ones.
LM_QUESTIONS = [
    {"id": "lm_trend", "text": "Over the last 10 bars, has the price gone up or down? Answer up or down.",
     "choices": ["up", "down"], "label": "trend_up(n=10)", "threshold": "auto:0.9", "learn": False},
    {"id": "lm_above_sma", "text": "Is the latest close higher than the mean close of the last 20 bars? Answer yes or no.",
     "choices": ["yes", "no"], "label": "above_sma(n=20)", "threshold": "auto:0.9", "learn": False},
]
REACH = 256  # bars a label may look back over (the shipped ones read at most 40)
FRESH_TIMEOUT_S = 120.0


class Side:
    """One method's engine, session and attachment, and what it measured."""

    def __init__(self, loaded, adapter: str | None, spec, questions: list, method: str, context: int) -> None:
        self.method = method
        config = EngineConfig(max_context=context, max_cells=4 * context + 8192,
                              compaction=CompactionPolicy(method=method))
        self.engine = Engine(loaded, config, adapter=adapter)
        self.engine.open_session("m", spec.system_prompt, max_context=context)
        for q in questions:
            self.engine.register("m", q)
        self.questions = questions
        self.att = Attachment(self.engine, AttachSpec.of(spec, session="m"), questions=tuple(questions))
        self.fresh_ms: list[float] = []
        self.idle_ms: list[float] = []
        self.answers: list[dict[str, str]] = []  # per bar: question id -> answer
        self.compacted_at: int | None = None  # the first bar after which the session had compacted

    def feed(self, bar) -> None:
        t0 = time.perf_counter()
        self.att.offer(bar)
        ack = self.att.flush()
        version = ack.data_version
        deadline = t0 + FRESH_TIMEOUT_S
        while True:  # every standing answer at the new version: what a subscriber waits for
            answers = {q.id: self.engine.ask("m", q.id) for q in self.questions}
            if all(a.data_version >= version for a in answers.values()):
                break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"bench compaction ({self.method}): answers not fresh after {FRESH_TIMEOUT_S} s")
            time.sleep(0.0005)
        self.fresh_ms.append((time.perf_counter() - t0) * 1000)
        if not self.engine.wait_idle(timeout=FRESH_TIMEOUT_S):
            raise RuntimeError(f"bench compaction ({self.method}): not idle after {FRESH_TIMEOUT_S} s")
        self.idle_ms.append((time.perf_counter() - t0) * 1000)
        self.answers.append({k: a.text.strip().casefold() for k, a in answers.items()})
        if self.compacted_at is None and self.engine.session_info("m").compactions:
            self.compacted_at = len(self.answers) - 1

    def figures(self) -> dict[str, float]:
        stats = self.engine.stats()
        info = self.engine.session_info("m")
        ingest = stats["tokens_ingest"]
        return {"fresh_ms_p50": percentile(self.fresh_ms, 50), "fresh_ms_p99": percentile(self.fresh_ms, 99),
                "idle_ms_p50": percentile(self.idle_ms, 50), "idle_ms_p99": percentile(self.idle_ms, 99),
                "compactions": info.compactions,
                "copy_tokens_per_ingest_token": stats["compaction_tokens"] / ingest if ingest else float("nan")}


def run(args: argparse.Namespace) -> tuple[dict[str, float], list[list], list[list]]:
    loaded = load_model(args.model)
    config = load_config(args.config)
    spec = config.sessions[0]
    notes: list[str] = []
    chosen = pick_adapter(None, config.adapter, loaded.name, warn=notes.append, config=config)
    for note in notes:
        print(f"note: {note}", flush=True)
    adapter = None if chosen is None else str(chosen.path)
    questions = [*spec.questions, *(parse_question(q) for q in LM_QUESTIONS)]
    every = TableSource(args.data, "bar", instrument=spec.instrument).events()
    if args.start + args.bars > len(every):
        raise SystemExit(f"bench compaction: {args.data} has {len(every)} bars, not {args.start + args.bars}")
    bars = every[args.start: args.start + args.bars]
    sides = [Side(loaded, adapter, spec, questions, m, args.context) for m in METHODS]
    t0 = time.perf_counter()
    try:
        for i, bar in enumerate(bars):
            for side in sides if i % 2 == 0 else sides[::-1]:  # who goes first alternates
                side.feed(bar)
            if (i + 1) % 50 == 0:
                print(f"  {i + 1} / {len(bars)} bars in {time.perf_counter() - t0:.0f} s; compactions "
                      + ", ".join(f"{s.method} {s.engine.session_info('m').compactions}" for s in sides), flush=True)
        figures = {s.method: s.figures() for s in sides}
    finally:
        for side in sides:
            side.engine.shutdown()

    metrics: dict[str, float] = {}
    for method, fig in figures.items():
        metrics.update({f"{k}.{method}": v for k, v in fig.items()})
    shift, recompute = sides
    metrics["fresh_p50_ratio"] = metrics["fresh_ms_p50.shift"] / metrics["fresh_ms_p50.recompute"]
    metrics["idle_p50_ratio"] = metrics["idle_ms_p50.shift"] / metrics["idle_ms_p50.recompute"]
    compacted = [s.compacted_at for s in sides if s.compacted_at is not None]
    first = min(compacted) if compacted else len(bars)  # the first bar whose answers may differ
    history = [bars[max(0, i + 1 - REACH): i + 1] for i in range(len(bars))]
    rows = []
    for q in questions:
        truths = [q.expected_answer(h) for h in history]
        judged = [i for i in range(first, len(bars)) if truths[i] is not None]
        if not judged:
            continue
        base = max(sum(truths[i] == c for i in judged) for c in q.choices) / len(judged)
        acc = {s.method: sum(s.answers[i][q.id] == truths[i] for i in judged) / len(judged) for s in sides}
        same = sum(shift.answers[i][q.id] == recompute.answers[i][q.id] for i in range(first, len(bars)))
        agree = same / max(1, len(bars) - first)
        before = all(shift.answers[i][q.id] == recompute.answers[i][q.id] for i in range(first))
        metrics.update({f"accuracy.{q.id}.shift": acc["shift"], f"accuracy.{q.id}.recompute": acc["recompute"],
                        f"base_rate.{q.id}": base, f"agreement.{q.id}": agree})
        by_head = adapter is not None and q.id not in {x["id"] for x in LM_QUESTIONS}
        rows.append([q.id, "head" if by_head else "model", len(judged),
                     base, acc["shift"], acc["recompute"], agree, "yes" if before else "NO"])
    cost = [[m, *(figures[m][k] for k in ("fresh_ms_p50", "fresh_ms_p99", "idle_ms_p50", "idle_ms_p99",
                                          "compactions", "copy_tokens_per_ingest_token"))] for m in METHODS]
    metrics["bars_after_first_compaction"] = len(bars) - first
    return metrics, cost, rows


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench compaction", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", default=str(CONFIG), help="the bars config whose session and questions are used")
    p.add_argument("--data", default=str(BTC_BARS), help="recorded 1-minute bars (csv)")
    p.add_argument("--start", type=int, default=30_000, help="first bar replayed")
    p.add_argument("--bars", type=int, default=400, help="bars replayed")
    p.add_argument("--context", type=int, default=2048, help="the session's context budget (small: it compacts)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    metrics, cost, rows = run(args)
    print_table(f"bench compaction: {args.bars} bars, context {args.context}, {args.model}",
                ["method", "fresh p50 ms", "fresh p99 ms", "idle p50 ms", "idle p99 ms", "compactions",
                 "copy tok / ingest tok"], cost)
    print_table("answers after the first compaction", ["question", "by", "judged", "base rate", "shift",
                                                       "recompute", "agree", "same before"], rows)
    write_json(args.json, metrics, {"bench": "compaction", "model": args.model, "bars": args.bars,
                                    "context": args.context, "start": args.start})
    return 0
