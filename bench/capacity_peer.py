"""`streamllm bench capacity --peer-url URL`: the same S-session workload, answered by a peer server.

A peer (llama.cpp's `llama-server`, vLLM's OpenAI server) keeps no standing answers, so a client
keeps each answer fresh the only way it can: on every bar it asks the session's standing questions
again, each as one completion whose prompt is the session's context so far and the question, laid
out exactly as the engine lays out its entries (engine/prompt.py), with the server's prompt cache on
(`cache_prompt`). Everything else is ours' workload (bench/capacity.py): the same sessions, bars,
offsets, pace, seconds, standing questions (the free-text one on one session in 16) and seeded
Poisson asks (half a standing question, half an ad-hoc one), and the same stopping rule.

- Warm-up: each session's context (system prompt and its warm-up bars) is sent once, so the peer
  holds it (one slot per session with `--peer-slots`, pinned by `id_slot`, as `make peer` is started
  with `PEER_SLOTS=S`; else wherever the server puts it).
- Each arriving bar queues a job for its session: the bar's line is appended to its context and its
  standing questions are asked in turn. A bar is fresh when the last of them is answered. Jobs run on
  `--peer-workers` client threads; a session's jobs run in order.

Per S (`peer_{metric}@{S}`): sustained_bars_per_s (bars answered by the phase's end / its seconds),
freshness_lag_p50/p99_ms (a bar's arrival to its last standing answer; still stale after --drain-s:
--drain-s), lag_p99_versions (bars arrived minus bars answered per session, sampled every 100 ms),
standing_ask_p50/p99_ms (one standing question's completion), cold_ask_p50/p99_ms (an ad-hoc
question), warmup_s, held (1: kept fresh as ours must be, `Phase.held`'s rule), and over all S tried,
`peer_largest_fresh_s`.
"""

from __future__ import annotations

import argparse
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from bench.baselines import Peer
from bench.common import median, percentile
from bench.loadgen import AD_HOC_QUESTIONS, poisson_schedule, run_schedule
from bench.phase import Phase
from streamllm.engine.prompt import PromptLayout
from streamllm.feeding.attach import AttachSpec
from streamllm.feeding.render import Renderer


@dataclass
class PeerSession:
    """One session as a client of the peer keeps it: its context ids and what it asks on every bar."""

    name: str
    context: list[int]
    bars: list
    questions: dict[str, tuple[list[int], int]]  # id -> (question ids, max_tokens)
    renderer: Renderer
    next_bar: int = 0
    arrived: int = 0  # bars of the phase that arrived
    answered: int = 0  # ... whose standing questions were all answered
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class PeerPhase(Phase):
    """Ours' Phase, as the peer's client measured it (`ingested`: bars whose standing asks were all answered
    by the phase's end), and the requests that failed, which ours cannot have."""

    done: int = 0  # bars answered by the drain's end
    errors: int = 0
    error: str = ""

    def held(self, interval_s: float) -> bool:
        return self.errors == 0 and super().held(interval_s)


def _complete(peer: Peer, ids: list[int], max_tokens: int, slot: int | None) -> float:
    """One completion of the prompt `ids` (decoded to the text the peer tokenizes): its wall ms."""
    pinned = {} if slot is None else {"id_slot": slot}  # llama-server: the slot whose cache holds the session
    return peer.complete(peer.prompt(ids, []), max_tokens, **pinned)[0]


def peer_sessions(layout: PromptLayout, spec, slices: list[list], free, free_every: int) -> list[PeerSession]:
    """The peer's copy of ours' S sessions (bench/capacity.open_sessions): the same names, bars (`slices`),
    render settings and standing questions."""
    out = []
    for i, bars in enumerate(slices):
        name = f"s{i:03d}"
        # a choice question is decided by its first token, ours and the peer's (bench/baselines.Peer)
        questions = {q.id: (layout.question_ids(q.text), 1 if q.choices else q.max_tokens) for q in spec.questions}
        if i % free_every == 0:  # the free-text standing question
            questions[free.id] = (layout.question_ids(free.text), free.max_tokens)
        att = AttachSpec.of(spec, session=name)
        renderer = Renderer(with_symbol=att.with_symbol, changes=att.changes)  # as ours' attachment renders
        out.append(PeerSession(name, layout.prefix_ids(spec.system_prompt), bars, questions, renderer))
    return out


def _append_bar(layout: PromptLayout, s: PeerSession) -> None:
    line = s.renderer.render(s.bars[s.next_bar])
    s.next_bar += 1
    s.context += layout.lines_ids([line])[0]


