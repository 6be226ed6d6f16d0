"""Catch-up after a long outage, on a real replica: the cluster was down for a day (the last
leader's watermark is a day old) and a replica comes back. A per-second cron with catch-up
'latest' fires the latest missed second, not one a day old; a per-second interval with
'all' and a 600 s window fires exactly its window; what each skipped is one ledger entry
that counts it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from hascheduler.core.models import ScheduleIn
from hascheduler.storage.schedules import ScheduleStore
from tests.test_failover import Harness
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(120)]
DAY = dt.timedelta(days=1)


async def published(h: Harness, schedule_id: str) -> list[dict[str, Any]]:
    return [
        d
        async for d in h.db.fires.find({"schedule_id": schedule_id, "state": "published"}).sort(
            "nominal_at", 1
        )
    ]


async def test_a_day_down_catches_up_latest_and_the_window_only(own_harness: Harness) -> None:
    h = own_harness
    now = dt.datetime.now(dt.UTC)
    down_since = now - DAY
    store = ScheduleStore(h.db.schedules)
    for body in (
        {
            "id": "latest",
            "name": "latest",
            "target": "outage.latest",
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
            "catchup": "latest",
        },
        {
            "id": "window",
            "name": "window",
            "target": "outage.window",
            "trigger": {"kind": "interval", "every": 1, "start_at": (down_since - DAY).isoformat()},
            "catchup": "all",
            "catchup_window": 600,
        },
    ):
        created = down_since - DAY
        await store.create(ScheduleIn.model_validate(body, context={"now": created}), created)
    # The last leader stopped a day ago; its lease has long expired.
    await h.db.leases.insert_one(
        {
            "_id": "scheduler",
            "holder": "gone",
            "term": 7,
            "expires_at": down_since,
            "fired_through": down_since,
        }
    )
    back = dt.datetime.now(dt.UTC)
    h.start("a")

    async def caught_up() -> bool:
        skipped = await h.db.fires.count_documents({"state": "skipped"})
        return skipped == 2 and bool(await published(h, "window"))

    await wait_until(caught_up, 30, "the catch-up to be planned and published")

    latest = await published(h, "latest")
    first = latest[0]["nominal_at"]
    assert back - dt.timedelta(seconds=1) <= first <= back + dt.timedelta(seconds=10), (
        f"catch-up 'latest' fired {first}, the outage ended at {back}"
    )
    skipped_latest = await h.db.fires.find_one({"schedule_id": "latest", "state": "skipped"})
    assert skipped_latest is not None
    assert skipped_latest["last_nominal_at"] == first - dt.timedelta(seconds=1)
    assert skipped_latest["count"] == round((first - skipped_latest["nominal_at"]).total_seconds())
    assert skipped_latest["count"] > 86_000
    assert "latest" in skipped_latest["reason"]

    window = await published(h, "window")
    caught = [
        d["nominal_at"]
        for d in window
        if d["nominal_at"] <= window[0]["nominal_at"] + dt.timedelta(seconds=599)
    ]
    assert len(caught) == 600  # the window, each second once
    assert back - dt.timedelta(seconds=601) <= caught[0] <= back - dt.timedelta(seconds=590)
    skipped_window = await h.db.fires.find_one({"schedule_id": "window", "state": "skipped"})
    assert skipped_window is not None
    assert skipped_window["last_nominal_at"] == caught[0] - dt.timedelta(seconds=1)
    assert skipped_window["count"] == round(
        (caught[0] - skipped_window["nominal_at"]).total_seconds()
    )
    assert "window" in skipped_window["reason"]
    # Nothing else: two ranges for a day of seconds, not 170,000 documents.
    assert await h.db.fires.count_documents({"state": "skipped"}) == 2
    lease = await h.lease()
    assert (lease["holder"], lease["term"]) == ("a", 8)


async def test_a_databases_first_term_catches_each_schedule_up_from_its_creation(
    own_harness: Harness,
) -> None:
    """Schedules written before any replica of the database ever led (no watermark in the
    lease): what fell due between each one's creation and the first term is caught up by
    its policy, and nothing before its creation. A creation time that is not a date is
    passed over: that schedule fires from the term's start."""
    h = own_harness
    # Whole seconds: the database keeps milliseconds.
    created = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=20)).replace(microsecond=0)
    store = ScheduleStore(h.db.schedules)
    for body in (
        {
            "id": "once",
            "name": "once",
            "target": "first.once",
            "trigger": {"kind": "at", "at": (created + dt.timedelta(seconds=10)).isoformat()},
        },
        {
            "id": "latest",
            "name": "latest",
            "target": "first.latest",
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
            "catchup": "latest",
        },
        {
            "id": "window",
            "name": "window",
            "target": "first.window",
            "trigger": {"kind": "interval", "every": 1, "start_at": (created - DAY).isoformat()},
            "catchup": "all",
            "catchup_window": 600,
        },
    ):
        await store.create(ScheduleIn.model_validate(body, context={"now": created}), created)
    await h.db.schedules.insert_one(
        {
            "_id": "odd",
            "name": "odd",
            "target": "first.odd",
            "payload": {},
            "labels": {},
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
            "jitter": 0.0,
            "paused": False,
            "catchup": "all",
            "catchup_window": 600.0,
            "revision": 1,
            "created_at": "long ago",
            "updated_at": created,
        }
    )
    assert await h.db.leases.count_documents({}) == 0
    back = dt.datetime.now(dt.UTC)
    h.start("a")

    async def caught_up() -> bool:
        return all([await published(h, sid) for sid in ("once", "latest", "window", "odd")])

    await wait_until(caught_up, 30, "the first term's catch-up to be published")

    once = await published(h, "once")
    assert [d["nominal_at"] for d in once] == [created + dt.timedelta(seconds=10)]

    latest = await published(h, "latest")
    assert (
        back - dt.timedelta(seconds=1) <= latest[0]["nominal_at"] <= back + dt.timedelta(seconds=10)
    )
    skipped = await h.db.fires.find_one({"schedule_id": "latest", "state": "skipped"})
    assert skipped is not None
    assert created < skipped["nominal_at"] <= created + dt.timedelta(seconds=1)
    assert skipped["last_nominal_at"] == latest[0]["nominal_at"] - dt.timedelta(seconds=1)

    # Every second from its creation on (it is on the interval's grid): none before it,
    # none skipped.
    first = created + dt.timedelta(seconds=1)
    window = await wait_until(
        lambda: every_second(h, "window", first, back),
        30,
        "each second since the creation published",
    )
    assert window[0] == first
    assert await h.db.fires.count_documents({"schedule_id": "window", "state": "skipped"}) == 0

    odd = await published(h, "odd")
    assert odd[0]["nominal_at"] >= back - dt.timedelta(seconds=1)


