"""ServerClock: bounds on the database's clock from replies, on the monotonic clock only."""

from __future__ import annotations

import datetime as dt

import pytest

from hascheduler.core.clock import MAX_DRIFT, RESOLUTION_S, ServerClock

SERVER_START = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


class Machine:
    """A server whose clock reads ``SERVER_START + t`` at true time ``t``, and a local host
    whose wall clock is off by ``wall_offset_s`` and whose monotonic clock reads ``t + 50``
    (an arbitrary origin). ``ask`` is one round trip of ``rtt_s``, answered at
    ``answer_at`` of the way."""

    def __init__(self, wall_offset_s: float) -> None:
        self.t = 0.0
        self.wall_offset_s = wall_offset_s
        self.clock = ServerClock(
            monotonic=lambda: self.t + 50,
            wall=lambda: SERVER_START + dt.timedelta(seconds=self.t + self.wall_offset_s),
        )

    def server_time(self) -> dt.datetime:
        exact = SERVER_START + dt.timedelta(seconds=self.t)
        return exact.replace(microsecond=exact.microsecond // 1000 * 1000)  # whole ms

    def ask(self, rtt_s: float, answer_at: float = 0.5) -> None:
        sent = self.clock.monotonic()
        self.t += rtt_s * answer_at
        server = self.server_time()
        self.t += rtt_s * (1 - answer_at)
        self.clock.observe(sent, self.clock.monotonic(), server)

    def true_now(self) -> dt.datetime:
        return SERVER_START + dt.timedelta(seconds=self.t)


def test_before_any_sample_the_clock_is_unknown_and_may_not_lead() -> None:
    m = Machine(wall_offset_s=600)
    assert not m.clock.known
    assert m.clock.problem() == "no reply from the database has told its time yet"
    assert m.clock.offset_s() is None
    assert m.clock.error_s() == float("inf")


@pytest.mark.parametrize("wall_offset_s", [-600.0, -4.0, 0.0, 4.0, 600.0])
@pytest.mark.parametrize("answer_at", [0.0, 0.5, 1.0])
def test_now_never_runs_ahead_of_the_server_whatever_the_wall_clock(
    wall_offset_s: float, answer_at: float
) -> None:
    m = Machine(wall_offset_s)
    for _ in range(20):
        m.ask(rtt_s=0.004, answer_at=answer_at)
        for _ in range(5):
            m.t += 0.1
            now = m.clock.now()
            assert now <= m.true_now()
            # ... and lags it by no more than the round trip (plus resolution and drift).
            assert (m.true_now() - now).total_seconds() <= 0.004 + RESOLUTION_S + 0.001
    offset = m.clock.offset_s()
    assert offset is not None
    assert abs(offset - (-wall_offset_s)) <= m.clock.error_s() + 1e-9
    assert m.clock.problem() is None


def test_a_stepped_wall_clock_changes_the_offset_but_not_now() -> None:
    m = Machine(wall_offset_s=0.0)
    m.ask(rtt_s=0.002)
    before = m.clock.now()
    m.wall_offset_s = 3600.0  # NTP stepped this host's clock by an hour
    m.t += 1.0
    assert (m.clock.now() - before).total_seconds() == pytest.approx(1.0, abs=0.01)
    offset = m.clock.offset_s()
    assert offset is not None
    assert offset == pytest.approx(-3600.0, abs=0.01)


def test_the_tightest_sample_is_kept_and_the_bounds_widen_with_drift() -> None:
    m = Machine(wall_offset_s=0.0)
    m.ask(rtt_s=0.002)
    tight = m.clock.error_s()
    m.ask(rtt_s=0.400)  # a slow reply does not loosen what a fast one told
    assert m.clock.error_s() <= tight + 0.001
    m.t += 100.0  # no sample for 100 s: the monotonic clock may have drifted meanwhile
    assert m.clock.error_s() == pytest.approx(tight + 100 * MAX_DRIFT, rel=0.1)


def test_only_slow_round_trips_leave_the_clock_unbounded() -> None:
    m = Machine(wall_offset_s=0.0)
    m.ask(rtt_s=0.8)  # known to within about 400 ms: more than the 250 ms tolerance
    problem = m.clock.problem()
    assert problem is not None
    assert "tolerance of 250 ms" in problem
    m.ask(rtt_s=0.01)
    assert m.clock.problem() is None


def test_a_server_clock_step_is_taken_from_the_newest_sample() -> None:
    m = Machine(wall_offset_s=0.0)
    m.ask(rtt_s=0.002)
    # The database's clock is stepped back 30 s (or a new primary answers with its own).
    shifted = SERVER_START - dt.timedelta(seconds=30)
    sent = m.clock.monotonic()
    m.t += 0.002
    m.clock.observe(sent, m.clock.monotonic(), shifted + dt.timedelta(seconds=m.t - 0.001))
    assert m.clock.resets == 1
    now = m.clock.now()
    assert now <= shifted + dt.timedelta(seconds=m.t)
    assert (shifted + dt.timedelta(seconds=m.t) - now).total_seconds() < 0.01


def test_a_reply_received_before_it_was_sent_is_ignored() -> None:
    m = Machine(wall_offset_s=0.0)
    m.clock.observe(10.0, 9.0, SERVER_START)
    assert not m.clock.known
    assert m.clock.samples == 0
