"""The fire-rate quota's decisions (core/quota.py), as a table of fires."""

from __future__ import annotations

import datetime as dt

from hascheduler.core.quota import ADMIT, DEFER, SKIP, FireRates

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def test_a_burst_up_to_the_limit_then_one_slot_per_interval() -> None:
    rates = FireRates()
    decided = [rates.decide("noisy", 4, at(0)) for _ in range(8)]
    assert [d for d, _ in decided[:4]] == [ADMIT] * 4
    assert [d for d, _ in decided[4:]] == [DEFER] * 4
    assert [slot for _, slot in decided[4:]] == [at(0.25), at(0.5), at(0.75), at(1.0)]
    # Another namespace and an unlimited one are untouched.
    assert rates.decide("quiet", 4, at(0)) == (ADMIT, at(0))
    assert rates.decide("free", None, at(0)) == (ADMIT, at(0))


def test_a_steady_rate_under_the_limit_is_never_deferred() -> None:
    rates = FireRates()
    assert all(rates.decide("n", 10, at(i * 0.1))[0] == ADMIT for i in range(1000))


def test_fires_that_would_wait_past_the_bound_are_skipped_and_reserve_nothing() -> None:
    rates = FireRates(max_delay_s=2)
    decisions = [rates.decide("n", 1, at(0))[0] for _ in range(6)]
    assert decisions == [ADMIT, DEFER, DEFER, SKIP, SKIP, SKIP]
    assert rates.decide("n", 1, at(10)) == (ADMIT, at(10))  # the quota refilled
