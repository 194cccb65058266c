"""`streamllm bench stress`: a seeded storm of callers against one engine, then the verdict.

Threads and asyncio tasks push / ask (half the async asks cancelled at random moments) /
register / unregister / close+reopen / evict at random against several sessions, while a
pusher feeds two small "hot" sessions at ~100 lines/s so they compact again and again.
The engine runs `check_integrity()` after every step. Every call has a timeout: a caller
still waiting after it is a hang. At the end:

  stress_engine_deaths      1 if the core thread died (core_alive == 0)
  stress_hung_callers       calls that outlived their timeout (never resolved)
  stress_failed_steps       forwards that failed in the core
  stress_pushes_refused     pushes refused for any reason but a closed (or evicted-and-closed) session
  stress_integrity_failures check_integrity() at the end (0 or 1)
  stress_unexpected_errors  errors of any kind not in EXPECTED (see `errors` for the messages)
  stress_acked_pushes_lost  pushes acked to the caller that then failed in the core (logged)
  stress_engine_errors_logged  anything the engine logged at ERROR
  stress_asks_ok / _cancelled / _failed, stress_compactions, stress_evictions, ... (activity)

`run_stress(engine_factory?, StressConfig)` returns (counters, error messages by kind).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import re
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from bench.common import market_lines, print_table, write_json
from streamllm.config import QuestionSpec
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import Engine, EngineConfig, SchedulerConfig

# Failures a caller may legitimately see while others close, reopen and evict its session.
EXPECTED = (
    r"^(SessionError|SnapshotError): .*no session named '…'; open it first",
    r"^SessionError: .*session '…' was closed",
    r"^SessionError: .*session '…' is already open",
    r"^SnapshotError: .*session '…' is not idle",  # evict refused: work in flight
    r"^ValueError: session '…' already has a standing question '…'",
    r"^KeyError: .*session '…' has no standing question '…'",
    r"^CancelledError",
)
QUESTIONS = (
    QuestionSpec("dir", "Is the price going up or down? Answer up or down.", ("up", "down")),
    QuestionSpec("vol", "Is volume rising? Answer yes or no.", ("yes", "no")),
    QuestionSpec("free", "Summarize the last bar in three words.", max_tokens=3),
)
COLD = ("What was the last close?", "Describe the trend.", "Any spike in volume?")


@dataclass(slots=True)
class StressConfig:
    seconds: float = 20.0
    seed: int = 0
    model: str = "tiny"
    threads: int = 3  # random-operation threads
    tasks: int = 4  # asyncio ask tasks (one event loop)
    sessions: int = 4  # churned sessions (closed, reopened, evicted)
    hot_sessions: int = 2  # fed by the pusher, never closed
    lines_per_s: float = 100.0  # the pusher's total rate over the hot sessions
    hot_max_context: int = 640
    max_context: int = 1024
    max_cells: int = 16384
    call_timeout_s: float = 30.0
    ingest_log: bool = False  # every push, open, close, evict/restore also goes through an IngestLog


@dataclass(slots=True)
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # normalized message -> count
    inflight: dict[int, tuple[str, float]] = field(default_factory=dict)
    ids: int = 0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def error(self, op: str, exc: BaseException) -> str:
        kind = normalize(exc)
        with self.lock:
            self.errors[f"{op}: {kind}"] += 1
        return kind

    @contextlib.contextmanager
    def track(self, op: str):
        with self.lock:
            self.ids += 1
            key = self.ids
            self.inflight[key] = (op, time.monotonic())
        try:
            yield
        finally:
            with self.lock:
                self.inflight.pop(key, None)

    def hung(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        with self.lock:
            return [op for op, t0 in self.inflight.values() if now - t0 > timeout_s]


def normalize(exc: BaseException) -> str:
    """Error kind: class name + message with names and numbers blanked, so equal kinds group."""
    if isinstance(exc, (CancelledError, asyncio.CancelledError)):
        return "CancelledError"
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\d+", "N", text)
    return f"{type(exc).__name__}: {text}"


def expected(kind: str) -> bool:
    return any(re.search(p, kind) for p in EXPECTED)


class Stress:
    def __init__(self, engine: ResidentEngine, cfg: StressConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.tally = _Tally()
        self.stop = threading.Event()
        self.churn = [f"c{i}" for i in range(cfg.sessions)]
        self.hot = [f"hot{i}" for i in range(cfg.hot_sessions)]
        self.lines = market_lines(seed=cfg.seed, instruments=("BTCUSDT", "ETHUSDT"))
        self._lines_lock = threading.Lock()
        # Question ids a worker saw registered, per session: an unregister picks a session and one of
        # them (else a random id), so that on a slow machine, with few operations in the storm,
        # unregisters still meet registered questions. Only a hint for choosing: the engine decides.
        self.registered: dict[str, set[str]] = {}

    def next_lines(self, n: int) -> list[str]:
        with self._lines_lock:
            return [next(self.lines) for _ in range(n)]

    # -- operations (each one counted, each failure classified) --------------------------
    def _op(self, op: str, fn) -> bool:
        with self.tally.track(op):
            try:
                fn()
            except (FutureTimeout, TimeoutError):
                self.tally.add("hung_callers")
                self.tally.error(op, TimeoutError("no answer within the call timeout"))
                return False
            except Exception as exc:
                kind = self.tally.error(op, exc)
                if op == "push" and not kind.startswith("SessionError: no session named"):
                    self.tally.add("pushes_refused")
                if not expected(kind):
                    self.tally.add("unexpected_errors")
                if op.startswith("ask"):
                    self.tally.add("asks_failed")
                return False
        self.tally.add(f"{op}_ok")
        return True

    def push(self, name: str, n: int) -> None:
        self._op("push", lambda: self.engine.push(name, self.next_lines(n)))

    def ask(self, rng: random.Random, name: str) -> None:
        q = rng.choice([s.text for s in QUESTIONS] + list(COLD))
        t = self.cfg.call_timeout_s
        self._op("ask", lambda: self.engine.ask(name, q, max_tokens=rng.randint(1, 4), timeout=t))

    def random_op(self, rng: random.Random) -> None:
        e, name = self.engine, rng.choice(self.churn)
        r = rng.random()
        if r < 0.30:
            self.push(name, rng.randint(1, 4))
        elif r < 0.55:
            self.ask(rng, rng.choice(self.churn + self.hot))
        elif r < 0.67:
            question = rng.choice(QUESTIONS)
            if self._op("register", lambda: e.register(name, question)):
                self.registered.setdefault(name, set()).add(question.id)
        elif r < 0.77:
            # A session known to hold a question, if any: one picked at random mostly holds none yet,
            # and a 20 s storm on a slow machine then saw no unregister succeed (CI, 2026-12-03).
            holding = sorted(k for k, ids in self.registered.items() if ids)
            name = rng.choice(holding) if holding else name
            seen = sorted(self.registered.get(name, ()))
            question_id = rng.choice(seen) if seen else rng.choice(QUESTIONS).id
            if self._op("unregister", lambda: e.unregister(name, question_id)):
                self.registered.get(name, set()).discard(question_id)
        elif r < 0.87:
            if self._op("close", lambda: e.close_session(name)):
                self.registered.pop(name, None)
                time.sleep(rng.random() * 0.05)
                self._op("open", lambda: e.open_session(name, max_context=self.cfg.max_context))
        else:
            self._op("evict", lambda: e.evict_session(name))

    # -- the actors --------------------------------------------------------------------
    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            self.random_op(rng)
            time.sleep(rng.random() * 0.02)

    def pusher(self) -> None:
        """~lines_per_s lines spread over the hot sessions, in batches of 1-3 lines, paced."""
        rng = random.Random(self.cfg.seed + 1000)
        t0, sent = time.monotonic(), 0
        while not self.stop.is_set():
            n = rng.randint(1, 3)
            self.push(self.hot[sent % len(self.hot)], n)
            sent += n
            self.tally.add("hot_lines", n)
            delay = t0 + sent / self.cfg.lines_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def asyncio_thread(self) -> None:
        asyncio.run(self._async_main())

    async def _async_main(self) -> None:
        await asyncio.gather(*(self._ask_task(random.Random(self.cfg.seed * 7919 + i)) for i in range(self.cfg.tasks)))

    async def _ask_task(self, rng: random.Random) -> None:
        t = self.cfg.call_timeout_s
        while not self.stop.is_set():
            name = rng.choice(self.churn + self.hot)
            q = rng.choice([s.text for s in QUESTIONS] + list(COLD))
            with self.tally.track("ask_async"):
                try:
                    task = asyncio.ensure_future(self.engine.ask_async(name, q, max_tokens=rng.randint(1, 6)))
                except Exception as exc:  # refused synchronously (closed session, ...)
                    self._async_failed(exc)
                    continue
                cancel = rng.random() < 0.5
                try:
                    if cancel:
                        done, _ = await asyncio.wait({task}, timeout=rng.random() * 0.1)
                        if not done:
                            task.cancel()
                    await asyncio.wait_for(task, t)
                    self.tally.add("asks_ok")
                except asyncio.CancelledError as exc:
                    if cancel:
                        self.tally.add("asks_cancelled")
                    else:  # nobody cancelled it: the engine did, which it must not
                        self._async_failed(RuntimeError(f"ask cancelled by the engine ({exc!r})"))
                except TimeoutError:
                    self.tally.add("hung_callers")
                    self.tally.error("ask_async", TimeoutError("no answer within the call timeout"))
                except Exception as exc:
                    self._async_failed(exc)
            await asyncio.sleep(rng.random() * 0.02)

    def _async_failed(self, exc: BaseException) -> None:
        self.tally.add("asks_failed")
        if not expected(self.tally.error("ask_async", exc)):
            self.tally.add("unexpected_errors")

    # -- the run -----------------------------------------------------------------------
    def setup(self) -> None:
        e = self.engine
        for name in self.hot:
            e.open_session(name, max_context=self.cfg.hot_max_context)
            for spec in QUESTIONS[:2]:
                e.register(name, spec)
        for name in self.churn:
            e.open_session(name, max_context=self.cfg.max_context)
            e.push(name, self.next_lines(3))
            e.register(name, QUESTIONS[0])

    def run(self) -> dict[str, float]:
        cfg = self.cfg
        self.setup()
        actors = [threading.Thread(target=self.worker, args=(cfg.seed * 100 + i,), daemon=True)
                  for i in range(cfg.threads)]
        actors += [threading.Thread(target=self.pusher, daemon=True),
                   threading.Thread(target=self.asyncio_thread, daemon=True)]
        t0 = time.monotonic()
        for a in actors:
            a.start()
        self.stop.wait(cfg.seconds)
        self.stop.set()
        deadline = time.monotonic() + cfg.call_timeout_s + 5
        for a in actors:
            a.join(max(0.1, deadline - time.monotonic()))
        wall = time.monotonic() - t0
        hung_now = self.tally.hung(cfg.call_timeout_s)
        stuck_threads = sum(a.is_alive() for a in actors)
        return self.verdict(wall, len(hung_now) + stuck_threads)

    def verdict(self, wall: float, stuck: int) -> dict[str, float]:
        e, c = self.engine, self.tally.counts
        integrity = 0
        stats = e.stats()
        if stats["core_alive"]:
            try:
                e.wait_idle(timeout=self.cfg.call_timeout_s)
                e.engine.check_integrity()
            except Exception as exc:
                integrity = 1
                self.tally.error("check_integrity", exc)
            stats = e.stats()
            compactions = sum(e.session_info(n).compactions for n in self.hot)
        else:
            integrity, compactions = 1, 0
        asks_ok = c["asks_ok"] + c["ask_ok"]
        return {
            "stress_seconds": wall,
            "stress_engine_deaths": float(1 - stats["core_alive"]),
            "stress_hung_callers": float(c["hung_callers"] + stuck),
            "stress_failed_steps": float(stats["failed_steps"]),
            "stress_pushes_refused": float(c["pushes_refused"]),
            "stress_integrity_failures": float(integrity),
            "stress_unexpected_errors": float(c["unexpected_errors"]),
            "stress_asks_ok": float(asks_ok),
            "stress_asks_cancelled": float(c["asks_cancelled"]),
            "stress_asks_failed": float(c["asks_failed"]),
            "stress_pushes_ok": float(c["push_ok"]),
            "stress_hot_lines_per_s": c["hot_lines"] / wall,
            "stress_compactions": float(compactions),
            "stress_registers_ok": float(c["register_ok"]),
            "stress_unregisters_ok": float(c["unregister_ok"]),
            "stress_reopens": float(c["open_ok"]),
            "stress_evictions": float(c["evict_ok"]),
            "stress_steps": float(stats["steps"]),
            "stress_commands": float(stats["commands"]),
        }


class _ErrorLog(logging.Handler):
    """Counts what the engine logs at ERROR: an acked push that failed in the core is lost data."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages[record.getMessage()] += 1

    def count(self, needle: str = "") -> int:
        return sum(v for k, v in self.messages.items() if needle in k)


