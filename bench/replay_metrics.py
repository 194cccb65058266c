"""What a replay run measured, as the report's flat metrics (`{system}_..@{speed}`, docs/benchmarks.md).

bench/replay.py runs the systems and fills a `Run`; this turns it into the numbers the JSON
report holds and bench/report.py renders: per system and speed, the ratios between
systems, each system's saturation speed, and the context sweep's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from bench.common import median, percentile
from bench.live import SystemRun, diverged
from bench.sweep import Sweep

SYSTEMS = ("ours", "prefixcache", "stateless", "peer")


@dataclass(slots=True)
class Run:
    runs: list[SystemRun] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)
    sweep: Sweep | None = None
    notes: list[str] = field(default_factory=list)
    feed_span_s: float = 0.0  # feed seconds of the paced part
    model_name: str = ""
    peer_tokens_match: bool | None = None
    capacity: tuple[float, float, float] | None = None  # --speed auto: (capacity x, feed s measured, speed run)


def system_metrics(run: SystemRun, tag: str) -> dict[str, float]:
    """`{system}_..@{speed}`: standing asks for the headline figures, ad-hoc asks beside them."""
    s = run.system
    ok = [r for r in run.asks if r.ok]
    standing = [r for r in ok if r.spec is not None]
    adhoc = [r for r in ok if r.spec is None]
    ms = [r.ms for r in standing]
    m = {f"{s}_ms_p50@{tag}": median(ms), f"{s}_ms_p99@{tag}": percentile(ms, 99),
         f"{s}_asks@{tag}": len(standing), f"{s}_adhoc_asks@{tag}": len(adhoc),
         f"{s}_adhoc_ms_p50@{tag}": median([r.ms for r in adhoc]),
         f"{s}_adhoc_ms_p99@{tag}": percentile([r.ms for r in adhoc], 99),
         f"{s}_unanswered@{tag}": len(run.asks) - len(ok), f"{s}_wall_s@{tag}": run.wall_s,
         f"{s}_tokens_per_ask@{tag}": median([float(r.tokens_computed) for r in standing])}
    labelled = [r for r in standing if r.truth is not None]
    m[f"{s}_labelled@{tag}"] = len(labelled)
    m[f"{s}_accuracy@{tag}"] = sum(bool(r.correct) for r in labelled) / len(labelled) if labelled else math.nan
    m[f"{s}_base_rate@{tag}"] = base_rate(labelled)
    for qid in sorted({r.spec.id for r in labelled}):  # per question id, pooled over sessions
        mine = [r for r in labelled if r.spec.id == qid]
        m[f"{s}_accuracy.{qid}@{tag}"] = sum(bool(r.correct) for r in mine) / len(mine)
        m[f"{s}_base_rate.{qid}@{tag}"], m[f"{s}_labelled.{qid}@{tag}"] = base_rate(mine), len(mine)
    is_diverged, growth = diverged(run)
    m[f"{s}_growth@{tag}"], m[f"{s}_diverged@{tag}"] = growth, float(is_diverged)
    if s == "ours":
        for path in ("fast", "entry", "cold"):
            xs = [r.ms for r in ok if r.path == path]
            m[f"ours_{path}_asks@{tag}"] = len(xs)
            m[f"ours_{path}_ms_p50@{tag}"] = median(xs)
        lags = [float(r.lag) for r in ok]
        m[f"lag_versions_p50@{tag}"], m[f"lag_versions_p99@{tag}"] = median(lags), percentile(lags, 99)
        fast = [r for r in labelled if r.path == "fast"]
        m[f"gate_coverage@{tag}"] = len(fast) / len(labelled) if labelled else math.nan
        m[f"gate_precision@{tag}"] = sum(bool(r.correct) for r in fast) / len(fast) if fast else math.nan
        m[f"feed_lines@{tag}"], m[f"summary_lines@{tag}"] = run.lines_pushed, run.summary_lines
        m[f"compactions@{tag}"] = run.compactions
    else:
        m[f"{s}_wait_ms_p50@{tag}"] = median([r.wait_ms for r in ok])
    return m


def base_rate(labelled: list) -> float:
    """What always answering each question's most common truth would score on these asks: the
    accuracy a system must beat to know anything (nan without labelled asks)."""
    by_question: dict[tuple[str, str], Counter[str]] = {}
    for r in labelled:
        by_question.setdefault((r.session, r.spec.id), Counter())[r.truth.casefold()] += 1
    n = sum(c.total() for c in by_question.values())
    return sum(max(c.values()) for c in by_question.values()) / n if n else math.nan


def per_question(m: dict[str, float], speeds: list[float], systems: list[str]) -> list[list]:
    """Rows [speed, question, labelled, base rate, each system's accuracy] for every question ours
    has per-question figures for (`ours_accuracy.Q@tag`); the terminal and report.md print them."""
    rows = []
    for speed in speeds:
        tag = speed_tag(speed)
        for q in sorted({k[len("ours_accuracy."):].rsplit("@", 1)[0] for k in m
                         if k.startswith("ours_accuracy.") and k.endswith(f"@{tag}")}):
            rows.append([f"{tag}x", q, int(m[f"ours_labelled.{q}@{tag}"]), m[f"ours_base_rate.{q}@{tag}"],
                         *(m.get(f"{s}_accuracy.{q}@{tag}", math.nan) for s in systems)])
    return rows


def speed_tag(speed: float) -> str:
    return f"{speed:g}"


def metrics_of(run: Run) -> dict[str, float]:
    m: dict[str, float] = {"feed_span_s": run.feed_span_s}
    if run.capacity is not None:
        m["ingest_capacity_speed"], m["auto_speed"] = run.capacity[0], run.capacity[2]
    if run.peer_tokens_match is not None:
        m["peer_tokens_match"] = float(run.peer_tokens_match)
    ours = [r for r in run.runs if r.system == "ours"]
    if ours:  # what the feed became, warm-up included (the same for every run)
        m["events_in"], m["lines_pushed"] = ours[0].events_in, ours[0].lines_total
    by_speed: dict[float, dict[str, SystemRun]] = {}
    for r in run.runs:
        m.update(system_metrics(r, speed_tag(r.speed)))
        by_speed.setdefault(r.speed, {})[r.system] = r
    for speed, systems in by_speed.items():
        tag = speed_tag(speed)
        for s in SYSTEMS[1:]:
            if "ours" in systems and s in systems:  # ratio of medians over the standing asks
                m[f"speedup_vs_{s}@{tag}"] = m[f"{s}_ms_p50@{tag}"] / m[f"ours_ms_p50@{tag}"]
    for s in SYSTEMS:
        done = sorted(speed for speed, systems in by_speed.items() if s in systems)
        if done:  # the lowest swept speed at which its backlog diverged; null when none did
            hit = [speed for speed in done if m[f"{s}_diverged@{speed_tag(speed)}"]]
            m[f"saturation_speed_{s}"] = hit[0] if hit else math.nan
    if run.sweep is not None:
        m.update(sweep_metrics(run.sweep))
    return m


def sweep_metrics(sw: Sweep) -> dict[str, float]:
    m: dict[str, float] = {"sweep_lines_available": sw.lines_available, "sweep_wall_s": sw.wall_s}
    for n in sorted(sw.held):
        for series, by_size in sw.ms.items():
            if by_size.get(n):
                m[f"sweep_{series}_ms_p50@{n}"] = median(by_size[n])
        m[f"sweep_context_tokens@{n}"], m[f"sweep_recorded_lines@{n}"] = sw.held[n], sw.lines_used[n]
        fresh, prefix = sw.ms["ours"].get(n), sw.ms["prefixcache"].get(n)
        if fresh and prefix:
            m[f"sweep_speedup_vs_prefixcache@{n}"] = median(prefix) / median(fresh)
            m[f"sweep_speedup_from_push_vs_prefixcache@{n}"] = median(prefix) / median(sw.ms["ours_from_push"][n])
    if sw.stopped_at is not None:
        m["sweep_stopped_at"] = sw.stopped_at
    return m
