"""`streamllm demo`: the whole loop on the embedded default, no network, no recorded data.

`--config FILE` runs that config's sessions on their own feeds: the synthetic market, or
recorded files (`replay:`/`csv:` feeds, paced at --speed); a feed that needs the network
(a venue, cryptofeed) is refused before the model loads: `streamllm serve` runs those.

synthetic feed -> 5 s bars -> sessions (one per instrument) -> standing questions,
pre-positioned after every bar -> standing answers shown live as they change, plus a
question asked now and then on each path (fast, entry, cold) with its latency. Every answer
that has a ground truth is shown beside it: labelled choices are scored live by the engine,
and the free-text number questions (the last close, the highest close) against the bars the
answer's data version holds, so a fast wrong answer shows as wrong.
"""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feeds.events import Bar
from feeds.synthetic import SyntheticFeed
from streamllm.client.cells import calibration_cells, percent
from streamllm.config import LIVE_VENUES, QueryConfig, load_config
from streamllm.engine import Engine, EngineConfig, decode_note
from streamllm.feeding.attach import Attachment, AttachSpec, attach
from streamllm.feeding.render import fixed
from streamllm.feeding.wiring import FeedGroup, attach_mode, feed_events, group_feeds
from streamllm.model.adapter import pick_adapter
from streamllm.model.loader import load_model

if TYPE_CHECKING:
    import argparse

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "queries" / "demo.toml"
ADHOC = "What was the highest close so far? Answer with the number only."
ADHOC_TOKENS = 24  # SmolLM2 writes a number digit by digit: "The highest close so far is 60083.67" is 17
# Free-text questions whose truth the demo knows: the standing last_close (demo.toml) and ADHOC.
FREE_TEXT_TRUTHS = {"last_close": "last", ADHOC: "high"}
NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def open_from_config(engine: Engine, config: QueryConfig) -> None:
    for s in config.sessions:
        system = s.system_prompt.format(instrument=s.instrument) if s.system_prompt else None
        kw = {"system": system} if system else {}
        engine.open_session(s.name, max_context=s.max_context_tokens, **kw)
        for q in s.questions:
            engine.register(s.name, q)


@dataclass
class Witness(Attachment):
    """An attachment that also keeps, for each data version it pushed, the last and the highest
    close of the bars in the session so far: the truth of the demo's free-text number questions."""

    closes: dict[int, tuple[float, float, int]] = field(default_factory=dict)  # version -> (last, high, dp)
    _last: float = math.nan
    _high: float = -math.inf
    _dp: int = 0

    def _saw_bar(self, bar: Bar) -> None:
        super()._saw_bar(bar)
        if bar.trades != 0:  # an empty interval's bar repeats the last close (-1: a table's bar, count unknown)
            self._last, self._high, self._dp = bar.close, max(self._high, bar.close), max(self._dp, bar.px_dp)

    def flush(self):
        ack = super().flush()  # every bar seen so far is in the lines it pushed (or coalesced into them)
        if ack is not None and not math.isnan(self._last):
            self.closes[ack.data_version] = (self._last, self._high, self._dp)
        return ack

    def truth(self, question: str, version: int) -> str | None:
        """The right number for a free-text question at `version`, as a bar line writes it; None if unknown."""
        kind, seen = FREE_TEXT_TRUTHS.get(question), self.closes.get(version)
        if kind is None or seen is None:
            return None
        last, high, dp = seen
        return fixed(last if kind == "last" else high, dp)


def names_number(text: str, truth: str) -> bool:
    """Whether the answer names the true number (any of its numbers, thousands commas allowed)."""
    want = float(truth)
    for token in NUMBER.findall(text):
        try:
            if math.isclose(float(token.replace(",", "")), want, rel_tol=0, abs_tol=1e-9 * max(1.0, abs(want))):
                return True
        except ValueError:  # "1,2.3" and the like: not a number
            continue
    return False


def offline_groups(config: QueryConfig) -> list[FeedGroup]:
    """The config's feeds, each one the demo can run without the network; ValueError names any other."""
    groups = group_feeds(config, None)
    for g in groups:
        if g.feed.kind in LIVE_VENUES or g.feed.kind == "cryptofeed":
            names = ", ".join(s.name for s in g.sessions)
            raise ValueError(f"{config.source}: session(s) {names} take feed {g.feed}, which needs the network; the "
                             "demo runs offline: run that config with `streamllm serve --config FILE`, or give the "
                             "sessions feed = \"synthetic\" or a recorded file (replay:FILE, csv:FILE)")
        missing = [p for p in str(g.feed.path).split(",") if not Path(p).is_file()] if g.feed.path is not None else []
        if missing:
            raise ValueError(f"{config.source}: feed {g.feed}: no file {', '.join(missing)}")
    return groups


