"""The live replay of `streamllm bench replay`: one system at a time answers the same asks
while the same feed runs at the same speed.

    feed (paced) ──▶ attachments ──▶ sink ──┐         seeded Poisson asks (same for every system)
                                            │                    │
      ours         Engine.push: ingest + re-position   submit_ask (fast / entry / cold)
      prefixcache  TokenSink: lines only tokenized     one worker: catch up on new tokens, question
      stateless    TokenSink                           one worker (every k-th ask): full prefill
      peer         TokenSink                           one worker: HTTP to the server, whole prompt

Every system starts from the same warm-up (the first `warmup_s` of feed pushed unpaced, so
labels have their history), then the paced part runs with the asks. Latency is from the
ask to the answer, queueing included: a baseline answers one ask at a time, like one server
slot. Each labelled standing answer is scored against the label on exactly the bars its
data held (ours: the answer's data_version; a baseline: the data at the moment of the ask,
which is what its prompt held).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from bench.baselines import Peer, PrefixCache, Stateless
from bench.common import median
from bench.loadgen import AskEvent, poisson_schedule, run_schedule
from streamllm.config import QueryConfig, QuestionSpec
from streamllm.engine.outputs import PushAck
from streamllm.engine.standing.gate import Gate
from streamllm.feeding.attach import Attachment, AttachSpec, attach

BETWEEN_ASKS = {
    "ours": "ingests every batch as it arrives and re-positions every standing question on it "
            "(entries and ready distributions at the newest data)",
    "prefixcache": "nothing: new lines are only tokenized; an ask first catches the session's cached "
                   "table up on the tokens that arrived since its previous ask, then prefills the question",
    "stateless": "nothing: each ask prefills system prompt + all data + question from scratch",
    "peer": "nothing on our side: each ask sends the whole prompt text; the server reuses its slot's "
            "cached prefix (cache_prompt)",
}


@dataclass(slots=True)
class LiveAsk:
    system: str
    index: int  # position in the shared schedule
    session: str
    question: str
    spec: QuestionSpec | None  # None: ad hoc
    pushed_at_ask: int
    t0: float = 0.0
    ms: float = math.nan
    wait_ms: float = math.nan  # baselines: queued before their worker picked the ask up
    path: str = ""
    data_version: int = -1
    lag: int = 0  # versions pushed before the ask that the answer did not see
    text: str = ""
    confidence: float | None = None
    tokens_computed: int = 0
    truth: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not math.isnan(self.ms)

    @property
    def correct(self) -> bool | None:
        if self.truth is None or not self.ok:
            return None
        return self.text.strip().strip(".,!:;\"'").casefold() == self.truth.casefold()


@dataclass(slots=True)
class SystemRun:
    system: str
    speed: float
    asks: list[LiveAsk] = field(default_factory=list)
    wall_s: float = 0.0
    lines_pushed: int = 0  # during the paced part (the warm-up's lines not counted)
    events_in: int = 0  # feed events offered, warm-up included
    lines_total: int = 0  # lines pushed, warm-up included
    summary_lines: int = 0
    compactions: int = 0  # ours: compaction copies swapped in (each recomputes up to half a budget)
    notes: list[str] = field(default_factory=list)


class TokenSink:
    """Where a baseline's feed goes: lines tokenized exactly as the engine would, nothing computed."""

    def __init__(self, layout, config: QueryConfig) -> None:
        self.layout = layout
        self.prefix = {s.name: layout.prefix_ids(s.system_prompt) for s in config.sessions}
        self.ids: dict[str, list[int]] = {s.name: [] for s in config.sessions}
        self.version_ends: dict[str, list[int]] = {s.name: [0] for s in config.sessions}
        self.lines: dict[str, list[str]] = {s.name: [] for s in config.sessions}
        self._lock = threading.Lock()

    def push(self, session: str, lines: list[str]) -> PushAck:
        new = [t for ids in self.layout.lines_ids(lines) for t in ids]
        with self._lock:
            self.ids[session].extend(new)
            self.lines[session].extend(lines)
            self.version_ends[session].append(len(self.ids[session]))
            return PushAck(session, len(self.version_ends[session]) - 1, 0, len(lines))

    def backlog(self, session: str) -> int:
        return 0

    def snapshot(self, session: str) -> tuple[int, list[int]]:
        """(newest version, the session's whole prompt context at it): what an ask sends now."""
        with self._lock:
            return len(self.version_ends[session]) - 1, self.prefix[session] + self.ids[session]


