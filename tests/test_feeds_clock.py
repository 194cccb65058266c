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
    assert c.settled(T0 + 3 * S) == T0 + 3 * S - 120 * MS
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
    assert c.settled(T0 + S) == T0 + S + 1230 * MS


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


@pytest.mark.parametrize("speed", [1.0, 4.0, 0.5, 0.25])
def test_through_a_silence_the_venue_clock_runs_at_its_measured_rate(speed: float) -> None:
    """Between trades (a live feed's quiet ticks) the settled time moves at the rate the venue's
    has been moving, at most the wall rate: a bar of a replay paced slower than recorded does not
    close before its trades arrive, and a live silent market's bars still close on time."""
    c = VenueClock(window_s=2, max_grace_s=1)
    old = T0 - 2 * 365 * 86400 * S

    def venue(recv: int) -> int:
        return old + round((recv - T0) * speed) - 30 * MS  # the replay's trades arrive 30 ms after their times

    for i in range(1000):  # ten seconds of a trade every 10 ms
        c.observe(venue(T0 + i * 10 * MS), T0 + i * 10 * MS)
    assert c.rate == pytest.approx(min(speed, 1.0), abs=0.01)
    last = T0 + 999 * 10 * MS
    for quiet in range(1, 41):  # then four seconds of silence, ticked as attach() ticks a live feed
        now = last + quiet * 100 * MS
        assert c.settled(now) <= venue(now)
        if speed <= 1:
            assert c.settled(now) >= venue(now) - S - 100 * MS  # the cap, and a tick's length
    assert c.settled(last + 40 * S) - c.settled(last) == pytest.approx(40 * S * min(speed, 1.0), rel=0.01)


def test_a_trade_stamped_long_ago_does_not_bend_the_rate() -> None:
    c = VenueClock()
    for i in range(600):
        c.observe(T0 + i * 10 * MS - 40 * MS, T0 + i * 10 * MS)
    c.observe(T0 - 3600 * S, T0 + 6 * S)
    c.observe(T0 + 6 * S, T0 + 6 * S + 40 * MS)
    assert c.rate == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("speed", [1.0, 0.5, 0.25, 0.1])
def test_a_slowed_replay_keeps_its_recorded_spread_of_delays(speed: float) -> None:
    """A recording's trades arrived 0-200 ms after their times, out of order; replayed at `speed`,
    that spread takes 1/speed as long on the receive clock. Measured against the replay's own
    rate, the grace still covers it: once the clock has seen a few seconds (the rate, and the
    spread of delays), no trade comes after its bar could have closed."""
    import random

    rng = random.Random(7)
    venue0, recv0 = T0 - 2 * 365 * 86400 * S, T0
    recorded = sorted((e + rng.randrange(200 * MS), e) for e in range(venue0, venue0 + 30 * S, 10 * MS))
    c, settled, late = VenueClock(), 0, 0
    for rec, event in recorded:
        recv = recv0 + round((rec - recorded[0][0]) / speed)
        late += event < settled and recv - recv0 > 10 * S
        if c.lag_ns is not None:
            settled = max(settled, c.settled(recv - 5 * MS))  # a quiet tick just before it arrives
        c.observe(event, recv)
        settled = max(settled, c.settled(recv))
    assert c.rate == pytest.approx(speed, abs=0.01) and late == 0


def test_ahead_is_a_time_past_what_the_venue_clock_can_have_run_to() -> None:
    c = VenueClock(max_ahead_s=10)
    assert not c.ahead(T0 + 3600 * S, T0)  # nothing seen: no clock to be ahead of
    c.observe(T0 - 40 * MS, T0)
    assert not c.ahead(T0 + 9 * S, T0 + 10 * MS) and c.ahead(T0 + 11 * S, T0 + 10 * MS)
    assert not c.ahead(T0 + 29 * S, T0 + 20 * S)  # the clock ran on meanwhile


def test_the_first_live_trade_after_a_snapshot_of_old_ones_is_not_ahead() -> None:
    """A subscription's history (minutes old) sets the clock far behind; the first live trade is
    far past it, but not past its own receive time: a venue's trade comes after it happens."""
    c = VenueClock(max_ahead_s=10)
    for i in range(50):
        c.observe(T0 - 600 * S + i * 6 * S, T0 + i * MS)  # the last 50 trades of ten quiet minutes
    live = T0 + 2 * S
    assert live - 100 * MS - c.settled(live) > 200 * S and not c.ahead(live - 100 * MS, live)
    replayed = T0 - 2 * 365 * 86400 * S  # a capture's dates through a replay server: never past its receive time
    c2 = VenueClock(max_ahead_s=10)
    c2.observe(replayed, T0)
    assert not c2.ahead(replayed + 3600 * S, T0 + MS)
    with pytest.raises(ValueError, match="max_ahead_s > max_grace_s"):
        VenueClock(max_grace_s=2, max_ahead_s=1)
