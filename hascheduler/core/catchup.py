"""The catch-up plan (pure): which missed times a new leader fires, and what it skips; and
the fires a change applied late makes due before the watermark (``replan_from``,
``late_fires``)."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hascheduler.core.entries import Entry, Written
from hascheduler.core.fire_queue import Due
from hascheduler.core.triggers import (
    Trigger,
    count_between,
    fire_times,
    jitter_offset,
    just_before,
    latest_at_or_before,
    made_since,
)

# What one catch-up may replay for one schedule with policy 'all' (its window over its
# shortest gap between fires): a schedule asking for more is refused when written.
MAX_CATCHUP_FIRES = 100_000
# A change the mirror applies after the loop has passed the instants it makes due (its
# change stream lagging a busy server, its write held up, a schedule written just before a
# term began) is planned from when it was made (replan_from), not from the watermark:
# planned from the watermark, a one-off due in between was never fired, nor a cron's
# first fires. At most this far back: a change applied later than that (a stream resumed
# after an outage) is planned from this far back, as a catch-up window would bound it.
LATE_CHANGE_S = 10.0
# The most instants one schedule's late fires take (a catch-up's of one created just before
# the previous leader's watermark, plan_catchups; a term's start, late_fires): those of
# LATE_CHANGE_S of a dense trigger.
LATE_FIRES_MAX = 10_000


@dataclass(frozen=True, slots=True)
class SkippedRange:
    """Missed fire times not fired, recorded as one ledger document: the first and last
    nominal times, how many there were, and why."""

    first: dt.datetime
    last: dt.datetime
    count: int
    reason: str


def plan_catchup(
    trigger: Trigger, policy: str, window_s: float, since: dt.datetime, now: dt.datetime
) -> tuple[list[dt.datetime], SkippedRange | None]:
    """Nominal times in (since, now] no leader fired: which to fire now, and the range of
    those skipped with its reason.

    ``all`` fires those within ``window_s`` of now; ``latest`` only the most recent;
    ``none`` none. The work is proportional to what is fired, not to the outage: the
    latest time is found by bisection and the skipped ones are counted, not listed.
    """
    if policy == "all":
        oldest = now - dt.timedelta(seconds=window_s)
        fire = list(fire_times(trigger, max(since, oldest - _TICK), until=now))
        return fire, _skipped(
            trigger, since, min(oldest - _TICK, now), "older than the catch-up window"
        )
    if policy == "latest":
        latest = latest_at_or_before(trigger, since, now)
        if latest is None:
            return [], None
        return [latest], _skipped(
            trigger, since, latest - _TICK, "catch-up policy 'latest': a later time fired"
        )
    return [], _skipped(trigger, since, now, "catch-up policy 'none'")


_TICK = dt.timedelta(microseconds=1)


def _skipped(
    trigger: Trigger, after: dt.datetime, until: dt.datetime, reason: str
) -> SkippedRange | None:
    first = next(iter(fire_times(trigger, after, until=until, limit=1)), None)
    if first is None:
        return None
    last = latest_at_or_before(trigger, after, until)
    assert last is not None
    return SkippedRange(first, last, count_between(trigger, after, until), reason)


def change_start(written: Written | None) -> dt.datetime | None:
    """From when a change makes fires due: a new schedule's creation, or its commit."""
    if written is None:
        return None
    return written.created_at if written.created_at is not None else written.at


def replan_from(watermark: dt.datetime | None, written: Written | None) -> dt.datetime | None:
    """Where a changed schedule's fires are planned from: a new schedule from its
    creation, as the catch-up plans one (plan_catchups: its write may have been held up
    past the watermark, and the instants after its creation are due all the same); a
    change to one from the watermark, or from the commit of a change committed before it;
    either at most LATE_CHANGE_S before the watermark."""
    start = change_start(written)
    if watermark is None or start is None:
        return watermark
    new = written is not None and written.created_at is not None
    if not new and start >= watermark:
        return watermark
    return max(start, watermark - dt.timedelta(seconds=LATE_CHANGE_S))


def unplanned(
    entry: Entry | None,
    written: Written | None,
    start: dt.datetime,
    planned_from: dt.datetime,
    lag_s: float,
) -> SkippedRange | None:
    """The instants of a new schedule whose change was applied later than LATE_CHANGE_S
    that fell due between its creation and where it is planned from, as a skipped range
    (pure); None for a change to a schedule (the leader fired it as it was) or none due."""
    if entry is None or written is None or written.created_at is None or entry.dormant:
        return None
    # Due (jittered) in (start, planned_from]: with jitter, those whose nominal time is
    # surely so (the few in the jitter before planned_from may have been planned).
    until = planned_from - dt.timedelta(seconds=entry.jitter)
    first = next(iter(fire_times(entry.trigger, start, until=until, limit=1)), None)
    last = latest_at_or_before(entry.trigger, start, until)
    if first is None or last is None:
        return None
    return SkippedRange(
        first,
        last,
        count_between(entry.trigger, start, until),
        f"its creation reached the leader {lag_s:.0f} s late (more than "
        f"{LATE_CHANGE_S:g} s): its fires before were not planned",
    )


