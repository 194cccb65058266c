"""What a tuning run's windows are cut from: bar files and captures (PATH@FROM..TO time ranges),
seeded synthetic markets, --mix-as variants of --data, and the plan of windows over each.

Time split, per data file (no window straddles a boundary):

    bars: |------------- train (70%) -------------|-- dev (10%) --|---- later (20%) ----|
    --mix: |- train windows anywhere -|      (more markets, for training only: never judged on)
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feeds.bars import bars as to_bars
from feeds.bars import merge_bars
from feeds.events import Bar, Trade
from feeds.sources import file_format, open_source, read_options
from feeds.synthetic import SyntheticFeed
from streamllm.config import QuestionSpec, SessionSpec

if TYPE_CHECKING:
    import argparse

SPLIT = (0.7, 0.8)  # train | dev | later, as fractions of each data file's bars
# The sets a series card shows the base model's own answers on: those never trained or tuned on. Their
# windows run the whole model (decision points branch off them); the others stop at the tap layer.
BASE_MODEL_SETS = ("later", "other", "synthetic")


class TuneError(ValueError):
    """Arguments, config or data that a tuning run cannot start from."""


@dataclass(frozen=True, slots=True)
class WindowPlan:
    set: str  # train | dev | later | other | synthetic
    source: str  # data file name, or "synthetic:SYMBOL"
    start: int
    bars: int
    mixed: bool = False  # from a --mix source: trimmed to the session's context when its lines are longer
    teaches: tuple[str, ...] = ()  # question ids whose heads train on it (--mix-as ...,for=ID); empty: every one

    @property
    def key(self) -> str:
        stem = self.source.replace("/", "_").replace(":", "_")
        return f"{self.set}-{stem}-{self.start}-{self.bars}"


def read_opts(args: argparse.Namespace, **kw: Any) -> Any:
    """The shared read flags (feeds.sources.add_read_args) as ReadOptions; a bad --columns is a TuneError."""
    try:
        return read_options(args, **kw)
    except ValueError as exc:
        raise TuneError(str(exc)) from None


def load_bars(paths: list[str], *, opts: Any, bar_seconds: float) -> dict[str, list[Any]]:
    """Bars per source, each file read by feeds.sources.open_source as every other command reads it
    (`opts`: its ReadOptions). A file's own bars (bar tables, DBN OHLCV) are one source per instrument,
    at the interval they show; trades (Binance captures, trade tables, DBN trades) become bars of
    `bar_seconds` per symbol, a symbol's captures merged into one source."""
    out: dict[str, list[Any]] = {}
    trades: dict[str, list[Any]] = {}
    for name in sorted(paths):
        file, lo, hi = time_range(name)
        path = Path(file)
        if not path.is_file():
            raise TuneError(f"data file {path} does not exist")
        try:
            src = open_source(path, opts)
            events = list(src)
        except (OSError, ValueError, KeyError) as exc:
            raise TuneError(f"cannot read bars from {path}: {exc}") from exc
        for note in getattr(src, "notes", ()):
            print(f"note: {note}", file=sys.stderr)
        if src.stats.errors:  # rows or records the reader refused: said, never silently dropped
            print(f"{path}: {src.stats.errors} left out ({src.stats.error_kinds}), e.g. {src.stats.error_samples[0]}",
                  file=sys.stderr)
        bars_of: dict[str, list[Any]] = {}  # this file's bars and trades, by instrument
        trades_of: dict[str, list[Any]] = {}
        for ev in events:
            if isinstance(ev, Bar):
                bars_of.setdefault(ev.instrument, []).append(ev)
            elif isinstance(ev, Trade):
                trades_of.setdefault(ev.instrument, []).append(ev)
        if not bars_of and not trades_of:
            raise TuneError(f"{path}: no bars or trades to make bars of (it holds {_kinds(events)})")
        label = path.name + name[len(file):]
        for inst, evs in bars_of.items():  # one instrument keeps the file's name (and its windows' saved states)
            several = len(bars_of) > 1
            what = "bar" + (f" of {inst}" if several else "")
            out[label + (f":{inst}" if several else "")] = _in_range(name, what, evs, "ts_open", lo, hi)
        for inst, evs in trades_of.items():  # a symbol's captures are one source, as they were recorded
            group = f"capture:{inst}" if file_format(path) == "capture" else f"{label}:{inst}"
            what = "trade" + (f" of {inst}" if len(trades_of) > 1 else "")
            trades.setdefault(group, []).extend(_in_range(name, what, evs, "ts_event", lo, hi))
    for group, events in trades.items():
        events.sort(key=lambda t: t.ts_event)
        out[group] = list(to_bars(events, bar_seconds))
    return out


def _in_range(name: str, what: str, events: list[Any], at: str, lo: int, hi: int) -> list[Any]:
    """The events whose time `at` falls in [lo, hi), or an error saying what the file holds instead."""
    kept = [e for e in events if lo <= getattr(e, at) < hi]
    if not kept:
        raise TuneError(f"{name}: no {what} in that range (the file holds {_day(getattr(events[0], at))} to "
                        f"{_day(getattr(events[-1], at))})")
    return kept


