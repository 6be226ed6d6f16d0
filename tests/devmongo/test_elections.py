"""replSetStepDown on the development server: it answers as a secondary for the time
asked (writes NotWritablePrimary, reads NotPrimaryNoSecondaryOk, connections open at the
step-down closed), then wins a new election (a greater electionId, a new topology
version). The drivers' retryable writes and change-stream resumption ride through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest
from pymongo import ReadPreference
from pymongo.errors import AutoReconnect, NotPrimaryError, OperationFailure

from tests.devmongo.test_change_streams import collect, run_writer
from tests.drivers import Driver
from tests.helpers.change_writer import event_count
from tests.waiting import wait_until

pytestmark = [pytest.mark.devmongo_only]


@pytest.fixture
def admin(client: Any) -> Any:
    return client.admin


async def hello(admin: Any) -> dict[str, Any]:
    """The server's hello (a secondary answers it too); a command is not retried by the
    driver, so the one that meets a connection the step-down closed is sent again."""
    for _ in range(3):
        try:
            reply: dict[str, Any] = await admin.command(
                "hello", read_preference=ReadPreference.SECONDARY_PREFERRED
            )
            return reply
        except AutoReconnect:
            continue
    raise AssertionError("hello failed three times")


async def step_down(admin: Any, seconds: float) -> None:
    await admin.command({"replSetStepDown": seconds})


async def test_a_step_down_is_a_secondary_for_its_time_then_a_new_election(
    admin: Any, db: Any
) -> None:
    before = await hello(admin)
    assert before["isWritablePrimary"]
    await db.c.insert_one({"_id": "before"})
    started = time.monotonic()
    await step_down(admin, 1.5)
    during = await hello(admin)
    assert (during["isWritablePrimary"], during["secondary"]) == (False, True)
    assert "primary" not in during
    assert "electionId" not in during
    assert during["topologyVersion"]["counter"] > before["topologyVersion"]["counter"]
    with pytest.raises(NotPrimaryError) as refused:
        await admin.command(
            {"replSetStepDown": 1}, read_preference=ReadPreference.SECONDARY_PREFERRED
        )
    details = refused.value.details
    assert isinstance(details, Mapping)  # the server's reply
    assert details["code"] == 10107

    # A retryable write issued now waits for the next primary and is applied once.
    await db.c.insert_one({"_id": "during"})
    assert time.monotonic() - started >= 1.4
    after = await hello(admin)
    assert after["isWritablePrimary"]
    assert after["electionId"] > before["electionId"]
    assert after["topologyVersion"]["counter"] == during["topologyVersion"]["counter"] + 1
    assert sorted([d["_id"] async for d in db.c.find()]) == ["before", "during"]


@pytest.mark.parametrize("seconds", [0, -1, 3601, "1", True, None])
async def test_a_step_down_for_a_bad_time_is_refused(admin: Any, seconds: Any) -> None:
    with pytest.raises(OperationFailure) as refused:
        await admin.command({"replSetStepDown": seconds})
    assert refused.value.code == 2
    assert (await hello(admin))["isWritablePrimary"]


async def test_a_change_stream_resumes_across_a_step_down_losing_nothing(
    admin: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    watcher = driver.client(mongo_uri)
    try:
        stream = await driver.watch(watcher[db_name].feed, max_await_time_ms=50, batch_size=2)
        reading = asyncio.create_task(collect(stream, event_count(20), deadline_s=30))
        writing = asyncio.create_task(run_writer(mongo_uri, db_name, "feed", 20, delay_s=0.1))

        async def mid_way() -> bool:
            count: int = await watcher[db_name].feed.count_documents({})
            return count >= 5

        await wait_until(mid_way, 20, "the writer mid-way")
        await step_down(admin, 1.0)
        expected = await writing
        events = await reading
        assert [(e["operationType"], e["documentKey"]["_id"]) for e in events] == expected
        assert await stream.try_next() is None, "an event was delivered twice"
        await stream.close()
    finally:
        await driver.close(watcher)
