"""The replay benchmark's human-readable report: report.md with tables and PNG plots.

Written for a reader who has never seen the project: what each system is and does with
the data between asks, what was measured, on which machine, and what to be careful about.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from bench.common import machine, median
from bench.live import BETWEEN_ASKS
from bench.replay_metrics import per_question

SYSTEM_TEXT = {
    "ours": "streamllm: stateful sessions whose KV cache grows with the data; standing questions are "
            "pre-positioned after every update; a choice question is answered from the cached ready "
            "distribution (its best choice: fast path when the gate fires, entry path otherwise); ad-hoc "
            "questions prefill only the question on top of the session (cold path).",
    "prefixcache": "a server with prefix caching (vLLM/SGLang automatic prefix caching, a llama.cpp slot): one "
                   "cached table per session holds system prompt + data up to the previous question. Same "
                   "model, forward code and cells, run on the engine's core thread (it owns the model while "
                   "it answers).",
    "stateless": "a request-driven server without a cache (512-token prefill chunks); only every k-th ask of "
                 "the schedule (a full prefill each).",
    "peer": "an external OpenAI-compatible completion server (llama.cpp's llama-server, `make peer`) sent the "
            "same prompt text with cache_prompt: true over loopback HTTP.",
}


def _f(x: Any, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _f(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def feed_rate(m: dict[str, float], speed: float) -> float:
    """Lines per wall second the feed delivered at this speed."""
    lines = m.get(f"feed_lines@{speed:g}", math.nan)
    return lines / (m["feed_span_s"] / speed) if m.get("feed_span_s") else math.nan


def plot_speeds(run, m: dict[str, float], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in ("ours", "prefixcache", "stateless", "peer"):
        pts = [(feed_rate(m, v), m.get(f"{s}_ms_p50@{v:g}"), m.get(f"{s}_ms_p99@{v:g}")) for v in run.speeds]
        pts = [p for p in pts if p[1] is not None and not math.isnan(p[1]) and not math.isnan(p[0])]
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{s} p50")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(), label=f"{s} p99")
        sat = m.get(f"saturation_speed_{s}")
        if sat is not None and not math.isnan(sat):
            ax.axvline(feed_rate(m, sat), color=line.get_color(), alpha=0.4, linestyle=":")
    ax.set(xscale="log", yscale="log", xlabel="feed rate (lines per second)", ylabel="ask -> answer (ms)",
           title="live replay: standing asks vs feed rate (dotted: backlog diverges)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_sweep(sw, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    labels = {"ours_from_push": "ours, timed from the push", "ours": "ours, entries fresh",
              "ours_cold": "ours ad hoc (cold)", "prefixcache": "prefix cache", "stateless": "stateless",
              "peer": "peer"}
    for series, label in labels.items():
        pts = [(sw.held[n], median(sw.ms[series][n])) for n in sorted(sw.held) if sw.ms[series].get(n)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context held by the session (tokens)",
           ylabel="answer latency p50 (ms)", title="latency vs context (recorded lines)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_report(out: Path, run, m: dict[str, float], args: argparse.Namespace) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plot_speeds(run, m, out / "latency_vs_feed_rate.png")
    mach = machine()
    systems = [s for s in SYSTEM_TEXT if any(r.system == s for r in run.runs)]
    lines = [
        "# streamllm replay benchmark", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{args.command}`", "",
        f"Model `{run.model_name}` on {mach['machine']}, {mach['cpus']} CPUs ({mach['torch_threads']} torch threads),"
        f" CUDA: {mach['cuda']}, torch {mach['torch']}, Python {mach['python']}.", "",
        "## What was measured", "",
        f"Market data ({', '.join(args.data) if args.data else 'the embedded synthetic feed'}): the first "
        f"{args.warmup:g} s of feed time are pushed unpaced (the history every system starts from, so labels "
        f"have their bars), then {m['feed_span_s']:.0f} s of feed time are replayed at each speed "
        f"({', '.join(f'{v:g}x' for v in run.speeds)}) through the project's feed sources and attachments. "
        "Each system runs the same replay in turn, on a fresh engine in the same process: same feed, same "
        f"speed, same seeded Poisson schedule (seed {args.seed}: standing asks at the rate that gives "
        f"~{args.asks} per run, ad-hoc asks at {args.adhoc_rate:g}/s). Latency runs from the ask to the answer "
        "while the feed runs, queueing included (a baseline answers one ask at a time, like one server slot). "
        "Every system uses the same prompt token ids and the same stopping rule: a question with choices is "
        "answered by its best choice at the first token (the question's gate); an ad-hoc question decodes "
        f"greedily up to {args.adhoc_tokens} tokens.", "",
        "## The systems, and what each does with the data between asks", "",
    ]
    lines += [f"- **{s}**: {SYSTEM_TEXT[s]} *Between asks*: {BETWEEN_ASKS[s]}." for s in systems]
    lines += ["", "## Live replay: standing asks", ""]
    rows = []
    for v in run.speeds:
        t = f"{v:g}"
        for s in systems:
            if f"{s}_ms_p50@{t}" not in m:
                continue
            rows.append([f"{t}x", s, _f(m[f"{s}_ms_p50@{t}"], ".2f"), _f(m[f"{s}_ms_p99@{t}"], ".1f"),
                         int(m[f"{s}_asks@{t}"]), int(m[f"{s}_unanswered@{t}"]),
                         _f(m[f"{s}_accuracy@{t}"], ".2f"), _f(m.get(f"{s}_base_rate@{t}"), ".2f"),
                         int(m[f"{s}_labelled@{t}"]),
                         _f(m.get(f"speedup_vs_{s}@{t}"), ".1f"), _f(m[f"{s}_adhoc_ms_p50@{t}"], ".0f"),
                         "yes" if m[f"{s}_diverged@{t}"] else "no"])
    lines += [_table(["speed", "system", "p50 ms", "p99 ms", "standing answered", "unanswered", "accuracy",
                      "base rate", "labelled", "its p50 / ours", "ad hoc p50 ms", "backlog diverged"], rows), "",
              "![latency vs feed rate](latency_vs_feed_rate.png)", ""]
    rows = [[speed, q, n, *(_f(x, ".2f") for x in figures)]
            for speed, q, n, *figures in per_question(m, run.speeds, systems)]
    if rows:
        lines += ["Accuracy per question on its labelled standing asks, beside its base rate (what always "
                  "giving its most common truth scores on ours' asks).", "",
                  _table(["speed", "question", "labelled", "base rate", *systems], rows), ""]
    rows = []
    for v in run.speeds:
        t = f"{v:g}"
        if f"ours_ms_p50@{t}" in m:
            rows.append([f"{t}x", _f(feed_rate(m, v), ".2f"), int(m[f"ours_fast_asks@{t}"]),
                         int(m[f"ours_entry_asks@{t}"]), int(m[f"ours_cold_asks@{t}"]),
                         _f(m[f"gate_coverage@{t}"], ".2f"), _f(m[f"gate_precision@{t}"], ".2f"),
                         _f(m[f"lag_versions_p50@{t}"], ".0f"), _f(m[f"lag_versions_p99@{t}"], ".1f"),
                         int(m[f"summary_lines@{t}"]), int(m.get(f"compactions@{t}", 0))])
    lines += ["Ours per speed: paths, gate, and data lag (versions pushed before the ask that the answer "
              "did not include).", "",
              _table(["speed", "feed lines/s", "fast", "entry", "cold", "gate coverage", "gate precision",
                      "lag p50", "lag p99", "summary lines", "compactions"], rows), ""]
    sat = [f"{s}: " + (_f(m.get(f"saturation_speed_{s}"), "g") + "x" if _f(m.get(f"saturation_speed_{s}")) != "-"
                       else "not reached") for s in systems]
    lines += ["Saturation (lowest swept speed at which the system's backlog diverged: asks left unanswered "
              "after the drain, the last third of answers over twice as slow as the first third and over "
              "250 ms, or ours' data lag growing): " + ", ".join(sat) + ".",
              ""]
    sw = run.sweep
    if sw is not None and sw.held:
        plot_sweep(sw, out / "latency_vs_context.png")
        lines += ["## Latency vs context (recorded lines only)", "",
                  f"One session filled with {sw.source} to each size; per size {args.sweep_reps} new recorded "
                  "bar(s), each timed two ways for ours: **from the push** (push -> ingest -> re-position -> "
                  "answer, all standing questions asked for the new version at once) and **entries fresh** "
                  "(asked again once the engine is idle: the steady state). The prefix cache answers on the "
                  "same context with its cache at the previous question.", ""]
        rows = []
        for n in sorted(sw.held):
            rows.append([n, sw.held[n], sw.lines_used[n], _f(m.get(f"sweep_ours_from_push_ms_p50@{n}"), ".1f"),
                         _f(m.get(f"sweep_ours_ms_p50@{n}"), ".2f"), _f(m.get(f"sweep_ours_cold_ms_p50@{n}"), ".0f"),
                         _f(m.get(f"sweep_prefixcache_ms_p50@{n}"), ".1f"),
                         _f(m.get(f"sweep_stateless_ms_p50@{n}"), ".0f"), _f(m.get(f"sweep_peer_ms_p50@{n}"), ".1f"),
                         ", ".join(f"{k} {v}" for k, v in sorted(sw.paths.get(n, {}).items()))])
        lines += [_table(["size", "held", "recorded lines used", "ours from push p50", "ours entries fresh p50",
                          "ours ad hoc p50", "prefix cache p50", "stateless p50", "peer p50", "our paths"], rows),
                  "", "![latency vs context](latency_vs_context.png)", ""]
        if sw.stopped_at is not None:
            lines += [f"The sweep stopped at {sw.stopped_at} tokens: the recording ({sw.lines_available} lines) "
                      "cannot fill it (no synthetic padding).", ""]
    lines += ["## Caveats", "",
              "- Shared, noisy machine: absolute times move between runs; compare systems within one run.",
              "- The systems run one after the other, not at once: each had the CPU to itself (besides "
              "whatever else the machine was doing at the time).",
              "- Ours and the runner baselines are in process; the peer's latency includes loopback HTTP and "
              "its own tokenization of the prompt text."]
    lines += [f"- {note}" for note in run.notes]
    lines += ["", "Flat metrics: the JSON report (`--json`).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
