"""The mirror of a fan-out source against the development server: loaded after its stream
opened, ready once caught up, equal (digest) on every copy through dropped streams and lost
history, and the tenants a fan-out selects."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson import ObjectId

from hascheduler.core.fanout import FanOut
from hascheduler.replica.tenants import SourceMirror, project
from tests.drivers import Driver
from tests.waiting import wait_until

ACTIVE_PRO = FanOut.model_validate(
    {"collection": "tenants", "key": "slug", "filter": {"plan": {"$in": ["pro"]}, "active": True}}
)
FIELDS = ACTIVE_PRO.fields()


def test_only_the_fields_a_fan_out_needs_are_kept() -> None:
    doc = {
        "_id": 1,
        "slug": "acme",
        "plan": "pro",
        "active": True,
        "secret": "x",
        "org": {"region": "eu", "name": "Acme"},
    }
    assert project(doc, ["_id", "slug", "org.region", "missing.path"]) == {
        "_id": 1,
        "slug": "acme",
        "org": {"region": "eu"},
    }


def test_tenants_are_the_matching_documents_usable_keys_sorted() -> None:
    mirror = SourceMirror(collection=None, fields=FIELDS)  # type: ignore[arg-type]
    mirror.load(
        [
            {"_id": 1, "slug": "b", "plan": "pro", "active": True},
            {"_id": 2, "slug": "a", "plan": "pro", "active": True},
            {"_id": 3, "slug": "c", "plan": "free", "active": True},
            {"_id": 4, "slug": "d", "plan": "pro", "active": False},
            {"_id": 5, "slug": "e\n", "plan": "pro", "active": True},  # unusable key
            {"_id": 6, "plan": "pro", "active": True},
        ]
    )  # no key
    assert mirror.tenants(ACTIVE_PRO) == ["a", "b"]


@pytest.fixture
async def tenants(driver: Driver, mongo_uri: str, db_name: str) -> AsyncIterator[Any]:
    client = driver.client(mongo_uri, tz_aware=True, appname="tenants-test")
    yield client[db_name].tenants
    await client.drop_database(db_name)
    await driver.close(client)


@contextlib.asynccontextmanager
async def running(*mirrors: SourceMirror) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(m.run()) for m in mirrors]
    try:
        yield
    finally:
        for m, task in zip(mirrors, tasks, strict=True):
            m.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def truth(tenants: Any) -> SourceMirror:
    """What the collection holds now, as a mirror would keep it."""
    expected = SourceMirror(collection=None, fields=FIELDS)  # type: ignore[arg-type]
    expected.load([d async for d in tenants.find({})])
    return expected


async def churn(tenants: Any, rng: random.Random, rounds: int) -> None:
    for _ in range(rounds):
        roll = rng.random()
        key = rng.randrange(40)
        if roll < 0.5:
            await tenants.replace_one(
                {"_id": key},
                {
                    "slug": f"t{key}",
                    "plan": rng.choice(["pro", "free"]),
                    "active": rng.random() < 0.8,
                    "note": "x" * rng.randrange(50),
                },
                upsert=True,
            )
        elif roll < 0.8:
            await tenants.update_one({"_id": key}, {"$set": {"active": rng.random() < 0.5}})
        else:
            await tenants.delete_one({"_id": key})


async def test_mirrors_of_a_changing_source_converge_to_it(tenants: Any) -> None:
    rng = random.Random(17)
    await tenants.insert_many([{"_id": ObjectId(), "slug": "pre", "plan": "pro", "active": True}])
    await churn(tenants, rng, 40)
    one = SourceMirror(tenants, FIELDS)
    two = SourceMirror(tenants, FIELDS)
    async with running(one, two):
        writes = asyncio.create_task(churn(tenants, rng, 200))  # while they load
        await asyncio.wait_for(one.wait_ready(), 20)
        await writes
        expected = await truth(tenants)

        async def converged() -> bool:
            return one.digest == two.digest == expected.digest

        await wait_until(converged, 20, "both mirrors to equal the collection")
        assert one.tenants(ACTIVE_PRO) == expected.tenants(ACTIVE_PRO)
        assert one.size == expected.size > 0


async def test_dropped_streams_and_lost_history_lose_nothing(tenants: Any, client: Any) -> None:
    rng = random.Random(18)
    mirror = SourceMirror(tenants, FIELDS)
    admin = client.admin
    async with running(mirror):
        await asyncio.wait_for(mirror.wait_ready(), 20)
        await admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 3},
                "data": {
                    "failCommands": ["getMore"],
                    "closeConnection": True,
                    "appName": "tenants-test",
                },
            }
        )
        await churn(tenants, rng, 60)
        expected = await truth(tenants)
        await wait_until(
            lambda: mirror.digest == expected.digest,
            20,
            "the mirror to follow through dropped connections",
        )
        off = await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        assert off["count"] == 3, "the faults did not reach the mirror's stream"
        resyncs = mirror.resyncs
        await admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 1},
                "data": {"failCommands": ["getMore"], "errorCode": 286, "appName": "tenants-test"},
            }
        )
        await churn(tenants, rng, 60)
        await wait_until(
            lambda: mirror.resyncs > resyncs, 20, "a resync after the history was lost"
        )
        await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        expected = await truth(tenants)

        async def converged() -> bool:
            return mirror.ready and mirror.digest == expected.digest

        await wait_until(converged, 20, "the mirror to equal the collection")