def run_stress(cfg: StressConfig, model=None) -> tuple[dict[str, float], dict[str, int]]:
    """Run the scenario on a fresh engine; returns (counters, {"op: error kind": count})."""
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.model import load_model

    loaded = model if model is not None else load_model(cfg.model, progress=False)
    errors_logged = _ErrorLog()
    logger = logging.getLogger("streamllm")
    logger.addHandler(errors_logged)
    with tempfile.TemporaryDirectory(prefix="streamllm-stress-") as tmp:
        log = IngestLog(f"{tmp}/log") if cfg.ingest_log else None
        engine = ResidentEngine(Engine(loaded, EngineConfig(max_cells=cfg.max_cells, block_size=16, max_context=cfg.max_context, check_integrity_every_step=True, scheduler=SchedulerConfig(chunk_tokens=64, step_tokens=192)), ingest_log=log), f"{tmp}/evicted")
        try:
            stress = Stress(engine, cfg)
            metrics = stress.run()
        finally:
            engine.shutdown()
            if log is not None:
                log.close()
            logger.removeHandler(errors_logged)
    metrics["stress_acked_pushes_lost"] = float(errors_logged.count("a push the engine acked failed"))
    metrics["stress_engine_errors_logged"] = float(errors_logged.count())
    errors = dict(stress.tally.errors)
    errors.update({f"logged: {normalize(RuntimeError(m))}": n for m, n in errors_logged.messages.items()})
    return metrics, errors


