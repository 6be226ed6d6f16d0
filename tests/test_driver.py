"""The database client every process makes: the driver's wait for a server survives tasks
cancelled twice (hascheduler/storage/driver.py), which on Python 3.11 left the topology's
lock held for good and every later operation of the client waiting forever."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest
from pymongo.errors import ServerSelectionTimeoutError

from hascheduler.storage import driver
from tests.waiting import wait_until


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_tasks_cancelled_twice_while_waiting_for_a_server_leave_the_client_usable(
) -> None:
    """No server answers, so five reads wait for one (as during a primary's step-down);
    each is cancelled twice, the second while the first is being handled (a lost term's
    task group cancelling its tasks again). Each ends cancelled, the topology's lock is
    free, and the next read fails at its server selection timeout rather than waiting
    for ever."""
    client = driver.connect(f"mongodb://127.0.0.1:{unused_port()}/",
                            serverSelectionTimeoutMS=2000, connectTimeoutMS=200)
    try:
        reads = [asyncio.create_task(client.db.c.find_one({})) for _ in range(5)]
        topology = client._topology
        await wait_until(lambda: len(topology._condition._waiters) == len(reads), 5,
                         "the reads waiting for a server")
        for read in reads:
            read.cancel()
        await asyncio.sleep(0)  # each inside wait_for's handling of the first cancel
        for read in reads:
            read.cancel()
        ended = await asyncio.gather(*reads, return_exceptions=True)
        assert [type(e) for e in ended] == [asyncio.CancelledError] * len(reads)
        assert not topology._lock.locked()
        began = time.monotonic()
        with pytest.raises(ServerSelectionTimeoutError):
            await asyncio.wait_for(client.db.c.find_one({}), 10)
        assert time.monotonic() - began < 5
    finally:
        await asyncio.wait_for(client.close(), 5)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for runs in the caller's "
                    "task from Python 3.12: nothing to replace (CI runs 3.11)")
def test_every_module_of_the_driver_that_waits_on_a_condition_waits_with_ours() -> None:
    """The driver binds the function by name in each module that uses it: a new driver
    that moved or renamed it would silently bring the hang back."""
    import importlib

    for name in driver.PATCHED_MODULES:
        assert importlib.import_module(name)._async_cond_wait is driver._cond_wait, name
