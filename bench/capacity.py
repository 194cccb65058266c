"""`streamllm bench capacity`: how many instruments one engine watches, fresh, on this machine.

For each S of `--sessions`, a fresh engine on the default model opens S sessions of
queries/bars.toml's session (its render settings, system prompt, four labelled questions
and its adapter's series heads), each fed the shared recorded 1-minute BTC bars from its
own offset in the table, so no two sessions see the same bars. Bars go through a feed
`Attachment` each (the public contract: `EngineClient.push`, truths for the labels),
time-compressed `--speed` times, session i's bars falling i/S of a bar interval after
session 0's. One session in 16 also has a free-text standing question. Seeded Poisson
asks (bench/loadgen.py) ask standing questions by id and ad-hoc ones (the cold path)
while the bars flow; the same ad-hoc asks are asked again on the idle engine.

Sessions that cannot be opened (`AdmissionError`: the pool's cells) are reported, not
fatal: `opened@S` says how many were, the table the refusal; the rest of S is measured on
the sessions that opened, each at its context budget `--context` (a user's 2k setting).

The pool is a memory budget, `--kv-gb` of KV cells (14 GB, at most 60% of the machine's memory; at
most S x --context, at least EngineConfig's default; `--max-cells` sets it outright): the pool's
cells are only touched as they fill, so KV takes what the sessions hold, never more than the
budget, and the process stays under 20 GB at any S. Sessions are admitted by their working sets;
past what the budget holds, `--spill DIR` puts idle sessions on disk, each back on its next bar.

Per S (`{metric}@{S}`):
  opened                          sessions the engine admitted (of S)
  warmup_idle, idle_after_phase   1 when the engine went idle after the warm-up / the phase (0: it did not
                                  within --warmup-s / max(--drain-s, 60) s; what it waited on is printed, and
                                  the idle asks and the ramp are skipped)
  offered_bars_per_s              bars the feeds offered per second (the pace asked for)
  sustained_bars_per_s            bars whose push the engine had ingested by the phase's end / its seconds
  freshness_lag_p50/p99_ms        from a bar's arrival at its attachment to every standing answer of its
                                  session at a data_version holding it (bars still stale after --drain-s
                                  count as --drain-s; `stale_bars` says how many)
  lag_p50/p99_versions            pushed version minus each standing answer's version, sampled every 100 ms
  standing_ask_p50/p99_ms         a standing question asked by id while the bars flow (submit to answer)
  cold_ask_p50/p99_ms             an ad-hoc question (1 token) while the bars flow
  cold_ask_idle_p50/p99_ms        the same ad-hoc asks, one at a time, on the idle engine
  cold_loaded_over_idle_p99       their ratio
  rss_gb                          this process's resident memory at the end of the phase
  head_entry_share                entries the adapter's series heads decided without a prefill, of all entries
  spills_per_min, restores_per_min   sessions evicted to disk / restored (`--spill DIR`: a ResidentEngine
                                  that evicts idle sessions when an open or restore is refused, the pool is
                                  short or fewer than --restore-room sessions on disk could come back; else 0)
  spills_dropping_work            of those, how many dropped standing answers still being made (redone on
                                  restore, at the session's next bar or ask)
  asks_answered_on_disk           standing asks answered from a session on disk, without restoring it
  sessions_on_disk                how many were on disk at the end of the phase
  max_cells, kv_gb                the pool (cells) and the KV cells in use at the end of the phase (GB)
  rss_peak_gb                     this process's peak resident memory (VmHWM) at the end of S's run
  compaction_tokens_per_ingest_token  tokens compaction copies computed (swapped in or preempted: the
                                  engine's `compaction_tokens`) per ingested token; `compactions` how many swapped
  max_speed_x                     the fastest pace (x real time) held: from 2x --speed, doubling, each step
                                  at least two bars per session long; a pace is held when a bar's answers are
                                  fresh (p99) before its session's next bar arrives, no bar is coalesced or
                                  still stale after the drain, and lag_p99_versions <= 1. The ramp stops at
                                  the first miss, --max-speed or after --ramp-s (--speed itself counts when
                                  the main phase held it; 0 when it did not)

With --peer-url, the peer answers the same workload after ours at each S (peer_{metric}@{S},
peer_largest_fresh_s: bench/capacity_peer.py says how).
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.baselines import Peer
from bench.capacity_peer import measure_peer, peer_sessions
from bench.common import BTC_BARS, median, parse_ints, percentile, print_table, write_json
from bench.loadgen import AD_HOC_QUESTIONS, poisson_schedule, run_schedule
from bench.phase import Phase
from feeds.tables import TableSource
from streamllm.config import load_config, parse_question
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.outputs import AdmissionError
from streamllm.engine.prompt import PromptLayout
from streamllm.feeding.attach import Attachment, AttachSpec
from streamllm.model import load_model
from streamllm.model.adapter import pick_adapter
from streamllm.model.dtype import resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "queries" / "bars.toml"
FREE = {"id": "last_close", "text": "What is the last close price? Answer with the number only.",
        "threshold": 4.0, "max_tokens": 8}
FREE_EVERY = 16  # one session in 16 has the free-text standing question


@dataclass
class Feed:
    """One session's attachment, its bars, and which data_version holds which bars."""

    name: str
    att: Attachment
    bars: list
    questions: int  # standing questions registered
    next_bar: int = 0
    offered_at: list[float] = field(default_factory=list)  # arrival times of bars not yet in a push
    versions: list[tuple[int, int]] = field(default_factory=list)  # (data_version, bars pushed up to it)
    fresh: deque = field(default_factory=deque)  # (data_version, arrival time) of bars not yet fresh
    refused: int = 0  # pushes refused for want of cells to restore the session (retried)

    def offer(self, now: float) -> None:
        if self.next_bar >= len(self.bars):
            raise RuntimeError(f"bench capacity: session {self.name} ran out of bars ({len(self.bars)}); "
                               "lower --seconds, --speed or --max-speed, or use fewer sessions")
        self.att.offer(self.bars[self.next_bar])
        self.next_bar += 1
        self.offered_at.append(now)

    def flush(self) -> None:
        try:
            ack = self.att.flush()
        except AdmissionError:  # on disk and no room to come back yet: the attachment keeps the lines
            self.refused += 1
            return
        if ack is None:
            return
        pushed = (self.versions[-1][1] if self.versions else 0) + len(self.offered_at)
        self.versions.append((ack.data_version, pushed))
        for t in self.offered_at:
            self.fresh.append((ack.data_version, t))
        self.offered_at.clear()

    def bars_ingested(self, data_version: int) -> int:
        return max((n for v, n in self.versions if v <= data_version), default=0)


