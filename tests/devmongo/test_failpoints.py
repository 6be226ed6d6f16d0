"""failCommand fault injection: the drivers' resume and retry logic against real faults."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, NotPrimaryError, OperationFailure

from tests.devmongo.test_change_streams import collect, run_writer
from tests.drivers import Driver
from tests.helpers.change_writer import event_count


@pytest.fixture
async def admin(client: Any) -> AsyncIterator[Any]:
    """The admin database; any fail point a test sets is switched off afterwards."""
    yield client.admin
    await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})


def app_name() -> str:
    return f"app-{uuid.uuid4().hex[:8]}"


async def hold_once(admin: Any, command: str, app: str, ms: int) -> None:
    """The next ``command`` from ``app`` is held ``ms`` before the server runs it."""
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 1},
            "data": {
                "failCommands": [command],
                "appName": app,
                "blockConnection": True,
                "blockTimeMS": ms,
            },
        }
    )


async def test_watcher_resumes_after_getmore_connection_drops_losing_nothing(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    name = app_name()
    watcher = driver.client(mongo_uri, appname=name)
    try:
        # Small batches while the writer runs: many getMores, so every fault lands mid-stream.
        stream = await driver.watch(watcher[db_name].feed, max_await_time_ms=50, batch_size=2)
        await admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 3},
                "data": {"failCommands": ["getMore"], "closeConnection": True, "appName": name},
            }
        )
        reading = asyncio.create_task(collect(stream, event_count(10)))
        expected = await run_writer(mongo_uri, db_name, "feed", 10, delay_s=0.02)
        events = await reading
        assert [(e["operationType"], e["documentKey"]["_id"]) for e in events] == expected
        assert await stream.try_next() is None, "an event was delivered twice"
        await stream.close()
        off = await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        assert off["count"] == 3, "the fail point did not cut the watcher's connection"
    finally:
        await driver.close(watcher)


async def test_retryable_insert_with_write_concern_error_is_applied_once(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    # Portable to a real mongod: the write is applied, then answered with a retryable
    # write concern error; the driver retries with the same (lsid, txnNumber).
    name = app_name()
    # Error 91 marks the server Unknown until the next heartbeat (as with a real mongod):
    # a short heartbeat keeps the retry quick.
    writer = driver.client(mongo_uri, appname=name, heartbeatFrequencyMS=500)
    try:
        await admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 1},
                "data": {
                    "failCommands": ["insert"],
                    "appName": name,
                    "writeConcernError": {
                        "code": 91,
                        "errmsg": "Replication is being shut down",
                        "errorLabels": ["RetryableWriteError"],
                    },
                },
            }
        )
        await writer[db_name].once.insert_one({"_id": "x"})
        assert await writer[db_name].once.count_documents({}) == 1
    finally:
        await driver.close(writer)


@pytest.mark.devmongo_only
async def test_retryable_insert_whose_reply_is_lost_is_applied_exactly_once(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    name = app_name()
    data = {"failCommands": ["insert"], "appName": name, "closeConnectionAfterExecution": True}
    retrying = driver.client(mongo_uri, appname=name)
    plain = driver.client(mongo_uri, appname=name, retryWrites=False)
    try:
        # Without retries the client sees the lost reply, yet the write happened.
        await admin.command(
            {"configureFailPoint": "failCommand", "mode": {"times": 1}, "data": data}
        )
        with pytest.raises(AutoReconnect):
            await plain[db_name].once.insert_one({"_id": "seen-failing"})
        assert await plain[db_name].once.count_documents({"_id": "seen-failing"}) == 1

        # With retries the driver resends the same statement; the server answers it from
        # the session's record instead of inserting again (no DuplicateKeyError either).
        await admin.command(
            {"configureFailPoint": "failCommand", "mode": {"times": 1}, "data": data}
        )
        await retrying[db_name].once.insert_many([{"_id": "a"}, {"_id": "b"}])
        assert await retrying[db_name].once.count_documents({}) == 3
        off = await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        assert off["count"] == 1
    finally:
        await driver.close(retrying)
        await driver.close(plain)


async def test_error_code_and_labels_and_skip_mode(admin: Any, db: Any) -> None:
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"skip": 1},
            "data": {"failCommands": ["find"], "errorCode": 96, "errorLabels": ["SomeLabel"]},
        }
    )
    assert await db.c.find_one() is None  # skipped once
    with pytest.raises(OperationFailure) as caught:
        await db.c.find_one()
    assert caught.value.code == 96
    assert caught.value.has_error_label("SomeLabel")


async def test_state_change_error_carries_topology_version(admin: Any, db: Any) -> None:
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 1},
            "data": {"failCommands": ["find"], "errorCode": 10107},
        }
    )
    with pytest.raises(NotPrimaryError) as caught:
        await db.command("find", "c")  # a command is not retried, unlike find_one
    details = caught.value.details
    assert isinstance(details, Mapping)  # the server's reply
    assert details["code"] == 10107
    assert "topologyVersion" in details
    assert await db.c.find_one() is None  # the driver rediscovers the primary


async def test_block_connection_stalls_only_the_named_app(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    name = app_name()
    stalled = driver.client(mongo_uri, appname=name)
    try:
        await hold_once(admin, "find", name, 600)
        start = time.monotonic()
        await admin.command("ping")  # another app is not blocked
        await admin.client[db_name].c.find_one()
        assert time.monotonic() - start < 0.5
        start = time.monotonic()
        await stalled[db_name].c.find_one()
        assert time.monotonic() - start >= 0.55
    finally:
        await driver.close(stalled)


async def test_a_write_held_past_its_max_time_is_refused_not_applied(admin: Any, db: Any) -> None:
    """mongod's rule, which a leader's writes rely on (Term.write): maxTimeMS runs from
    when the server took the command, so a write held up longer is never applied."""
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 2},
            "data": {"failCommands": ["insert"], "blockConnection": True, "blockTimeMS": 400},
        }
    )
    with pytest.raises(OperationFailure) as caught:
        await db.command({"insert": "fenced", "documents": [{"_id": "late"}], "maxTimeMS": 100})
    assert caught.value.code == 50
    assert await db.fenced.find_one({"_id": "late"}) is None
    # Within its limit, the same held-up write is applied.
    await db.command({"insert": "fenced", "documents": [{"_id": "in-time"}], "maxTimeMS": 2000})
    assert await db.fenced.find_one({"_id": "in-time"}) is not None


async def test_wait_for_fail_point_answers_while_the_command_it_caught_is_held(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    name = app_name()
    stalled = driver.client(mongo_uri, appname=name)
    try:
        await hold_once(admin, "insert", name, 2000)
        with pytest.raises(OperationFailure) as caught:  # nothing caught yet
            await admin.command(
                {"waitForFailPoint": "failCommand", "timesEntered": 1, "maxTimeMS": 100}
            )
        assert caught.value.code == 50
        inserting = asyncio.ensure_future(stalled[db_name].held.insert_one({"_id": "x"}))
        await admin.command(
            {"waitForFailPoint": "failCommand", "timesEntered": 1, "maxTimeMS": 10_000}
        )
        assert not inserting.done()  # caught, and still held
        assert await admin.client[db_name].held.count_documents({}) == 0
        await inserting
        assert await admin.client[db_name].held.count_documents({}) == 1
    finally:
        await driver.close(stalled)


@pytest.mark.parametrize(
    "body",
    [
        {"waitForFailPoint": "failCommand", "timesEntered": 0, "maxTimeMS": 100},
        {"waitForFailPoint": "failCommand", "timesEntered": 1},
        {"waitForFailPoint": "failCommand", "timesEntered": "1", "maxTimeMS": 100},
        {"waitForFailPoint": "somethingElse", "timesEntered": 1, "maxTimeMS": 100},
    ],
)
async def test_wait_for_fail_point_refuses_what_it_cannot_wait_for(
    admin: Any, body: dict[str, Any]
) -> None:
    with pytest.raises(OperationFailure):
        await admin.command(body)