def measure_peer(peer: Peer, layout: PromptLayout, sessions: list[PeerSession], s: int,
                 args: argparse.Namespace) -> tuple[dict[str, float], list]:
    slots = args.peer_slots
    slot_of = {x.name: (i % slots if slots else None) for i, x in enumerate(sessions)}
    workers = max(1, args.peer_workers)
    print(f"  peer S={s}: {len(sessions)} sessions, {args.warmup_bars} bars of warm-up each ({workers} client "
          f"threads{f', {slots} slots pinned' if slots else ''}) ...", flush=True)
    m: dict[str, float] = {}
    t0 = time.perf_counter()

    def warm(x: PeerSession) -> bool:
        for _ in range(args.warmup_bars):
            _append_bar(layout, x)
        if time.perf_counter() - t0 > args.warmup_s:
            return False
        _complete(peer, x.context, 1, slot_of[x.name])
        return True

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peer-warm") as pool:
        warmed = sum(pool.map(warm, sessions))
    m["warmup_s"] = time.perf_counter() - t0
    print(f"  peer S={s}: warm-up of {warmed} of {len(sessions)} sessions in {m['warmup_s']:.0f} s", flush=True)
    if warmed < len(sessions):
        print(f"  peer S={s}: the warm-up did not finish in {args.warmup_s:g} s: not measured", flush=True)
        m["held"] = 0
        return m, [s, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, m["warmup_s"], "no (warm-up)"]
    phase = _paced(peer, layout, sessions, slot_of, s, args)
    m.update({
        "offered_bars_per_s": phase.offered / phase.seconds,
        "sustained_bars_per_s": phase.ingested / phase.seconds,
        "freshness_lag_p50_ms": median(phase.lags_ms), "freshness_lag_p99_ms": percentile(phase.lags_ms, 99),
        "stale_bars": phase.stale_bars,
        "lag_p99_versions": percentile(phase.lag_versions, 99),
        "standing_ask_p50_ms": median(phase.standing_ms), "standing_ask_p99_ms": percentile(phase.standing_ms, 99),
        "cold_ask_p50_ms": median(phase.cold_ms), "cold_ask_p99_ms": percentile(phase.cold_ms, 99),
        "errors": phase.errors, "bars_offered": phase.offered, "bars_answered": phase.done,
    })
    m["held"] = int(phase.held(60.0 / args.speed))
    if phase.errors:
        print(f"  peer S={s}: {phase.errors} requests failed; the first: {phase.error}", flush=True)
    row = [s, m["sustained_bars_per_s"], m["freshness_lag_p99_ms"], m["lag_p99_versions"], m["standing_ask_p99_ms"],
           m["cold_ask_p50_ms"], m["cold_ask_p99_ms"], m["warmup_s"], "yes" if m["held"] else "no"]
    return m, row


def _paced(peer: Peer, layout: PromptLayout, sessions: list[PeerSession], slot_of: dict, s: int,
           args: argparse.Namespace) -> PeerPhase:
    """Bars at --speed for --seconds, as bench/capacity.paced offers them, then up to --drain-s."""
    out = PeerPhase()
    lock = threading.Lock()
    interval = 60.0 / args.speed
    n = len(sessions)
    by_name = {x.name: x for x in sessions}
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.perf_counter()
    deadline = t0 + args.seconds + args.drain_s

    def fail(exc: BaseException) -> None:
        with lock:
            out.errors += 1
            out.error = out.error or repr(exc)

    def bar_job(x: PeerSession, arrived: float) -> None:
        if time.perf_counter() > deadline:
            return  # past the drain: stale
        try:
            with x.lock:  # a session's bars in order; asks on it wait for its context
                _append_bar(layout, x)
                for ids, max_tokens in x.questions.values():
                    ms = _complete(peer, x.context + ids, max_tokens, slot_of[x.name])
                    with lock:
                        out.standing_ms.append(ms)
                x.answered += 1
            with lock:
                out.lags_ms.append((time.perf_counter() - arrived) * 1000)
        except Exception as exc:  # noqa: BLE001 - counted; the phase goes on
            fail(exc)

    def ask_job(ev) -> None:
        x = by_name[ev.session]
        try:
            with x.lock:
                context = list(x.context)
            if ev.standing:
                ids, max_tokens = x.questions[ev.question]
            else:
                ids, max_tokens = layout.question_ids(ev.question), 1
            ms = _complete(peer, context + ids, max_tokens, slot_of[x.name])
            with lock:
                (out.standing_ms if ev.standing else out.cold_ms).append(ms)
        except Exception as exc:  # noqa: BLE001
            fail(exc)

    def worker() -> None:
        while (job := jobs.get()) is not None:
            job()

    threads = [threading.Thread(target=worker, name=f"peer-client-{j}", daemon=True) for j in range(args.peer_workers)]
    for t in threads:
        t.start()
    standing = {x.name: list(x.questions) for x in sessions}
    asks = poisson_schedule(args.seed + s, args.ask_rate, args.seconds, standing, standing_share=0.5,
                            ad_hoc=AD_HOC_QUESTIONS)
    stop = threading.Event()
    asker = run_schedule(asks, lambda ev: jobs.put(lambda: ask_job(ev)), stop)
    sampling = threading.Event()
    sampling.set()

    def sample() -> None:
        while sampling.is_set():
            with lock:
                out.lag_versions += [x.arrived - x.answered for x in sessions]
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, name="peer-lag", daemon=True)
    sampler.start()
    k = 0
    while True:  # the k-th bar of the phase: session k % n, its bar k // n, as ours
        due = t0 + (k // n + (k % n) / n) * interval
        if due - t0 >= args.seconds:
            break
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
            continue
        x = sessions[k % n]
        x.arrived += 1
        jobs.put(lambda x=x, now=now: bar_job(x, now))
        out.offered += 1
        k += 1
    time.sleep(max(0.0, t0 + args.seconds - time.perf_counter()))
    out.seconds = time.perf_counter() - t0
    out.ingested = sum(x.answered for x in sessions)
    sampling.clear()
    stop.set()
    asker.join()
    for _ in threads:
        jobs.put(None)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()) + 60)
    sampler.join()
    out.done = sum(x.answered for x in sessions)
    out.stale_bars = out.offered - out.done
    out.lags_ms += [args.drain_s * 1000] * out.stale_bars
    return out
