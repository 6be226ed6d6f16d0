"""Change streams across processes: order, updateLookup, resume tokens, history loss."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import pytest
from bson import Timestamp
from pymongo.errors import OperationFailure

from tests.drivers import Driver
from tests.servers import start_devmongo


async def run_writer(
    uri: str, db: str, coll: str, count: int, delay_s: float = 0.0
) -> list[tuple[str, int]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.helpers.change_writer",
        uri,
        db,
        coll,
        str(count),
        str(delay_s),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return [tuple(e) for e in json.loads(out.decode().strip().splitlines()[-1])]


async def collect(stream: Any, count: int, deadline_s: float = 20.0) -> list[dict[str, Any]]:
    """Read exactly ``count`` events, failing at the deadline."""
    events: list[dict[str, Any]] = []
    end = time.monotonic() + deadline_s
    while len(events) < count:
        assert time.monotonic() < end, f"only {len(events)} of {count} events arrived"
        event = await stream.try_next()
        if event is not None:
            events.append(event)
    return events


async def first_event(driver: Driver, target: Any, **options: Any) -> Any:
    """Open a stream and read once (a driver may report a bad start point at either step)."""
    stream = await driver.watch(target, **options)
    try:
        return await stream.try_next()
    finally:
        await stream.close()


async def test_events_from_another_process_arrive_in_order_with_update_lookup(
    db: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    stream = await driver.watch(db.changes, full_document="updateLookup", max_await_time_ms=200)
    try:
        expected = await run_writer(mongo_uri, db_name, "changes", 12)
        events = await collect(stream, len(expected))
        assert [(e["operationType"], e["documentKey"]["_id"]) for e in events] == expected
        for e in events:
            assert e["ns"] == {"db": db_name, "coll": "changes"}
            assert isinstance(e["clusterTime"], Timestamp)
            if e["operationType"] == "insert":
                assert e["fullDocument"] == {"_id": e["documentKey"]["_id"], "v": 0}
            if e["operationType"] == "update":
                assert e["updateDescription"]["updatedFields"]["v"] == 1
                assert e["updateDescription"]["updatedFields"]["nested"] == {
                    "k": e["documentKey"]["_id"]
                }
                # updateLookup gives the document as it is when the event is read: the
                # later replace or delete may already be visible, never an older state.
                doc = e["fullDocument"]
                assert doc is None or doc["_id"] == e["documentKey"]["_id"]
            if e["operationType"] == "replace":
                assert e["fullDocument"] == {"_id": e["documentKey"]["_id"], "v": "replaced"}
        tokens = [e["_id"]["_data"] for e in events]
        assert tokens == sorted(tokens), "resume tokens must order like their events"
        assert await stream.try_next() is None, "no event beyond what was written"
    finally:
        await stream.close()


async def test_resuming_from_each_token_yields_exactly_the_later_events(
    db: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    stream = await driver.watch(db.resume, max_await_time_ms=100)
    try:
        expected = await run_writer(mongo_uri, db_name, "resume", 6)
        events = await collect(stream, len(expected))
    finally:
        await stream.close()
    ids = [e["_id"] for e in events]
    for i, token in enumerate(ids):
        resumed = await driver.watch(db.resume, resume_after=token, max_await_time_ms=100)
        try:
            later = await collect(resumed, len(ids) - i - 1)
            assert [e["_id"] for e in later] == ids[i + 1 :]
            assert await resumed.try_next() is None
        finally:
            await resumed.close()


async def test_database_stream_sees_every_collection_and_drop_invalidates(
    db: Any, driver: Driver
) -> None:
    db_stream = await driver.watch(db, max_await_time_ms=100)
    coll_stream = await driver.watch(db.a, max_await_time_ms=100)
    try:
        await db.a.insert_one({"_id": 1})
        await db.b.insert_one({"_id": 2})
        await db.a.drop()
        seen = await collect(db_stream, 3)
        assert [(e["operationType"], e["ns"].get("coll")) for e in seen] == [
            ("insert", "a"),
            ("insert", "b"),
            ("drop", "a"),
        ]
        coll_events = await collect(coll_stream, 3)
        assert [e["operationType"] for e in coll_events] == ["insert", "drop", "invalidate"]
    finally:
        await db_stream.close()
        await coll_stream.close()


async def test_start_before_history_is_change_stream_history_lost(db: Any, driver: Driver) -> None:
    with pytest.raises(OperationFailure) as caught:
        await first_event(driver, db.lost, start_at_operation_time=Timestamp(1, 1))
    assert caught.value.code == 286


@pytest.mark.devmongo_only
async def test_token_evicted_from_the_ring_is_change_stream_history_lost(driver: Driver) -> None:
    server = start_devmongo("--oplog-size", "16")
    client = driver.client(server.uri)
    try:
        coll = client.ring.c
        stream = await driver.watch(coll, max_await_time_ms=100)
        await coll.insert_one({"_id": "first"})
        first = (await collect(stream, 1))[0]["_id"]
        await stream.close()
        # Still in the ring: resumable.
        resumed = await driver.watch(coll, resume_after=first)
        await resumed.close()
        await coll.insert_many([{"_id": i} for i in range(40)])
        with pytest.raises(OperationFailure) as caught:
            await first_event(driver, coll, resume_after=first)
        assert caught.value.code == 286
    finally:
        await driver.close(client)
        assert server.stop() == 0