class RecordingAttachment(Attachment):
    """Keeps every closed bar and which bars each data_version holds."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.bars: list[Any] = []
        self.bars_at_version: dict[int, int] = {0: 0}

    def _saw_bar(self, bar: Any) -> None:  # built from trades or ready-made (a bar table)
        self.bars.append(bar)
        super()._saw_bar(bar)

    def flush(self) -> Any:
        ack = super().flush()
        if ack is not None:  # a flush pushes every bar closed so far
            self.bars_at_version[ack.data_version] = len(self.bars)
        return ack

    def bars_upto(self, version: int) -> list[Any]:
        known = [v for v in self.bars_at_version if v <= version]
        return self.bars[: self.bars_at_version[max(known)]]


def attachments_for(config: QueryConfig, sink, truths: bool = False) -> dict[str, RecordingAttachment]:
    """truths: pushes carry labelled questions' truths (ours: live calibration, auto thresholds)."""
    return {s.name: RecordingAttachment(sink, AttachSpec.of(s), questions=s.questions if truths else ())
            for s in config.sessions}


def live_schedule(seed: int, standing_rate: float, adhoc_rate: float, window_s: float,
                  config: QueryConfig) -> list[AskEvent]:
    """Standing asks and ad-hoc asks as two seeded Poisson streams, merged by time."""
    standing = {s.name: [q.id for q in s.questions] for s in config.sessions if s.questions}
    if not standing:
        raise ValueError("the config has no standing questions to ask")
    asks = poisson_schedule(seed, standing_rate, window_s, standing, standing_share=1.0)
    if adhoc_rate > 0:
        asks += poisson_schedule(seed + 1_000_003, adhoc_rate, window_s, standing, standing_share=0.0)
    return sorted(asks, key=lambda ev: ev.at_s)


class _Asker:
    """Submits the schedule's asks to one system and records each answer."""

    def __init__(self, system: str, config: QueryConfig, run: SystemRun, adhoc_tokens: int, bar: tqdm) -> None:
        self.system, self.config, self.run, self.adhoc_tokens, self.bar = system, config, run, adhoc_tokens, bar
        self.futures: list[Future] = []
        self.seen = 0  # asks of the schedule offered so far

    def record(self, ev: AskEvent, pushed: int) -> LiveAsk:
        spec = self.config.session(ev.session).find_question(ev.question) if ev.standing else None
        rec = LiveAsk(self.system, self.seen - 1, ev.session, ev.question, spec, pushed)
        self.run.asks.append(rec)
        return rec

    def max_tokens(self, rec: LiveAsk) -> int:
        return rec.spec.max_tokens if rec.spec is not None else self.adhoc_tokens

    def drain(self, timeout: float) -> None:
        wait(self.futures, timeout=timeout)


class OursAsker(_Asker):
    def __init__(self, engine, *args) -> None:
        super().__init__("ours", *args)
        self.engine = engine

    def submit(self, ev: AskEvent) -> None:
        self.seen += 1
        rec = self.record(ev, self.engine.session_info(ev.session).pushed_version)
        rec.t0 = time.perf_counter()
        try:
            fut = self.engine.submit_ask(ev.session, ev.question, max_tokens=self.max_tokens(rec))
        except Exception as exc:  # a refused ask is a result too: counted, not timed
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        self.futures.append(fut)
        fut.add_done_callback(lambda f, rec=rec: self.done(rec, f))

    def done(self, rec: LiveAsk, fut: Future) -> None:
        rec.ms = (time.perf_counter() - rec.t0) * 1000
        self.bar.update()
        try:
            ans = fut.result()
        except Exception as exc:
            rec.error, rec.ms = f"{type(exc).__name__}: {exc}", math.nan
            return
        rec.path, rec.data_version, rec.text = ans.path, ans.data_version, ans.text
        rec.tokens_computed, rec.confidence = ans.tokens_computed, ans.confidence
        rec.lag = max(0, rec.pushed_at_ask - ans.data_version)


class BaselineAsker(_Asker):
    """One worker thread: the system answers one ask at a time, in arrival order (one server slot)."""

    def __init__(self, system, sink: TokenSink, gates: dict[tuple[str, str], Gate], every: int, *args) -> None:
        super().__init__(system.name, *args)
        self.baseline, self.sink, self.gates, self.every = system, sink, gates, max(1, every)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"bench-{system.name}")
        self.question_ids: dict[str, list[int]] = {}

    def submit(self, ev: AskEvent) -> None:
        self.seen += 1
        if (self.seen - 1) % self.every:  # a sample of the schedule (stateless): the rest is skipped
            return
        version, context = self.sink.snapshot(ev.session)
        rec = self.record(ev, version)
        rec.data_version, rec.t0 = version, time.perf_counter()
        self.futures.append(self.pool.submit(self.work, rec, context))

    def work(self, rec: LiveAsk, context: list[int]) -> None:
        rec.wait_ms = (time.perf_counter() - rec.t0) * 1000
        text = rec.spec.text if rec.spec is not None else rec.question
        qids = self.question_ids.get(text)
        if qids is None:
            qids = self.question_ids[text] = self.sink.layout.question_ids(text)
        gate = self.gates.get((rec.session, rec.spec.id)) if rec.spec is not None else None
        try:
            if isinstance(self.baseline, PrefixCache):
                ans = self.baseline.answer(rec.session, context, qids, self.max_tokens(rec), gate)
            else:
                ans = self.baseline.answer(context, qids, self.max_tokens(rec), gate)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.bar.update()
        rec.ms = (time.perf_counter() - rec.t0) * 1000
        rec.text, rec.tokens_computed, rec.path = ans.text, ans.tokens_computed, self.system
        if ans.choices and rec.spec is not None:
            ranked = sorted(ans.choices.values(), reverse=True) + [0.0]
            rec.confidence = ranked[0] - ranked[1]

    def drain(self, timeout: float) -> None:
        wait(self.futures, timeout=timeout)
        self.pool.shutdown(wait=True, cancel_futures=True)  # asks still queued stay unanswered


