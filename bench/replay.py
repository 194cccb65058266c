"""`streamllm bench replay`: every system answers the same asks, live, under the same feed.

    streamllm bench replay --data ../shared/data/binance-spot/btcusdt_20240808.gz \\
        ../shared/data/binance-spot/ethusdt_20240808.gz --questions queries/crypto.toml \\
        --speeds 1,10 --json report.json --out report/

Live replay (bench/live.py), per speed, one system after the other (ours, the prefix
cache on the same runner, a sample of stateless, the peer with `--peer-url`): a fresh
engine, the same warm-up, then the same recorded feed through the real sources and
attachments at the same speed while the same seeded Poisson schedule asks standing and
ad-hoc questions. Each system does with the data between asks what it would in
production (ours ingests and re-positions; the baselines do nothing until asked).
Latency is from the ask to the answer while the feed runs; labelled standing answers
are scored against the label on exactly the bars their data held. Real time (1x) is
always one of the speeds; `--speed auto` first measures our sustained ingest capacity
and adds a point at `--auto-fraction` of it. A system's backlog diverging marks its
saturation speed. The JSON report is rewritten after every system, so a run that dies
keeps what it measured.
Then the context sweep (bench/sweep.py) on recorded lines only.

Without `--out` the report goes to ./bench-replay-report/ in the working directory, named so
that it is not mistaken for anything else there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.baselines import Peer
from bench.common import parse_ints, print_table, write_json
from bench.live import (
    BETWEEN_ASKS,
    SystemRun,
    TokenSink,
    attachments_for,
    live_schedule,
    run_system,
)
from bench.replay_metrics import SYSTEMS, Run, metrics_of, per_question, speed_tag
from bench.sweep import sweep_phase
from streamllm.config import QueryConfig, load_config

DEFAULT_OUT = "bench-replay-report"  # the report folder without --out: named for what it holds

QUICK = {"duration": 15.0, "warmup": 75.0, "speeds": "1,10", "asks": 24, "adhoc_rate": 0.3, "drain_s": 10.0,
         "sweep": "256,512", "sweep_reps": 1, "stateless_every": 6, "stateless_reps": 1}


def matches(text: str, truth: str) -> bool:
    """The answer's first word is the label's choice (case and punctuation aside)."""
    words = text.strip().split()
    return bool(words) and words[0].strip(".,!:;\"'").casefold() == truth.casefold()


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


def split_feed(args: argparse.Namespace, config: QueryConfig) -> tuple[list[Any], list[Any], float]:
    """(warm-up events, paced events, paced span in feed seconds); recorded data stops where it ends."""
    from feeds.sources import read_options

    total = None if args.duration is None else args.warmup + args.duration
    if total is None and not args.data:
        total = args.warmup + 300.0  # the synthetic feed never ends
    insts = {s.instrument for s in config.sessions}
    # Tables without a symbol column hold the sessions' instrument when they share one.
    opts = read_options(args, instrument=next(iter(insts)) if len(insts) == 1 else "")
    events = list(feed_events(args.data or [], args.seed, total, opts))
    if not events:
        raise ValueError("the feed produced no events")
    cut = events[0].ts_recv + int(args.warmup * 1e9)
    warm = [ev for ev in events if ev.ts_recv < cut]
    timed = [ev for ev in events if ev.ts_recv >= cut]
    if len(timed) < 2:
        raise ValueError(f"the recording ends within the {args.warmup:g} s warm-up; lower --warmup")
    return warm, timed, (timed[-1].ts_recv - timed[0].ts_recv) / 1e9


def pool_cells(config: QueryConfig) -> int:
    """Sessions + a prefix-cache table each + a stateless table + branches."""
    return sum(2 * s.max_context_tokens for s in config.sessions) + max(s.max_context_tokens for s in config.sessions)


def new_engine(loaded, config: QueryConfig, sweep_context: int = 0, adapter: Any = None):
    """adapter: the `streamllm tune` adapter dir ours serves with (bench(): --adapter, else the config's)."""
    from streamllm.engine import Engine, EngineConfig

    return Engine(loaded, EngineConfig(max_cells=max(pool_cells(config), 4 * sweep_context) + 8192, branch_cells=8192, max_context=max([s.max_context_tokens for s in config.sessions] + [sweep_context])), adapter=adapter)


def ingest_capacity(loaded, config: QueryConfig, warm: list[Any], timed: list[Any],
                    feed_s: float, adapter: Any = None) -> tuple[float, float]:
    """The fastest speed (x real time) at which ours keeps up: each recorded batch is pushed and
    ingested + re-positioned before the next, over the first `feed_s` seconds of the paced part."""
    from streamllm.engine.prompt import PromptLayout

    window = [ev for ev in timed if ev.ts_recv - timed[0].ts_recv <= feed_s * 1e9]
    span = (window[-1].ts_recv - window[0].ts_recv) / 1e9
    batches: list[tuple[str, list[str]]] = []

    class Batches(TokenSink):
        def push(self, session, lines):
            if recording:
                batches.append((session, list(lines)))
            return super().push(session, lines)

    sink = Batches(PromptLayout(loaded.tokenizer), config)
    atts = list(attachments_for(config, sink).values())
    recording = False
    asyncio.run(_attach(warm, atts))
    warm_lines = {name: list(lines) for name, lines in sink.lines.items()}
    recording = True
    asyncio.run(_attach(window, atts))
    engine = new_engine(loaded, config, adapter=adapter)
    try:
        for s in config.sessions:
            engine.open_session(s.name, system=s.system_prompt, max_context=s.max_context_tokens)
            for q in s.questions:
                engine.register(s.name, q)
            if warm_lines[s.name]:  # the same history the live runs start from
                engine.push(s.name, warm_lines[s.name])
        engine.wait_idle()
        t0 = time.perf_counter()
        for session, lines in batches:
            engine.push(session, lines)
            engine.wait_idle()
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return (span / wall if wall > 0 else math.inf), span


async def _attach(events: list[Any], atts) -> None:
    from streamllm.feeding.attach import attach

    await attach(iter(events), atts)


def recorded_lines(loaded, config: QueryConfig, args: argparse.Namespace) -> tuple[list[str], str]:
    """The first session's lines over the whole recording (never padded), or the synthetic feed's."""
    from bench.common import market_lines
    from streamllm.engine.prompt import PromptLayout

    spec = config.sessions[0]
    if not args.data:
        lines = market_lines(args.seed, spec.render.bar_seconds or 5, (spec.instrument,))
        return [next(lines) for _ in range(args.sweep_lines)], "the embedded synthetic feed (no --data)"
    sink = TokenSink(PromptLayout(loaded.tokenizer), config)
    from feeds.sources import read_options

    insts = {s.instrument for s in config.sessions}
    opts = read_options(args, instrument=next(iter(insts)) if len(insts) == 1 else "")
    asyncio.run(_attach(list(feed_events(args.data, args.seed, None, opts)),
                        list(attachments_for(config, sink).values())))
    return sink.lines[spec.name], f"the recording ({len(sink.lines[spec.name])} lines of session {spec.name!r})"


def speeds_of(args: argparse.Namespace) -> tuple[list[float], bool]:
    """The swept speeds (1x always among them) and whether `auto` was asked for."""
    words = [w.strip() for w in args.speeds.split(",") if w.strip()]
    if args.speed is not None:
        words.append(args.speed)
    auto = "auto" in words
    try:
        speeds = {float(w) for w in words if w != "auto"}
    except ValueError as exc:
        raise ValueError(f"--speeds/--speed: {exc}; give numbers (x real time) or 'auto'") from None
    if any(s <= 0 for s in speeds):
        raise ValueError("--speeds: every speed must be positive (x real time)")
    if not speeds and not auto:
        raise ValueError("--speeds: give at least one speed")
    return sorted(speeds if args.no_realtime else speeds | {1.0}), auto


def bench(args: argparse.Namespace, model: Any = None) -> tuple[Run, dict[str, float]]:
    from streamllm.model import load_model
    from streamllm.model.adapter import pick_adapter

    config = load_config(args.questions)
    sizes = sorted(parse_ints(args.sweep)) if args.sweep else []
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "ours" not in systems:
        raise ValueError(f"--systems: {unknown or 'ours missing'}; choose from {', '.join(SYSTEMS)} (ours first)")
    speeds, auto = speeds_of(args)
    loaded = model if model is not None else load_model(args.model, progress=not args.no_progress)
    run = Run(model_name=loaded.name)
    # The heads `streamllm tune` made for this config, as serve would load them (the baselines answer from the LM).
    chosen = pick_adapter(args.adapter, config.adapter, loaded.name, warn=run.notes.append, config=config)
    adapter = None if chosen is None else str(chosen.path)
    warm, timed, run.feed_span_s = split_feed(args, config)
    if auto:
        capacity, measured_s = ingest_capacity(loaded, config, warm, timed, args.capacity_s, adapter)
        auto_speed = max(round(args.auto_fraction * capacity, 1), 0.1)
        run.capacity = (capacity, measured_s, auto_speed)
        run.notes.append(f"--speed auto: ours sustained {capacity:.1f}x real time over {measured_s:.0f} feed s "
                         f"(each batch ingested and re-positioned before the next); ran at {args.auto_fraction:g} "
                         f"of it, {auto_speed:g}x")
        speeds = sorted(set(speeds) | {auto_speed})
    run.speeds = speeds
    peer = None
    if "peer" in systems and not args.peer_url:
        systems.remove("peer")
    if args.peer_url:
        from streamllm.engine.prompt import PromptLayout

        peer = Peer(args.peer_url, loaded.tokenizer)
        spec = config.sessions[0]
        layout = PromptLayout(loaded.tokenizer)
        probe = layout.prefix_ids(spec.system_prompt) + layout.question_ids(spec.questions[0].text)
        run.peer_tokens_match = peer.tokens_match(probe)
        systems += [] if "peer" in systems else ["peer"]
    else:
        run.notes.append("no --peer-url: the peer (an OpenAI-compatible server such as llama-server) was skipped")
    meta = {"bench": "replay", "model": run.model_name, "command": args.command, "speeds": speeds,
            "between_asks": {s: BETWEEN_ASKS[s] for s in systems},
            "adapter": adapter, "adapter_id": None if chosen is None else chosen.id}
    for speed in speeds:
        window = run.feed_span_s / speed
        rate = args.rate or args.asks / window
        schedule = live_schedule(args.seed, rate, args.adhoc_rate, window, config)
        for system in systems:
            engine = new_engine(loaded, config, adapter=adapter)
            try:
                result = run_system(system, engine, config, warm, timed, speed, schedule, args, peer)
                engine.check_integrity()
            finally:
                engine.shutdown()
            run.runs.append(result)
            run.notes.extend(result.notes)
            if args.asks_out:
                _append_asks(args.asks_out, result)
            m = metrics_of(run)
            tag = speed_tag(speed)
            print(f"{system} @ {tag}x: {int(m[f'{system}_asks@{tag}'])} standing asks answered "
                  f"(+{int(m[f'{system}_adhoc_asks@{tag}'])} ad hoc, {int(m[f'{system}_unanswered@{tag}'])} "
                  f"unanswered), p50 {m[f'{system}_ms_p50@{tag}']:.1f} ms, accuracy "
                  f"{m[f'{system}_accuracy@{tag}']:.2f} in {result.wall_s:.0f} s", file=sys.stderr, flush=True)
            _write(args, m, meta)  # a run that dies later keeps what it measured
    if sizes:
        lines, source = recorded_lines(loaded, config, args)
        sweep_context = max(sizes) + 64 * args.sweep_reps + 512
        engine = new_engine(loaded, config, sweep_context, adapter)
        try:
            run.sweep = sweep_phase(engine, config, args, lines, source, sizes, sweep_context, peer)
            engine.check_integrity()
        finally:
            engine.shutdown()
        if run.sweep.stopped_at is not None:
            run.notes.append(f"the sweep stopped at {run.sweep.stopped_at} tokens: {source} holds no more")
    metrics = metrics_of(run)
    _write(args, metrics, meta)
    return run, metrics


def _append_asks(path: str, result: SystemRun) -> None:
    """One JSON line per ask of a system's run: the aggregates' raw material (what fired, when, right or not)."""
    with open(path, "a") as fh:
        for a in result.asks:
            fh.write(json.dumps({
                "system": a.system, "speed": result.speed, "index": a.index, "session": a.session,
                "question": a.question, "standing": a.spec is not None, "t_s": round(a.t0, 4),
                "ms": None if math.isnan(a.ms) else round(a.ms, 4), "path": a.path,
                "data_version": a.data_version, "pushed_at_ask": a.pushed_at_ask, "lag": a.lag, "text": a.text,
                "confidence": a.confidence, "truth": a.truth, "correct": a.correct, "error": a.error}) + "\n")


def _write(args: argparse.Namespace, metrics: dict[str, float], meta: dict) -> None:
    # JSON has no NaN: a metric this run could not define (no fast answers, no peer) is null.
    write_json(args.json, {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()},
               meta)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="*", help="raw captures (.gz) or trade/quote/bar tables; default: synthetic feed")
    p.add_argument("--questions", default="queries/crypto.toml", help="sessions and standing questions (TOML)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapter", help="ours serves with these `streamllm tune` heads (default: the config's [model] "
                                     "adapter when it was trained on --model)")
    p.add_argument("--seed", type=int, default=0, help="ask schedule (and synthetic feed) seed")
    p.add_argument("--quick", action="store_true", help="a one-minute version (CI): " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--speeds", default="1,10", help="replay paces, x real time; 'auto' measures ingest capacity")
    p.add_argument("--speed", help="one more pace (a number or 'auto'); 1x always runs too")
    p.add_argument("--no-realtime", action="store_true",
                   help="do not add the 1x point (tests on tables of long bars only; published runs keep 1x)")
    p.add_argument("--auto-fraction", type=float, default=0.5, help="--speed auto runs at this share of capacity")
    p.add_argument("--capacity-s", type=float, default=60.0, help="feed seconds the capacity measurement ingests")
    p.add_argument("--systems", default="ours,prefixcache,stateless,peer", help="systems to run (peer: --peer-url)")
    p.add_argument("--warmup", type=float, default=90.0, help="feed seconds pushed unpaced before the asks start")
    p.add_argument("--duration", type=float, help="feed seconds of the paced part (default: to the recording's end)")
    p.add_argument("--asks", type=int, default=330, help="standing asks per system per speed (sets the rate)")
    p.add_argument("--rate", type=float, help="standing asks per wall second (overrides --asks)")
    p.add_argument("--adhoc-rate", type=float, default=0.2, help="ad-hoc asks per wall second (Poisson)")
    p.add_argument("--adhoc-tokens", type=int, default=8, help="max_tokens of ad-hoc questions")
    p.add_argument("--stateless-every", type=int, default=10, help="stateless answers every k-th ask of the schedule")
    p.add_argument("--drain-s", type=float, default=60.0, help="after the feed ends, wait this long for answers")
    p.add_argument("--sweep", default="512,1024,2048,4096,8192", help="context sizes in tokens ('' to skip)")
    p.add_argument("--sweep-reps", type=int, default=4, help="new bars (each followed by every question) per size")
    p.add_argument("--sweep-lines", type=int, default=2000, help="synthetic lines for the sweep without --data")
    p.add_argument("--stateless-reps", type=int, default=3, help="stateless answers per size up to 2048 (1 above)")
    p.add_argument("--stateless-max", type=int, default=8192, help="largest sweep size stateless is run at")
    p.add_argument("--chunk", type=int, default=512, help="baselines' prefill chunk in tokens")
    p.add_argument("--peer-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8080 (make peer)")
    from streamllm.cli.common import add_read_args

    add_read_args(p)
    p.add_argument("--json", help="write the flat metrics here (rewritten as the run goes)")
    p.add_argument("--asks-out", help="append every ask of every system run here, one JSON line each")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for report.md and the PNG plots (default: ./{DEFAULT_OUT}/ in the working "
                        "directory, made if absent; a rerun overwrites its files)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (a run logged to a file: the per-system summary lines stay)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, `--quick` filled in; `args.out` the report folder (DEFAULT_OUT unless given)."""
    p = parser()
    args = p.parse_args(argv)
    if args.quick:  # quick values, unless given on the command line
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if args.sweep_reps < 1 or args.asks < 1 or args.stateless_every < 1:
        p.error("--sweep-reps, --asks and --stateless-every must be at least 1")
    args.command = "streamllm bench replay " + " ".join(argv)
    return args


def cli_main(argv: list[str]) -> int:
    from bench.report import write_report

    args = parse_args(argv)
    try:
        run, metrics = bench(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"streamllm bench replay: error: {exc}", file=sys.stderr)
        return 2
    path = write_report(Path(args.out), run, metrics, args)
    rows = []
    for speed in run.speeds:
        tag = speed_tag(speed)
        for s in SYSTEMS:
            if f"{s}_ms_p50@{tag}" in metrics:
                rows.append([f"{tag}x", s, metrics[f"{s}_ms_p50@{tag}"], metrics[f"{s}_ms_p99@{tag}"],
                             int(metrics[f"{s}_asks@{tag}"]), metrics[f"{s}_accuracy@{tag}"],
                             metrics[f"{s}_base_rate@{tag}"], "yes" if metrics[f"{s}_diverged@{tag}"] else "no"])
    print_table("live replay: standing asks (ms, from ask to answer)",
                ["speed", "system", "p50", "p99", "asks", "accuracy", "base rate", "diverged"], rows)
    ran = [s for s in SYSTEMS if any(f"{s}_ms_p50@{speed_tag(v)}" in metrics for v in run.speeds)]
    rows = per_question(metrics, run.speeds, ran)
    if rows:
        print_table("accuracy per question (base rate: always its most common truth, on ours' asks)",
                    ["speed", "question", "labelled", "base rate", *ran], rows)
    for note in run.notes:
        print(f"note: {note}")
    print(f"wrote {path}" + (f" and {args.json}" if args.json else ""))
    return 0