def paced(engine, feeds: list[Feed], speed: float, seconds: float, drain_s: float,
          asks: list | None = None, push_threads: int = 8) -> Phase:
    """Bars at `speed` x real time for `seconds` (asks on their schedule meanwhile), then up to `drain_s`
    for the last bars to become fresh. Bars arrive here on time; `push_threads` threads push them, each
    for its share of the sessions (as feeds on several connections would), so a push that waits (a
    session coming back from disk) holds up only its thread's sessions."""
    out = Phase()
    interval = 60.0 / speed  # one bar per session per interval
    n = len(feeds)
    for f in feeds:
        f.versions.clear()
        f.fresh.clear()
    pushing = threading.Event()
    pushing.set()
    stop_asks = threading.Event()
    lock = threading.Lock()

    def submit(ev) -> None:
        t0 = time.perf_counter()
        try:
            fut = engine.submit_ask(ev.session, ev.question, **({} if ev.standing else {"max_tokens": 1}))
        except Exception as exc:  # noqa: BLE001 - a refused ask is counted, the phase goes on
            out.ask_errors += 1
            out.ask_error = out.ask_error or f"{ev.session}: {exc!r}"
            return

        def done(f) -> None:
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                if f.exception() is not None:
                    out.ask_errors += 1
                    out.ask_error = out.ask_error or f"{ev.session}: {f.exception()!r}"
                elif ev.standing:
                    out.standing_ms.append(ms)
                else:
                    out.cold_ms.append(ms)
                    out.cold_asks.append((ev.session, ev.question))
        fut.add_done_callback(done)

    def watch() -> None:
        """Lags: each bar's arrival to its session's answers holding it; versions behind, every 100 ms."""
        next_sample = 0.0
        while pushing.is_set() or any(f.fresh for f in feeds):
            now = time.perf_counter()
            if now > deadline:
                break
            for f in feeds:
                if not f.fresh:
                    continue
                answers = engine.standing(f.name)
                version = min(a.data_version for a in answers) if len(answers) >= f.questions else 0
                while f.fresh and f.fresh[0][0] <= version:
                    out.lags_ms.append((now - f.fresh.popleft()[1]) * 1000)
            if pushing.is_set() and now >= next_sample:
                next_sample = now + 0.1
                for f in feeds:
                    pushed = engine.session_info(f.name).pushed_version
                    out.lag_versions += [pushed - a.data_version for a in engine.standing(f.name)]
            time.sleep(0.002)

    summaries0 = sum(f.att.stats.summaries for f in feeds)
    t0 = time.perf_counter()
    deadline = t0 + seconds + drain_s
    watcher = threading.Thread(target=watch, name="capacity-watch", daemon=True)
    watcher.start()
    asker = run_schedule(asks, submit, stop_asks) if asks else None
    inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(max(1, min(push_threads, n)))]

    def push(inbox: queue.SimpleQueue) -> None:
        """Offer and push the bars of this thread's sessions as they arrive; retry held-back lines."""
        waiting: set[int] = set()  # feeds whose lines the attachment held back (ingest lagging, or refused)
        while True:
            try:
                bar = inbox.get(timeout=0.005) if waiting else inbox.get()
            except queue.Empty:
                bar = ()
            if bar is None:
                return
            if bar and time.perf_counter() > deadline:  # past the phase and its drain: never pushed, stale
                with lock:
                    out.unpushed += 1
                continue
            if bar:
                i, arrived = bar
                feeds[i].offer(arrived)
                feeds[i].flush()
                if feeds[i].offered_at:
                    waiting.add(i)
            for i in list(waiting):
                if bar and bar[0] == i:
                    continue
                feeds[i].flush()
                if not feeds[i].att.pending_events and not feeds[i].offered_at:
                    waiting.discard(i)

    pushers = [threading.Thread(target=push, args=(inbox,), name=f"capacity-push-{j}", daemon=True)
               for j, inbox in enumerate(inboxes)]
    for t in pushers:
        t.start()
    k = 0  # the k-th bar of the phase, across sessions: session k % n, its bar k // n
    while True:
        due = t0 + (k // n + (k % n) / n) * interval
        if due - t0 >= seconds:
            break
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
            continue
        inboxes[(k % n) % len(inboxes)].put((k % n, now))
        out.offered += 1
        k += 1
    for inbox in inboxes:
        inbox.put(None)
    for t in pushers:
        t.join()
    time.sleep(max(0.0, t0 + seconds - time.perf_counter()))
    out.seconds = time.perf_counter() - t0
    out.ingested = sum(f.bars_ingested(engine.session_info(f.name).data_version) for f in feeds)
    pushing.clear()
    stop_asks.set()
    if asker is not None:
        asker.join()
    for f in feeds:  # the held-back bars go in now; they are late, and their lags say so
        while f.offered_at and time.perf_counter() < deadline:
            f.flush()
            if f.offered_at:
                time.sleep(0.01)
    watcher.join()
    out.stale_bars = sum(len(f.fresh) + len(f.offered_at) for f in feeds) + out.unpushed
    out.lags_ms += [drain_s * 1000] * out.stale_bars
    out.summaries = sum(f.att.stats.summaries for f in feeds) - summaries0
    out.idle_after = engine.wait_idle(timeout=max(drain_s, 60.0))
    return out


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, math.nan) - before.get(key, math.nan)


