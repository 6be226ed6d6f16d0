"""A database primary election under the cluster: the development server steps down
(replSetStepDown: writes refused, connections closed, a new election id afterwards) during
steady firing and during a leader handover. One leader at a time, every fire exactly once
in the stream and the ledger, the mirrors equal afterwards."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time
from typing import Any

import aiohttp
import pytest
from pymongo import AsyncMongoClient

from tests.servers import losing_sockets
from tests.test_failover import DEADLINE, TTL, Harness, audit, harness, nats_server, published_by
from tests.waiting import wait_until

__all__ = ["harness", "nats_server"]  # test_failover's fixtures, shared

pytestmark = [pytest.mark.timeout(240)]

STEP_DOWN_S = 2  # longer than the replicas' renew deadline: the leader loses the lease
SAMPLE_WINDOW_S = (TTL - DEADLINE) / 2


async def step_down(mongo_uri: str) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    with losing_sockets():  # the server drops every connection as it steps down
        try:
            await client.admin.command({"replSetStepDown": STEP_DOWN_S, "force": True})
        finally:
            await client.close()


class LeaderWatch:
    """Asks every replica at once who leads, every 50 ms, until stopped: at most one may
    answer as the leader in any sample.

    A sample counts only if every answer came back within SAMPLE_WINDOW_S of its start:
    during the step-down a replica's answer can wait seconds on the database, and an
    answer from before a handover beside one from after it is not two leaders at once.
    The window is shorter than the handover's own gap (ttl - renew deadline: the old
    leader has stopped that long before the lease may be taken), so an overlap inside it
    is a real one."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.samples = 0
        self.overlaps: list[list[str]] = []
        self._task = asyncio.create_task(self._watch())

    async def _ask(self, name: str) -> bool:
        try:
            view = await self.h.get(name, "/leader")
        except (aiohttp.ClientError, TimeoutError):  # a replica just stopped
            return False
        return bool(view.get("answered_by_leader"))

    async def _watch(self) -> None:
        while True:
            names = list(self.h.replicas)
            started = time.monotonic()
            answers = await asyncio.gather(*(self._ask(name) for name in names))
            if time.monotonic() - started <= SAMPLE_WINDOW_S:
                self.samples += 1
                leading = [name for name, says in zip(names, answers, strict=True) if says]
                if len(leading) > 1:
                    self.overlaps.append(leading)
            await asyncio.sleep(0.05)  # the sampling interval, not a wait for a state

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def through_a_step_down(h: Harness, fault: Any) -> dict[str, Any]:
    """Schedules firing, ``fault`` (a step-down, maybe with more) on the leader, then the
    audit once fires flow again. Whoever leads afterwards: the same replica may take its
    lease back (the same term) or another may (a newer one)."""
    leader = await h.leader()
    term = (await h.lease())["term"]
    schedules = await h.create_schedules()
    start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    await published_by(h, term, 3, after=start)
    await fault(leader)
    primary_again = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=STEP_DOWN_S)

    async def firing_again() -> bool:
        return (
            await h.db.fires.count_documents(
                {"state": "published", "due_at": {"$gte": primary_again}}
            )
            >= 3
        )

    await wait_until(firing_again, 30, "fires published after the election")
    end = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=0.5)
    return await audit(h, schedules, start, end)


async def converged(h: Harness) -> None:
    async def equal() -> bool:
        views = [await h.get(name, "/readyz") for name in h.replicas]
        return all(v["ready"] for v in views) and len({v["digest"] for v in views}) == 1

    await wait_until(equal, 20, "every replica's mirror ready and equal")


async def watched(h: Harness, fault: Any) -> None:
    """``through_a_step_down`` while every replica is asked who leads: never two at once,
    and afterwards every mirror ready and equal."""
    watch = LeaderWatch(h)
    try:
        result = await through_a_step_down(h, fault)
    finally:
        await watch.stop()
    assert result["expected"] > 0
    assert watch.samples > 20
    assert not watch.overlaps, watch.overlaps
    await converged(h)


async def test_a_step_down_during_steady_firing(harness: Harness, mongo_uri: str) -> None:
    async def fault(leader: str) -> None:
        await step_down(mongo_uri)

    await watched(harness, fault)


async def test_a_step_down_during_a_leader_handover(harness: Harness, mongo_uri: str) -> None:
    async def fault(leader: str) -> None:
        harness.signal(leader, signal.SIGTERM)
        await step_down(mongo_uri)
        departed = harness.replicas.pop(leader)
        assert departed.process is not None
        assert departed.process.wait(20) == 0, "SIGTERM must exit cleanly"
        departed.stop()

    await watched(harness, fault)
    assert (await harness.lease())["holder"] in harness.replicas  # not the departed one
    # A schedule written after the election reaches every mirror.
    any_replica = next(iter(harness.replicas))
    async with harness.http.post(
        harness.replicas[any_replica].uri + "/schedules",
        json={
            "id": f"{harness.prefix}-after",
            "name": "after",
            "target": "t",
            "trigger": {"kind": "interval", "every": 60},
        },
    ) as r:
        assert r.status == 201, await r.text()
    await converged(harness)