async def test_a_schedule_written_during_an_outage_is_not_caught_up_before_its_creation(
    own_harness: Harness,
) -> None:
    """The outage began a day ago (the last leader's watermark); a schedule written
    half a minute ago with catch-up 'all' over a 600 s window fires the seconds since its
    creation only, and records no skipped range: the times before it were never due."""
    h = own_harness
    now = dt.datetime.now(dt.UTC)
    down_since = now - DAY
    created = (now - dt.timedelta(seconds=30)).replace(microsecond=0)
    await ScheduleStore(h.db.schedules).create(
        ScheduleIn.model_validate(
            {
                "id": "new",
                "name": "new",
                "target": "outage.new",
                "trigger": {"kind": "cron", "cron": "* * * * * *"},
                "catchup": "all",
                "catchup_window": 600,
            },
            context={"now": created},
        ),
        created,
    )
    await h.db.leases.insert_one(
        {
            "_id": "scheduler",
            "holder": "gone",
            "term": 7,
            "expires_at": down_since,
            "fired_through": down_since,
        }
    )
    back = dt.datetime.now(dt.UTC)
    h.start("a")

    first = first_second_after(created)
    fires = await wait_until(
        lambda: every_second(h, "new", first, back), 30, "each second since the creation published"
    )
    assert fires[0] == first
    assert await h.db.fires.count_documents({"schedule_id": "new", "state": "skipped"}) == 0


def first_second_after(instant: dt.datetime) -> dt.datetime:
    return instant.replace(microsecond=0) + dt.timedelta(seconds=1)


async def every_second(
    h: Harness, schedule_id: str, first: dt.datetime, back: dt.datetime
) -> list[dt.datetime]:
    """The published nominal times of ``schedule_id``, once they hold each second from
    ``first`` to ``back``; empty before."""
    fires = [d["nominal_at"] for d in await published(h, schedule_id)]
    wanted = {
        first + dt.timedelta(seconds=i) for i in range(int((back - first).total_seconds()) + 1)
    }
    return fires if wanted <= set(fires) else []
