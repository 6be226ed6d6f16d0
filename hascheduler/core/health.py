"""A schedule's health, judged from what its ledgers say (pure: the reads are
storage/health.py's).

A schedule is *late* when its own trigger says a fire was due (past a grace of
``late_after_s``, serve --late-after, plus its jitter) and the fire ledger holds no fire
for it: nothing was claimed, skipped or failed for that nominal time. Only the trigger's
fires count, not runs now; the first due time looked for is the trigger's next after the
latest fire of the ledger, or after the schedule's last change (a pause, a resume or a new
trigger moves what is due, and times before it are not owed).

It is *failing* while its latest ended runs are dead: ``consecutive_failures`` counts the
dead runs since the last success, newest first, at most ``RUNS_SCANNED`` of them
(cancelled runs neither break nor extend the count). A fan-out's runs count together.

With ``expect.success_within``, its *objective* is a success within that long: met while
the last success (or, before the first, the schedule's creation) is younger than that.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from hascheduler.core import triggers

# A fire is published within milliseconds of its due time on a healthy cluster and within
# seconds of a failover; a minute past it, a missing fire is news (serve --late-after).
DEFAULT_LATE_AFTER_S = 60.0
# The most ended runs read to count consecutive failures.
RUNS_SCANNED = 100

Status = Literal["ok", "late", "objective_missed", "failing", "paused", "completed"]


class LastFire(BaseModel):
    fire_id: str
    nominal_at: dt.datetime
    state: str = Field(description="claimed, published, buffered, skipped or failed")
    reason: str | None = None


class LastRun(BaseModel):
    id: str
    state: str = Field(description="succeeded, dead or cancelled")
    finished_at: dt.datetime | None = None
    last_error: str | None = None


class ScheduleHealth(BaseModel):
    schedule_id: str
    namespace: str
    status: Status = Field(
        description="the worst that holds: late, objective_missed, "
        "failing; else paused, completed or ok"
    )
    last_fire: LastFire | None = Field(
        None, description="the latest fire of its trigger in the ledger"
    )
    last_run: LastRun | None = Field(None, description="the latest ended run")
    last_success_at: dt.datetime | None = None
    consecutive_failures: int = Field(
        description=f"dead runs since the last success, counted up to {RUNS_SCANNED}"
    )
    late: bool = Field(
        description="a fire of its trigger was due longer ago than the "
        "cluster's --late-after (plus its jitter) and the "
        "ledger has none"
    )
    overdue_since: dt.datetime | None = Field(
        None, description="the first nominal time that is late"
    )
    success_within: float | None = Field(None, description="expect.success_within, seconds")
    success_deadline: dt.datetime | None = Field(
        None,
        description="the objective holds until then: last success (or creation) "
        "plus success_within",
    )
    objective_met: bool | None = Field(None, description="null without an objective")
    checked_at: dt.datetime


@dataclass(frozen=True)
class Judged:
    """What health needs of the schedule itself."""

    schedule_id: str
    namespace: str
    trigger: triggers.Trigger
    jitter: float
    paused: bool
    completed: bool
    created_at: dt.datetime
    changed_at: dt.datetime  # its last revision's instant
    success_within: float | None


def assess(
    schedule: Judged,
    last_fire: LastFire | None,
    ended: Sequence[LastRun],
    last_success_at: dt.datetime | None,
    now: dt.datetime,
    late_after_s: float = DEFAULT_LATE_AFTER_S,
) -> ScheduleHealth:
    """``ended``: its latest ended runs, newest nominal time first; ``last_success_at``:
    its latest success's end, which may be older than every run in ``ended``."""
    failures = 0
    for run in ended:
        if run.state == "succeeded":
            break
        if run.state == "dead":
            failures += 1
    overdue = None
    if not (schedule.paused or schedule.completed):
        after = schedule.changed_at
        if last_fire is not None and last_fire.nominal_at > after:
            after = last_fire.nominal_at
        due = triggers.next_fire(schedule.trigger, after)
        grace = dt.timedelta(seconds=late_after_s + schedule.jitter)
        if due is not None and due + grace <= now:
            overdue = due
    deadline = met = None
    if schedule.success_within is not None:
        deadline = (last_success_at or schedule.created_at) + dt.timedelta(
            seconds=schedule.success_within
        )
        met = now <= deadline
    status: Status
    if overdue is not None:
        status = "late"
    elif met is False:
        status = "objective_missed"
    elif failures:
        status = "failing"
    elif schedule.completed:
        status = "completed"
    elif schedule.paused:
        status = "paused"
    else:
        status = "ok"
    return ScheduleHealth(
        schedule_id=schedule.schedule_id,
        namespace=schedule.namespace,
        status=status,
        last_fire=last_fire,
        last_run=ended[0] if ended else None,
        last_success_at=last_success_at,
        consecutive_failures=failures,
        late=overdue is not None,
        overdue_since=overdue,
        success_within=schedule.success_within,
        success_deadline=deadline,
        objective_met=met,
        checked_at=now,
    )
