"""Run control under hostile load, with real processes (two replicas, nats-server): 1,000
`buffer_all` schedules every second whose runs never end, a backfill of the largest size
allowed and a storm of cancels, all at once. Nothing holds the leader's event loop near a
renewal's deadline, and the lease never changes hands."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.firing_bench import schedule_doc
from tests.test_failover import DEADLINE, INTERVAL, Harness
from tests.waiting import wait_until

# The lease and the loop lag are timed: on an otherwise idle machine (scripts/test).
pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]

SCHEDULES = 1000
MAX_BUFFERED = 5


LOOP_LAG, RENEW = "hascheduler_event_loop_lag_seconds", "hascheduler_lease_renew_seconds"


async def histograms(h: Harness, name: str) -> dict[str, dict[float, float]]:
    """The loop lag's and the lease renewals' histograms of a replica: bucket -> count."""
    async with h.http.get(h.replicas[name].uri + "/metrics") as r:
        text = await r.text()
    return {
        family.name: {
            float(sample.labels["le"]): sample.value
            for sample in family.samples
            if sample.name.endswith("_bucket")
        }
        for family in text_string_to_metric_families(text)
        if family.name in (LOOP_LAG, RENEW)
    }


def longest(before: dict[float, float], after: dict[float, float]) -> float:
    """The smallest bucket holding every observation made between the two readings."""
    total = after[math.inf] - before.get(math.inf, 0.0)
    return min(le for le, n in after.items() if n - before.get(le, 0.0) >= total)


async def test_never_ending_buffers_a_largest_backfill_and_cancel_storms(
    own_harness: Harness,
) -> None:
    h = own_harness
    for name in ("a", "b"):
        h.start(name, "--write-rate", "0", "--max-buffered", str(MAX_BUFFERED))
    leader = await h.leader()
    term = (await h.lease())["term"]
    api = h.replicas[leader].uri
    before = await histograms(h, leader)

    docs = [
        {
            **schedule_doc(
                f"{h.prefix}-{i:04d}", {"kind": "cron", "cron": "* * * * * *"}, f"audit.{h.prefix}"
            ),
            "overlap": "buffer_all",
        }
        for i in range(SCHEDULES)
    ]
    await h.db.schedules.insert_many(docs)
    filled = f"{h.prefix}-filled"
    async with h.http.post(
        api + "/schedules",
        json={
            "id": filled,
            "name": filled,
            "target": f"audit.{h.prefix}.filled",
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
        },
    ) as r:
        assert r.status == 201, await r.text()
    end = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=1)
    async with h.http.post(
        f"{api}/schedules/{filled}/backfill",
        json={"start": (end - dt.timedelta(seconds=100_000)).isoformat(), "end": end.isoformat()},
    ) as r:
        assert r.status == 202, await r.text()
        backfill = (await r.json())["id"]

    # Every schedule's buffer fills: one run open (pending: no worker), five waiting.
    async def buffers_full() -> bool:
        waiting = await h.db.fires.count_documents({"state": "buffered"})
        return waiting >= SCHEDULES * MAX_BUFFERED

    await wait_until(buffers_full, 60, "every buffer full", 0.5)

    # A storm of cancels: every open run, 50 at a time, twice over (each cancel lets a
    # waiting fire go, whose run is then open in turn).
    cancelled = 0
    for _ in range(2):
        open_runs = [d["_id"] async for d in h.db.runs.find({"state": "pending"}, {"_id": 1})]
        for i in range(0, len(open_runs), 50):

            async def cancel(fire: str) -> int:
                async with h.http.post(f"{api}/runs/{fire}/cancel") as r:
                    return r.status

            statuses = await asyncio.gather(*(cancel(f) for f in open_runs[i : i + 50]))
            assert set(statuses) <= {200, 409}, statuses
            cancelled += statuses.count(200)
    assert cancelled >= SCHEDULES

    # Fires beyond the buffer are skipped, saying so; the backfill makes progress.
    async def skipped_full() -> bool:
        return await h.db.fires.count_documents({"reason": "overlap: buffer full"}) > 0

    await wait_until(skipped_full, 30, "fires skipped for a full buffer", 0.5)
    async with h.http.get(f"{api}/backfills/{backfill}") as r:
        progress: dict[str, Any] = await r.json()
    assert progress["fired"] > 0

    # Through all of it: one term; no loop stall near the renew deadline; and every
    # renewal back within what a renewal sent an interval after the last one has (a query
    # that held the database for half a second left renewals waiting up to a second).
    assert (await h.lease())["term"] == term
    after = await histograms(h, leader)
    stalled = longest(before[LOOP_LAG], after[LOOP_LAG])
    assert stalled < DEADLINE, f"the leader's loop stalled up to {stalled} s"
    renewed = longest(before.get(RENEW, {}), after[RENEW])
    assert renewed < DEADLINE - INTERVAL, f"a renewal took up to {renewed} s"
    async with h.http.delete(f"{api}/backfills/{backfill}") as r:
        assert r.status == 200