def stuck(engine) -> str:
    """What an engine that does not go idle is waiting for, from its stats."""
    st = engine.stats()
    keys = ("cells_free", "blocked_for_cells", "ingest_backlog_tokens", "questions_waiting", "questions_running",
            "queue_background", "sessions_stuck",
            "compactions_running")
    return ", ".join(f"{k} {st[k]}" for k in keys if k in st)


def ask_ms(engine, session: str, text: str) -> float:
    """An ad-hoc 1-token ask, submit to answer, as the loaded phase times it."""
    t0 = time.perf_counter()
    engine.ask(session, text, max_tokens=1, timeout=600)
    return (time.perf_counter() - t0) * 1000


def rss_gb(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS), or its peak since it started (VmHWM), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def kv_bytes_per_token(loaded) -> int:
    """Bytes of KV one token takes in the pool on this machine (keys and values, every layer)."""
    c = loaded.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dtype = resolve_dtype(None, "cuda" if torch.cuda.is_available() else "cpu").dtype
    return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def default_kv_gb(machine_bytes: int | None = None) -> float:
    """--kv-gb's default: 14 GB (512 sessions of ~1,000 warm tokens take 11.5 GB of KV), but at most 60% of
    the machine's memory, so a smaller machine refuses or spills sessions instead of running out."""
    if machine_bytes is None:
        try:
            machine_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system: the budget alone
            return 14.0
    return round(min(14.0, 0.6 * machine_bytes / 2**30), 1)