def late_fires(
    changes: Mapping[str, Written], entries: Mapping[str, Entry], now: dt.datetime
) -> list[Due]:
    """The fires due by ``now`` of changes applied while a term started (pure): planned
    from when each was made (replan_from), where the term's seed plans them from ``now``.
    A fan-out's too: an instant the ledger holds nothing of, for the tenants it selects
    now (FiringPath.claim_late)."""
    due: list[Due] = []
    for schedule_id, written in changes.items():
        entry = entries.get(schedule_id)
        start = replan_from(now, written)
        if entry is None or entry.dormant or start is None or start >= now:
            continue
        due += _dues(
            schedule_id,
            entry,
            fire_times(
                entry.trigger,
                start - dt.timedelta(seconds=entry.jitter),
                until=now,
                limit=LATE_FIRES_MAX,
            ),
            now,
            after=start,
        )
    return sorted(due)


def _dues(
    schedule_id: str,
    entry: Entry,
    nominals: Iterable[dt.datetime],
    now: dt.datetime,
    after: dt.datetime | None = None,
) -> list[Due]:
    """``nominals`` as fires to claim: those whose jittered time is by ``now`` (and after
    ``after``), and at which the schedule is not paused (until an instant)."""
    due = []
    for nominal in nominals:
        if entry.paused_at(nominal):
            continue
        fire_at = nominal + jitter_offset(schedule_id, nominal, entry.jitter)
        if fire_at <= now and made_since(fire_at, after):
            due.append(Due(fire_at, nominal, schedule_id, entry.revision))
    return due


def plan_catchups(
    entries: list[tuple[str, Entry]],
    watermark: dt.datetime | None,
    now: dt.datetime,
    created: Mapping[str, dt.datetime],
) -> tuple[list[Due], list[tuple[str, SkippedRange]]]:
    """The schedules' catch-up: the fires due by now (later ones are queued by seeding),
    and the range each skips (pure). Each schedule from the previous leader's
    ``watermark`` (with none, a database's first term, from ``now``), or from its creation
    when ``created`` has it. One created before the watermark (``created`` holds those
    created up to LATE_CHANGE_S before) also fires every instant between its creation and
    it: that leader's watermark may have passed them before it learned of the schedule (a
    write held up, a change stream lagging) and then lost the lease, as a late change's
    are fired (replan_from). Those it did fire keep their one fire: a claim is the fire
    id's insert (a fan-out's instant the ledger holds any claim of is left out,
    FiringPath.claim_late). A paused one is planned, by its policy, up to its pause's
    start (its instants before were due: the previous leader may have died before it
    fired them) and from its pause's end, if that has come (``until`` is its resume,
    whoever writes the resume and whenever its change comes); a pause from no known
    instant (a write saying ``paused``) covers everything before its end."""
    to_fire: list[Due] = []
    skipped: list[tuple[str, SkippedRange]] = []
    for schedule_id, entry in entries:
        jitter = dt.timedelta(seconds=entry.jitter)
        born = created.get(schedule_id)
        start = (watermark or now) if born is None else born
        late: Iterable[dt.datetime] = ()
        if born is not None and watermark is not None and born < watermark:
            start = watermark  # by its policy from there
            late = fire_times(
                entry.trigger, born - jitter, until=watermark - jitter, limit=LATE_FIRES_MAX
            )
        fire: list[dt.datetime] = []
        for since, until in _unpaused(entry, start, now):
            planned, skip = plan_catchup(
                entry.trigger, entry.catchup, entry.catchup_window, since - jitter, until
            )
            fire += planned
            if skip is not None and since == watermark and jitter:
                skip = _less_handled(schedule_id, entry, skip, since)
            if skip is not None:
                skipped.append((schedule_id, skip))
        to_fire += _dues(schedule_id, entry, itertools.chain(late, fire), now, born)
    return to_fire, skipped


def _less_handled(
    schedule_id: str, entry: Entry, skip: SkippedRange, watermark: dt.datetime
) -> SkippedRange | None:
    """``skip`` less the instants the previous leader handled (pure): a jittered
    schedule's instants with nominal times in the jitter before ``watermark`` whose
    jittered time is by it were fired or recorded skipped by then; planned from
    ``watermark`` less the jitter, they were counted again."""
    handled = {
        n
        for n in fire_times(
            entry.trigger, watermark - dt.timedelta(seconds=entry.jitter), until=watermark
        )
        if skip.first <= n <= skip.last
        and n + jitter_offset(schedule_id, n, entry.jitter) <= watermark
    }
    if not handled:
        return skip
    count = skip.count - len(handled)
    if count <= 0:
        return None
    first = next(
        n
        for n in fire_times(entry.trigger, just_before(skip.first), until=skip.last)
        if n not in handled
    )
    return SkippedRange(first, skip.last, count, skip.reason)


def _unpaused(
    entry: Entry, start: dt.datetime, now: dt.datetime
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The spans of (``start``, ``now``] in which ``entry`` is not paused, each as
    (after, until]: the whole of it, or the part before its pause's start and the part from
    its pause's end (pure)."""
    if not entry.paused:
        return [(start, now)]
    spans = []
    if entry.paused_since is not None and entry.paused_since > start:
        spans.append((start, min(now, just_before(entry.paused_since))))
    if entry.paused_until is not None and entry.paused_until <= now:
        spans.append((max(start, just_before(entry.paused_until)), now))
    return spans
