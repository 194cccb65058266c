"""`streamllm bench feeds [--json out.json]`: wire-parser throughput and tokens per line.

Parse throughput: every line of the shared Binance captures (held in memory, so gzip is
not timed) through `BinanceParser`, with orjson and with the stdlib `json` in the same
run, interleaved, median of `--reps` repetitions, one core. Tokens: lines rendered by
`streamllm.market.render` counted with the default tokenizer (smollm2-135m): 1-minute bars of
the shared bars CSV (the 1-minute data set), 1-minute bars aggregated from the BTCUSDT
capture, and trades of the captures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from feeds.bars import bars
from feeds.binance import BinanceParser
from feeds.events import Trade
from feeds.sources import CaptureSource, TableSource, open_source
from feeds.wire import fast_loads, stdlib_loads
from streamllm.market.render import Renderer

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _lines(paths: list[Path]) -> list[tuple[int, bytes]]:
    out = []
    for path in paths:
        with gzip.open(path, "rb") as fh:
            for line in fh:
                head, _, raw = line.rstrip(b"\n").partition(b" ")
                out.append((int(head), raw))
    return out


def _parse_rate(lines: list[tuple[int, bytes]], loads: Any) -> tuple[float, int]:
    parser = BinanceParser(loads=loads)
    parse = parser.parse
    start = time.perf_counter()
    n = 0
    for recv, raw in lines:
        n += len(parse(raw, recv))
    elapsed = time.perf_counter() - start
    if parser.stats.errors:
        raise RuntimeError(f"bench feeds: {parser.stats.errors} parse errors: {parser.stats.error_samples[:3]}")
    return n / elapsed, n


def read_fully(path: Path, opts: Any = None) -> Any:
    """Open and drain one file source. A ValueError naming the file (cannot be read as asked)
    is allowed; any other exception is a crash and raises AssertionError saying so."""
    try:
        src = open_source(path, opts)
        for _ in src:
            pass
        return src
    except (ValueError, FileNotFoundError) as exc:
        if path.name not in str(exc):
            raise AssertionError(f"{path.name}: refusal does not name the file: {exc!r}") from exc
        return None
    except Exception as exc:
        raise AssertionError(f"{path.name}: source crashed with {type(exc).__name__}: {exc}") from exc


def _token_counts(tok: Any, lines: list[str]) -> float:
    return statistics.mean(len(ids) for ids in tok(lines, add_special_tokens=False)["input_ids"])


def run(data: Path, reps: int) -> dict[str, Any]:
    captures = sorted((data / "binance-spot").glob("*.gz"))
    if not captures:
        raise FileNotFoundError(f"bench feeds: no captures under {data / 'binance-spot'}")
    lines = _lines(captures)
    fast, slow = [], []
    n = 0
    for _ in range(reps):
        rate, n = _parse_rate(lines, fast_loads)
        fast.append(rate)
        slow.append(_parse_rate(lines, stdlib_loads)[0])
    report: dict[str, Any] = {
        "parse_events_per_s": statistics.median(fast),
        "parse_events_per_s_stdlib_json": statistics.median(slow),
        "parse_orjson_speedup": statistics.median(f / s for f, s in zip(fast, slow, strict=True)),
        "parse_messages": len(lines),
        "parse_events": n,
        "reps": reps,
    }
    try:
        from streamllm.model import load_tokenizer

        tok = load_tokenizer("smollm2-135m")
    except Exception as exc:  # the tokenizer needs the converted default model
        print(f"bench feeds: no tokenizer ({type(exc).__name__}: {exc}); token counts skipped", file=sys.stderr)
        return report
    csv = data / "bars" / "btc-perp-20211231-20220201_1m.csv"
    if csv.exists():
        r = Renderer()
        bar_lines = [r.render(b) for b in TableSource(csv, "bar").events()[:5000]]
        report["render_tokens_per_bar"] = _token_counts(tok, bar_lines)
        report["render_bar_example"] = bar_lines[1]
    btc = next((p for p in captures if p.name.startswith("btcusdt")), captures[0])
    events = list(CaptureSource(btc))
    r = Renderer()
    bin_bars = [r.render(b) for b in bars(events, 60.0)]
    report["render_tokens_per_bar_binance_1m"] = _token_counts(tok, bin_bars)
    r = Renderer()
    trade_lines = [r.render(e) for e in events if type(e) is Trade][:5000]
    report["render_tokens_per_trade"] = _token_counts(tok, trade_lines)
    report["render_trade_example"] = trade_lines[1]
    if "render_tokens_per_bar" not in report:
        report["render_tokens_per_bar"] = report["render_tokens_per_bar_binance_1m"]
    return report


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="streamllm bench feeds", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the flat metric report here")
    ap.add_argument("--data", type=Path, default=DATA, help="shared data folder")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        report = run(args.data, args.reps)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    report["machine"] = f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} py{platform.python_version()}"
    print(f"{'metric':<36} value")
    for key, value in report.items():
        shown = f"{value:,.1f}" if isinstance(value, float) else str(value)
        print(f"{key:<36} {shown}")
    if args.json:
        numbers = {k: v for k, v in report.items() if isinstance(v, int | float)}
        args.json.write_text(json.dumps(numbers, indent=2) + "\n")
    return 0
