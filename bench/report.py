"""The replay benchmark's human-readable report: report.md with tables and PNG plots.

Written for a reader who has never seen the project: it says what each system is,
what was measured, on which machine, and what to be careful about.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from bench.common import machine, median

SYSTEM_TEXT = {
    "ours": "streamllm: stateful sessions whose KV cache grows with the data; standing questions are "
            "pre-positioned after every update and answered from the cached distribution when the "
            "confidence gate fires (fast path), else by decoding from the pre-paid entry (entry path); "
            "ad-hoc questions prefill only the question on top of the session (cold path).",
    "prefixcache": "a server with prefix caching (what vLLM/SGLang automatic prefix caching or a "
                   "llama.cpp slot pays): one cached table per session holds system prompt + data up to "
                   "the previous question; a question pays the data that arrived since, the question, "
                   "and the decode. Same model, same forward code, same cells.",
    "stateless": "a request-driven server without a cache: every question prefills system prompt + all "
                 "data so far + question from scratch (in 512-token chunks), then decodes.",
    "peer": "an external OpenAI-compatible completion server (e.g. llama.cpp's llama-server) sent the "
            "same prompt text with cache_prompt: true, over HTTP on this machine.",
}


def _f(x: Any, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(out)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(run, sizes: list[int], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for system, label in (("ours", "ours (standing)"), ("ours_cold", "ours (ad hoc, cold)"),
                          ("prefixcache", "prefix cache"), ("stateless", "stateless"), ("peer", "peer")):
        pts = [(run.sweep_held.get(n, n), median(run.sweep[system][n])) for n in sizes if run.sweep[system].get(n)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context held by the session (tokens)",
           ylabel="answer latency p50 (ms)", title="latency vs context")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_cdf(run, path: Path) -> None:
    plt = _plt()
    ok = [r for r in run.records if r.ok]
    series = {f"ours {p}": [r.ms for r in ok if r.path == p] for p in ("fast", "entry", "cold")}
    for system in ("prefixcache", "stateless", "peer"):
        series[system] = [r.baseline_ms[system] for r in ok if system in r.baseline_ms]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, xs in series.items():
        if xs:
            xs = sorted(max(x, 1e-3) for x in xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")
    ax.set(xscale="log", xlabel="answer latency (ms)", ylabel="share of answers", ylim=(0, 1.02),
           title="replay: latency CDF per path and system")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_gate(run, path: Path) -> int:
    from streamllm.engine.gate import risk_coverage

    plt = _plt()
    labelled = [r for r in run.records if r.ok and r.spec is not None and r.truth is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    if labelled:
        curve = risk_coverage([r.confidence or 0.0 for r in labelled], [bool(r.correct) for r in labelled])
        ax.plot([p.coverage for p in curve], [p.precision for p in curve], drawstyle="steps-post",
                label=f"all labelled standing asks (n={len(labelled)})")
        fast = [r for r in labelled if r.path == "fast"]
        if fast:  # where the configured thresholds put the gate
            prec = sum(bool(r.correct) for r in fast) / len(fast)
            ax.plot([len(fast) / len(labelled)], [prec], "o", label="configured thresholds")
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no labelled answers in this run", ha="center", va="center")
    ax.set(xlabel="coverage (share of asks the gate would fire on)", ylabel="precision of fired answers",
           xlim=(0, 1.02), ylim=(0, 1.02), title="gate risk-coverage (confidence = logit gap)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return len(labelled)


def write_report(out: Path, run, m: dict[str, float], args: argparse.Namespace, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    sizes = sorted(run.sweep_held)
    if sizes:
        plot_sweep(run, sizes, out / "latency_vs_context.png")
    plot_cdf(run, out / "latency_cdf.png")
    plot_gate(run, out / "gate_risk_coverage.png")
    mach = machine()
    lines = [
        "# streamllm replay benchmark",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{command}`",
        "",
        f"Model `{run.model_name}` on {mach['machine']}, {mach['cpus']} CPUs ({mach['torch_threads']} torch threads),"
        f" CUDA: {mach['cuda']}, torch {mach['torch']}, Python {mach['python']}. All systems ran in this one"
        " process on the same model weights, the same forward code and the same KV pool.",
        "",
        "## What was measured",
        "",
        f"Market data ({', '.join(args.data) if args.data else 'the embedded synthetic feed'}) was replayed at "
        f"{args.speed:g}x real time for {args.duration:g} s of feed time through the project's real feed sources, "
        f"attachments (bars or events per session, as the config `{args.questions}` says) and engine. "
        f"{_f(m['events_in'], '.0f')} feed events became {_f(m['lines_pushed'], '.0f')} text lines "
        f"({_f(m['summary_lines'], '.0f')} summary lines where ingest fell behind). Meanwhile a load generator "
        f"(seed {args.seed}) asked questions at Poisson times, {args.rate:g} per second on average: ~80% standing "
        "questions of the config (by id), the rest ad-hoc questions nobody registered. "
        "Every answer was timed end to end (submit to result, in process), with its path and how many data "
        "versions it lagged behind the newest version pushed when it was asked.",
        "",
        "The token ids each of our answers saw were recorded; after the replay ended the baselines answered the "
        "same questions on exactly those ids, one at a time, so their cost never slowed our answers (and ours "
        "never slowed theirs). Baselines decode greedily up to the question's max_tokens.",
        "",
        "## The systems",
        "",
    ]
    lines += [f"- **{name}**: {text}" for name, text in SYSTEM_TEXT.items()]
    lines += ["", "## Replay: latency per answer", ""]
    rows = [["ours", _f(m["ours_ms_p50"], ".2f"), _f(m["ours_ms_p99"], ".1f"), int(m["asks_ok"]),
             _f(m["ours_tokens_per_ask"], ".0f"), "1.0"]]
    for system in ("prefixcache", "stateless", "peer"):
        if f"{system}_ms_p50" in m:
            rows.append([system, _f(m[f"{system}_ms_p50"], ".1f"), _f(m[f"{system}_ms_p99"], ".1f"),
                         int(m[f"{system}_asks"]), _f(m[f"{system}_tokens_per_ask"], ".0f"),
                         _f(m.get(f"speedup_vs_{system}"), ".1f")])
    lines += [_table(["system", "p50 ms", "p99 ms", "answers", "tokens computed (median)",
                      "its p50 / ours on standing asks"], rows), ""]
    rows = []
    for path in ("fast", "entry", "cold"):
        rows.append([path, int(m[f"ours_{path}_asks"]), _f(m[f"ours_{path}_ms_p50"], ".2f"),
                     _f(m[f"ours_{path}_ms_p99"], ".2f")])
    lines += ["Our answers by path:", "", _table(["path", "answers", "p50 ms", "p99 ms"], rows), "",
              f"Data freshness: answers lagged the newest pushed data version by {_f(m['lag_versions_p50'], '.0f')}"
              f" versions at the median, {_f(m['lag_versions_p99'], '.1f')} at p99, {_f(m['lag_versions_max'], '.0f')}"
              " at most (a version is one pushed batch of lines; lag means the answer was computed on data "
              "the engine had ingested, while newer lines still waited in the ingest queue).",
              "", "![latency CDF](latency_cdf.png)", ""]
    if m["asks_failed"]:
        errors = sorted({r.error for r in run.records if r.error})
        lines += [f"{int(m['asks_failed'])} asks got no answer: " + "; ".join(errors[:3]), ""]
    lines += ["## Gate", "",
              f"{int(m['labelled_asks'])} standing asks had a ground-truth label (computed from the real bars the "
              f"answer's data covered). The gate fired (fast path) on {_f(m['gate_coverage'] * 100, '.0f')}% of them "
              f"(coverage); {_f(m['gate_precision'] * 100, '.0f')}% of fired answers matched the label (precision); "
              f"over all labelled answers, {_f(m['ours_accuracy'] * 100, '.0f')}% matched. The curve shows what other "
              "thresholds would give.", "", "![gate risk-coverage](gate_risk_coverage.png)", ""]
    if sizes:
        lines += ["## Latency vs context", "",
                  f"One session (config session `{args.questions}`[0]'s system prompt and standing questions) was "
                  f"filled to each size; then {args.sweep_reps} times: one new bar arrives, every standing question "
                  "is asked on ours and on the prefix cache (whose cache already holds the context up to the "
                  "previous question, so it pays one bar + question + decode), plus one ad-hoc question on ours. "
                  "Stateless answers one standing question "
                  f"{args.stateless_reps} times per size up to 2048 tokens and once above (it costs tens of seconds "
                  f"at 8k on this CPU){'' if args.stateless_max >= max(sizes) else f', and not above {args.stateless_max}'}.",
                  ""]
        rows = []
        for n in sizes:
            sw = run.sweep
            rows.append([n, run.sweep_held[n], _f(m.get(f"ours_latency_ms_p50@{n}"), ".2f"),
                         _f(m.get(f"ours_cold_latency_ms_p50@{n}"), ".1f"),
                         _f(m.get(f"prefixcache_latency_ms_p50@{n}"), ".1f"),
                         f"{_f(m.get(f'stateless_latency_ms_p50@{n}'), '.0f')} ({len(sw['stateless'][n])}x)",
                         _f(m.get(f"peer_latency_ms_p50@{n}"), ".1f"), _f(m.get(f"speedup_vs_prefixcache@{n}"), ".1f"),
                         ", ".join(f"{k} {v}" for k, v in sorted(run.sweep_paths.get(n, {}).items()))])
        lines += [_table(["size", "held", "ours p50 ms", "ours ad hoc p50", "prefix cache p50", "stateless p50",
                          "peer p50", "prefix cache / ours", "our paths"], rows), "",
                  "![latency vs context](latency_vs_context.png)", ""]
    lines += ["## Goals", ""]
    speed = m.get("speedup_vs_prefixcache", math.nan)
    lines.append(f"- speedup over the prefix cache on standing questions (replay, p50 / p50): {_f(speed, '.1f')}x "
                 f"(goal >= 10x: {'met' if speed >= 10 else 'not met'})")
    ratio = m.get("ours_p50_ratio_max_over_min_context")
    if ratio is not None:
        flat = 1 / 1.2 <= ratio <= 1.2
        lines.append(f"- our p50 at the largest swept size over the smallest >= 1024: {_f(ratio, '.2f')} "
                     f"(goal: within 20%: {'met' if flat else 'not met'})")
    if m["ours_fast_asks"] == 0 and m["asks_standing"]:
        lines.append("- why: the gate never fired at the configured thresholds, so every standing answer decoded "
                     "from its entry (entry path) instead of coming from the cached distribution; see the gate "
                     "curve for thresholds that would fire.")
    if m["lag_versions_p50"] > 0:
        lines.append(f"- why: ingest fell behind the replay (median lag {_f(m['lag_versions_p50'], '.0f')} versions): "
                     "a standing ask waits for its entry at the newest ingested version, and entries are "
                     "re-computed after every ingested batch, so asks queued behind ingest and re-positioning. "
                     "A slower --speed or a faster machine moves this; the sweep shows the steady state.")
    lines += ["", "## Caveats", "",
              "- These machines are shared with other jobs: absolute times are noisy; ratios measured side by side "
              "in one run mean more than any single figure.",
              "- The replay's baselines run after it, one question at a time on an idle engine: they never "
              "queue behind each other or behind ingest, which favours them. Ours answered while data "
              "was being ingested and entries re-positioned, in the same process and on the same cores.",
              f"- Stateless answered {int(m.get('stateless_asks', 0))} replay asks (evenly spread over the run), not "
              "all: each costs a full prefill.",
              "- A fast-path answer is the gate's choice from the ready distribution; it is only as right as "
              "the model's first token (see the gate section). The baselines always decode.",
              "- Latencies are in process (no network) for ours and the runner baselines; the peer's include "
              "loopback HTTP and its own tokenization of the prompt text."]
    lines += [f"- {note}" for note in run.notes]
    lines += ["", f"Flat metrics: the JSON report (`--json`). Wall time: replay {_f(m['replay_wall_s'])} s, "
              f"baselines {_f(m['baseline_wall_s'])} s, sweep {_f(m['sweep_wall_s'])} s.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path

