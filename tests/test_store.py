"""Store logic: fast unit tests on mongomock-motor, and Motor/PyMongo on a real server."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

import pytest
from mongomock_motor import AsyncMongoMockClient

from hascheduler.core.errors import RevisionConflict, ScheduleExists, ScheduleNotFound
from hascheduler.core.history import Actor
from hascheduler.core.models import ScheduleFields, ScheduleIn
from hascheduler.storage.collection import Collection
from hascheduler.storage.schedules import ScheduleStore
from tests.drivers import Driver

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def new(schedule_id: str | None = None, **extra: Any) -> ScheduleIn:
    return ScheduleIn.model_validate(
        {
            "id": schedule_id,
            "name": "n",
            "target": "t",
            "trigger": {"kind": "interval", "every": 60},
            **extra,
        },
        context={"now": NOW},
    )


def fields(**extra: Any) -> ScheduleFields:
    return ScheduleFields.model_validate(
        {"name": "n2", "target": "t", "trigger": {"kind": "cron", "cron": "0 * * * *"}, **extra},
        context={"now": NOW},
    )


@pytest.fixture
def mock_store() -> ScheduleStore:
    # mongomock-motor answers the calls the store makes as a collection does.
    return ScheduleStore(cast(Collection, AsyncMongoMockClient()["db"]["schedules"]))


async def test_create_assigns_revision_and_anchors_intervals(mock_store: ScheduleStore) -> None:
    created = await mock_store.create(new("a"), NOW)
    assert created.revision == 1
    assert created.trigger.start_at == NOW
    with pytest.raises(ScheduleExists):
        await mock_store.create(new("a"), NOW)
    generated = await mock_store.create(new(), NOW)
    assert len(generated.id) == 32


async def test_revision_guards(mock_store: ScheduleStore) -> None:
    await mock_store.create(new("a"), NOW)
    updated = await mock_store.replace("a", fields(), NOW, expected_revision=1)
    assert (updated.revision, updated.name) == (2, "n2")
    with pytest.raises(RevisionConflict) as conflict:
        await mock_store.replace("a", fields(), NOW, expected_revision=1)
    assert conflict.value.current == 2
    with pytest.raises(ScheduleNotFound):
        await mock_store.replace("missing", fields(), NOW)
    paused = await mock_store.pause("a", NOW, Actor("write-1"))
    assert (paused.paused, paused.revision) == (True, 3)
    with pytest.raises(RevisionConflict):
        await mock_store.delete("a", expected_revision=2)
    await mock_store.delete("a", expected_revision=3)
    with pytest.raises(ScheduleNotFound):
        await mock_store.get("a")


async def test_store_works_with_motor_and_pymongo(
    driver: Driver, mongo_uri: str, db_name: str
) -> None:
    client = driver.client(mongo_uri)  # naive datetimes from the driver: still read as UTC
    try:
        store = ScheduleStore(client[db_name].schedules)
        await store.ensure_indexes()
        await store.create(new("a", labels={"k": "v"}), NOW)
        await store.create(new("b"), NOW)
        got = await store.get("a")
        assert got.created_at == NOW
        items, after = await store.list(labels={"k": "v"})
        assert ([s.id for s in items], after) == (["a"], None)
        page, after = await store.list(limit=1)
        assert ([s.id for s in page], after) == (["a"], "a")
        await store.replace("b", fields(), NOW, expected_revision=1)
        assert (await store.get("b")).revision == 2
    finally:
        await client.drop_database(db_name)
        await driver.close(client)
