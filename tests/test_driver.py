"""The database client every process makes: the driver's wait for a server survives tasks
cancelled twice (hascheduler/storage/driver.py), which on Python 3.11 left the topology's
lock held for good and every later operation of the client waiting forever."""

from __future__ import annotations

import asyncio

from hascheduler.storage import driver
from tests.test_db_elections import STEP_DOWN_S, step_down
from tests.waiting import wait_until


async def test_tasks_cancelled_twice_while_waiting_for_a_server_leave_the_client_usable(
    mongo_uri: str,
) -> None:
    """The database steps down, so five reads wait for a primary (as a replica's tasks do
    in CI's step-down tests); each is cancelled twice, the second while the first is being
    handled (a lost term's task group cancelling its tasks again). Each ends cancelled,
    the topology's lock is free, and a read once a primary is back is answered rather
    than waiting for ever."""
    client = driver.connect(mongo_uri, serverSelectionTimeoutMS=20_000)
    try:
        await client.db.c.find_one({})  # connected, so the reads below wait for a primary
        await step_down(mongo_uri)
        reads = [asyncio.create_task(client.db.c.find_one({})) for _ in range(5)]
        topology = client._topology
        await wait_until(
            lambda: len(topology._condition._waiters) == len(reads),
            5,
            "the reads waiting for a primary",
        )
        for read in reads:
            read.cancel()
        await asyncio.sleep(0)  # each inside wait_for's handling of the first cancel
        for read in reads:
            read.cancel()
        # Bounded: with the driver's own wait, a read could be left waiting for the lock
        # for good, cancellations and all.
        _, pending = await asyncio.wait(reads, timeout=5)
        assert not pending
        assert all(read.cancelled() for read in reads)
        assert not topology._lock.locked()
        await asyncio.wait_for(client.db.c.find_one({}), STEP_DOWN_S + 10)
    finally:
        await asyncio.wait_for(client.close(), 5)


def test_every_module_of_the_driver_that_waits_on_a_condition_waits_with_ours() -> None:
    """The driver binds the function by name in each module that uses it: a new driver
    that moved or renamed it would silently bring the hang back."""
    import importlib

    for name in driver.PATCHED_MODULES:
        assert importlib.import_module(name)._async_cond_wait is driver._cond_wait, name


def test_every_process_makes_its_client_through_connect() -> None:
    """A process whose client came from AsyncMongoClient directly would run the driver's
    own wait (if nothing imported storage/driver.py), and could hang after a step-down."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sources = [
        *(root / "hascheduler").rglob("*.py"),
        *(root / "dev" / "hascheduler_dev").rglob("*.py"),
    ]
    assert len(sources) > 50
    direct = [
        str(path.relative_to(root))
        for path in sources
        if "AsyncMongoClient(" in path.read_text()
        and path != root / "hascheduler" / "storage" / "driver.py"
    ]
    assert direct == []


async def test_the_pool_opens_more_connections_at_once_unless_the_uri_says() -> None:
    """Two at a time (the driver's default), a slowed link's new connections queued past a
    fenced write's budget (test_slow_link.py)."""
    made = driver.connect("mongodb://127.0.0.1:1/?directConnection=true")
    told = driver.connect("mongodb://127.0.0.1:1/?directConnection=true&maxConnecting=3")
    try:
        assert made.options.pool_options.max_connecting == driver.MAX_CONNECTING > 2
        assert told.options.pool_options.max_connecting == 3
    finally:
        await made.close()
        await told.close()
