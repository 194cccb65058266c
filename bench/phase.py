"""What one paced phase of `bench capacity` measured, ours or a peer's, and the rule for "kept fresh".

One rule for both sides, so the engine and a peer are judged alike (bench/capacity.py,
bench/capacity_peer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.common import percentile


@dataclass
class Phase:
    """What one paced phase measured."""

    seconds: float = 0.0
    offered: int = 0
    ingested: int = 0
    summaries: int = 0
    lags_ms: list[float] = field(default_factory=list)
    lag_versions: list[int] = field(default_factory=list)
    stale_bars: int = 0
    standing_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    cold_asks: list[tuple[str, str]] = field(default_factory=list)
    ask_errors: int = 0
    ask_error: str = ""  # the first one, printed
    unpushed: int = 0  # bars their push thread reached only after the phase's drain (counted stale)
    idle_after: bool = True  # the engine went idle after the phase (within max(drain_s, 60) s)

    def held(self, interval_s: float) -> bool:
        """Kept up: a bar's answers fresh (p99) before its session's next bar arrives, no bar still stale
        after the drain or coalesced into a summary, and answers within one version of their session."""
        return (self.offered > 0 and self.stale_bars == 0 and self.summaries == 0
                and percentile(self.lags_ms, 99) <= interval_s * 1000 and percentile(self.lag_versions, 99) <= 1)