def pool_cells(s: int, context: int, bytes_per_token: int, kv_gb: float) -> int:
    """The KV pool for S sessions: the memory budget (--kv-gb of cells), but no more than every session
    at its whole context and no less than EngineConfig's default. Cells are only touched as they fill
    (engine/kv.py), so the budget bounds what KV can take, not what it takes at start."""
    budget = int(kv_gb * 2**30) // bytes_per_token
    return max(EngineConfig().max_cells, min(budget, s * context))


def open_sessions(engine, spec, s: int, bars: list, args: argparse.Namespace) -> tuple[list[Feed], str]:
    """Up to S sessions of `spec`, each with its own stretch of the bars, opened and registered from
    --open-threads threads (the core drains every command waiting between two steps, so a busy core
    serves many opens per step); those the engine refused are counted, the first refusal returned."""
    free = parse_question(FREE)
    slices = session_bars(bars, s, args)
    t0 = time.perf_counter()
    done = [0]
    lock = threading.Lock()

    def open_one(i: int) -> Feed | str:
        name = f"s{i:03d}"
        try:
            engine.open_session(name, spec.system_prompt, max_context=args.context)
        except AdmissionError as exc:
            return f"session {i + 1} of {s}: {exc}"
        questions = [*spec.questions, *([free] if i % FREE_EVERY == 0 else [])]
        for q in questions:
            engine.register(name, q)
        att = Attachment(engine, AttachSpec.of(spec, session=name), questions=tuple(spec.questions))
        with lock:
            done[0] += 1
            if done[0] % 64 == 0:
                print(f"  S={s}: {done[0]} sessions open in {time.perf_counter() - t0:.0f} s, rss "
                      f"{rss_gb():.2f} GB, {engine.stats().get('sessions_evicted', 0)} on disk", flush=True)
        return Feed(name, att, slices[i], len(questions))

    opened: dict[int, Feed | str] = {}
    todo = list(range(s))
    for _ in range(1 + (args.open_retries if args.spill else 0)):  # with --spill a refusal may pass later
        with ThreadPoolExecutor(max_workers=args.open_threads, thread_name_prefix="capacity-open") as pool:
            opened.update(zip(todo, pool.map(open_one, todo), strict=True))
        todo = [i for i in todo if isinstance(opened[i], str)]
        if not todo:
            break
        print(f"  S={s}: {len(todo)} opens refused ({opened[todo[0]]}); trying them again", flush=True)
    refusals = [o for _, o in sorted(opened.items()) if isinstance(o, str)]
    refused = f"{len(refusals)} of {s} refused; the first: {refusals[0]}" if refusals else ""
    return [o for _, o in sorted(opened.items()) if isinstance(o, Feed)], refused


