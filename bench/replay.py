"""`streamllm bench replay`: recorded feeds into sessions, Poisson questions, baselines, a report.

    streamllm bench replay --data ../shared/data/binance-spot/btcusdt_20240808.gz \\
        ../shared/data/binance-spot/ethusdt_20240808.gz --questions queries/crypto.toml \\
        --speed 60 --duration 300 --json report.json --out report/

Phase 1, replay: the config's sessions and standing questions are opened on one engine;
the recorded feeds (or the embedded synthetic feed) go through the real sources,
attachments and renderers at `--speed`; a seeded load generator asks standing and
ad-hoc questions at Poisson times. Every answer is timed end to end, with its path,
its data_version lag behind the newest pushed version, and, for labelled questions,
whether it matches the label on the bars it saw. Each answer's exact token ids are
recorded; after the replay (so they never slow our answers) the same questions at the
same data points go to the baselines of bench/baselines.py.
Phase 2, sweep: one session filled to each `--sweep` size; per size, one new bar then
every standing question, on ours, the prefix cache, the peer and (fewer times) stateless.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.baselines import Peer, PrefixCache, Stateless
from bench.common import (
    median,
    parse_ints,
    percentile,
    print_table,
    write_json,
)
from bench.loadgen import AskEvent, poisson_schedule, run_schedule
from bench.sweep import SYSTEMS, sweep_phase
from streamllm.config import QueryConfig, QuestionSpec, load_config
from streamllm.engine.kv import KVCapacityError
from streamllm.market.attach import Attachment, AttachSpec, attach


@dataclass(slots=True)
class AskRecord:
    """One question of the replay: our answer, then what each baseline paid for it."""

    session: str
    question: str
    spec: QuestionSpec | None  # None: ad hoc
    max_tokens: int
    question_ids: list[int]
    pushed_at_ask: int
    t0: float = 0.0
    ms: float = math.nan
    path: str = ""
    data_version: int = -1
    lag: int = 0  # versions pushed before the ask that the answer did not see
    tokens_computed: int = 0
    confidence: float | None = None
    text: str = ""
    context_ids: list[int] = field(default_factory=list)
    truth: str | None = None
    error: str | None = None
    baseline_ms: dict[str, float] = field(default_factory=dict)
    baseline_text: dict[str, str] = field(default_factory=dict)
    baseline_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not math.isnan(self.ms)

    @property
    def correct(self) -> bool | None:
        return None if self.truth is None else matches(self.text, self.truth)


def matches(text: str, truth: str) -> bool:
    """The answer's first word is the label's choice (case and punctuation aside)."""
    words = text.strip().split()
    return bool(words) and words[0].strip(".,!:;\"'").casefold() == truth.casefold()


class LineLog:
    """The engine as an attachment's sink, remembering the lines pushed per session."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lines: dict[str, list[str]] = {}

    def push(self, session: str, lines: list[str]):
        ack = self.engine.push(session, lines)
        self.lines.setdefault(session, []).extend(lines)
        return ack

    def backlog(self, session: str) -> int:
        return self.engine.backlog(session)


