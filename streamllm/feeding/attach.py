"""Attach a market feed to engine sessions: events -> lines -> `engine.push`.

Each attachment feeds one session with either raw events (one line each) or time bars of
N seconds. Lines wait in a pending list until the session's ingest backlog is below
`max_backlog`; while ingest lags, the pending list is coalesced into summary lines once it
exceeds `max_pending`, one line per instrument (feeding/summaries.py).

Nothing is dropped silently: `stats` counts every event in, and
`in == as_lines + in_summaries + held_in_open_bars + ignored + late + ahead + pending`, where
pending events are still waiting to be pushed (see `Attachment.accounted`).

The sink is the engine (`push(session, lines) -> PushAck`, `backlog(session) -> int`);
anything with those two methods works.

Exactly-once feeds: an attachment with a `feed_id` pushes every batch with its feed
position (`source=(feed_id, position)`): the key of the last line in it, a bar's open
time in bars mode, the event's index in the feed in events mode. The ingest log keeps
it with the batch. After a restart the feed is replayed from its start with
`resume_from` = the logged position: every event still goes through the bars and the
renderer (whose output depends on what came before), but lines with a key at or before
it are dropped as delivered (`stats.resumed_lines`), and the log refuses a batch behind
it (`DuplicateBatch`, counted in `stats.duplicates`). This holds for recorded feeds,
whose events replay in the same order (`replay:`/`csv:` files); a live feed cannot be
replayed. Keys assume one instrument per attachment in bars mode (what `serve` builds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from feeds.bars import BarAggregator
from feeds.clock import VenueClock
from feeds.events import Bar, Trade
from streamllm.durability.ingest_log import DuplicateBatch
from streamllm.feeding.render import Renderer
from streamllm.feeding.summaries import bar_summary, event_summary

QUIET_TICK_S = 0.25  # how often a silent live feed's bars are checked for having ended

log = logging.getLogger(__name__)


class Sink(Protocol):
    def push(self, session: str, lines: list[str]) -> Any: ...

    def backlog(self, session: str) -> int: ...


@dataclass
class AttachSpec:
    session: str
    mode: str = "bars"  # "bars" or "events"
    bar_s: float = 60.0
    instruments: frozenset[str] | None = None  # None: every instrument of the feed
    # Session lines not yet ingested before we hold back: ~32 bar lines is ~1.5k tokens, a few
    # seconds of CPU prefill. Past that, waiting lines are coalesced instead of queued for minutes.
    max_backlog: int = 32
    max_pending: int = 64  # held lines before they are coalesced
    with_symbol: bool = False
    changes: str = "price"  # bar lines' moves: "price" or "bp" (the session's `[sessions.render] changes`)

    @classmethod
    def of(cls, spec: Any, **overrides: Any) -> AttachSpec:
        """The attachment a config session (`SessionSpec`) renders with: its name, instrument and
        `[sessions.render]`, so served, demo and benchmark lines are the ones `tune` trained on."""
        fields = dict(session=spec.name, mode=spec.render.mode, bar_s=float(spec.render.bar_seconds or 60),
                      instruments=frozenset({spec.instrument}), changes=spec.render.changes)
        return cls(**(fields | overrides))

    def __post_init__(self) -> None:
        if self.mode not in ("bars", "events"):
            raise ValueError(f"attach {self.session!r}: mode must be 'bars' or 'events', got {self.mode!r}")
        if self.bar_s <= 0:
            raise ValueError(f"attach {self.session!r}: bar_s must be positive, got {self.bar_s}")


@dataclass(slots=True)
class AttachStats:
    events_in: int = 0
    ignored: int = 0  # other instruments or, in bars mode, events that are not trades
    lines_pushed: int = 0
    pushes: int = 0
    held: int = 0  # flushes skipped because ingest lagged
    summaries: int = 0  # summary lines made
    events_summarized: int = 0  # events represented by summary lines
    events_as_lines: int = 0  # events represented one line each (bars: trades inside pushed bars)
    late: int = 0  # trades for bar intervals already closed
    ahead: int = 0  # trades stamped far past the venue's clock, the next trade back in line (feeds/clock.py)
    resumed_lines: int = 0  # lines delivered before a restart (key <= `resume_from`): dropped
    events_resumed: int = 0  # events those lines represent
    duplicates: int = 0  # batches the ingest log refused as already delivered


FORECAST_SLACK = 512  # bars a forecast's settling push may carry beyond its horizon (kept for judging)


def _horizon(question: Any) -> int:
    """Bars after its own a question's label reads (0: it judges the present)."""
    return int(getattr(question.label, "horizon", 0) or 0)


