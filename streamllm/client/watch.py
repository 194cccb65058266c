"""`streamllm watch SESSION`: a live table of a session's standing answers.

Subscribes, shows the snapshot, then updates rows as `standing` events arrive; the
header follows `data` events. Age counts from each answer's `updated_at`; a labelled
question's row shows its live calibration (right so far, and the gate), every row the
threshold its gate decided at and whose it is (config, head, auto).

Events carry only answers whose text changed, so an answer that stays "up" for ten bars
keeps the data_version it was first told at. A row is marked "(behind)" only against a
snapshot (which holds every answer's newest data_version): taken at start and again at
most once a second, a second after `data` events. An answer made before its question can
be answered (no data yet, a head or label short of history) shows "warming up", its reason
under the table; a `push = false` free-text question is sent to nobody, so its row says
"ask to decode" (`streamllm ask SESSION ID`) rather than the gate's first token.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from rich.live import Live
from rich.table import Table

from streamllm.client.cells import calibration_cells
from streamllm.client.client import AsyncClient

REFRESH_S = 1.0  # a snapshot at most this often, this long after a data event


class WatchState:
    """What the table shows; fed with the subscribe reply and the events after it."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.data_version = 0
        self.confirmed = 0  # the session's data_version at the last snapshot: rows older than it are behind
        self.answers: dict[str, dict[str, Any]] = {}
        self.events = 0

    def snapshot(self, reply: dict[str, Any]) -> None:
        self.confirmed = reply.get("data_version", 0)
        self.data_version = max(self.data_version, self.confirmed)
        for answer in reply.get("standing", []):
            self.answers[answer["question_id"]] = answer

    @property
    def stale(self) -> bool:
        """Whether data came after the last snapshot (a new one would show the answers' newest versions)."""
        return self.data_version > self.confirmed

    def apply(self, event: dict[str, Any]) -> None:
        self.events += 1
        if event.get("type") == "standing":
            self.answers[event["question_id"]] = event
            self.data_version = max(self.data_version, event.get("data_version", 0))
        elif event.get("type") == "data":
            self.data_version = max(self.data_version, event.get("data_version", 0))

    def table(self, now: float | None = None) -> Table:
        now = time.time() if now is None else now
        table = Table(title=f"{self.session}  data_version {self.data_version}  ({self.events} events)",
                      title_justify="left")
        for column, justify in (("question", "left"), ("answer", "left"), ("path", "left"),
                                ("confidence", "right"), ("threshold", "right"), ("right (live)", "right"),
                                ("gate", "right"), ("data_version", "right"), ("age", "right")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        warming = []
        for qid in sorted(self.answers):
            a = self.answers[qid]
            updated = a.get("updated_at")
            age = f"{max(0.0, now - updated):.1f}s" if isinstance(updated, int | float) else "-"
            behind = a.get("data_version", 0) < self.confirmed
            text, path, confidence = answer_cells(a)
            if a.get("warming_up"):
                warming.append(f"{qid} is warming up: {a.get('warming_up_reason') or 'not enough data yet'}")
            table.add_row(qid, text, path, confidence, threshold_cell(a), *calibration_cells(a.get("calibration")),
                          f"{a.get('data_version', '-')}" + (" (behind)" if behind else ""), age)
        if warming:
            table.caption, table.caption_justify = "\n".join(warming), "left"
        return table


def answer_cells(a: dict[str, Any]) -> tuple[str, str, str]:
    """(answer, path, confidence) as shown: a guess while warming up says so, and a `push = false`
    free-text question's gate view (its first token, path "gate") is no answer: ask decodes one."""
    confidence = a.get("confidence")
    shown = f"{confidence:.2f}" if isinstance(confidence, int | float) else "-"
    if a.get("path") == "gate":
        return "ask to decode", "not pushed", "-"
    if a.get("warming_up"):
        return "warming up", str(a.get("path", "")), "-"
    return str(a.get("text", "")), str(a.get("path", "")), shown


def threshold_cell(a: dict[str, Any]) -> str:
    """The gap the gate decided this answer at and whose it is: "2.00 config", "closed head", "0.41 auto"."""
    if "threshold_source" not in a:
        return "-"  # a server from before answers said
    t = a.get("threshold")
    return f"{t:.2f} {a['threshold_source']}" if isinstance(t, int | float) else f"closed {a['threshold_source']}"


async def watch(url: str, token: str | None, session: str, duration_s: float | None = None) -> int:
    state = WatchState(session)
    async with await AsyncClient.connect(url, token) as client:
        state.snapshot(await client.subscribe(session))
        deadline = None if duration_s is None else time.monotonic() + duration_s
        events = client.events()
        drawn = refreshed = 0.0
        stale_since: float | None = None
        # One pending read at a time, kept across wake-ups: cancelling a read (as wait_for does
        # on timeout) would close the event stream after the first quiet quarter second.
        next_event: asyncio.Future | None = None
        with Live(state.table(), refresh_per_second=4, auto_refresh=False) as live:
            try:
                while deadline is None or time.monotonic() < deadline:
                    if next_event is None:
                        next_event = asyncio.ensure_future(events.__anext__())
                    # Wake at least every 0.25 s so ages keep counting in a quiet market.
                    done, _ = await asyncio.wait({next_event}, timeout=0.25)
                    if done:
                        try:
                            state.apply(next_event.result())
                        except StopAsyncIteration:
                            print(f"streamllm watch: connection closed: {client.close_reason or 'no reason given'}",
                                  file=sys.stderr)
                            return 1
                        next_event = None
                    now = time.monotonic()
                    stale_since = (stale_since or now) if state.stale else None
                    if stale_since is not None and now - max(stale_since, refreshed) >= REFRESH_S:
                        refreshed = now  # the answers' newest versions (events only carry changed texts)
                        state.snapshot(await client.subscribe(session))
                    if time.monotonic() - drawn >= 0.2:  # a burst of events redraws once
                        live.update(state.table(), refresh=True)
                        drawn = time.monotonic()
            finally:
                if next_event is not None:
                    next_event.cancel()
    return 0