async def _until(events: AsyncIterator[Any], duration_s: float) -> AsyncIterator[Any]:
    """A recorded feed's events for `duration_s` wall seconds at most (or until the file ends)."""
    stop = time.monotonic() + duration_s
    async for ev in events:
        if time.monotonic() >= stop:
            break
        yield ev


async def _feed(group: FeedGroup, attachments: list[Witness], speed: float, duration_s: float,
                seed: int) -> list[Witness]:
    if group.feed.kind == "synthetic":
        events: AsyncIterator[Any] = SyntheticFeed(seed=seed).aevents(duration_s=duration_s * speed, speed=speed)
    else:
        events = _until(feed_events(group, speed, seed), duration_s)
    await attach(events, attachments)
    return attachments


class Display:
    """Live table on a terminal; one line per change otherwise (logs, CI)."""

    def __init__(self, engine: Engine, config: QueryConfig, live: bool) -> None:
        self.engine = engine
        self.config = config
        self.t0 = time.monotonic()
        self.asks: list[tuple[str, str, str, float, int, str, str]] = []  # ... text, verdict ("" if no truth)
        self.judged: list[tuple[str, str, bool]] = []  # free-text asks with a truth: session, question, right
        self.live = None
        if live:
            from rich.live import Live

            self.live = Live(self.table(), refresh_per_second=2, transient=False)

    def table(self):
        from rich.table import Table

        t = Table(title=f"streamllm demo: standing answers ({self.engine.model_name})", expand=False)
        for col in ("session", "question", "answer", "path", "gap", "right (live)", "version", "age / latency"):
            t.add_column(col)
        now = time.time()
        for s in self.config.sessions:
            for a in self.engine.standing(s.name):
                t.add_row(s.name, a.question_id, a.text[:40], a.path, f"{a.confidence:.2f}", _right(a.calibration),
                          str(a.data_version), f"{now - a.updated_at:.1f} s old")
        for session, question, path, ms, version, text, verdict in self.asks[-6:]:
            t.add_row(session, f"ask: {question[:30]}", text[:40], path, "", verdict, str(version), f"took {ms:.2f} ms")
        return t

    def on_change(self, answer) -> None:
        if self.live is None:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {answer.session}/{answer.question_id} -> "
                  f"{answer.text!r} ({answer.path}, gap {answer.confidence:.2f}, v{answer.data_version})", flush=True)

    def on_ask(self, session: str, question: str, answer, truth: str | None = None) -> None:
        verdict = ""
        if truth is not None:
            right = names_number(answer.text, truth)
            self.judged.append((session, question, right))
            verdict = f"{'right' if right else 'wrong'}: {truth}"
        self.asks.append((session, question, answer.path, answer.latency_ms, answer.data_version, answer.text,
                          verdict))
        if self.live is None:
            print(f"[{time.monotonic() - self.t0:6.1f}s] ask {session}: {question!r} -> {answer.text!r} "
                  f"[{answer.path}, {answer.latency_ms:.2f} ms, {answer.tokens_computed} tokens computed, "
                  f"v{answer.data_version}]" + (f" {verdict}" if verdict else ""), flush=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.table())


async def _asker(engine: Engine, config: QueryConfig, display: Display, every_s: float,
                 witnesses: dict[str, Witness]) -> None:
    """Now and then ask each session a standing question and an ad-hoc one."""
    i = 0
    while True:
        await asyncio.sleep(every_s)
        for s in config.sessions:
            if engine.session_info(s.name).data_version == 0 or not s.questions:
                continue
            q = s.questions[i % len(s.questions)]
            for question, kw in ((q.id, {}), (ADHOC, {"max_tokens": ADHOC_TOKENS})):
                answer = await engine.ask_async(s.name, question, **kw)
                display.on_ask(s.name, question, answer, witnesses[s.name].truth(question, answer.data_version))
        i += 1


