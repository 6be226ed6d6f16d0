"""The catch-up plan (pure): which missed times a new leader fires, and what it skips."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from hascheduler.core.triggers import Trigger, count_between, fire_times, latest_at_or_before

# What one catch-up may replay for one schedule with policy 'all' (its window over its
# shortest gap between fires): a schedule asking for more is refused when written.
MAX_CATCHUP_FIRES = 100_000


@dataclass(frozen=True, slots=True)
class SkippedRange:
    """Missed fire times not fired, recorded as one ledger document: the first and last
    nominal times, how many there were, and why."""

    first: dt.datetime
    last: dt.datetime
    count: int
    reason: str


def plan_catchup(trigger: Trigger, policy: str, window_s: float, since: dt.datetime,
                 now: dt.datetime) -> tuple[list[dt.datetime], SkippedRange | None]:
    """Nominal times in (since, now] no leader fired: which to fire now, and the range of
    those skipped with its reason.

    ``all`` fires those within ``window_s`` of now; ``latest`` only the most recent;
    ``none`` none. The work is proportional to what is fired, not to the outage: the
    latest time is found by bisection and the skipped ones are counted, not listed.
    """
    if policy == "all":
        oldest = now - dt.timedelta(seconds=window_s)
        fire = list(fire_times(trigger, max(since, oldest - _TICK), until=now))
        return fire, _skipped(trigger, since, min(oldest - _TICK, now),
                              "older than the catch-up window")
    if policy == "latest":
        latest = latest_at_or_before(trigger, since, now)
        if latest is None:
            return [], None
        return [latest], _skipped(trigger, since, latest - _TICK,
                                  "catch-up policy 'latest': a later time fired")
    return [], _skipped(trigger, since, now, "catch-up policy 'none'")


_TICK = dt.timedelta(microseconds=1)


def _skipped(trigger: Trigger, after: dt.datetime, until: dt.datetime,
             reason: str) -> SkippedRange | None:
    first = next(iter(fire_times(trigger, after, until=until, limit=1)), None)
    if first is None:
        return None
    last = latest_at_or_before(trigger, after, until)
    assert last is not None
    return SkippedRange(first, last, count_between(trigger, after, until), reason)
