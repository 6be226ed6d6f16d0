"""The dashboard's read model, shaped without a server (hascheduler/api/views.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hascheduler.api.views import fan_out_fires, fire_rows, fire_view, schedule_row
from hascheduler.core import models

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def at(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def fire(sid: str, nominal: dt.datetime, **more: Any) -> dict[str, Any]:
    fid = f"{sid}@{nominal.isoformat()}" + (f"/{more['tenant']}" if "tenant" in more else "")
    return {"_id": fid, "schedule_id": sid, "nominal_at": nominal, "state": "published", **more}


def test_a_fire_is_shown_with_its_id_and_its_instants_in_utc() -> None:
    # A driver without tz_aware reads BSON dates back naive: they are UTC.
    shown = fire_view(fire("s", at(0), published_at=at(1).replace(tzinfo=None), attempts=1))
    assert shown["id"] == f"s@{at(0).isoformat()}"
    assert "_id" not in shown
    assert shown["published_at"] == at(1).isoformat()
    assert shown["attempts"] == 1


def test_a_plain_fire_carries_its_lateness_and_its_run() -> None:
    published = fire("s", at(-10), due_at=at(-10), published_at=at(-9.75))
    waiting = fire("s", at(-5), state="claimed", due_at=at(-5))
    run = {
        "state": "running",
        "attempts": 1,
        "duration_s": None,
        "worker_id": "w1",
        "payload": {"not": "shown"},
    }
    rows = fire_rows([published, waiting], {published["_id"]: run}, [])
    assert [r["id"] for r in rows] == [waiting["_id"], published["_id"]]  # latest first
    assert rows[1]["lateness_s"] == 0.25
    assert rows[1]["run"] == {
        "state": "running",
        "attempts": 1,
        "duration_s": None,
        "worker_id": "w1",
    }
    assert rows[0]["lateness_s"] is None
    assert rows[0]["run"] is None


def test_a_fan_out_fire_is_one_row_of_counts_among_the_others() -> None:
    recent = [
        fire("f", at(-3), tenant="a"),
        fire("f", at(-3), tenant="b"),
        fire("f", at(-1), tenant="a"),
        fire("s", at(-2)),
    ]
    assert fan_out_fires(recent) == {"f": [at(-3), at(-1)]}  # each fire once, as seen
    group = {
        "fire": f"f@{at(-3).isoformat()}",
        "schedule_id": "f",
        "nominal_at": at(-3).isoformat(),
        "fires": {"published": 2, "total": 2},
        "runs": {"total": 0},
    }
    rows = fire_rows(recent, {}, [group])
    assert [r["id"] for r in rows] == [f"s@{at(-2).isoformat()}", group["fire"]]
    assert rows[1]["fan_out"] == {"fires": group["fires"], "runs": group["runs"]}
    assert not any("tenant" in r for r in rows)  # no tenant's entry is a row of its own


def test_a_schedule_row_shows_its_next_fire_time_and_its_state() -> None:
    body: dict[str, Any] = {
        "name": "n",
        "target": "t",
        "trigger": {"kind": "interval", "every": 60},
    }
    schedule = models.Schedule.model_validate(
        {
            **models.ScheduleIn.model_validate(body, context={"now": at(-30)}).model_dump(),
            "id": "s",
            "created_at": at(-30),
            "updated_at": at(-30),
            "revision": 1,
            "trigger": {**body["trigger"], "start_at": at(-30)},
        }
    )
    row = schedule_row(schedule, NOW)
    assert (row["id"], row["revision"], row["paused"]) == ("s", 1, False)
    assert row["next_fire_at"] is not None
    assert NOW < dt.datetime.fromisoformat(row["next_fire_at"]) <= at(60)
    assert (row["overlap"], row["completed"], row["pause"]) == ("allow", False, None)