def unexpected_errors(errors: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in errors.items() if not expected(k.split(": ", 1)[1])}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench stress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--threads", type=int, default=3)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--lines-per-s", type=float, default=100.0)
    p.add_argument("--ingest-log", action="store_true", help="run the engine with an ingest log")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cfg = StressConfig(seconds=args.seconds, seed=args.seed, model=args.model, threads=args.threads,
                       tasks=args.tasks, lines_per_s=args.lines_per_s, ingest_log=args.ingest_log)
    metrics, errors = run_stress(cfg)
    print_table(f"bench stress: {args.model}, {args.seconds:.0f} s, seed {args.seed}", ["counter", "value"],
                [[k, v] for k, v in metrics.items()])
    print_table("errors callers saw (op: kind)", ["error", "count", "expected"],
                [[k, v, expected(k.split(": ", 1)[1])] for k, v in sorted(errors.items())])
    write_json(args.json, metrics, {"bench": "stress", "model": args.model, "seed": args.seed,
                                    "errors": errors})
    bad = ("stress_engine_deaths", "stress_hung_callers", "stress_failed_steps", "stress_pushes_refused",
           "stress_integrity_failures", "stress_unexpected_errors", "stress_acked_pushes_lost",
           "stress_engine_errors_logged")
    return 1 if any(metrics[k] for k in bad) or metrics["stress_compactions"] == 0 else 0