def session_bars(bars: list, s: int, args: argparse.Namespace) -> list[list]:
    """Each of S sessions' bars: its own stretch of the table (warm-up and phase), offset by session."""
    need = args.warmup_bars + bars_per_session(args)
    stride = (len(bars) - need) // s
    if stride < 1:
        raise SystemExit(f"bench capacity: {len(bars)} bars cannot give {s} sessions {need} bars each")
    return [bars[i * stride: i * stride + need] for i in range(s)]


def bars_per_session(args: argparse.Namespace) -> int:
    """Bars one session can take in the main phase and the ramp (each step at most --ramp-s long)."""
    main = math.ceil(args.seconds * args.speed / 60) + 1
    ramp = math.ceil(args.ramp_s * args.max_speed / 60) + 2 * int(math.log2(max(args.max_speed / args.speed, 1)) + 2)
    return main + ramp


def measure(loaded, adapter, spec, bars: list, s: int, args: argparse.Namespace) -> tuple[dict[str, float], list]:
    cells = args.max_cells or pool_cells(s, args.context, kv_bytes_per_token(loaded), args.kv_gb)
    config = EngineConfig(max_context=args.context, max_cells=cells,
                          scheduler=SchedulerConfig(cut_in_share=args.cut_in_share))
    engine = Engine(loaded, config, adapter=adapter)
    print(f"  S={s}: a pool of {cells} cells ({cells * kv_bytes_per_token(loaded) / 2**30:.1f} GB of KV at most)",
          flush=True)
    if args.spill:
        from streamllm.durability.resident import ResidentEngine

        engine = ResidentEngine(engine, Path(args.spill) / f"S{s}", auto_evict=True, restore_room=args.restore_room,
                                settle_s=args.settle_s)
    m: dict[str, float] = {}
    try:
        feeds, refused = open_sessions(engine, spec, s, bars, args)
        m["opened"] = len(feeds)
        if refused:
            print(f"  S={s}: opened {len(feeds)}; {refused}", flush=True)
        if not feeds:
            return m, [s, 0, *[math.nan] * 9, refused]
        print(f"  S={s}: {len(feeds)} sessions, {args.warmup_bars} bars of warm-up each ...", flush=True)
        t0 = time.perf_counter()

        def warm(f: Feed) -> bool:
            """Its warm-up bars in; a push refused (on disk, no room to come back yet) is retried."""
            for _ in range(args.warmup_bars):
                f.offer(0.0)
            f.flush()
            while f.att.pending_events and time.perf_counter() - t0 < args.warmup_s:
                time.sleep(0.1)
                f.flush()
            f.offered_at.clear()
            return not f.att.pending_events

        with ThreadPoolExecutor(max_workers=args.push_threads, thread_name_prefix="capacity-warm") as pool:
            pushed = all(list(pool.map(warm, feeds)))
        left = max(1.0, args.warmup_s - (time.perf_counter() - t0))
        m["warmup_idle"] = int(pushed and engine.wait_idle(timeout=left))
        print(f"  S={s}: warm-up in after {time.perf_counter() - t0:.0f} s (idle: {m['warmup_idle']}), rss "
              f"{rss_gb():.2f} GB, {engine.stats().get('sessions_evicted', 0)} on disk", flush=True)
        if not m["warmup_idle"]:
            print(f"  S={s}: the warm-up did not finish in {args.warmup_s:g} s ({stuck(engine)}); measuring anyway",
                  flush=True)
        standing = {f.name: [q.id for q in engine.standing_questions(f.name)] for f in feeds}
        asks = poisson_schedule(args.seed + s, args.ask_rate, args.seconds, standing, standing_share=0.5,
                                ad_hoc=AD_HOC_QUESTIONS)
        before = engine.stats()
        print(f"  S={s}: {args.speed:g}x real time ({len(feeds) * args.speed / 60:.2f} bars/s) for "
              f"{args.seconds:g} s, {len(asks)} asks ...", flush=True)
        main = paced(engine, feeds, args.speed, args.seconds, args.drain_s, asks, args.push_threads)
        m["rss_gb"] = rss_gb()
        if main.ask_errors:
            print(f"  S={s}: {main.ask_errors} asks failed; the first: {main.ask_error}", flush=True)
        after = engine.stats()
        m["max_cells"] = after["cells_total"]
        m["kv_gb"] = (after["cells_total"] - after["cells_free"]) * after["kv_bytes_per_token"] / 2**30
        m["sessions_on_disk"] = after.get("sessions_evicted", 0)
        minutes = main.seconds / 60
        idle = [ask_ms(engine, session, text) for session, text in main.cold_asks] if main.idle_after else []
        if not main.idle_after:
            print(f"  S={s}: not idle {max(args.drain_s, 60):g} s after the phase ({stuck(engine)}): no idle asks, "
                  "no ramp", flush=True)
        ingest = after["tokens_ingest"] - before["tokens_ingest"]
        copies = delta(before, after, "compaction_tokens")
        m.update({
            "offered_bars_per_s": main.offered / main.seconds, "sustained_bars_per_s": main.ingested / main.seconds,
            "freshness_lag_p50_ms": median(main.lags_ms), "freshness_lag_p99_ms": percentile(main.lags_ms, 99),
            "stale_bars": main.stale_bars,
            "lag_p50_versions": median(main.lag_versions), "lag_p99_versions": percentile(main.lag_versions, 99),
            "standing_ask_p50_ms": median(main.standing_ms), "standing_ask_p99_ms": percentile(main.standing_ms, 99),
            "cold_ask_p50_ms": median(main.cold_ms), "cold_ask_p99_ms": percentile(main.cold_ms, 99),
            "cold_ask_idle_p50_ms": median(idle), "cold_ask_idle_p99_ms": percentile(idle, 99),
            "cold_loaded_over_idle_p99": percentile(main.cold_ms, 99) / percentile(idle, 99) if idle else math.nan,
            "ask_errors": main.ask_errors, "idle_after_phase": int(main.idle_after),
            "push_refusals": sum(f.refused for f in feeds),
            "spills_per_min": sum(delta(before, after, k) for k in ("auto_evictions", "pressure_spills")) / minutes
            if args.spill else 0.0,
            "restores_per_min": delta(before, after, "auto_restores") / minutes if args.spill else 0.0,
            "spills_dropping_work": delta(before, after, "evictions_dropped_work") if args.spill else 0.0,
            "asks_answered_on_disk": delta(before, after, "answered_on_disk") if args.spill else 0.0,
            "compaction_tokens_per_ingest_token": copies / ingest if ingest else math.nan,
            "compactions": after["compactions"] - before["compactions"],
            "head_entry_share": delta(before, after, "head_only_entries") / max(delta(before, after, "entries_computed"), 1),
        })
        m["max_speed_x"] = ramp(engine, feeds, main, args, s)
        m["failed_steps"] = engine.stats()["failed_steps"]
        m["rss_peak_gb"] = rss_gb("VmHWM")
    finally:
        engine.shutdown()
    row = [s, len(feeds), m["sustained_bars_per_s"], m["freshness_lag_p99_ms"], m["lag_p99_versions"],
           m["standing_ask_p99_ms"], m["cold_ask_p99_ms"], m["cold_ask_idle_p99_ms"], m["rss_gb"],
           m["compaction_tokens_per_ingest_token"], m["max_speed_x"], refused or "-"]
    return m, row


