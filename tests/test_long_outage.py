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
    return [d async for d in h.db.fires.find({"schedule_id": schedule_id,
                                              "state": "published"}).sort("nominal_at", 1)]


async def test_a_day_down_catches_up_latest_and_the_window_only(own_harness: Harness) -> None:
    h = own_harness
    now = dt.datetime.now(dt.UTC)
    down_since = now - DAY
    store = ScheduleStore(h.db.schedules)
    for body in ({"id": "latest", "name": "latest", "target": "outage.latest",
                  "trigger": {"kind": "cron", "cron": "* * * * * *"}, "catchup": "latest"},
                 {"id": "window", "name": "window", "target": "outage.window",
                  "trigger": {"kind": "interval", "every": 1,
                              "start_at": (down_since - DAY).isoformat()},
                  "catchup": "all", "catchup_window": 600}):
        created = down_since - DAY
        await store.create(ScheduleIn.model_validate(body, context={"now": created}), created)
    # The last leader stopped a day ago; its lease has long expired.
    await h.db.leases.insert_one({"_id": "scheduler", "holder": "gone", "term": 7,
                                  "expires_at": down_since, "fired_through": down_since})
    back = dt.datetime.now(dt.UTC)
    h.start("a")

    async def caught_up() -> bool:
        skipped = await h.db.fires.count_documents({"state": "skipped"})
        return skipped == 2 and bool(await published(h, "window"))

    await wait_until(caught_up, 30, "the catch-up to be planned and published")

    latest = await published(h, "latest")
    first = latest[0]["nominal_at"]
    assert back - dt.timedelta(seconds=1) <= first <= back + dt.timedelta(seconds=10), \
        f"catch-up 'latest' fired {first}, the outage ended at {back}"
    skipped_latest = await h.db.fires.find_one({"schedule_id": "latest", "state": "skipped"})
    assert skipped_latest is not None
    assert skipped_latest["last_nominal_at"] == first - dt.timedelta(seconds=1)
    assert skipped_latest["count"] == round((first - skipped_latest["nominal_at"])
                                            .total_seconds())
    assert skipped_latest["count"] > 86_000
    assert "latest" in skipped_latest["reason"]

    window = await published(h, "window")
    caught = [d["nominal_at"] for d in window if d["nominal_at"] <= window[0]["nominal_at"]
              + dt.timedelta(seconds=599)]
    assert len(caught) == 600  # the window, each second once
    assert back - dt.timedelta(seconds=601) <= caught[0] <= back - dt.timedelta(seconds=590)
    skipped_window = await h.db.fires.find_one({"schedule_id": "window", "state": "skipped"})
    assert skipped_window is not None
    assert skipped_window["last_nominal_at"] == caught[0] - dt.timedelta(seconds=1)
    assert skipped_window["count"] == round((caught[0] - skipped_window["nominal_at"])
                                            .total_seconds())
    assert "window" in skipped_window["reason"]
    # Nothing else: two ranges for a day of seconds, not 170,000 documents.
    assert await h.db.fires.count_documents({"state": "skipped"}) == 2
    lease = await h.lease()
    assert (lease["holder"], lease["term"]) == ("a", 8)
