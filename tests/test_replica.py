"""A replica in this process (its declared lifecycle): it starts, serves, leads and fires,
and leaving its block stops everything it started and hands its lease over."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from typing import Any

import aiohttp
import pytest
from pymongo import AsyncMongoClient

from hascheduler.brokers.registry import parse_broker_url
from hascheduler.replica.service import Replica, ReplicaSettings
from hascheduler.storage.lease import LeaseTimings
from hascheduler.storage.lease_history import LeaseHistory
from tests.servers import losing_sockets, with_database
from tests.waiting import wait_until


def in_process(uri: str, replica_id: str) -> ReplicaSettings:
    """A replica run in the test's process, publishing to the log, on a 2 s lease."""
    return ReplicaSettings(
        mongodb_uri=uri,
        http_host="127.0.0.1",
        http_port=0,
        replica_id=replica_id,
        broker=parse_broker_url("log:"),
        timings=LeaseTimings(ttl=2.0, renew_deadline=1.4, renew_interval=0.4),
    )


async def test_a_replica_runs_in_process_and_stops_everything_it_started(mongo_uri: str) -> None:
    uri = with_database(mongo_uri, f"inproc_{uuid.uuid4().hex[:8]}")
    settings = in_process(uri, "in-process")
    before = asyncio.all_tasks()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()
    try:
        async with Replica(settings) as replica, aiohttp.ClientSession() as http:
            assert replica.url.startswith("http://127.0.0.1:")
            async with http.post(
                replica.url + "/schedules",
                json={
                    "id": "tick",
                    "name": "tick",
                    "target": "in.process",
                    "trigger": {"kind": "cron", "cron": "* * * * * *"},
                },
            ) as r:
                assert r.status == 201, await r.text()

            async def fired() -> bool:
                return bool(
                    await db.fires.count_documents({"schedule_id": "tick", "state": "published"})
                )

            await wait_until(fired, 15, "a fire published by the in-process replica")
            assert replica.elector.is_leader
        lease = await db.leases.find_one({"_id": "scheduler"})
        assert lease is not None
        # Handed over on the way out: the lease is released, not left to expire.
        assert lease["expires_at"] <= dt.datetime.now(dt.UTC)
    finally:
        await client.drop_database(db)
        await client.close()
    leftover = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not [t for t in leftover if not t.done()], leftover


async def test_a_handover_releases_the_lease_only_once_its_terms_writes_are_answered(
    mongo_uri: str,
) -> None:
    """The database holds the replica's claim (a fail point) when the replica is told to
    stop. The replica waits for the claim's answer before it releases the lease: released
    first, the claim would land after the release, where the next leader may already act
    (the lease history calls such a write stale)."""
    name = f"handover_{uuid.uuid4().hex[:8]}"
    uri = with_database(mongo_uri, name)
    settings = in_process(uri, "handing-over")
    timings = settings.timings
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()
    try:
        async with LeaseHistory(db) as history:
            async with Replica(settings) as replica, aiohttp.ClientSession() as http:
                await wait_until(lambda: replica.elector.is_leader, 15, "the replica leads")
                await client.admin.command(
                    {
                        "configureFailPoint": "failCommand",
                        "mode": {"times": 1},
                        "data": {
                            "failCommands": ["insert"],
                            "namespace": f"{name}.fires",
                            "appName": "hascheduler/handing-over",
                            "blockConnection": True,
                            "blockTimeMS": 400,
                        },
                    }
                )
                due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2.5)
                async with http.post(
                    replica.url + "/schedules",
                    json={
                        "id": "once",
                        "name": "once",
                        "target": "in.process",
                        "trigger": {"kind": "at", "at": [due.isoformat()]},
                    },
                ) as r:
                    assert r.status == 201, await r.text()
                # Its claim (made ahead of the due time) is held: the replica stops now.
                await client.admin.command(
                    {"waitForFailPoint": "failCommand", "timesEntered": 1, "maxTimeMS": 10_000}
                )

            async def claimed() -> bool:
                return await db.fires.count_documents({"schedule_id": "once"}) == 1

            await wait_until(claimed, 10, "the held claim applied")
        report = history.check(timings)
        assert report.ok, report.as_dict()
        assert report.acts == 1, report.as_dict()
        released = history.terms[1].released_at
        assert released is not None
        assert history.acts[0].at <= released
        lease = await db.leases.find_one({"_id": "scheduler"})
        assert lease is not None
        assert lease["expires_at"] <= dt.datetime.now(dt.UTC)
    finally:
        await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        await client.drop_database(db)
        await client.close()