def _kinds(events: list[Any]) -> str:
    kinds = sorted({type(ev).__name__.lower() + "s" for ev in events})
    return ", ".join(kinds) if kinds else "no events"


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


def describe(name: str, bars: list[Any]) -> str:
    """One line of what a source became: 'btc.csv: 44,640 bars of 60 s, 2022-01-01 to 2022-01-31'."""
    if not bars:
        return f"{name}: no bars"
    return (f"{name}: {len(bars):,} bars of {bars[0].interval_ns / 1e9:g} s, {_day(bars[0].ts_open)} to "
            f"{_day(bars[-1].ts_open)}")


def _day(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).date().isoformat()


def synthetic_bars(seed: int, bars_each: int, bar_seconds: float) -> dict[str, list[Any]]:
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
    volume: float = 1.0  # times the volume (another market's size unit: contracts, shares, ticks)
    bars: int = 1  # consecutive bars merged into one (another interval: larger moves per bar)
    every: int = 0  # seconds between the bars' stamps (86400: one line per day, each dated); 0: as merged
    # Question ids it teaches (for=ID+ID); empty: every labelled question. A variant can teach what one
    # question lacks without moving the others: only the named questions' fits (their training samples,
    # so their features and weight decay too) read its windows.
    only: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        kw: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = (x.strip() for x in part.partition("="))
            try:
                if not sep or key not in ("price", "volume", "bars", "every", "for"):
                    raise ValueError
                if key == "for":
                    kw["only"] = tuple(value.split("+"))
                    if not all(kw["only"]):
                        raise ValueError
                else:
                    kw[key] = float(value) if key in ("price", "volume") else int(value)
            except ValueError:
                raise TuneError(f"--mix-as {text!r}: write price=X[,volume=V][,bars=N][,every=SECONDS][,for=ID+ID], "
                                "e.g. price=0.003,bars=30,every=86400 or volume=1000,for=volume_spike") from None
        v = cls(**kw)
        if not all(x > 0 and math.isfinite(x) for x in (v.price, v.volume)) or v.bars < 1 or v.every < 0:
            raise TuneError(f"--mix-as {text!r}: need price > 0, volume > 0, bars >= 1 and every >= 0")
        return v

    def __str__(self) -> str:  # the source's name: the same bars keep their extracted states whatever `for=` says
        return (f"x{self.price:g}" + (f"-vol{self.volume:g}" if self.volume != 1 else "")
                + (f"-{self.bars}bars" if self.bars > 1 else "") + (f"-{self.every}s" if self.every else ""))

    def apply(self, bars: list[Any]) -> list[Any]:
        merged = bars if self.bars == 1 else [merge_bars(bars[i:i + self.bars])
                                              for i in range(0, len(bars) - self.bars + 1, self.bars)]
        if not merged:
            return []
        level = sorted(b.close for b in merged)[len(merged) // 2] * self.price
        dp = max(0, 6 - (math.floor(math.log10(level)) + 1))
        p, v, t0, step = self.price, self.volume, merged[0].ts_open, self.every * 1_000_000_000
        return [dataclasses.replace(b, open=b.open * p, high=b.high * p, low=b.low * p, close=b.close * p,
                                    vwap=b.vwap * p, px_dp=dp, volume=b.volume * v, buy_volume=b.buy_volume * v,
                                    sell_volume=b.sell_volume * v, **({} if not step else {
                                        "ts_open": t0 + i * step, "interval_ns": step, "ts_event": t0 + (i + 1) * step,
                                        "ts_recv": t0 + (i + 1) * step}))
                for i, b in enumerate(merged)]


def load_sources(args: argparse.Namespace, spec: SessionSpec, flag: str, items: list[str],
             windows: int) -> dict[str, list[Any]]:
    """Bars of bar tables and of "synthetic:SEED" markets (enough bars for `windows` windows in each
    time range), by source name. --data takes the session's instrument from a synthetic market; --mix
    takes every instrument it has (other price levels are what mixing is for)."""
    bar_s = float(spec.render.bar_seconds or 60)
    files = [d for d in items if not d.startswith("synthetic")]
    out = load_bars(files, opts=read_opts(args, instrument=spec.instrument), bar_seconds=bar_s)
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
                out.update((f"synthetic-{seed}:{name.partition(':')[2]}", bars) for name, bars in simulated.items())
                continue
            name = f"synthetic:{spec.instrument}"
            if name not in simulated:
                raise TuneError(f"{flag} {d}: the synthetic market has no {spec.instrument!r} "
                                f"(has {sorted(simulated)})")
            out[f"synthetic-{seed}:{spec.instrument}"] = simulated[name]
    return out


@dataclass(slots=True)
class Task:
    """One session of the config: its prompt, labelled questions, data and windows."""

    spec: SessionSpec
    questions: list[QuestionSpec]
    sources: dict[str, list[Any]]
    plans: list[WindowPlan]
    fingerprint: str = ""
    extractor: Any = None
