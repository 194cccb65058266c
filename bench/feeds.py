"""`streamllm bench feeds [--json out.json]`: wire-parser throughput and tokens per line.

Also: bookTicker parse rate (spot form and the futures form with e/E/T), DBN decode rate
on a 200k-record trades file written with databento-dbn's encoder, tokens per trade when
the same trades come from a Parquet table (Arrow doubles), and `bad_input_crashes` over a
corpus of 300 damaged captures, DBN files and tables (must be 0).

Parse throughput: every line of the shared Binance captures (held in memory, so gzip is
not timed) through `BinanceParser`, with orjson and with the stdlib `json` in the same
run, interleaved, median of `--reps` repetitions, one core. Tokens: lines rendered by
`streamllm.feeding.render` counted with the default tokenizer (smollm2-135m): 1-minute bars of
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
from streamllm.feeding.render import Renderer

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


def _bookticker_rate(lines: list[tuple[int, bytes]]) -> float:
    """Spot bookTicker messages of the captures, and the same quotes in the futures form (e/E/T)."""
    spot = [(r, raw) for r, raw in lines if b"@bookTicker" in raw[:40]]
    fut = [(r, raw.replace(b'"data":{"u"', b'"data":{"e":"bookTicker","E":1723161254000,"T":1723161254000,"u"'))
           for r, raw in spot]
    parser = BinanceParser(market="usdm")
    start = time.perf_counter()
    n = sum(len(parser.parse(raw, recv)) for recv, raw in spot + fut)
    elapsed = time.perf_counter() - start
    if parser.stats.errors or n != 2 * len(spot):
        raise RuntimeError(f"bench feeds: bookTicker parse errors: {parser.stats.error_samples[:3]}")
    return n / elapsed


def dbn_trades(n: int, seed: int = 0) -> bytes:
    """A DBN trades file of `n` records written with databento-dbn's encoder (ES-like prices)."""
    import datetime as dt
    import random
    from types import SimpleNamespace as NS

    import databento_dbn as dbn

    rng = random.Random(seed)
    t0 = 1_700_000_000_000_000_000
    day = dt.date(2023, 11, 14)
    md = dbn.Metadata(dataset="GLBX.MDP3", start=t0, stype_in=dbn.SType.RAW_SYMBOL, stype_out=dbn.SType.INSTRUMENT_ID,
                      schema=dbn.Schema.TRADES, symbols=["ESZ3"], end=t0 + n * 1_000_000,
                      mappings=[NS(raw_symbol="ESZ3", intervals=[NS(start_date=day, end_date=day, symbol="1")])])
    sides = (dbn.Side.BID, dbn.Side.ASK, dbn.Side.NONE)
    px = 4500 * 4
    out = [md.encode()]
    for i in range(n):
        px += rng.choice((-1, 0, 0, 1))
        out.append(bytes(dbn.TradeMsg(1, 1, t0 + i * 1_000_000, px * 250_000_000, rng.randint(1, 20),
                                      dbn.Action.TRADE, sides[i % 3], 0, t0 + i * 1_000_000 + 5000, sequence=i)))
    return b"".join(out)


def _dbn_rate(path: Path) -> tuple[float, int]:
    from feeds.dbn import DbnSource

    src = DbnSource(path)
    start = time.perf_counter()
    n = sum(1 for _ in src)
    elapsed = time.perf_counter() - start
    if src.stats.errors:
        raise RuntimeError(f"bench feeds: DBN errors: {src.stats.error_samples[:3]}")
    return n / elapsed, n


def _dbn_decode_rate(data: bytes) -> float:
    import databento_dbn as dbn

    start = time.perf_counter()
    dec = dbn.DBNDecoder()
    dec.write(data)
    n = len(dec.decode()) - 1  # the metadata
    return n / (time.perf_counter() - start)


