"""`streamllm ...`: one entry point; every command's flags live in streamllm/cli/<command>.py.

Each command module has a `main(argv) -> int` that parses its flags and calls plain functions of
the library; the dispatcher stays a table. serve.py is the one composition root (engine, ingest
log, feeds, server).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("streamllm.cli.demo", "run the full loop on the embedded default (synthetic feed, default model)"),
    "model": ("streamllm.cli.model", "fetch / convert / inspect models (`model fetch smollm2-135m`)"),
    "record": ("streamllm.cli.record", "record a live venue to raw captures and Parquet"),
    "inspect": ("streamllm.cli.inspect", "what a capture, table or DBN file holds: streams, times, gaps, errors"),
    "calibrate": ("streamllm.cli.calibrate", "replay data and calibrate gate thresholds"),
    "tune": ("streamllm.cli.tune", "teach the model a config's labelled questions (choice heads) from recorded bars"),
    "serve": ("streamllm.cli.serve", "websocket service: engine + feeds + standing questions from a config"),
    "ask": ("streamllm.cli.ask", "ask a question on a running server's session"),
    "watch": ("streamllm.cli.watch", "live table of a session's standing answers on a running server"),
    "sessions": ("streamllm.cli.sessions", "operate a `serve --ray` front door: `sessions move NAME --to N`"),
}

BENCHES: dict[str, tuple[str, str]] = {
    "query": ("bench.query", "ask latency vs context, stateless baseline, prefill/decode vs transformers"),
    "feeds": ("bench.feeds", "wire-parser throughput and rendering token counts"),
    "prepos": ("bench.prepos", "fast / entry / cold path latency"),
    "tenants": ("bench.tenants", "through the engine: batched vs sequential asks, freshness lag under load, interactive latency"),
    "capacity": ("bench.capacity", "S sessions on recorded 1-minute bars: sustained bars/s, freshness, ask latency, memory, fastest pace"),
    "server": ("bench.server", "ask round trip over loopback websockets, 1 and 50 clients"),
    "faults": ("bench.faults", "SIGKILL + log recovery, snapshot restore vs replay, fuzzing, websocket load"),
    "stress": ("bench.stress", "threads + asyncio tasks storm one engine: no death, hang, leak or refused push"),
    "wal": ("bench.wal", "the Arrow ingest log vs stdlib sqlite3 (WAL): appends/s per flush policy, read-back"),
    "scale": ("bench.scale", "serve --ray: updates/s at 1..N replicas, routing overhead, a replica killed mid-push"),
    "learn": ("bench.learn", "questions learned live from recorded bars: prequential accuracy, gate, raw-number control"),
    "abuse": ("bench.abuse", "hostile clients and a failing disk while a well-behaved client works: nothing dies, hangs or leaks"),
    "compaction": ("bench.compaction", "shifted vs recomputed compaction on recorded bars: cost per bar, answers beside their labels"),
    "replay": ("bench.replay", "every system answers the same asks live under the same recorded feed; accuracy, report"),
}


def _usage() -> str:
    lines = ["usage: streamllm COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["  bench      benchmarks:"]
    lines += [f"    bench {name:<8} {doc}" for name, (_, doc) in BENCHES.items()]
    return "\n".join(lines)


def _dispatch(table: dict[str, tuple[str, str]], name: str, argv: list[str], entry: str = "main") -> int:
    if name not in table:
        print(f"streamllm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    return int(getattr(module, entry)(argv) or 0)


def _find_bench() -> str | None:
    """Make the checkout's bench/ importable (it is not in the wheel); None when found, else why not."""
    try:
        importlib.import_module("bench")
        return None
    except ImportError:
        pass
    checkout = Path.cwd()
    if (checkout / "bench" / "__init__.py").is_file():
        sys.path.insert(0, str(checkout))
        importlib.invalidate_caches()
        importlib.import_module("bench")
        return None
    return ("streamllm bench: the benchmarks live in bench/ of a source checkout and are not installed with "
            f"the package; none at {checkout}. Run it from the checkout's root (git clone, then `make install` "
            "and `cd` into it), or put the checkout on PYTHONPATH.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(_usage())
            return 0 if rest else 2
        if rest[0] in BENCHES and (why := _find_bench()) is not None:
            print(why, file=sys.stderr)
            return 2
        return _dispatch(BENCHES, rest[0], rest[1:], entry="cli_main")
    return _dispatch(COMMANDS, command, rest)