def renew_failures(replica: Replica) -> float:
    return next(
        s.value
        for m in replica.elector.metrics.renew_failures.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


async def test_a_pool_held_by_slow_reads_does_not_starve_the_lease(mongo_uri: str) -> None:
    """Reads of the fires that the database holds for 2 s each (a fail point), as many as
    the pool has connections (the API's, here) and the leader's own behind them: the
    leader's renewals, on a client of their own, still come every interval and none
    fails, so it keeps its term. In the ledger's pool, a renewal waited behind them past
    its 1.4 s deadline. And the fire loop goes on: its retry turn's adoption, whose write
    waits for a connection past what remained of the term, is put off to the next turn
    (it stopped the loop, which led again in the same term)."""
    name = f"starve_{uuid.uuid4().hex[:8]}"
    settings = in_process(with_database(mongo_uri, name) + "&maxPoolSize=4", "busy")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(settings.mongodb_uri, tz_aware=True)
    db = client.get_default_database()
    held = {
        "configureFailPoint": "failCommand",
        "mode": "alwaysOn",
        "data": {
            "failCommands": ["find"],
            "namespace": f"{name}.fires",
            "appName": "hascheduler/busy",
            "blockConnection": True,
            "blockTimeMS": 2000,
        },
    }
    try:
        # The replica stops while the database still holds reads of its own: cancelled.
        with losing_sockets():
            async with Replica(settings) as replica, aiohttp.ClientSession() as http:
                await wait_until(lambda: replica.elector.is_leader, 15, "the replica leads")
                term = replica.elector.lease.term
                await client.admin.command(held)

                async def read_fire(i: int) -> int:
                    async with http.get(f"{replica.url}/fires/none@{i}") as r:
                        return r.status

                elector = replica.elector
                attempts = elector.attempts
                leading = elector._leading
                failures = renew_failures(replica)
                started = time.monotonic()
                # A pool held, and the leader's own reads behind it. Its request poll and
                # retry scan hold connections for 2 s a read too, so the four reads share
                # the pool with them: 4 to 12 s on an idle machine (a multiple of the
                # hold), past 15 s once in a full suite on two cores.
                reads = asyncio.gather(*(read_fire(i) for i in range(4)))
                assert await asyncio.wait_for(reads, 45) == [404] * 4
                held_s = time.monotonic() - started
                await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
                assert held_s >= 1.9, f"the reads were not held ({held_s:.2f} s)"
                # Renewed all along, none timed out, the same term.
                interval = settings.timings.renew_interval
                # Half the cadence at least, so a loaded machine's lag passes; in the
                # ledger's pool it was about a third, every renewal waiting its turn.
                assert elector.attempts - attempts >= held_s / interval / 2, (
                    f"{elector.attempts - attempts} renewals in {held_s:.2f} s"
                )
                assert renew_failures(replica) == failures
                assert elector.is_leader
                assert replica.elector.lease.term == term
                # ... and the fire loop that led before the hold still leads.
                assert leading is not None
                assert elector._leading is leading
                assert not leading.done()
    finally:
        await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        await client.drop_database(db)
        await client.close()


@pytest.mark.parametrize("held", ["change stream", "insert", "history lost"])
async def test_a_one_off_the_leader_learns_of_after_its_instant_still_fires(
    mongo_uri: str, held: str
) -> None:
    """The database holds, 4 s (a fail point), either the leader's change stream (each
    of its getMores; with history lost, they then fail with 286 and the mirror learns of
    the one-off from a resync's load) or the schedule's own insert, while a one-off due
    after 1.5 s is written: the mirror applies it after the fire loop has passed its
    instant. Planned from the loop's watermark (or, for the held insert, from its
    commit), it was never fired; a new schedule is planned from its creation (the API's
    clock when it took the request), and it fires, late by the hold. The held insert was
    found by the chaos soak: a stalled server held a new schedule's write past five of
    its fires."""
    name = f"late_{uuid.uuid4().hex[:8]}"
    uri = with_database(mongo_uri, name)
    settings = in_process(uri, "late")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()
    hold = {"blockConnection": True, "blockTimeMS": 4000}
    try:
        async with Replica(settings) as replica, aiohttp.ClientSession() as http:
            await wait_until(lambda: replica.elector.is_leader, 15, "the replica leads")
            await asyncio.wait_for(replica.mirror.wait_ready(), 15)
            if held != "insert":
                lost = {"errorCode": 286} if held == "history lost" else {}
                await client.admin.command(
                    {
                        "configureFailPoint": "failCommand",
                        "mode": "alwaysOn",
                        "data": {
                            "failCommands": ["getMore"],
                            "appName": "hascheduler/late",
                            **hold,
                            **lost,
                        },
                    }
                )
                # The replica's two change streams (the mirror's, the lease watch's) each
                # await one getMore at a time, for at most half a second: two entries are
                # both held, and what is written now reaches the mirror when its hold ends.
                await client.admin.command(
                    {"waitForFailPoint": "failCommand", "timesEntered": 2, "maxTimeMS": 10_000}
                )
            else:
                await client.admin.command(
                    {
                        "configureFailPoint": "failCommand",
                        "mode": {"times": 1},
                        "data": {
                            "failCommands": ["insert"],
                            "namespace": f"{name}.schedules",
                            **hold,
                        },
                    }
                )
            # Due well within the hold, with room for a slow request on a busy machine.
            due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.5)
            async with http.post(
                replica.url + "/schedules",
                json={
                    "id": "soon",
                    "name": "soon",
                    "target": "in.process",
                    "trigger": {"kind": "at", "at": due.isoformat()},
                },
            ) as r:
                assert r.status == 201, await r.text()
                created = dt.datetime.fromisoformat(
                    (await r.json())["created_at"].replace("Z", "+00:00")
                )
            await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
            assert created < due

            async def fired() -> dict[str, Any] | None:
                doc: dict[str, Any] | None = await db.fires.find_one(
                    {"schedule_id": "soon", "state": "published"}
                )
                return doc

            fire = await wait_until(fired, 15, "the one-off to be fired")
            assert fire["nominal_at"] == due.replace(microsecond=due.microsecond // 1000 * 1000)
            # Claimed after its instant: the leader did learn of it late.
            assert fire["claimed_at"] > due
            if held == "history lost":  # learned of from a resync's load
                assert replica.mirror.resyncs >= 2
            assert await db.fires.count_documents({"schedule_id": "soon"}) == 1
    finally:
        await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        await client.drop_database(db)
        await client.close()