def run_system(system: str, engine, config: QueryConfig, warm: list[Any], timed: list[Any], speed: float,
               schedule: list[AskEvent], args, peer: Peer | None = None) -> SystemRun:
    """One system through the warm-up, then the paced feed with the schedule's asks."""
    run = SystemRun(system, speed)
    sink: Any = engine if system == "ours" else TokenSink(engine.layout, config)
    if system == "ours":
        for s in config.sessions:
            engine.open_session(s.name, system=s.system_prompt, max_context=s.max_context_tokens)
            for q in s.questions:
                engine.register(s.name, q)
    atts = attachments_for(config, sink, truths=system == "ours")
    asyncio.run(attach(iter(warm), list(atts.values())))  # the history every system starts from
    warm_lines = sum(a.stats.lines_pushed for a in atts.values())
    every = args.stateless_every if system == "stateless" else 1
    bar = tqdm(total=math.ceil(len(schedule) / every), desc=f"{system} @ {speed:g}x: answered", unit="ask",
               leave=False, disable=args.no_progress)
    if system == "ours":
        engine.wait_idle()
        asker: Any = OursAsker(engine, config, run, args.adhoc_tokens, bar)
    else:
        gates = {(s.name, q.id): Gate.for_question(q, engine.tokenizer) for s in config.sessions
                 for q in s.questions}
        baseline = {"prefixcache": PrefixCache, "stateless": Stateless}.get(system)
        impl = peer if system == "peer" else baseline(engine, args.chunk)
        for s in config.sessions:  # caches start as if they had answered an ask at the end of the warm-up
            if isinstance(impl, PrefixCache):
                impl.catch_up(s.name, sink.snapshot(s.name)[1])
            elif isinstance(impl, Peer):
                impl.answer(sink.snapshot(s.name)[1], [], 1)
        asker = BaselineAsker(impl, sink, gates, every, config, run, args.adhoc_tokens, bar)
    from feeds.replay import apaced

    stop = threading.Event()
    t0 = time.perf_counter()
    thread = run_schedule(schedule, asker.submit, stop)
    try:
        asyncio.run(attach(apaced(timed, speed), list(atts.values())))
        thread.join(timeout=max(0.0, t0 + schedule[-1].at_s - time.perf_counter()) + 1 if schedule else 0)
    finally:
        stop.set()  # the feed ended: no more asks (their answers would all see the last data)
        thread.join()
    asker.drain(args.drain_s)
    bar.close()
    run.wall_s = time.perf_counter() - t0
    if isinstance(getattr(asker, "baseline", None), PrefixCache):
        asker.baseline.close()
    for rec in run.asks:
        if rec.error is None and math.isnan(rec.ms):
            rec.error = f"not answered within {args.drain_s:g} s after the feed ended"
        if rec.ok and rec.spec is not None and rec.spec.label is not None:
            rec.truth = rec.spec.expected_answer(atts[rec.session].bars_upto(rec.data_version))
    run.lines_total = sum(a.stats.lines_pushed for a in atts.values())
    run.lines_pushed = run.lines_total - warm_lines  # the paced part's
    run.events_in = max((a.stats.events_in for a in atts.values()), default=0)  # each sees every event
    run.summary_lines = sum(a.stats.summaries for a in atts.values())
    if system == "ours":
        run.compactions = engine.stats()["compactions"]
    return run


def diverged(run: SystemRun) -> tuple[bool, float]:
    """Whether this system fell behind for good at this speed, and the growth ratio that says so.

    Its backlog diverges when asks were left unanswered, or when the last third of the run's
    answers took over twice as long as the first third and over a quarter of a second (ours:
    or its data lag grew by over 2 versions to at least 3)."""
    ok = sorted((r for r in run.asks if r.ok), key=lambda r: r.t0)
    if not ok:
        return bool(run.asks), math.nan
    third = max(1, len(ok) // 3)
    first, last = median([r.ms for r in ok[:third]]), median([r.ms for r in ok[-third:]])
    growth = last / max(first, 1.0)  # sub-millisecond answers: growth from a 1 ms floor, not from noise
    lag_first, lag_last = median([float(r.lag) for r in ok[:third]]), median([float(r.lag) for r in ok[-third:]])
    unanswered = any(not r.ok for r in run.asks)
    slower = growth > 2 and last > 250
    lagging = lag_last - lag_first > 2 and lag_last >= 3
    return unanswered or slower or lagging, growth