async def _run(engine: Engine, config: QueryConfig, args: argparse.Namespace) -> Display:
    display = Display(engine, config, live=args.live)
    for s in config.sessions:
        engine.subscribe(s.name, display.on_change)
    if display.live is not None:
        display.live.start()
    groups = offline_groups(config)
    witnesses = {s.name: Witness(engine, AttachSpec.of(s, mode=attach_mode(g.feed, s)), questions=s.questions)
                 for g in groups for s in g.sessions}
    asker = asyncio.create_task(_asker(engine, config, display, args.ask_every, witnesses))
    try:
        feed = asyncio.gather(*(_feed(g, [witnesses[s.name] for s in g.sessions], args.speed, args.duration, args.seed)
                                for g in groups))
        while not feed.done():
            display.refresh()
            await asyncio.sleep(0.5)
        attachments = [a for fed in feed.result() for a in fed]
        await asyncio.to_thread(engine.wait_idle, 60)
        display.refresh()
    finally:
        asker.cancel()
        if display.live is not None:
            display.live.stop()
    for a in attachments:
        st = a.stats
        print(f"{a.spec.session}: {st.events_in} events in, {st.lines_pushed} lines pushed "
              f"({st.ignored} other instruments/quotes, {a.pending_events} pending); every event accounted: "
              f"{a.accounted() == st.events_in}")
    return display


def _summary(engine: Engine, display: Display) -> None:
    by_path: dict[str, list[float]] = {}
    for _, _, path, ms, *_ in display.asks:
        by_path.setdefault(path, []).append(ms)
    print("\nasks by path: " + ", ".join(
        f"{p}: {len(v)} asks, median {statistics.median(v):.2f} ms" for p, v in sorted(by_path.items())))
    if display.judged:
        right = sum(r for *_, r in display.judged)
        print(f"free-text number asks: right {right} of {len(display.judged)} (the closes the bars held; "
              "a 135M model reads few numbers back: the choice questions are what its heads were tuned for)")
    stats = engine.stats()
    print(f"engine: {stats['forward_calls']} forward calls, {stats['tokens_computed']} tokens computed, "
          f"{engine.prepos.entry_tokens} of them pre-positioning entries; {engine.fast_answers} fast answers")
    for name in engine.sessions:
        info = engine.session_info(name)
        print(f"  {name}: data_version {info.data_version}, {info.num_tokens} tokens, "
              f"{info.lines_ingested} lines ingested")
    for name, questions in engine.calibration().items():  # answers scored against their labels, live
        for qid, c in questions.items():
            print(f"  {name}/{qid}: right {_right(c)}; gate fired on {percent(c['coverage'])} "
                  f"with precision {percent(c['precision'])}")


def _right(calibration: dict | None) -> str:
    """Live accuracy of a labelled question's standing answers (docs/calibration.md)."""
    return calibration_cells(calibration)[0]


def run(args: argparse.Namespace) -> int:
    """The demo with the flags of `streamllm demo` (streamllm/cli/demo.py); returns the exit code."""
    try:
        config = load_config(args.config)
        groups = offline_groups(config)  # a feed the demo cannot run is refused before the model loads
        print("feeds: " + ", ".join(f"{g.feed} ({', '.join(s.name for s in g.sessions)})" for g in groups))
        print(f"loading {args.model} ...", flush=True)
        t0 = time.monotonic()
        loaded = load_model(args.model, progress=True)
        adapter = pick_adapter(args.adapter, config.adapter, loaded.name, config=config)
    except (FileNotFoundError, ValueError) as exc:  # a config or adapter mistake: say what and where
        print(f"streamllm demo: {exc}", file=sys.stderr)
        return 2
    engine = Engine(loaded, EngineConfig(max_cells=65536), dtype=args.dtype, progress=True, adapter=adapter)
    if adapter is not None:
        print(f"adapter {adapter.path}: choice heads for " + ", ".join(h.question_id for h in adapter.heads))
    decode = f", {note}" if (note := decode_note(engine.stats())) else ""
    print(f"model ready in {time.monotonic() - t0:.1f} s on {engine.device}, {engine.model.dtype_choice.reason}{decode}; sessions: "
          + ", ".join(f"{s.name} ({s.instrument}, {len(s.questions)} standing questions)" for s in config.sessions))
    try:
        open_from_config(engine, config)
        display = asyncio.run(_run(engine, config, args))
        _summary(engine, display)
    finally:
        engine.shutdown()
    return 0
