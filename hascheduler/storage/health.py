"""A schedule's health read from its ledgers (three indexed reads; core/health.py judges).
GET /schedules/{id}/health, the list's health column and the per-schedule metrics all
read it here."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence

from hascheduler.core.health import (
    DEFAULT_LATE_AFTER_S,
    RUNS_SCANNED,
    Judged,
    LastFire,
    LastRun,
    ScheduleHealth,
    assess,
)
from hascheduler.core.instants import as_utc
from hascheduler.core.models import Schedule
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger

# How many schedules' health one reader judges at once (three indexed reads each): a list
# of 500 or a metrics round of thousands queues behind this many rather than opening a
# read per schedule at once.
READS_AT_ONCE = 16


class HealthReader:
    def __init__(
        self, fires: Ledger, runs: RunLedger, late_after_s: float = DEFAULT_LATE_AFTER_S
    ) -> None:
        self.fires = fires
        self.runs = runs
        self.late_after_s = late_after_s

    async def many(self, schedules: Sequence[Schedule], now: dt.datetime) -> list[ScheduleHealth]:
        gate = asyncio.Semaphore(READS_AT_ONCE)

        async def one(schedule: Schedule) -> ScheduleHealth:
            async with gate:
                return await self.of(schedule, now)

        return list(await asyncio.gather(*(one(s) for s in schedules)))

    async def of(self, schedule: Schedule, now: dt.datetime) -> ScheduleHealth:
        last, ended = await asyncio.gather(
            self.fires.last_of_trigger(schedule.id, schedule.namespace),
            self.runs.latest_ended(schedule.id, RUNS_SCANNED, schedule.namespace),
        )
        runs = [
            LastRun(
                id=d["_id"],
                state=d["state"],
                finished_at=as_utc(d.get("finished_at")),
                last_error=d.get("last_error"),
            )
            for d in ended
        ]
        success = next((r.finished_at for r in runs if r.state == "succeeded"), None)
        if success is None and len(runs) == RUNS_SCANNED:
            success = await self.runs.last_success(schedule.id, schedule.namespace)
        fire = (
            None
            if last is None
            else LastFire(
                fire_id=last["_id"],
                nominal_at=as_utc(last["nominal_at"]),
                state=last["state"],
                reason=last.get("reason"),
            )
        )
        judged = Judged(
            schedule_id=schedule.id,
            namespace=schedule.namespace,
            trigger=schedule.compile(),
            jitter=schedule.jitter,
            paused=schedule.paused,
            completed=schedule.completed,
            created_at=schedule.created_at,
            changed_at=schedule.updated_at,
            success_within=(
                float(schedule.expect.success_within) if schedule.expect is not None else None
            ),
        )
        return assess(judged, fire, runs, success, now, self.late_after_s)
