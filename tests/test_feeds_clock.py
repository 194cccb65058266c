"""When a bar can close: receive time minus the largest recent trade lag, capped above the newest."""

from __future__ import annotations

import pytest

from feeds.clock import VenueClock

S = 1_000_000_000
MS = 1_000_000
T0 = 1_723_161_600 * S


def test_the_receive_time_until_a_venue_time_is_seen() -> None:
    c = VenueClock()
    assert c.settled(T0) == T0
    c.observe(0, T0)  # no venue time: says nothing
    assert c.lag_ns is None and c.settled(T0 + S) == T0 + S


def test_the_slowest_recent_trade_sets_the_grace() -> None:
    c = VenueClock(window_s=10, max_grace_s=2)
    for sec, lag_ms in [(0, 80), (1, 30), (2, 120), (3, 45)]:
        c.observe(T0 + sec * S - lag_ms * MS, T0 + sec * S)
    assert c.lag_ns == 120 * MS  # every trade of the window would have arrived
    assert c.settled(T0 + 5 * S) == T0 + 5 * S - 120 * MS
    c.observe(T0 + 13 * S - 60 * MS, T0 + 13 * S)  # 11 s after the 120 ms one: it left the window
    assert c.lag_ns == 60 * MS
    c.observe(T0 + 30 * S - 200 * MS, T0 + 30 * S)  # all older ones left: the newest alone
    assert c.lag_ns == 200 * MS


def test_one_trade_stamped_long_ago_does_not_hold_bars_open() -> None:
    c = VenueClock(window_s=10, max_grace_s=2)
    c.observe(T0 - 40 * MS, T0)
    c.observe(T0 - 3600 * S, T0 + MS)  # an hour-old time: its own bar closed long ago
    assert c.settled(T0 + MS) == T0 - 3600 * S  # nothing new settles while it is the newest
    c.observe(T0 + 2 * MS - 50 * MS, T0 + 2 * MS)
    assert c.lag_ns == 2 * S + 50 * MS  # then the newest lag plus the cap, not an hour


def test_a_receiver_clock_behind_the_venue() -> None:
    """Lags below zero: the host's clock runs behind (the shared captures' is 1.27 s behind)."""
    c = VenueClock()
    c.observe(T0 + 1270 * MS, T0)
    c.observe(T0 + S + 1230 * MS, T0 + S)
    assert c.settled(T0 + 2 * S) == T0 + 2 * S + 1230 * MS


@pytest.mark.parametrize("speed", [4.0, 0.25])
def test_a_replay_paced_faster_or_slower_never_runs_ahead_of_the_venue(speed: float) -> None:
    """Replayed at `speed`, venue time runs `speed` times the receive clock: the settled time never
    passes it (a growing lag is followed) and stays behind it by at most the cap."""
    c = VenueClock(window_s=2, max_grace_s=1)
    for i in range(2000):
        recv = T0 + i * 10 * MS  # a trade every 10 ms
        venue = T0 - 2 * 365 * 86400 * S + round(i * 10 * MS * speed)  # a capture two years old
        c.observe(venue, recv)
        assert venue - S <= c.settled(recv) <= venue
