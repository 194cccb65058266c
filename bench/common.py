"""What every benchmark shares: percentiles, machine facts, the JSON report and the table.

Benchmarks report ratios measured side by side in one run and medians of several
repetitions (these machines are shared and noisy); tests never time anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# The project's shared recorded data (beside the checkout; a fresh clone has none): its README says what each
# file is. BTC_BARS: the 1-minute BTC bars most benches replay.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BTC_BARS = SHARED_DATA / "bars" / "btc-perp-20211231-20220201_1m.csv"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def machine() -> dict:
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def write_json(path: str | Path | None, metrics: dict[str, float], meta: dict | None = None) -> None:
    """Flat `metric: number` pairs; run facts go under `_meta` (not a metric)."""
    if not path:
        return
    report = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}
    report["_meta"] = {**machine(), **(meta or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def print_table(title: str, headers: list[str], rows: list[list[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def market_lines(seed: int = 7, bar_seconds: int = 5, instruments: tuple[str, ...] = ("BTCUSDT",)) -> Iterator[str]:
    """An endless stream of rendered synthetic bar lines (the embedded default feed)."""
    from feeds.bars import bars
    from feeds.synthetic import SyntheticFeed
    from streamllm.feeding.render import Renderer

    renderer = Renderer()
    feed = SyntheticFeed(seed=seed)
    for bar in bars(feed.events(), bar_seconds):
        if bar.instrument in instruments:
            yield renderer.render(bar)


def fill_session(engine, name: str, target_tokens: int, lines: Iterator[str], batch: int = 32) -> int:
    """Push lines until the session holds at least target_tokens; returns its token count."""
    while engine.session_info(name).num_tokens < target_tokens:
        info = engine.session_info(name)
        chunk = []
        budget = target_tokens - info.num_tokens
        while len(chunk) < batch and budget > 0:
            line = next(lines)
            budget -= len(engine.layout.lines_ids([line])[0])
            chunk.append(line)
        engine.push(name, chunk)
        engine.wait_idle()
        if engine.sessions[name].compactions:  # it would never reach the target: say so, not spin
            raise RuntimeError(f"session {name!r} was compacted while filling to {target_tokens} tokens; "
                               "open it with max_context=budget_for(target)")
    return engine.session_info(name).num_tokens


def budget_for(tokens: int, slack: int = 512) -> int:
    """A session max_context that holds `tokens` without triggering compaction.

    Compaction may start as soon as a session holds more than `retain` of its budget (when the
    measured push rate would fill it, as a fast fill does), so stay at or below `retain`."""
    from streamllm.engine.compaction import CompactionPolicy

    return int(tokens / CompactionPolicy().retain) + slack


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class SteadyPusher:
    """Calls `push(i)` for i = 0, 1, ... at `rate` calls/s on a thread of its own (a feed does not wait for
    the engine), until stopped or, with `count`, after that many; `done` is set when it ends either way."""

    def __init__(self, push: Callable[[int], object], rate: float, count: int | None = None) -> None:
        self.push, self.rate, self.count = push, rate, count
        self.stop, self.done = threading.Event(), threading.Event()
        self.pushed = 0
        self.elapsed = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyPusher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            while not self.stop.is_set() and (self.count is None or self.pushed < self.count):
                self.push(self.pushed)
                self.pushed += 1
                self.elapsed = time.perf_counter() - t0
                delay = t0 + self.pushed / self.rate - time.perf_counter()
                if delay > 0:
                    self.stop.wait(delay)
        finally:
            self.done.set()

    @property
    def updates_per_s(self) -> float:
        return self.pushed / self.elapsed if self.elapsed else 0.0


def standing_lags(engine, sessions: list[str], running: Callable[[], bool]) -> list[int]:
    """While `running()`: every 50 ms, how many versions each standing answer of `sessions` is behind
    what was pushed to its session."""
    lags: list[int] = []
    while running():
        for name in sessions:
            pushed = engine.session_info(name).pushed_version
            lags += [pushed - a.data_version for a in engine.standing(name)]
        time.sleep(0.05)
    return lags