def fuzz_corpus(folder: Path, capture: Path | None, n: int, seed: int = 0) -> list[Path]:
    """`n` damaged files: real capture lines, a DBN file, bar and trade tables, each cut, flipped,
    spliced with random bytes, before and after compression."""
    import random

    import polars as pl

    rng = random.Random(seed)
    head = b'1 {"u":1,"s":"BTCUSDT","b":"1.5","B":"1","a":"1.6","A":"2"}\n' * 30
    if capture is not None:
        with gzip.open(capture, "rb") as fh:
            head = b"".join(fh.readline() for _ in range(60))
    table = b"timestamp,open,high,low,close,volume\n" + b"".join(
        b"%d,100,101,99,100.5,3\n" % (1640991660000 + 60000 * i) for i in range(40))
    trades = b"time,price,qty,side\n" + b"".join(b"2024-01-01 00:00:%02d,10.5,1,BUYER\n" % i for i in range(40))
    pq_path = folder / "base.parquet"
    pl.DataFrame({"ts": list(range(40)), "price": [0.0295] * 40, "size": [1.0] * 40}).write_parquet(pq_path)
    bases = [("btcusdt_f.gz", head, True), ("es.trades.dbn", dbn_trades(50), False), ("bars_1m.csv", table, False),
             ("x_trades.csv", trades, False), ("t.parquet", pq_path.read_bytes(), False)]
    paths = []
    for i in range(n):
        name, data, gz = bases[i % len(bases)]
        inner = rng.random() < 0.5 and gz
        body = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op, at = rng.random(), rng.randrange(len(body) + 1)
            if op < 0.3:
                del body[at:]
            elif op < 0.7 and body:
                body[min(at, len(body) - 1)] = rng.randrange(256)
            else:
                body[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        out = gzip.compress(bytes(body)) if inner else (gzip.compress(data)[: rng.randrange(200)] if gz and
                                                         rng.random() < 0.3 else bytes(body))
        path = folder / f"{i:04d}_{name}"
        path.write_bytes(out)
        paths.append(path)
    return paths


def bad_input_crashes(capture: Path | None, n: int = 300) -> tuple[int, list[str]]:
    import tempfile

    crashes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in fuzz_corpus(Path(tmp), capture, n):
            try:
                read_fully(path)
            except AssertionError as exc:
                crashes.append(str(exc))
    return len(crashes), crashes[:5]


def _parquet_trades(events: list[Any], folder: Path) -> Path:
    """The capture's trades as a user's Parquet table (Arrow doubles, epoch ms, side strings)."""
    import polars as pl

    ts = [e for e in events if type(e) is Trade]
    path = folder / "btcusdt_trades.parquet"
    pl.DataFrame({"time": [t.ts_event // 1_000_000 for t in ts], "price": [t.price for t in ts],
                  "qty": [t.size for t in ts], "side": ["BUY" if t.side == 1 else "SELL" for t in ts]}
                 ).write_parquet(path)
    return path


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
    report["bookticker_events_per_s"] = statistics.median(_bookticker_rate(lines) for _ in range(reps))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dbn_path = Path(tmp) / "es.trades.dbn"
        dbn_path.write_bytes(dbn_trades(200_000))
        rates = [_dbn_rate(dbn_path) for _ in range(reps)]
    report["dbn_events_per_s"] = statistics.median(r for r, _ in rates)
    report["dbn_decode_records_per_s"] = _dbn_decode_rate(dbn_trades(200_000))  # the package alone
    report["dbn_events"] = rates[0][1]
    btc = next((p for p in captures if p.name.startswith("btcusdt")), captures[0])
    crashes, samples = bad_input_crashes(btc)
    report["bad_input_crashes"] = crashes
    report["bad_input_files"] = 300
    for sample in samples:
        print(f"bench feeds: crash: {sample}", file=sys.stderr)
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
    events = list(CaptureSource(btc))
    r = Renderer()
    bin_bars = [r.render(b) for b in bars(events, 60.0)]
    report["render_tokens_per_bar_binance_1m"] = _token_counts(tok, bin_bars)
    r = Renderer()
    trade_lines = [r.render(e) for e in events if type(e) is Trade][:5000]
    report["render_tokens_per_trade"] = _token_counts(tok, trade_lines)
    report["render_trade_example"] = trade_lines[1]
    with tempfile.TemporaryDirectory() as tmp:
        table = TableSource(_parquet_trades(events, Path(tmp)), "trade")
        r = Renderer()
        pq_lines = [r.render(e) for e in table.events()][:5000]
    report["render_tokens_per_trade_parquet"] = _token_counts(tok, pq_lines)
    report["render_parquet_vs_json_tokens"] = report["render_tokens_per_trade_parquet"] / report["render_tokens_per_trade"]
    report["render_trade_parquet_example"] = pq_lines[1]
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
