"""`streamllm tune`: teach the session model a config's labelled questions from recorded bars.

`--method series` (the default, minutes on a CPU) learns one series head per labelled
question: a readout over the session's last K lines, each line read as the residual
stream at one layer over its tokens (engine/taps.py, market/seriesfit.py). The model
reads the numbers; the head weighs them across lines, which a 135M model's single
decision-point state does not do well. `--method head` learns a readout W h + b over
the final normed hidden state h at the question's decision point (the LM head's rows
for its choices re-trained; convex, market/headfit.py). `--method lora` adapts the
model itself (market/tune_lora.py). States come from the engine's own prompt layout,
model, runner and KV store (streamllm/market/extract.py).

Time split, per data file (no window straddles a boundary):

    bars: |------------- train (70%) -------------|-- dev (10%) --|---- later (20%) ----|
           fit the heads                            L2, threshold    judged only
    --mix: |- train windows anywhere -|      (more markets, for training only: never judged on)

Judged as well on other instruments (`--judge` files: Binance captures or bar tables,
rendered into bars as the configs do) and on synthetic regimes (feeds/synthetic.py).
Every extracted window is checkpointed under OUT/states; `--resume` reuses them.
Writes OUT/head.safetensors (KBs), OUT/card.json and OUT/card.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamllm.config import ConfigError, QuestionSpec, SessionSpec, load_config, normalize_question
from streamllm.market.card import card_markdown

SPLIT = (0.7, 0.8)  # train | dev | later, as fractions of each data file's bars


class TuneError(ValueError):
    """Arguments, config or data that a tuning run cannot start from."""


@dataclass(frozen=True, slots=True)
class WindowPlan:
    set: str  # train | dev | later | other | synthetic
    source: str  # data file name, or "synthetic:SYMBOL"
    start: int
    bars: int
    mixed: bool = False  # from a --mix source: trimmed to the session's context when its lines are longer

    @property
    def key(self) -> str:
        stem = self.source.replace("/", "_").replace(":", "_")
        return f"{self.set}-{stem}-{self.start}-{self.bars}"


# -- data -----------------------------------------------------------------------------


def _columns(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise TuneError(f"--columns {pair!r}: write FIELD=COLUMN, e.g. ts_event=time")
        out[field] = column
    return out


def load_bars(paths: list[str], *, instrument: str | None, bar_seconds: float,
              columns: dict[str, str], time_format: str | None = None, tz: str | None = None) -> dict[str, list[Any]]:
    """Bars per source: a bar table is one source (at the interval its bars show); Binance captures
    become bars of `bar_seconds` per symbol."""
    from feeds.bars import bars as to_bars
    from feeds.events import Trade
    from feeds.sources import CaptureSource, TableSource, file_format

    out: dict[str, list[Any]] = {}
    trades: dict[str, list[Any]] = {}
    for name in sorted(paths):
        file, lo, hi = time_range(name)
        path = Path(file)
        if not path.is_file():
            raise TuneError(f"data file {path} does not exist")
        try:
            if file_format(path) == "capture":
                for ev in CaptureSource(path):
                    if isinstance(ev, Trade) and lo <= ev.ts_event < hi:
                        trades.setdefault(ev.instrument, []).append(ev)
            else:
                kw = {"instrument": instrument} if instrument else {}
                bars = TableSource(path, "bar", columns=columns, time_format=time_format, tz=tz,
                                   **kw).events()  # at its own interval
                kept = [b for b in bars if lo <= b.ts_open < hi]
                if bars and not kept:
                    raise TuneError(f"{name}: no bar in that range (the file holds "
                                    f"{_day(bars[0].ts_open)} to {_day(bars[-1].ts_open)})")
                out[path.name + name[len(file):]] = kept
        except (OSError, ValueError, KeyError) as exc:
            raise TuneError(f"cannot read bars from {path}: {exc}") from exc
    for symbol, events in trades.items():
        events.sort(key=lambda t: t.ts_event)
        out[f"capture:{symbol}"] = list(to_bars(events, bar_seconds))
    return out


def time_range(item: str) -> tuple[str, int, int]:
    """PATH@FROM..TO (ISO dates or times, UTC unless they say; either end may be left out) ->
    (PATH, from_ns, to_ns): bars that open in [FROM, TO). A plain PATH keeps every bar."""
    path, at, span = item.rpartition("@")
    if not at or ".." not in span:
        return item, -(2**63), 2**63 - 1
    ends = []
    for end, default in zip(span.split("..", 1), (-(2**63), 2**63 - 1), strict=True):
        if not end:
            ends.append(default)
            continue
        try:
            t = datetime.datetime.fromisoformat(end)
        except ValueError:
            raise TuneError(f"{item}: {end!r} is not an ISO date or time (write PATH@2013-04-01..2018-12-31)") from None
        t = t if t.tzinfo else t.replace(tzinfo=datetime.UTC)
        ends.append(int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000)
    if ends[0] >= ends[1]:
        raise TuneError(f"{item}: the range ends before it starts")
    return path, ends[0], ends[1]


def _day(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).date().isoformat()


def synthetic_bars(seed: int, bars_each: int, bar_seconds: float) -> dict[str, list[Any]]:
    from feeds.bars import bars as to_bars
    from feeds.events import Trade
    from feeds.synthetic import SyntheticFeed

    events = [e for e in SyntheticFeed(seed=seed).events(bars_each * bar_seconds) if isinstance(e, Trade)]
    out: dict[str, list[Any]] = {}
    for bar in to_bars(events, bar_seconds):
        out.setdefault(f"synthetic:{bar.instrument}", []).append(bar)
    return out


def plan_windows(name: str, n_bars: int, window: int, counts: dict[str, int], rng: random.Random,
                 whole: bool = False) -> list[WindowPlan]:
    """Non-overlapping windows inside each time range of one source (whole: training windows anywhere in it)."""
    plans = []
    bounds = {"train": (0, 1.0 if whole else SPLIT[0]), "dev": (SPLIT[0], SPLIT[1]), "later": (SPLIT[1], 1.0)}
    for set_name, count in counts.items():
        lo, hi = (int(f * n_bars) for f in bounds[set_name])
        slots = (hi - lo) // window
        if slots <= 0 or count <= 0:
            continue
        for slot in sorted(rng.sample(range(slots), min(count, slots))):
            plans.append(WindowPlan(set_name, name, lo + slot * window, window))
    return plans


def spread(n_bars: int, size: int, count: int) -> list[int]:
    """Starts of up to `count` non-overlapping windows of `size` bars spread evenly over a source
    (first and last slot included), so a long judged file is judged across its whole span."""
    slots = n_bars // size
    if slots <= 1 or count <= 1:
        return [0]
    picks = sorted({round(i * (slots - 1) / (min(count, slots) - 1)) for i in range(min(count, slots))})
    return [slot * size for slot in picks]


@dataclass(frozen=True, slots=True)
class Variant:
    """--mix-as: --data's training range as another market would show it. Every label is a comparison
    of prices or volumes within the window, and labels are computed from the variant's own bars."""

    price: float = 1.0  # times the price, quoted to 6 significant digits (another price level)
    bars: int = 1  # consecutive bars merged into one (another interval: larger moves per bar)
    every: int = 0  # seconds between the bars' stamps (86400: one line per day, each dated); 0: as merged

    @classmethod
    def parse(cls, text: str) -> Variant:
        kw: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            try:
                if not sep or key.strip() not in ("price", "bars", "every"):
                    raise ValueError
                kw[key.strip()] = float(value) if key.strip() == "price" else int(value)
            except ValueError:
                raise TuneError(f"--mix-as {text!r}: write price=X[,bars=N][,every=SECONDS], "
                                "e.g. price=0.003,bars=30,every=86400") from None
        v = cls(**kw)
        if not (v.price > 0 and math.isfinite(v.price)) or v.bars < 1 or v.every < 0:
            raise TuneError(f"--mix-as {text!r}: need price > 0, bars >= 1 and every >= 0")
        return v

    def __str__(self) -> str:
        return f"x{self.price:g}" + (f"-{self.bars}bars" if self.bars > 1 else "") + (f"-{self.every}s" if self.every else "")

    def apply(self, bars: list[Any]) -> list[Any]:
        from feeds.bars import merge_bars

        merged = bars if self.bars == 1 else [merge_bars(bars[i:i + self.bars])
                                              for i in range(0, len(bars) - self.bars + 1, self.bars)]
        if not merged:
            return []
        level = sorted(b.close for b in merged)[len(merged) // 2] * self.price
        dp = max(0, 6 - (math.floor(math.log10(level)) + 1))
        p, t0, step = self.price, merged[0].ts_open, self.every * 1_000_000_000
        return [dataclasses.replace(b, open=b.open * p, high=b.high * p, low=b.low * p, close=b.close * p,
                                    vwap=b.vwap * p, px_dp=dp, **({} if not step else {
                                        "ts_open": t0 + i * step, "interval_ns": step, "ts_event": t0 + (i + 1) * step,
                                        "ts_recv": t0 + (i + 1) * step}))
                for i, b in enumerate(merged)]


def _sources(args: argparse.Namespace, spec: SessionSpec, flag: str, items: list[str],
             windows: int) -> dict[str, list[Any]]:
    """Bars of bar tables and of "synthetic:SEED" markets (enough bars for `windows` windows in each
    time range), by source name. --data takes the session's instrument from a synthetic market; --mix
    takes every instrument it has (other price levels are what mixing is for)."""
    bar_s = float(spec.render.bar_seconds or 60)
    files = [d for d in items if not d.startswith("synthetic")]
    sources = load_bars(files, instrument=spec.instrument, bar_seconds=bar_s, columns=_columns(args.columns),
                        time_format=args.time_format, tz=args.tz)
    for d in items:  # "synthetic:SEED": the seeded synthetic market's bars for the session's instrument
        if d.startswith("synthetic"):
            try:
                seed = int(d.partition(":")[2] or 0)
            except ValueError:
                raise TuneError(f"{flag} {d}: write synthetic:SEED with an integer seed") from None
            if args.synthetic_bars > 0 and seed == args.seed + 1:
                raise TuneError(f"{flag} {d}: seed {seed} is the judged synthetic market (--seed + 1); use another")
            simulated = synthetic_bars(seed, windows * args.window * 2, bar_s)
            if flag == "--mix":
                sources.update((f"synthetic-{seed}:{name.partition(':')[2]}", bars) for name, bars in simulated.items())
                continue
            name = f"synthetic:{spec.instrument}"
            if name not in simulated:
                raise TuneError(f"{flag} {d}: the synthetic market has no {spec.instrument!r} "
                                f"(has {sorted(simulated)})")
            sources[f"synthetic-{seed}:{spec.instrument}"] = simulated[name]
    return sources


# -- the run ----------------------------------------------------------------------------


def _words(text: str) -> tuple[int | str, ...]:
    """--words: comma-separated distinct word indices >= 0 or prefixes ("" for none)."""
    from streamllm.engine.taps import check_words

    words = [w.strip() for w in text.split(",") if w.strip()]
    try:
        return check_words([int(w) if w.lstrip("-").isdigit() else w for w in words])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--words {text!r}: {exc} (e.g. 2, or 2,v)") from None


def _variant(text: str) -> Variant:
    try:
        return Variant.parse(text)
    except TuneError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm tune", description=__doc__.split("\n")[0])
    p.add_argument("--questions", required=True, help="config with labelled questions (queries/*.toml)")
    p.add_argument("--data", nargs="+", required=True,
                   help="bar tables (CSV/Parquet) to train and validate on, or synthetic:SEED (feeds/synthetic.py); "
                        "PATH@FROM..TO keeps the bars opening in that range (ISO dates, UTC; either end optional)")
    p.add_argument("--mix", nargs="+", default=[], metavar="DATA",
                   help="more markets for training only, as --data (e.g. synthetic:7 synthetic:8 "
                        "sp500.csv.gz@2013-04-01..): heads that have seen other price levels and line layouts "
                        "transfer better; never judged on")
    p.add_argument("--mix-as", nargs="+", type=_variant, default=[], metavar="SPEC",
                   help="train also on --data's training range as another market shows it: price=X (X times the "
                        "price, 6 significant digits), bars=N (N bars merged: larger moves), every=S (stamped S "
                        "seconds apart); e.g. price=0.00003 price=0.003,bars=30,every=86400; --mix-windows each")
    p.add_argument("--mix-windows", type=int, default=4,
                   help="training windows from each --mix source (each instrument of a synthetic market)")
    p.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    p.add_argument("--method", choices=("series", "head", "lora"), default="series",
                   help="series: a readout per question over the last lines' states (minutes on a CPU); head: over "
                        "the decision point's state; lora: peft's LoRA on the top layers")
    p.add_argument("--session", action="append", help="session of the config (repeatable; default: every session "
                                                      "with labelled questions)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="the forward's dtype for states (auto: the engine's default, so "
                                                   "heads train on the numbers they will read)")
    p.add_argument("--minutes", type=float, default=20.0, help="time budget; training windows stop when it is spent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="reuse the states already extracted under OUT/states")
    p.add_argument("--target-precision", type=float, default=0.9)
    p.add_argument("--columns", nargs="*", help="FIELD=COLUMN for bar tables whose columns are named otherwise")
    p.add_argument("--time-format", help="strftime format of --data/--mix tables' text times, e.g. '%%m/%%d/%%Y' "
                                         "(Yahoo's daily CSVs; ambiguous dates are never guessed; ISO 8601 "
                                         "tables it does not fit read as ISO)")
    p.add_argument("--tz", help="zone of bar tables' times written without one (default UTC)")
    p.add_argument("--window", type=int, default=160, help="bars per window (one session each)")
    p.add_argument("--stride", type=int, default=2, help="a decision point every STRIDE bars")
    p.add_argument("--train-windows", type=int, default=16)
    p.add_argument("--dev-windows", type=int, default=3)
    p.add_argument("--later-windows", type=int, default=4)
    p.add_argument("--judge", nargs="*", default=[], help="other instruments: Binance captures (.gz) or bar tables (as --data, PATH@FROM..TO too)")
    p.add_argument("--judge-bar-seconds", type=float, help="bar interval for --judge captures (default: the session's; "
                                                           "bar tables keep their own)")
    p.add_argument("--judge-time-format", help="as --time-format, for --judge tables")
    p.add_argument("--judge-windows", type=int, default=1,
                   help="windows per --judge source, spread evenly over it (a capture is usually one)")
    p.add_argument("--synthetic-bars", type=int, default=160, help="synthetic bars per instrument (0: none)")
    p.add_argument("--judge-bars", type=int, help="bars per --judge / synthetic window (default: --window)")
    series = p.add_argument_group("--method series")
    series.add_argument("--tap-layer", type=int, default=12, help="read each line's residual stream after this layer")
    series.add_argument("--lines", type=int, default=24, help="lines a head reads (at least the labels' history)")
    series.add_argument("--series-rank", type=int, default=8, help="numbers a head takes from each line")
    series.add_argument("--words", type=_words, default=(2, "v"), metavar="I,J",
                        help="words whose last token each line's features add: an index, or a prefix for the "
                             "line's first word that starts with it (default 2,v: a bar line's change and volume, "
                             "`23:02 46411 +34 h+5 v1.83M`); empty for [mean, last] only")
    lora = p.add_argument_group("--method lora")
    lora.add_argument("--lora-layers", type=int, default=8, help="adapt the top N layers (the rest run once per window)")
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--alpha", type=float, default=16.0)
    lora.add_argument("--lr", type=float, default=3e-4)
    lora.add_argument("--points", type=int, default=48, help="decision points per step")
    lora.add_argument("--kl", type=float, default=0.1, help="weight of the KL term to the base model")
    lora.add_argument("--eval-every", type=int, default=20, help="steps between dev evaluations (early stopping)")
    lora.add_argument("--max-steps", type=int, help="stop after this many steps even with budget left")
    p.add_argument("--no-progress", action="store_true")
    return p


def _sessions(config: Any, names: list[str] | None) -> list[SessionSpec]:
    try:
        specs = [config.session(n) for n in names] if names else list(config.sessions)
    except KeyError as exc:
        raise TuneError(str(exc.args[0])) from None
    specs = [s for s in specs if any(q.label is not None and q.choices for q in s.questions)]
    if not specs:
        raise TuneError(f"{config.source}: no session with labelled questions to tune")
    for spec in specs:
        if spec.render.mode != "bars":
            raise TuneError(f"session {spec.name!r} renders {spec.render.mode!r}; tune trains on bars")
    return specs


@dataclass(slots=True)
class Task:
    """One session of the config: its prompt, labelled questions, data and windows."""

    spec: SessionSpec
    questions: list[QuestionSpec]
    sources: dict[str, list[Any]]
    plans: list[WindowPlan]
    fingerprint: str = ""
    extractor: Any = None


def _plan(args: argparse.Namespace, spec: SessionSpec, rng: random.Random) -> Task:
    questions = [q for q in spec.questions if q.label is not None and q.choices]
    history = max(q.label.bars_needed for q in questions)
    if args.window <= history:
        raise TuneError(f"--window {args.window} leaves no decision point after the labels' {history}-bar history")
    bar_s = float(spec.render.bar_seconds or 60)
    sources = _sources(args, spec, "--data", args.data, args.train_windows + args.dev_windows + args.later_windows)
    plans: list[WindowPlan] = []
    for name, bars in sources.items():
        plans += plan_windows(name, len(bars), args.window, {"train": args.train_windows, "dev": args.dev_windows,
                                                              "later": args.later_windows}, rng)
    # --mix: more markets for training only (never dev or later: those judge --data's own later range).
    mixed = _sources(args, spec, "--mix", args.mix, args.mix_windows)
    tables = {name for name in mixed if not name.startswith("synthetic-")}
    for name, bars in list(sources.items()):  # --mix-as: --data's own training range as other markets show it
        for variant in args.mix_as:
            mixed[f"{name}@{variant}"] = variant.apply(bars[: int(SPLIT[0] * len(bars))])
    for name, bars in mixed.items():
        if name in sources:
            raise TuneError(f"--mix {name} is also in --data")
        # A table draws its windows from its own generator, so adding one moves no other window
        # (and no other window's extracted states).
        draw = random.Random(f"{args.seed}:{name}") if name in tables else rng
        train = [dataclasses.replace(p, mixed=True) for p in
                 plan_windows(name, len(bars), args.window, {"train": args.mix_windows}, draw, whole=True)]
        if not train:
            raise TuneError(f"--mix {name}: {len(bars)} bars hold no window of {args.window}")
        plans += train
    sources.update(mixed)
    if not any(p.set == "train" for p in plans) or not any(p.set == "dev" for p in plans):
        raise TuneError(f"--data has too few bars for train and dev windows of {args.window} bars")
    judged = load_bars(args.judge, instrument=None, bar_seconds=args.judge_bar_seconds or bar_s, columns={},
                       time_format=args.judge_time_format, tz=args.tz)
    if args.synthetic_bars > 0:  # judged on the market of seed --seed + 1 (never a training one)
        judged.update(synthetic_bars(args.seed + 1, args.synthetic_bars, bar_s))
    for name, bars in judged.items():
        size = min(len(bars), args.judge_bars or args.window)
        if size <= history:
            continue
        synthetic = name.startswith("synthetic")
        plans += [WindowPlan("synthetic" if synthetic else "other", name, start, size)
                  for start in spread(len(bars), size, 1 if synthetic else args.judge_windows)]
    sources.update(judged)
    return Task(spec, questions, sources, plans)


def run(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from tqdm import tqdm

    from streamllm.market.extract import StateExtractor, WindowStates
    from streamllm.model.loader import load_model

    if not 0 < args.target_precision <= 1:
        raise TuneError(f"--target-precision must be in (0, 1], got {args.target_precision}")
    if args.window < 2 or args.stride < 1 or args.minutes <= 0 or args.judge_windows < 1:
        raise TuneError("need --window >= 2, --stride >= 1, --minutes > 0 and --judge-windows >= 1")
    if args.method == "series" and (args.lines < 1 or args.series_rank < 1 or args.window <= args.lines):
        raise TuneError(f"--method series needs --lines >= 1, --series-rank >= 1 and --window > --lines "
                        f"(got {args.lines}, {args.series_rank}, {args.window})")
    t0 = time.perf_counter()
    config = load_config(args.questions)
    rng = random.Random(args.seed)
    tasks = [_plan(args, spec, rng) for spec in _sessions(config, args.session)]
    # The budget cuts training windows only; the judged sets after them are small and always run.
    order = {"dev": 0, "later": 1, "train": 2, "other": 3, "synthetic": 4}
    # Sessions interleaved within each set, so a spent budget leaves every session some training windows.
    work = sorted(((t, p) for t in tasks for p in t.plans),
                  key=lambda tp: (order[tp[1].set], tp[0].plans.index(tp[1]), tasks.index(tp[0])))

    loaded = loaded if loaded is not None else load_model(args.model, progress=not args.no_progress)
    states_dir = args.out / "states"
    if states_dir.exists() and not args.resume:
        for f in states_dir.glob("*.pt"):
            f.unlink()
    states_dir.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        tap = [args.tap_layer, list(args.words)] if args.method == "series" else None
        t.fingerprint = hashlib.sha256(json.dumps([loaded.name, t.spec.system_prompt, args.stride, tap, [
            (q.id, q.text, q.choices, q.label.text) for q in t.questions]]).encode()).hexdigest()[:12]
    if args.method == "lora":
        return _lora(args, loaded, tasks, t0)
    layers = loaded.config.num_hidden_layers
    if args.method == "series" and not 0 <= args.tap_layer <= layers:
        raise TuneError(f"--tap-layer {args.tap_layer} is outside 0..{layers} ({loaded.name} has {layers} layers)")
    for t in tasks:
        history = max(q.label.bars_needed for q in t.questions)
        if args.method == "series" and args.lines < history:
            raise TuneError(f"--lines {args.lines} is shorter than the labels' {history}-bar history "
                            f"(session {t.spec.name})")
    for t in tasks:
        t.extractor = StateExtractor(loaded, t.spec, t.questions, max_window_tokens=max(8192, t.spec.max_context_tokens),
                                     tap_layer=args.tap_layer if args.method == "series" else None, dtype=args.dtype,
                                     words=args.words if args.method == "series" else ())
    work = [(t, _fitted(t, p, args)) for t, p in work]  # checked before any extraction, not 20 minutes in
    work = [(t, p) for t, p in work if p is not None]
    got: dict[tuple[str, WindowPlan], WindowStates] = {}
    budget_s = args.minutes * 60
    tokens, spent = 0, False
    bar = tqdm(work, desc="extract", unit="window", disable=args.no_progress)
    for task, plan in bar:
        path = states_dir / f"{plan.key}-{task.fingerprint}.pt"
        if path.is_file():
            got[task.spec.name, plan] = WindowStates.from_dict(torch.load(path))
            continue
        if plan.set == "train" and time.perf_counter() - t0 > budget_s and any(p.set == "train" for _, p in got):
            if not spent:
                bar.write(f"time budget {args.minutes:g} min spent: stopping at "
                          f"{sum(p.set == 'train' for _, p in got)} train windows")
            spent = True
            continue
        window = task.sources[plan.source][plan.start: plan.start + plan.bars]
        try:
            states = task.extractor.extract(window, stride=args.stride)
        except ValueError as exc:  # a window longer than the session's context
            raise TuneError(f"{plan.set} window {plan.key}: {exc}; use a smaller --window") from None
        torch.save(states.to_dict(), path)  # the checkpoint: --resume starts after it
        got[task.spec.name, plan] = states
        tokens += states.tokens
        bar.set_postfix(set=plan.set, tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return _fit_and_write(args, loaded, tasks, got, time.perf_counter() - t0, tokens, t0)


def _fitted(task: Task, plan: WindowPlan, args: argparse.Namespace) -> WindowPlan | None:
    """The plan if its window fits the session's context; a --mix window is trimmed to the bars that
    fit (another market's lines may be longer: the synthetic one writes trade counts and buy shares),
    or dropped when too few would; any other window over it is an error, before anything is extracted."""
    from streamllm.market.extract import render_window

    limit = task.extractor.max_window_tokens
    lines = render_window(task.sources[plan.source][plan.start: plan.start + plan.bars])
    ids, ends = task.extractor.session_ids(lines)
    if len(ids) <= limit:
        return plan
    if not plan.mixed:
        raise TuneError(f"{plan.set} window {plan.key}: {plan.bars} bars are {len(ids)} tokens, over the "
                        f"session's {limit}; use a smaller --window")
    fit = sum(1 for end in ends if end <= limit)
    history = max(q.label.bars_needed for q in task.questions)
    if fit <= max(history, args.lines if args.method == "series" else 0):
        print(f"streamllm tune: --mix window {plan.key} skipped: only {fit} bars fit {limit} tokens", file=sys.stderr)
        return None
    return dataclasses.replace(plan, bars=fit)


def _lora(args: argparse.Namespace, loaded: Any, tasks: list[Task], t0: float) -> dict[str, Any]:
    from streamllm.market.tune_lora import run_lora
    from streamllm.model.adapter import CARD_FILE

    # The lower layers' states depend on these; the adapter's training settings do not.
    fingerprint = f"L{args.lora_layers}"
    try:
        card = run_lora(args, loaded, tasks, t0, fingerprint)
    except ValueError as exc:
        raise TuneError(str(exc)) from exc
    card["split"] = {"train": [0, SPLIT[0]], "dev": list(SPLIT), "later": [SPLIT[1], 1]}
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    return card


def _groups(tasks: list[Task]) -> list[tuple[str, QuestionSpec, list[tuple[str, str]]]]:
    """Questions by (text, choices, label) across sessions: one head each, trained on all their states
    (the engine matches a head by text and choices, so every session asking it gets the same head)."""
    groups: dict[tuple, tuple[QuestionSpec, list[tuple[str, str]]]] = {}
    for t in tasks:
        for q in t.questions:
            key = (normalize_question(q.text), q.choices, q.label.text)
            groups.setdefault(key, (q, []))[1].append((t.spec.name, q.id))
    ids = [q.id for q, _ in groups.values()]
    return [(q.id if ids.count(q.id) == 1 else f"{members[0][0]}.{q.id}", q, members)
            for q, members in groups.values()]


def in_set(plan: WindowPlan, set_name: str) -> bool:
    """"other/SOURCE" names one judged source inside the "other" set."""
    return plan.set == set_name or f"{plan.set}/{plan.source}" == set_name


def _gather(got: dict, set_name: str, members: list[tuple[str, str]], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [(s.features[qid], s.labels[qid]) for (session, p), s in got.items() if in_set(p, set_name)
             for name, qid in members if name == session]
    if not parts:
        return torch.empty(0, hidden), torch.empty(0, dtype=torch.long)
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _base_logits(extractor: Any, q: QuestionSpec, x: torch.Tensor) -> torch.Tensor:
    """The base model's own choice scores at the same states (the gate's rule, on its LM head rows)."""
    from streamllm.market.lora import ChoiceScorer

    return ChoiceScorer([q], extractor.layout.tokenizer)(q.id, x, extractor.model.lm_head)


def _fit_entry(args, head_id, q, members, got, sets, hidden):
    """An entry head: logistic regression on the decision points' states."""
    from streamllm.market.headfit import calibrate_threshold, fit_head
    from streamllm.model.adapter import ChoiceHead

    x, y = _gather(got, "train", members, hidden)
    xd, yd = _gather(got, "dev", members, hidden)
    fit = fit_head(x, y, xd, yd, len(q.choices))
    threshold = calibrate_threshold(xd @ fit.weight.T + fit.bias, yd, args.target_precision)
    head = ChoiceHead(head_id, q.text, q.choices, fit.weight, fit.bias, threshold)

    def scores(set_name):
        xs, ys = _gather(got, set_name, members, hidden)
        return head.logits(xs), ys

    return head, {"l2": fit.l2, "train_samples": len(y), "steps": fit.steps}, scores


def _fit_series(args, head_id, q, members, got, sets, hidden):
    """A series head: every bar of every window, read over its last --lines lines (market/seriesfit.py),
    or over all of a window's first lines once its label is known (a session's start, as served)."""
    from streamllm.market.headfit import calibrate_threshold
    from streamllm.market.seriesfit import feature_sets, fit_series, samples
    from streamllm.model.adapter import SeriesHead

    def gather(set_name, least=1):
        return samples([(st.lines, st.line_labels[qid]) for (session, p), st in got.items() if in_set(p, set_name)
                        for name, qid in members if name == session], args.lines, least)

    train, dev = gather("train"), gather("dev")
    fit = fit_series(train, dev, len(q.choices), k=args.lines, rank=args.series_rank, seed=args.seed,
                     sets=feature_sets(hidden, len(args.words)))
    least = int(train.reads.min())  # the label's history: fewer lines never had a label to learn from
    head = SeriesHead(head_id, q.text, q.choices, args.tap_layer, fit.proj, fit.proj_bias, fit.lags, fit.bias,
                      math.inf, tuple(args.words), least if least < args.lines else 0)
    head.threshold = calibrate_threshold(dev.logits(head), dev.labels, args.target_precision)

    judged = functools.cache(lambda set_name: gather(set_name, least))  # both views of a set, gathered once

    def scores(set_name, first_lines=False):  # judged through the served head itself: the engine's numbers
        got_set = judged(set_name)
        got_set = got_set.subset((got_set.reads < args.lines) == first_lines)
        return got_set.logits(head), got_set.labels

    return head, {"weight_decay": fit.weight_decay, "features": fit.features, "train_samples": len(train),
                  "min_lines": least, "steps": fit.steps, "dev_loss": round(fit.dev_loss, 4)}, scores


def _fit_and_write(args, loaded, tasks, got, extract_s, tokens, t0) -> dict[str, Any]:
    from streamllm.market.headfit import judge
    from streamllm.model.adapter import CARD_FILE, save_heads

    hidden = loaded.config.hidden_size
    heads, report, steps = [], {}, 0
    sets = [s for s in ("dev", "later", "other", "synthetic") if any(p.set == s for _, p in got)]
    judged_sources = sorted({p.source for _, p in got if p.set == "other"})
    if len(judged_sources) > 1:  # each other market on its own too: a pooled figure can hide one
        sets[sets.index("other") + 1:sets.index("other") + 1] = [f"other/{src}" for src in judged_sources]
    for head_id, q, members in _groups(tasks):
        if args.method == "series":
            head, entry, scores = _fit_series(args, head_id, q, members, got, sets, hidden)
        else:
            head, entry, scores = _fit_entry(args, head_id, q, members, got, sets, hidden)
        steps += entry.pop("steps")
        heads.append(head)
        entry.update({"label": q.label.text, "choices": list(q.choices), "sessions": [m[0] for m in members],
                      "judged": {}, "base_model": {},
                      "threshold": None if math.isinf(head.threshold) else round(head.threshold, 4)})
        for s in sets:
            logits, ys = scores(s)
            entry["judged"][s] = judge(logits, ys, q.choices, head.threshold, args.target_precision)
            if args.method == "series":  # a session's first lines, apart: the main figures stay whole windows
                logits, ys = scores(s, first_lines=True)
                if len(ys):
                    entry.setdefault("first_lines", {})[s] = judge(logits, ys, q.choices, head.threshold,
                                                                   args.target_precision)
            xs, ys = _gather(got, s, members, hidden)  # the base model at the decision points
            entry["base_model"][s] = judge(_base_logits(tasks[0].extractor, q, xs), ys, q.choices, math.inf,
                                           args.target_precision)
        report[head_id] = entry
    path = save_heads(args.out, heads, model=loaded.name)
    card = {
        "method": args.method, "model": loaded.name, "dtype": tasks[0].extractor.model.dtype_choice.name, "config": str(args.questions), "sessions": [t.spec.name for t in tasks],
        "data": [str(d) for d in args.data], "mix": [str(d) for d in args.mix] + [f"--data as {v}" for v in args.mix_as],
        "judge": [str(d) for d in args.judge], "seed": args.seed,
        "window_bars": args.window, "stride": args.stride, "split": {"train": [0, SPLIT[0]], "dev": list(SPLIT),
                                                                     "later": [SPLIT[1], 1]},
        "windows": {s: sorted(f"{n}/{p.key}" for n, p in got if p.set == s) for s in ("train", *sets) if "/" not in s},
        "decision_points": {s: sum(len(y) for (_, p), st in got.items() if in_set(p, s) for y in st.labels.values())
                            for s in ("train", *sets)},
        "target_precision": args.target_precision, "fit_steps": steps, "tokens_extracted": tokens,
        "tokens_all_windows": sum(st.tokens for st in got.values()),  # this run's and --resume'd checkpoints
        "minutes": round((time.perf_counter() - t0) / 60, 2), "extract_minutes": round(extract_s / 60, 2),
        "adapter_bytes": path.stat().st_size, "questions": report,
    }
    if args.method == "series":
        card["series"] = {"tap_layer": args.tap_layer, "lines": args.lines, "rank": args.series_rank,
                          "words": list(args.words)}
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    return card


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        card = run(args)
    except (TuneError, ConfigError) as exc:
        print(f"streamllm tune: error: {exc}", file=sys.stderr)
        return 2
    print(card_markdown(card))
    made = "lora/ (peft)" if card["method"] == "lora" else "head.safetensors"
    print(f"wrote {args.out}/{made}, card.json, card.md")
    return 0