@dataclass(slots=True)
class _Item:
    """A pending line's source: one event or bar, or a coalesced group."""

    events: int  # feed events it represents
    key: int = 0  # its feed position: bar open time (bars) or event index (events); summaries: the last
    bar: Bar | None = None
    event: Any = None
    line: str | None = None  # set for summaries (already rendered)


@dataclass
class Attachment:
    sink: Sink
    spec: AttachSpec
    renderer: Renderer | None = None
    stats: AttachStats = field(default_factory=AttachStats)
    last_ack: Any = None
    _pending: list[_Item] = field(default_factory=list)
    _agg: BarAggregator | None = None
    _bar_events: dict[str, int] = field(default_factory=dict)  # trades inside each open bar
    feed_id: str | None = None  # set: batches carry (feed_id, position) for exactly-once delivery
    resume_from: int | None = None  # lines with a key up to this were delivered before a restart
    _seen: int = 0  # feed events offered so far (the next event's index)
    # Labelled standing questions (config QuestionSpec): each push carries their truths on the bars
    # it completes, so the engine scores its answers live (engine/standing/calibration.py). Needs bars: bars
    # mode, or bar files replayed one line per bar.
    questions: tuple[Any, ...] = ()
    _recent: deque | None = None  # the last bars the labels need
    _bars_seen: int = 0  # bars taken so far (the newest bar's number)
    # (data version, bars taken when it was pushed) of pushes whose forecasts are not settled yet
    _unsettled: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.renderer is None:
            self.renderer = Renderer(with_symbol=self.spec.with_symbol, changes=self.spec.changes)
        if self.spec.mode == "bars":
            self._agg = BarAggregator(self.spec.bar_s)
        self.questions = tuple(q for q in self.questions if q.label is not None and q.choices)
        if self.questions:
            # Forecasts are judged `back` bars behind the newest, `back` >= their horizon (a push may carry
            # several bars): keep room for a batch of FORECAST_SLACK bars beyond it.
            slack = FORECAST_SLACK if any(_horizon(q) for q in self.questions) else 0
            self._recent = deque(maxlen=max(q.label.bars_needed + _horizon(q) for q in self.questions) + slack)

    # --- in ---
    def offer(self, ev: Any) -> None:
        index = self._seen
        if not self._arrive(ev):
            return
        if self._agg is None:
            if type(ev) is Bar:  # a bar file replayed one line per bar
                self._saw_bar(ev)
            self._add(_Item(1, key=index, event=ev))
            return
        if type(ev) is Bar:  # a table of ready-made bars: each is already a bar line
            self._saw_bar(ev)
            self._pending.append(_Item(1, bar=ev))
            return
        if type(ev) is not Trade:
            self.stats.ignored += 1
            return
        closed = self._agg.update(ev)
        self._take_bars(closed)
        if self._agg.late:  # a trade for an interval already closed: counted, not in any bar
            self.stats.late += self._agg.late
            self._agg.late = 0
        else:
            self._bar_events[ev.instrument] = self._bar_events.get(ev.instrument, 0) + 1

    @property
    def seen(self) -> int:
        """Feed events offered so far, its own and others' (the next event's index)."""
        return self._seen

    def catch_up(self, seen: int) -> None:
        """Count the feed events before index `seen` that attach() routed past this attachment: each was
        another instrument's, counted in and ignored as `offer` would have, without a call per event."""
        skipped = seen - self._seen
        if skipped > 0:
            self._seen = seen
            self.stats.events_in += skipped
            self.stats.ignored += skipped

    def left_out(self, ev: Any) -> None:
        """A trade attach() left out as stamped ahead of the venue's clock: counted, in no line."""
        if self._arrive(ev):
            self.stats.ahead += 1

    def _arrive(self, ev: Any) -> bool:
        """Count a feed event in; False (counted ignored) when it is another instrument's."""
        self._seen += 1
        self.stats.events_in += 1
        inst = self.spec.instruments
        if inst is not None and ev.instrument not in inst:
            self.stats.ignored += 1
            return False
        return True

    def tick(self, now_ns: int) -> None:
        """Close bars whose interval ended (a quiet market still produces bar lines)."""
        if self._agg is not None:
            self._take_bars(self._agg.advance(now_ns))

    def _saw_bar(self, bar: Bar) -> None:
        """Every bar that becomes a line passes here, built or ready-made (labels read the recent ones)."""
        if self._recent is not None:
            self._recent.append(bar)
            self._bars_seen += 1

    def _take_bars(self, closed: list[Bar]) -> None:
        for bar in closed:
            self._saw_bar(bar)
            n = bar.trades if bar.trades > 0 else 0
            self._bar_events[bar.instrument] = self._bar_events.get(bar.instrument, 0) - n
            self._add(_Item(n, key=bar.ts_open, bar=bar))

    def _add(self, item: _Item) -> None:
        if self.resume_from is not None and item.key <= self.resume_from:
            self._line(item)  # delivered before the restart: rendered (the renderer keeps state), not pushed
            self.stats.resumed_lines += 1
            self.stats.events_resumed += item.events
            return
        self._pending.append(item)

    # --- out ---
    def flush(self) -> Any:
        """Push pending lines if ingest keeps up; coalesce them if it does not."""
        if not self._pending:
            return None
        if self.sink.backlog(self.spec.session) >= self.spec.max_backlog:
            self.stats.held += 1
            if len(self._pending) > self.spec.max_pending:
                self._coalesce()
            return None
        lines = [self._line(item) for item in self._pending]
        kw: dict[str, Any] = {"truths": truths} if (truths := self.truths()) else {}
        if late := self.late_truths():
            kw["late_truths"] = late
        if self.feed_id is None:
            ack = self.sink.push(self.spec.session, lines, **kw)  # raises: pending kept for the next try
        else:
            try:
                ack = self.sink.push(self.spec.session, lines, source=(self.feed_id, self._pending[-1].key), **kw)
            except DuplicateBatch:  # delivered before a restart: the log has it already
                self.stats.duplicates += 1
                self._pending.clear()
                return None
        for item in self._pending:
            if item.line is None:
                self.stats.events_as_lines += item.events
        self.stats.lines_pushed += len(lines)
        self.stats.pushes += 1
        self._pending.clear()
        self.last_ack = ack
        version = getattr(ack, "data_version", None)  # a sink's ack (PushAck); forecasts need its version
        if version is not None and self._recent is not None and any(_horizon(q) for q in self.questions):
            self._settled()
            self._unsettled.append((version, self._bars_seen))
        return ack

    def truths(self) -> dict[str, str]:
        """Each labelled question's right choice on the bars taken so far (what a flush completes)."""
        if not self._recent:
            return {}
        bars = list(self._recent)
        out = {}
        for q in self.questions:
            if _horizon(q):
                continue  # a forecast: its bars to come settle it (late_truths)
            truth = q.expected_answer(bars)  # the judge of the engine's answers, never sent as one
            if truth is not None:
                out[q.id] = truth
        return out

    def late_truths(self) -> dict[str, dict[int, str]]:
        """Each forecast's right choice at the earlier versions the bars taken so far settle: the version
        pushed when bar b was the newest is judged once bar b + horizon is in, on bars up to the newest only."""
        if not self._recent or not self._unsettled:
            return {}
        bars = list(self._recent)
        out: dict[str, dict[int, str]] = {}
        for q in self.questions:
            h = _horizon(q)
            if not h:
                continue
            for version, newest in self._unsettled:
                back = self._bars_seen - newest  # bars taken since that push
                if back < h or back > len(bars) - 1:
                    continue  # not settled yet, or older than the bars kept
                truth = q.label.answer_at(bars, q.choices, back)
                if truth is not None and back - h < self._settling_batch():
                    out.setdefault(q.id, {})[version] = truth
        return out

    def _settling_batch(self) -> int:
        """Bars taken since the last push: a version is settled by the first push whose bars reach its
        horizon (later pushes do not send it again)."""
        return self._bars_seen - (self._unsettled[-1][1] if self._unsettled else 0)

    def _settled(self) -> None:
        """Forget pushes every forecast has been judged on (or that fell out of the bars kept)."""
        longest = max(_horizon(q) for q in self.questions)
        while self._unsettled and self._bars_seen - self._unsettled[0][1] >= longest:
            self._unsettled.popleft()
        while len(self._unsettled) > FORECAST_SLACK:
            self._unsettled.popleft()

    def _line(self, item: _Item) -> str:
        if item.line is not None:
            return item.line
        assert self.renderer is not None
        return self.renderer.render(item.bar if item.bar is not None else item.event)

    @property
    def pending_events(self) -> int:
        return sum(item.events for item in self._pending)

    def accounted(self) -> int:
        """Events accounted for so far; equals `stats.events_in` at every moment."""
        s = self.stats
        open_bars = sum(self._bar_events.values())
        pending = sum(i.events for i in self._pending if i.line is None)
        return s.events_as_lines + s.events_summarized + open_bars + s.ignored + s.late + s.ahead + pending + s.events_resumed

    def _coalesce(self) -> None:
        groups: dict[str, list[_Item]] = {}
        done: list[_Item] = []
        for item in self._pending:
            if item.line is not None:
                done.append(item)  # already a summary
                continue
            src = item.bar if item.bar is not None else item.event
            groups.setdefault(src.instrument, []).append(item)
        for inst, items in groups.items():
            assert self.renderer is not None
            if items[0].bar is not None:
                line = bar_summary(self.renderer, [i.bar for i in items if i.bar is not None])
            else:
                line = event_summary(self.renderer, inst, [i.event for i in items])
            n = sum(i.events for i in items)
            done.append(_Item(n, key=max(i.key for i in items), line=line))
            self.stats.summaries += 1
            self.stats.events_summarized += n
        self._pending = done