def ramp(engine, feeds: list[Feed], main: Phase, args: argparse.Namespace, s: int) -> float:
    """The fastest pace held, doubling from --speed (held by the main phase) within --ramp-s."""
    if not main.held(60 / args.speed) or not main.idle_after:
        return 0.0
    best, speed = args.speed, args.speed * 2
    budget_end = time.perf_counter() + args.ramp_s
    while speed <= args.max_speed:
        seconds = max(args.step_seconds, 2 * 60 / speed)
        if time.perf_counter() + seconds > budget_end:
            break
        step = paced(engine, feeds, speed, seconds, args.drain_s, push_threads=args.push_threads)
        print(f"  S={s}: {speed:g}x: offered {step.offered}, ingested {step.ingested}, lag p99 "
              f"{percentile(step.lag_versions, 99):.1f} versions, fresh p99 {percentile(step.lags_ms, 99):.0f} ms "
              f"-> {'held' if step.held(60 / speed) else 'missed'}", flush=True)
        if not step.held(60 / speed) or not step.idle_after:
            break
        best, speed = speed, speed * 2
    return best


def run(args: argparse.Namespace) -> tuple[dict[str, float], dict]:
    loaded = load_model(args.model)
    config = load_config(args.config)
    spec = config.sessions[0]
    notes: list[str] = []
    chosen = pick_adapter(None, config.adapter, loaded.name, warn=notes.append, config=config)
    adapter = None if chosen is None else str(chosen.path)
    for note in notes:
        print(f"note: {note}", flush=True)
    bars = TableSource(args.data, "bar", instrument=spec.instrument).events()
    metrics: dict[str, float] = {}
    rows, peer_rows = [], []
    ours_s = parse_ints(args.sessions) if args.sessions else []
    peer_s = parse_ints(args.peer_sessions) if args.peer_sessions else ours_s
    peer = layout = None
    if args.peer_url:
        peer, layout = Peer(args.peer_url, loaded.tokenizer), PromptLayout(loaded.tokenizer)
    for s in sorted(set(ours_s) | set(peer_s if peer else [])):  # ours then the peer's at each S, one run
        if s in ours_s:
            m, row = measure(loaded, adapter, spec, bars, s, args)
            metrics.update({f"{k}@{s}": v for k, v in m.items()})
            rows.append(row)
        if peer is not None and s in peer_s:
            sessions = peer_sessions(layout, spec, session_bars(bars, s, args), parse_question(FREE), FREE_EVERY)
            m, row = measure_peer(peer, layout, sessions, s, args)
            metrics.update({f"peer_{k}@{s}": v for k, v in m.items()})
            peer_rows.append(row)
    if rows:
        print_table(f"bench capacity: {args.model}, {args.context}-token sessions, {args.speed:g}x real time, "
                    f"{args.seconds:g} s per S",
                    ["S", "opened", "bars/s", "fresh p99 ms", "lag p99 v", "standing p99 ms", "cold p99 ms",
                     "idle cold p99 ms", "rss GB", "compact tok/ingest", "max speed x", "refused"], rows)
    if peer_rows:
        held = [r[0] for r in peer_rows if r[-1] == "yes"]
        metrics["peer_largest_fresh_s"] = max(held, default=0)
        print_table(f"the peer at {args.peer_url} on the same workload ({args.speed:g}x real time): every bar's "
                    "standing questions asked as prompts",
                    ["S", "bars/s", "fresh p99 ms", "lag p99 bars", "standing p99 ms", "cold p50 ms", "cold p99 ms",
                     "warm-up s", "fresh"], peer_rows)
    meta = {"adapter": adapter, "adapter_notes": notes, "config": str(args.config), "data": str(args.data),
            "session_context": args.context, "max_cells": args.max_cells, "kv_gb_budget": args.kv_gb,
            "context_note": f"each session opened with max_context={args.context} (a user's setting); the pool "
                            "is --kv-gb of cells, at most S x max_context, at least EngineConfig's, unless "
                            "--max-cells (max_cells@S says which)", "spill": args.spill}
    return metrics, meta


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", default="64,128,256,512")
    p.add_argument("--speed", type=float, default=1.0, help="x real time of the 1-minute bars (main phase)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the main phase per S")
    p.add_argument("--context", type=int, default=2048, help="each session's max_context")
    p.add_argument("--max-cells", type=int, default=0,
                   help="the KV pool in cells (default: --kv-gb of them, at most S x --context)")
    p.add_argument("--kv-gb", type=float, default=default_kv_gb(),
                   help="the KV pool's memory budget when --max-cells is not given (default: 14 GB, where 512 "
                        "sessions' warm working sets fit and rss stays under 20 GB; at most 60%% of this machine's "
                        "memory)")
    p.add_argument("--open-threads", type=int, default=8, help="threads opening and registering sessions")
    p.add_argument("--push-threads", type=int, default=8, help="threads pushing the bars, each for its sessions")
    p.add_argument("--open-retries", type=int, default=2,
                   help="with --spill: passes over the opens refused (every candidate to spill was busy)")
    p.add_argument("--warmup-bars", type=int, default=32, help="bars each session holds before the phase")
    p.add_argument("--ask-rate", type=float, default=2.0, help="asks/s in the main phase (half standing)")
    p.add_argument("--drain-s", type=float, default=30.0, help="after a phase, how long bars may take to be fresh")
    p.add_argument("--warmup-s", type=float, default=900.0, help="how long the warm-up may take to be ingested")
    p.add_argument("--max-speed", type=float, default=64.0, help="the ramp's highest pace (x real time)")
    p.add_argument("--step-seconds", type=float, default=10.0, help="shortest ramp step")
    p.add_argument("--ramp-s", type=float, default=120.0, help="the ramp's time budget per S")
    p.add_argument("--spill", help="a folder: run a ResidentEngine that evicts idle sessions there when full")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="with --spill: how long an open or restore waits for busy sessions to go idle and make room")
    p.add_argument("--restore-room", type=int, default=2,
                   help="with --spill: sessions on disk the pool keeps room for, spilling others ahead of their bars")
    p.add_argument("--cut-in-share", type=float, default=SchedulerConfig().cut_in_share,
                   help="how long questions may cut into a running step of ingest, as a share of its own time "
                        "(0: they wait for it)")
    p.add_argument("--peer-url", help="an OpenAI-compatible server on the same model (make peer, make peer-vllm): "
                                      "after ours at each S, the same workload answered by it (bench/capacity_peer.py)")
    p.add_argument("--peer-sessions", default="",
                   help="the S values the peer runs (default: --sessions'; '' for --sessions: the peer alone)")
    p.add_argument("--peer-slots", type=int, default=0,
                   help="pin session i to the peer's slot i %% N (llama-server's id_slot; start it with "
                        "PEER_SLOTS=N); 0: the server places requests")
    p.add_argument("--peer-workers", type=int, default=8, help="client threads asking the peer")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--config", default=str(CONFIG), help="the session (render, prompt, questions, adapter) copied")
    p.add_argument("--data", default=str(BTC_BARS), help="a table of 1-minute bars")
    p.add_argument("--quick", action="store_true", help="a smoke run: short phases, a fast pace")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.speed, args.warmup_bars, args.drain_s, args.warmup_s = 2.0, 120.0, 26, 10.0, 60.0
        args.max_speed, args.step_seconds, args.ramp_s, args.ask_rate = 480.0, 0.5, 2.0, 10.0
    if not Path(args.data).exists():
        raise SystemExit(f"bench capacity: {args.data} is missing (the shared data folder, ../shared/data)")
    if not args.sessions and not (args.peer_url and args.peer_sessions):
        raise SystemExit("bench capacity: --sessions is empty (and no --peer-url with --peer-sessions)")
    metrics, meta = run(args)
    write_json(args.json, metrics, {"bench": "capacity", "model": args.model, "speed": args.speed,
                                    "seconds": args.seconds, "quick": args.quick, **meta})
    return 0
