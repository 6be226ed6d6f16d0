"""Bounds for every trigger kind: start_at and end_at on cron and instant lists (pure), and
max_fires with a real replica: completed after its Nth fire, revived by raising it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pydantic import ValidationError

from hascheduler.core import models, specs
from hascheduler.core.triggers import At, Bounded, Cron, count_between, fire_times
from tests.test_failover import Harness
from tests.waiting import wait_until

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
NOW = T0 - dt.timedelta(days=1)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def test_a_bounded_cron_fires_only_within_its_window() -> None:
    trigger = Bounded(Cron("* * * * * *"), at(10), at(13))
    assert list(fire_times(trigger, at(0), limit=10)) == [at(10), at(11), at(12), at(13)]
    assert list(fire_times(trigger, at(11.5), limit=10)) == [at(12), at(13)]
    assert count_between(trigger, at(0), at(100)) == 4
    assert count_between(trigger, at(11), at(12)) == 1


def test_a_window_from_the_calendars_first_instant_counts_without_overflow() -> None:
    first = dt.datetime.min.replace(tzinfo=dt.UTC)
    trigger = Bounded(Cron("0 0 1 1 *"), first, None)
    assert count_between(trigger, first, T0) == 2029


def test_a_bounded_instant_list_drops_what_lies_outside() -> None:
    trigger = Bounded(At((at(1), at(5), at(9))), at(2), None)
    assert list(fire_times(trigger, at(0))) == [at(5), at(9)]
    assert count_between(trigger, at(0), at(10)) == 2


def test_the_models_compile_windows_for_cron_and_at() -> None:
    spec = specs.CronSpec.model_validate(
        {
            "kind": "cron",
            "cron": "0 9 * * *",
            "start_at": "2030-01-03T00:00:00Z",
            "end_at": "2030-01-05T00:00:00Z",
        },
        context={"now": NOW},
    )
    assert [t.day for t in fire_times(spec.compile(), T0)] == [3, 4]
    plain = specs.CronSpec.model_validate(
        {"kind": "cron", "cron": "0 9 * * *"}, context={"now": NOW}
    )
    assert isinstance(plain.compile(), Cron)


@pytest.mark.parametrize(
    ("trigger", "field"),
    [
        (
            {
                "kind": "cron",
                "cron": "@daily",
                "start_at": "2030-01-02T00:00:00Z",
                "end_at": "2030-01-01T00:00:00Z",
            },
            "end_at must be after start_at",
        ),
        (
            {"kind": "cron", "cron": "@daily", "end_at": "2020-01-01T00:00:00Z"},
            "end_at must be in the future",
        ),
        (
            {
                "kind": "at",
                "at": ["2030-01-05T00:00:00Z"],
                "end_at": "2029-12-31T00:00:00+01:00",
                "start_at": "2030-01-01T00:00:00Z",
            },
            "end_at must be after start_at",
        ),
        ({"kind": "cron", "cron": "@daily", "start_at": "2030-01-01T00:00:00"}, "offset"),
    ],
)
def test_bad_windows_are_refused(trigger: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        models.ScheduleIn.model_validate(
            {"name": "n", "target": "t", "trigger": trigger}, context={"now": NOW}
        )


@pytest.mark.parametrize("max_fires", [0, -1, 10_001, "5", 2.5])
def test_max_fires_is_a_count_from_1_to_10000(max_fires: Any) -> None:
    with pytest.raises(ValidationError, match="max_fires"):
        models.ScheduleIn.model_validate(
            {
                "name": "n",
                "target": "t",
                "max_fires": max_fires,
                "trigger": {"kind": "cron", "cron": "@daily"},
            },
            context={"now": NOW},
        )


async def test_max_fires_completes_after_that_many_and_raising_it_revives(
    own_harness: Harness,
) -> None:
    h = own_harness
    h.start("a")
    await h.leader()
    sid = f"{h.prefix}-five"

    status, created = await h.call(
        "POST",
        "/schedules",
        {
            "id": sid,
            "name": sid,
            "target": f"audit.{h.prefix}",
            "max_fires": 5,
            "trigger": {"kind": "interval", "every": 1},
        },
    )
    assert status == 201
    assert (created["completed"], created["fires_remaining"]) == (False, 5)

    async def completed() -> dict[str, Any] | None:
        _, body = await h.call("GET", f"/schedules/{sid}")
        return body if body["completed"] else None

    async def published() -> int:
        return await h.db.fires.count_documents({"schedule_id": sid, "state": "published"})

    done = await wait_until(completed, 30, "the schedule completed", 0.1)
    assert done["fires_remaining"] == 0
    # Firing has stopped: the leader handles two more seconds, and nothing more is out.

    async def two_seconds_after(schedule: dict[str, Any]) -> None:
        since = dt.datetime.fromisoformat(schedule["updated_at"]) + dt.timedelta(seconds=2)

        async def handled() -> bool:
            through = (await h.lease()).get("fired_through")
            return bool(through and through.replace(tzinfo=dt.UTC) > since)

        await wait_until(handled, 20, "the leader two seconds on", 0.1)

    await two_seconds_after(done)
    assert await published() == 5

    # A completed schedule runs now only when forced, and that fire is not one of its
    # max_fires: it stays completed.
    status, refused = await h.call("POST", f"/schedules/{sid}/trigger", {})
    assert status == 409
    assert "completed" in refused["title"]
    assert "force" in refused["title"]
    status, forced = await h.call("POST", f"/schedules/{sid}/trigger", {"force": True})
    assert status == 202

    async def forced_out() -> bool:
        fire = await h.db.fires.find_one({"_id": forced["fire_id"]})
        return fire is not None and fire["state"] == "published"

    await wait_until(forced_out, 20, "the forced fire published", 0.1)
    assert await published() == 6
    _, still = await h.call("GET", f"/schedules/{sid}")
    assert (still["completed"], still["fires_remaining"]) == (True, 0)

    status, revived = await h.call("PATCH", f"/schedules/{sid}", {"max_fires": 7})
    assert status == 200, revived
    assert (revived["completed"], revived["fires_remaining"], revived["revision"]) == (
        False,
        2,
        still["revision"] + 1,
    )
    again = await wait_until(completed, 30, "the schedule completed again", 0.1)
    assert again["fires_remaining"] == 0
    await two_seconds_after(again)
    assert await published() == 8  # seven of its trigger's and the one run now
