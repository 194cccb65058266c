"""`streamllm watch SESSION`: a live table of a session's standing answers.

Subscribes, shows the snapshot, then updates rows as `standing` events arrive; the
header follows `data` events. Age counts from each answer's `updated_at`; a labelled
question's row shows its live calibration (right so far, and the gate).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from rich.live import Live
from rich.table import Table

from streamllm.client.client import AsyncClient
from streamllm.engine.calibration import calibration_cells


class WatchState:
    """What the table shows; fed with the subscribe reply and the events after it."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.data_version = 0
        self.answers: dict[str, dict[str, Any]] = {}
        self.events = 0

    def snapshot(self, reply: dict[str, Any]) -> None:
        self.data_version = reply.get("data_version", 0)
        for answer in reply.get("standing", []):
            self.answers[answer["question_id"]] = answer

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
                                ("confidence", "right"), ("right (live)", "right"), ("gate", "right"),
                                ("data_version", "right"), ("age", "right")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        for qid in sorted(self.answers):
            a = self.answers[qid]
            confidence = a.get("confidence")
            updated = a.get("updated_at")
            age = f"{max(0.0, now - updated):.1f}s" if isinstance(updated, int | float) else "-"
            behind = a.get("data_version", 0) < self.data_version
            text = str(a.get("text", "")) + ("…" if a.get("path") == "gate" else "")  # a first token only
            table.add_row(qid, text, str(a.get("path", "")),
                          f"{confidence:.2f}" if isinstance(confidence, int | float) else "-",
                          *calibration_cells(a.get("calibration")),
                          f"{a.get('data_version', '-')}" + (" (behind)" if behind else ""), age)
        return table


async def watch(url: str, token: str | None, session: str, duration_s: float | None = None) -> int:
    state = WatchState(session)
    async with await AsyncClient.connect(url, token) as client:
        state.snapshot(await client.subscribe(session))
        deadline = None if duration_s is None else time.monotonic() + duration_s
        events = client.events()
        drawn = 0.0
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
                    if time.monotonic() - drawn >= 0.2:  # a burst of events redraws once
                        live.update(state.table(), refresh=True)
                        drawn = time.monotonic()
            finally:
                if next_event is not None:
                    next_event.cancel()
    return 0
