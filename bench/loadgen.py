"""A seeded open-loop load generator: questions at Poisson-distributed times.

Inter-arrival times are exponential with mean 1/rate, so asks arrive independently of
how fast the engine answers (open loop: a slow answer never delays the next ask).
Each ask picks a session uniformly, then a standing question by id (with probability
`standing_share`) or an ad-hoc question (never pre-positioned: the cold path).
The same seed gives the same schedule.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

AD_HOC_QUESTIONS = (
    "What was the last close?",
    "Describe the last bar in a few words.",
    "Was the last bar mostly buying or selling?",
    "Is the market quiet or busy right now?",
)


@dataclass(frozen=True, slots=True)
class AskEvent:
    at_s: float  # seconds after the schedule starts
    session: str
    question: str  # a standing question's id, or ad-hoc text
    standing: bool


def poisson_schedule(
    seed: int,
    rate: float,
    duration_s: float,
    standing: Mapping[str, Sequence[str]],
    standing_share: float = 0.8,
    ad_hoc: Sequence[str] = AD_HOC_QUESTIONS,
) -> list[AskEvent]:
    """Asks over [0, duration_s) at `rate` per second; `standing` maps session -> question ids."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if not standing:
        raise ValueError("no sessions to ask")
    rng = random.Random(seed)
    sessions = sorted(standing)
    out: list[AskEvent] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        session = rng.choice(sessions)
        ids = list(standing[session])
        if ids and rng.random() < standing_share:
            out.append(AskEvent(t, session, rng.choice(ids), True))
        else:
            out.append(AskEvent(t, session, rng.choice(list(ad_hoc)), False))
        t += rng.expovariate(rate)
    return out


def run_schedule(schedule: Sequence[AskEvent], submit: Callable[[AskEvent], None],
                 stop: threading.Event) -> threading.Thread:
    """Call `submit(ev)` at each event's time on a background thread, until `stop` is set.

    Sleeps are computed against the start anchor, so drift does not accumulate.
    """

    def loop() -> None:
        start = time.perf_counter()
        for ev in schedule:
            delay = start + ev.at_s - time.perf_counter()
            if delay > 0 and stop.wait(delay):
                return
            if stop.is_set():
                return
            submit(ev)

    thread = threading.Thread(target=loop, name="bench-loadgen", daemon=True)
    thread.start()
    return thread
