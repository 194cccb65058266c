"""`streamllm inspect FILE...`: what a capture, table or DBN file holds, before anyone replays it.

    streamllm inspect ../shared/data/binance-spot/btcusdt_20240808.gz
    streamllm inspect bars.csv --columns ts_event=Date,volume=Vol --tz America/New_York --json out.json

Per file and per stream (instrument x event kind): events, the time range (a bar table's
from its first bar's start to its last bar's end), gaps by the venue's own rule, errors by
kind with a few samples, messages set aside on purpose by kind (heartbeats, subscription
replies, unclosed klines, ...), whether each order book can be rebuilt (it needs a depth
snapshot; Binance's are synced as documented, feeds/books.py), and three rendered lines with
their token counts (the default model's tokenizer; `--tokenizer tiny` for a quick look,
`none` to skip). Exits 2 with the
reason when a file cannot be read as asked (unknown format, ambiguous dates, a capture of
a venue format we do not read).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feeds.books import LocalBooks
from feeds.events import EVENT_TYPES, Bar, BookDelta
from feeds.sources import CaptureSource, ReadOptions, open_source
from streamllm.feeding.render import Renderer

SAMPLE_LINES = 3
TOKEN_LINES = 300  # lines per stream whose tokens are counted
KIND_NAMES = {cls: name for name, cls in EVENT_TYPES.items()}


@dataclass
class StreamReport:
    events: int = 0
    first_ts: int | None = None
    last_ts: int | None = None
    lines: list[str] = field(default_factory=list)
    renderer: Renderer = field(default_factory=Renderer)
    tokens: list[int] = field(default_factory=list)
    gaps: int = 0  # sequence gaps the parser saw on this stream, plus missing bar intervals
    gap_samples: list[str] = field(default_factory=list)
    book: str | None = None  # book streams: whether and how the book can be rebuilt
    _bar_end: int | None = None

    def add(self, ev: Any) -> None:
        self.events += 1
        if type(ev) is Bar:
            if self._bar_end is not None and ev.ts_open > self._bar_end:
                self.gap(f"no bar from {_when(self._bar_end)} to {_when(ev.ts_open)}")
            self._bar_end = ev.ts_event if self._bar_end is None else max(self._bar_end, ev.ts_event)
        start = ev.ts_open if type(ev) is Bar else ev.ts_event  # a bar covers [ts_open, ts_event)
        self.first_ts = start if self.first_ts is None else min(self.first_ts, start)
        self.last_ts = ev.ts_event if self.last_ts is None else max(self.last_ts, ev.ts_event)
        if len(self.lines) < TOKEN_LINES:
            self.lines.append(self.renderer.render(ev))

    def gap(self, text: str) -> None:
        self.gaps += 1
        if len(self.gap_samples) < 5:
            self.gap_samples.append(text)

    def as_dict(self) -> dict[str, Any]:
        return {"events": self.events, "first_ts": self.first_ts, "last_ts": self.last_ts, "gaps": self.gaps,
                "gap_samples": self.gap_samples, **({"book": self.book} if self.book is not None else {}),
                "tokens_per_line": statistics.mean(self.tokens) if self.tokens else None,
                "lines": [{"text": t, "tokens": n if self.tokens else None}
                          for t, n in zip(self.lines[:SAMPLE_LINES], self.tokens or [0] * SAMPLE_LINES, strict=False)]}


def inspect_file(path: str | Path, opts: ReadOptions) -> dict[str, Any]:
    """One file's report (no token counts yet); raises ValueError when it cannot be read as asked."""
    src = open_source(path, opts, what="inspect")
    streams: dict[str, StreamReport] = {}
    # Update ids to sync by come only in captures; a table's book rows carry none (inline snapshots).
    books = LocalBooks.for_venue(src.venue if isinstance(src, CaptureSource) else "", opts.market)
    for ev in src:
        key = f"{ev.instrument} {KIND_NAMES.get(type(ev), type(ev).__name__)}"
        rep = streams.get(key)
        if rep is None:
            rep = streams[key] = StreamReport()
        rep.add(ev)
        if type(ev) is BookDelta:
            books.add(ev)
    notes = list(getattr(src, "notes", []))
    for inst, book in books.books.items():
        rep = streams[f"{inst} book"]
        rep.book = _book_state(book)
        if book.snapshot_id is None:
            notes.append(f"{inst}: no depth snapshot, so its order book cannot be rebuilt "
                         f"({rep.events} book updates only; a file that continues another capture needs that one's)")
    stats = src.stats
    for where, n in stats.gap_keys.items():  # "BTCUSDT@depth" -> the stream "BTCUSDT book"
        symbol, _, channel = where.partition("@")
        kind = "book" if channel.startswith("depth") else "trade" if "rade" in channel else ""
        rep = streams.get(f"{symbol} {kind}")
        if rep is not None:
            rep.gaps += n
            rep.gap_samples += [g for g in stats.gap_samples if g.startswith(where)][: 5 - len(rep.gap_samples)]
    time_gaps = sum(r.gaps for r in streams.values()) - sum(stats.gap_keys.values())
    firsts = [r.first_ts for r in streams.values() if r.first_ts is not None]
    lasts = [r.last_ts for r in streams.values() if r.last_ts is not None]
    return {"file": str(path), "format": type(src).__name__, "venue": getattr(src, "venue", ""),
            "messages": stats.messages, "events": sum(r.events for r in streams.values()),
            "errors": stats.errors, "error_kinds": dict(stats.error_kinds), "error_samples": stats.error_samples[:5],
            "skipped": _skipped(stats.skipped, stats.control_kinds),
            "gaps": stats.gaps + max(0, time_gaps), "gap_samples": stats.gap_samples[:5], "notes": notes,
            "first_ts": min(firsts, default=None), "last_ts": max(lasts, default=None), "_streams": streams}