class RecordingAttachment(Attachment):
    """Keeps every closed bar and which bars each data_version holds; stops cleanly when full."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.bars: list[Any] = []
        self.bars_at_version: dict[int, int] = {0: 0}
        self.full: str | None = None
        self.events_after_full = 0

    def offer(self, ev: Any) -> None:
        if self.full is not None:
            self.events_after_full += 1
            return
        super().offer(ev)

    def _take_bars(self, closed: list[Any]) -> None:
        self.bars.extend(closed)
        super()._take_bars(closed)

    def flush(self) -> Any:
        if self.full is not None:
            return None
        try:
            ack = super().flush()
        except KVCapacityError as exc:  # the session is at max_context: stop feeding it
            self.full = str(exc)
            return None
        if ack is not None:  # a flush pushes every bar closed so far
            self.bars_at_version[ack.data_version] = len(self.bars)
        return ack

    def bars_upto(self, version: int) -> list[Any]:
        known = [v for v in self.bars_at_version if v <= version]
        return self.bars[: self.bars_at_version[max(known)]]


def feed_events(data: list[str], seed: int, duration_s: float | None, opts: Any = None) -> Iterator[Any]:
    """Recorded captures/tables merged by receive time (or the synthetic feed), cut at duration_s."""
    from feeds.replay import merge
    from feeds.sources import open_recorded
    from feeds.synthetic import SyntheticFeed

    sources = open_recorded(data, opts, what="--data") if data else []
    for src in sources:
        for note in getattr(src, "notes", []):
            print(f"note: {note}", file=sys.stderr)
    events: Iterable[Any] = merge(*sources) if data else SyntheticFeed(seed=seed).events()
    first = None
    try:
        for ev in events:
            first = ev.ts_recv if first is None else first
            if duration_s is not None and ev.ts_recv - first > duration_s * 1e9:
                return
            yield ev
    finally:
        for src in sources:  # what the sources refused: counted, named, never silently dropped
            st = getattr(src, "stats", None)
            if st is not None and (st.errors or st.gaps):
                print(f"--data {getattr(src, 'path', '')}: {st.errors} errors {st.error_kinds}, {st.gaps} gaps"
                      + (f"; e.g. {st.error_samples[0]}" if st.error_samples else ""), file=sys.stderr)


@dataclass(slots=True)
class Run:
    records: list[AskRecord] = field(default_factory=list)
    sweep: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # system -> size -> ms
    sweep_paths: dict[int, dict[str, int]] = field(default_factory=dict)
    sweep_held: dict[int, int] = field(default_factory=dict)
    attachments: dict[str, RecordingAttachment] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    replay_wall_s: float = 0.0
    sweep_wall_s: float = 0.0
    baseline_wall_s: float = 0.0
    stateless_reps: dict[int, int] = field(default_factory=dict)
    sink: LineLog | None = None
    model_name: str = ""


def pool_cells(config: QueryConfig, sweep_context: int) -> int:
    """Sessions + one prefix-cache table each + one stateless table, in the bigger phase.

    The sweep session's reservation is sized past its context (see bench.sweep),
    so count it twice to be safe.
    """
    replay = sum(2 * s.max_context_tokens for s in config.sessions) + max(s.max_context_tokens for s in config.sessions)
    return max(replay, 4 * sweep_context) + 1024


def replay_phase(engine, config: QueryConfig, args: argparse.Namespace, run: Run) -> None:
    sink = LineLog(engine)
    for spec in config.sessions:
        engine.open_session(spec.name, system=spec.system_prompt, max_context=spec.max_context_tokens)
        for q in spec.questions:
            engine.register(spec.name, q)
        run.attachments[spec.name] = RecordingAttachment(sink, AttachSpec(
            session=spec.name, mode=spec.render.mode, bar_s=float(spec.render.bar_seconds or 60),
            instruments=frozenset({spec.instrument})))
    run.sink = sink  # the sweep reuses the recorded lines
    window_s = args.duration / args.speed if args.speed else args.duration
    schedule = poisson_schedule(args.seed, args.rate, window_s,
                                {s.name: [q.id for q in s.questions] for s in config.sessions})
    futures: list[Future] = []
    bar = tqdm(total=len(schedule), desc="replay: asks answered", unit="ask", leave=False)

    def on_done(rec: AskRecord, fut: Future) -> None:
        rec.ms = (time.perf_counter() - rec.t0) * 1000
        bar.update()
        try:
            ans = fut.result()
        except Exception as exc:  # a refused ask is a result too: counted, not timed
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        rec.path, rec.data_version, rec.text = ans.path, ans.data_version, ans.text
        rec.tokens_computed, rec.confidence = ans.tokens_computed, ans.confidence
        rec.lag = max(0, rec.pushed_at_ask - ans.data_version)
        def context(core, session=rec.session, version=ans.data_version):
            s = core.sessions.get(session)  # exactly the ids this answer saw, for the baselines
            return None if s is None else s.token_ids[: s.version_length(version)]

        rec.context_ids = engine.call(context)

    def submit(ev: AskEvent) -> None:
        spec = config.session(ev.session).find_question(ev.question) if ev.standing else None
        text = spec.text if spec is not None else ev.question
        rec = AskRecord(ev.session, ev.question, spec, spec.max_tokens if spec else args.adhoc_tokens,
                        engine.layout.question_ids(text), engine.session_info(ev.session).pushed_version)
        run.records.append(rec)
        rec.t0 = time.perf_counter()
        try:
            fut = engine.submit_ask(ev.session, ev.question, max_tokens=rec.max_tokens)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            bar.update()
            return
        futures.append(fut)
        fut.add_done_callback(lambda f, rec=rec: on_done(rec, f))

    from feeds.replay import apaced

    stop = threading.Event()
    t0 = time.perf_counter()
    asker = run_schedule(schedule, submit, stop)
    try:
        from feeds.sources import read_options

        insts = {s.instrument for s in config.sessions}
        # Tables without a symbol column hold the sessions' instrument when they share one.
        opts = read_options(args, instrument=next(iter(insts)) if len(insts) == 1 else "")
        events = feed_events(args.data or [], args.seed, args.duration, opts)
        asyncio.run(attach(apaced(events, args.speed or None), list(run.attachments.values())))
    finally:
        stop.set()  # the feed ended: no more asks (their answers would all see the last data)
        asker.join()
    wait(futures, timeout=args.answer_timeout)
    engine.wait_idle(args.answer_timeout)
    bar.close()
    run.replay_wall_s = time.perf_counter() - t0
    for rec in run.records:
        if rec.error is None and math.isnan(rec.ms):
            rec.error = "no answer within --answer-timeout"
        if rec.ok and rec.spec is not None and rec.spec.label is not None:
            rec.truth = rec.spec.expected_answer(run.attachments[rec.session].bars_upto(rec.data_version))
    for name, att in run.attachments.items():
        if att.full:
            run.notes.append(f"session {name} reached its max_context and stopped taking data: {att.full}")


def replay_baselines(engine, args: argparse.Namespace, run: Run, peer: Peer | None) -> None:
    """The recorded questions, in ask order, on the baselines; after the replay, never during it."""
    ok = sorted((r for r in run.records if r.ok and r.context_ids), key=lambda r: r.t0)
    k = min(args.stateless_asks, len(ok))
    stateless_at = {round(i * (len(ok) - 1) / max(1, k - 1)) for i in range(k)} if k else set()
    prefix, stateless = PrefixCache(engine, args.chunk), Stateless(engine, args.chunk)
    work = len(ok) * (2 if peer else 1) + len(stateless_at)
    t0 = time.perf_counter()
    with tqdm(total=work, desc="baselines on the recorded asks", unit="ask", leave=False) as bar:
        try:
            for i, rec in enumerate(ok):
                systems: list[Any] = [prefix] + ([stateless] if i in stateless_at else []) + ([peer] if peer else [])
                for system in systems:
                    if system is prefix:
                        ans = prefix.answer(rec.session, rec.context_ids, rec.question_ids, rec.max_tokens)
                    else:
                        ans = system.answer(rec.context_ids, rec.question_ids, rec.max_tokens)
                    rec.baseline_ms[system.name] = ans.ms
                    rec.baseline_text[system.name] = ans.text
                    rec.baseline_tokens[system.name] = ans.tokens_computed
                    bar.update()
        finally:
            prefix.close()
    run.baseline_wall_s = time.perf_counter() - t0


def metrics_of(run: Run, sizes: list[int], peer: bool) -> dict[str, float]:
    from streamllm.engine.gate import risk_coverage

    ok = [r for r in run.records if r.ok]
    standing = [r for r in ok if r.spec is not None]
    m: dict[str, float] = {"asks": len(run.records), "asks_ok": len(ok), "asks_failed": len(run.records) - len(ok),
                           "asks_standing": len(standing), "asks_adhoc": len(ok) - len(standing)}
    ms = [r.ms for r in ok]
    m.update(ours_ms_p50=median(ms), ours_ms_p99=percentile(ms, 99))
    for path in ("fast", "entry", "cold"):
        xs = [r.ms for r in ok if r.path == path]
        m[f"ours_{path}_asks"] = len(xs)
        m[f"ours_{path}_ms_p50"], m[f"ours_{path}_ms_p99"] = median(xs), percentile(xs, 99)
    m["ours_standing_ms_p50"] = median([r.ms for r in standing])
    lags = [float(r.lag) for r in ok]
    m.update(lag_versions_p50=median(lags), lag_versions_p99=percentile(lags, 99),
             lag_versions_max=max(lags, default=math.nan),
             ours_tokens_per_ask=median([float(r.tokens_computed) for r in ok]))
    for system in SYSTEMS[1:]:
        done = [r for r in ok if system in r.baseline_ms]
        if system == "peer" and not peer:
            continue
        xs = [r.baseline_ms[system] for r in done]
        m[f"{system}_asks"] = len(done)
        m[f"{system}_ms_p50"], m[f"{system}_ms_p99"] = median(xs), percentile(xs, 99)
        m[f"{system}_tokens_per_ask"] = median([float(r.baseline_tokens[system]) for r in done])
        pairs = [r for r in done if r.spec is not None]
        if pairs:  # ratio of medians over the same standing asks
            m[f"speedup_vs_{system}"] = median([r.baseline_ms[system] for r in pairs]) / median([r.ms for r in pairs])
    labelled = [r for r in standing if r.truth is not None]
    fast = [r for r in labelled if r.path == "fast"]
    m["labelled_asks"] = len(labelled)
    m["gate_coverage"] = len(fast) / len(labelled) if labelled else math.nan
    m["gate_precision"] = sum(bool(r.correct) for r in fast) / len(fast) if fast else math.nan
    m["ours_accuracy"] = sum(bool(r.correct) for r in labelled) / len(labelled) if labelled else math.nan
    if labelled:
        curve = risk_coverage([r.confidence or 0.0 for r in labelled], [bool(r.correct) for r in labelled])
        m["gate_best_precision"] = max(p.precision for p in curve)
    for n in sizes:
        for system, by_size in run.sweep.items():
            if by_size.get(n):
                m[f"{system}_latency_ms_p50@{n}"] = median(by_size[n])
        if run.sweep["ours"].get(n) and run.sweep["prefixcache"].get(n):
            m[f"speedup_vs_prefixcache@{n}"] = median(run.sweep["prefixcache"][n]) / median(run.sweep["ours"][n])
        m[f"context_tokens@{n}"] = run.sweep_held.get(n, math.nan)
    flat = [n for n in sizes if n >= 1024 and run.sweep["ours"].get(n)]
    if len(flat) >= 2:  # goal: within 20% from 1k to 8k
        m["ours_p50_ratio_max_over_min_context"] = (m[f"ours_latency_ms_p50@{flat[-1]}"]
                                                    / m[f"ours_latency_ms_p50@{flat[0]}"])
    atts = run.attachments.values()
    m.update(events_in=sum(a.stats.events_in for a in atts), lines_pushed=sum(a.stats.lines_pushed for a in atts),
             summary_lines=sum(a.stats.summaries for a in atts), replay_wall_s=run.replay_wall_s,
             baseline_wall_s=run.baseline_wall_s, sweep_wall_s=run.sweep_wall_s)
    return m


def bench(args: argparse.Namespace, model: Any = None) -> tuple[Run, dict[str, float]]:
    from streamllm.engine import Engine
    from streamllm.model import load_model

    config = load_config(args.questions)
    sizes = sorted(parse_ints(args.sweep)) if args.sweep else []
    if sizes and args.sweep_reps < 1:
        raise ValueError("--sweep-reps must be at least 1")
    sweep_context = (max(sizes) + 64 * args.sweep_reps + 512) if sizes else 0
    loaded = model if model is not None else load_model(args.model, progress=True)
    engine = Engine(loaded, max_cells=pool_cells(config, sweep_context) + 8192, branch_cells=8192,
                    max_context=max([s.max_context_tokens for s in config.sessions] + [sweep_context]))
    peer = Peer(args.peer_url, engine.tokenizer) if args.peer_url else None
    run = Run()
    if peer is None:
        run.notes.append("no --peer-url: the peer (an OpenAI-compatible server such as llama-server) was skipped")
    try:
        replay_phase(engine, config, args, run)
        for spec in config.sessions:  # the baselines' tables need the cells
            engine.close_session(spec.name)
        replay_baselines(engine, args, run, peer)
        if sizes:
            sweep_phase(engine, config, args, run, sizes, sweep_context, peer)
        engine.check_integrity()
    finally:
        engine.shutdown()
    run.model_name = loaded.name
    return run, metrics_of(run, sizes, peer is not None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="*", help="raw captures (.gz) or trade/quote/bar tables; default: synthetic feed")
    p.add_argument("--questions", default="queries/crypto.toml", help="sessions and standing questions (TOML)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0, help="load generator (and synthetic feed) seed")
    p.add_argument("--speed", type=float, default=60.0, help="replay pace, x real time (0: as fast as possible)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of feed time to replay")
    p.add_argument("--rate", type=float, default=6.0, help="asks per wall-clock second (Poisson)")
    p.add_argument("--adhoc-tokens", type=int, default=8, help="max_tokens of ad-hoc questions")
    p.add_argument("--sweep", default="512,1024,2048,4096,8192", help="context sizes in tokens ('' to skip)")
    p.add_argument("--sweep-reps", type=int, default=4, help="new bars (each followed by every question) per size")
    p.add_argument("--stateless-reps", type=int, default=3, help="stateless answers per size up to 2048 (1 above)")
    p.add_argument("--stateless-max", type=int, default=8192, help="largest sweep size stateless is run at")
    p.add_argument("--stateless-asks", type=int, default=8, help="replay asks also sent to stateless (evenly spread)")
    p.add_argument("--chunk", type=int, default=512, help="baselines' prefill chunk in tokens")
    p.add_argument("--peer-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8080 (llama-server)")
    p.add_argument("--answer-timeout", type=float, default=600.0)
    from feeds.sources import add_read_args

    add_read_args(p)
    p.add_argument("--json", help="write the flat metrics here")
    p.add_argument("--out", default="report", help="folder for report.md and the PNG plots")
    return p


def cli_main(argv: list[str]) -> int:
    from bench.report import write_report

    args = parser().parse_args(argv)
    try:
        run, metrics = bench(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"streamllm bench replay: error: {exc}", file=sys.stderr)
        return 2
    command = "streamllm bench replay " + " ".join(argv)
    meta = {"bench": "replay", "model": run.model_name, "command": command}
    # JSON has no NaN: a metric this run could not define (no fast answers, no peer) is null.
    write_json(args.json, {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()},
               meta)
    path = write_report(Path(args.out), run, metrics, args, command)
    rows = [[s, metrics.get(f"{s}_ms_p50", math.nan), metrics.get(f"{s}_ms_p99", math.nan),
             metrics.get(f"{s}_asks", metrics["asks_ok"] if s == "ours" else 0)] for s in SYSTEMS
            if s == "ours" or f"{s}_ms_p50" in metrics]
    print_table("replay: latency per answer (ms)", ["system", "p50", "p99", "asks"], rows)
    for note in run.notes:
        print(f"note: {note}")
    print(f"speedup_vs_prefixcache {metrics.get('speedup_vs_prefixcache', math.nan):.1f}  "
          f"gate coverage {metrics['gate_coverage']:.2f} precision {metrics['gate_precision']:.2f}")
    print(f"wrote {path}" + (f" and {args.json}" if args.json else ""))
    return 0
