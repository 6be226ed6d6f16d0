"""A replica in this process (its declared lifecycle): it starts, serves, leads and fires,
and leaving its block stops everything it started and hands its lease over."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import aiohttp
from pymongo import AsyncMongoClient

from hascheduler.brokers.registry import parse_broker_url
from hascheduler.replica.service import Replica, ReplicaSettings
from hascheduler.storage.lease import LeaseTimings
from tests.servers import with_database
from tests.waiting import wait_until


async def test_a_replica_runs_in_process_and_stops_everything_it_started(
        mongo_uri: str) -> None:
    uri = with_database(mongo_uri, f"inproc_{uuid.uuid4().hex[:8]}")
    settings = ReplicaSettings(mongodb_uri=uri, http_host="127.0.0.1", http_port=0,
                               replica_id="in-process", broker=parse_broker_url("log:"),
                               timings=LeaseTimings(ttl=2.0, renew_deadline=1.4,
                                                    renew_interval=0.4))
    before = asyncio.all_tasks()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()
    try:
        async with Replica(settings) as replica, aiohttp.ClientSession() as http:
            assert replica.url.startswith("http://127.0.0.1:")
            async with http.post(replica.url + "/schedules", json={
                    "id": "tick", "name": "tick", "target": "in.process",
                    "trigger": {"kind": "cron", "cron": "* * * * * *"}}) as r:
                assert r.status == 201, await r.text()

            async def fired() -> bool:
                return bool(await db.fires.count_documents({"schedule_id": "tick",
                                                            "state": "published"}))

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