def _skipped(records: dict[str, int], control: dict[str, int]) -> dict[str, int]:
    """Records kept out on purpose and control messages set aside, by kind: one table for a user."""
    out = dict(records)
    for kind, n in control.items():
        out[kind] = out.get(kind, 0) + n
    return out


def _book_state(book: Any) -> str:
    if book.snapshot_id is None:
        return "cannot be rebuilt: no depth snapshot"
    bid, ask = book.best
    return (f"rebuilt from snapshot {book.snapshot_id}, {book.applied} updates applied, {book.dropped} older "
            f"dropped; best {bid} / {ask}")


def count_tokens(reports: list[dict[str, Any]], tokenizer: Any) -> None:
    every: list[int] = []
    for rep in reports:
        per_file: list[int] = []
        for s in rep["_streams"].values():
            if tokenizer is not None and s.lines:
                s.tokens = [len(ids) for ids in tokenizer(s.lines, add_special_tokens=False)["input_ids"]]
                per_file += s.tokens
        rep["tokens_per_line"] = statistics.mean(per_file) if per_file else None
        rep["streams"] = {k: s.as_dict() for k, s in rep.pop("_streams").items()}
        every += per_file


def _when(ts: int | None) -> str:
    import datetime as dt

    return "-" if ts is None else dt.datetime.fromtimestamp(ts / 1e9, dt.UTC).isoformat(timespec="milliseconds")


def print_report(rep: dict[str, Any]) -> None:
    print(f"{rep['file']}: {rep['format']} {rep['venue']}  {rep['events']} events from {rep['messages']} "
          f"messages/rows, {rep['errors']} errors, {rep['gaps']} gaps")
    print(f"  time {_when(rep['first_ts'])} -> {_when(rep['last_ts'])}")
    for note in rep["notes"]:
        print(f"  note: {note}")
    if rep["error_kinds"]:
        print("  errors: " + ", ".join(f"{k} {n}" for k, n in sorted(rep["error_kinds"].items())))
        for s in rep["error_samples"][:3]:
            print(f"    e.g. {s[:160]}")
    for s in rep["gap_samples"][:3]:
        print(f"  gap: {s}")
    if rep.get("skipped"):
        print("  skipped on purpose (not market events): " + ", ".join(f"{k} {n}" for k, n in sorted(rep["skipped"].items())))
    for name, s in rep["streams"].items():
        tpl = f", {s['tokens_per_line']:.1f} tokens/line" if s["tokens_per_line"] is not None else ""
        gaps = f", {s['gaps']} gaps" if s["gaps"] else ""
        print(f"  {name}: {s['events']} events, {_when(s['first_ts'])} -> {_when(s['last_ts'])}{gaps}{tpl}")
        for g in s["gap_samples"][:2]:
            print(f"    gap: {g}")
        if "book" in s:
            print(f"    book: {s['book']}")
        for line in s["lines"]:
            n = f"[{line['tokens']:>2}] " if line["tokens"] is not None else ""
            print(f"    {n}{line['text']}")


def mean_of(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.mean(vals) if vals else None