async def attach(
    feed: AsyncIterable[Any] | Iterable[Any],
    attachments: list[Attachment],
    flush_every: int = 64,
    flush_s: float = 0.05,
    wall_clock: bool = False,
) -> None:
    """Drive attachments from a feed until it ends; flushes every `flush_every` events or
    `flush_s` seconds of wall time, and closes bars on the venue's clock as the trades' times
    and receive times estimate it (feeds/clock.py: a replayed capture or a host clock that is
    off would otherwise close bars before their trades arrive).

    `wall_clock`: the feed is live, its receive times this machine's clock (time.time_ns()).
    Then bars also close while it is silent (checked every QUIET_TICK_S): a quiet market's last
    bar would otherwise wait for its next message, minutes on an illiquid contract. A push that
    fails there fails the feed, as it would on an event. A recorded feed's receive times are the
    recording's, so only its own events can move its clock.

    A trade stamped far past the venue's clock and its own receive time (`VenueClock.ahead`)
    waits for the next trade: ahead too, and the venue's clock stepped, so both go in; back in
    line, and its time was wrong: it is left out (`stats.ahead`, a warning), so that it neither
    closes the bars before it at once nor makes every trade after it late."""
    loop = asyncio.get_running_loop()
    last_flush, n = loop.time(), 0
    clock = VenueClock()  # from trades only: some venues stamp quotes with the receive time
    held: Trade | None = None  # a trade stamped ahead, until the next trade says what it was
    left_out = 0
    # Demultiplexing: an event goes to the attachments of its instrument (and to those taking every
    # instrument), not to all, so one connection can feed hundreds of sessions. The others count it as
    # ignored when they next catch up (`Attachment.catch_up`): their counts stay exact.
    everyone = [a for a in attachments if a.spec.instruments is None]
    routes: dict[str, list[Attachment]] = {}
    for a in attachments:
        for instrument in a.spec.instruments or ():
            routes.setdefault(instrument, []).append(a)
    start = {id(a): a.seen for a in attachments}  # attachments outlive a feed's restart
    offered = 0  # events offered in this run (taken or left out)

    def tick(now: int) -> None:
        nonlocal last_flush
        for a in attachments:
            a.catch_up(start[id(a)] + offered)
            a.tick(now)
            a.flush()
        last_flush = loop.time()

    def step(ev: Any) -> None:
        nonlocal held, left_out, offered
        if type(ev) is Trade:
            if held is not None:
                suspect, held = held, None
                if clock.ahead(ev.ts_event, ev.ts_recv):  # ahead as well: the venue's clock stepped
                    take(suspect)
                else:
                    left_out += 1
                    if left_out <= 5 or left_out % 1000 == 0:
                        log.warning("%s trade %s stamped %.1f s past the venue's clock, the next trade back in "
                                    "line: left out (%d so far)", suspect.instrument, suspect.trade_id,
                                    (suspect.ts_event - clock.settled(suspect.ts_recv)) / 1e9, left_out)
                    for a in attachments:
                        a.catch_up(start[id(a)] + offered)
                        a.left_out(suspect)
                    offered += 1
            if clock.ahead(ev.ts_event, ev.ts_recv):
                held = ev
                return
        take(ev)

    def take(ev: Any) -> None:
        nonlocal n, offered
        n += 1
        if type(ev) is Trade:
            clock.observe(ev.ts_event, ev.ts_recv)
        for a in everyone:
            a.offer(ev)
        for a in routes.get(ev.instrument, ()):
            a.catch_up(start[id(a)] + offered)
            a.offer(ev)
        offered += 1
        if n % flush_every == 0 or loop.time() - last_flush >= flush_s:
            tick(clock.settled(ev.ts_recv))

    failed: list[BaseException] = []
    main = asyncio.current_task()

    async def quiet_ticks() -> None:  # same loop as step(): never between an offer and its tick
        while True:
            await asyncio.sleep(QUIET_TICK_S)
            if loop.time() - last_flush >= QUIET_TICK_S:
                try:
                    tick(clock.settled(time.time_ns()))
                except Exception as exc:  # the feed fails with it, as on an event's flush
                    failed.append(exc)
                    if main is not None:
                        main.cancel()
                    return

    quiet = asyncio.create_task(quiet_ticks()) if wall_clock else None
    try:
        if isinstance(feed, AsyncIterable):
            async for ev in feed:
                step(ev)
        else:
            for ev in feed:
                step(ev)
                if n % flush_every == 0:
                    await asyncio.sleep(0)
    except asyncio.CancelledError:
        if failed:
            raise failed[0] from None
        raise
    finally:
        if quiet is not None:
            quiet.cancel()
    if held is not None:  # nothing after it to judge it by: kept
        take(held)
    for a in attachments:
        a.catch_up(start[id(a)] + offered)
        a.flush()
