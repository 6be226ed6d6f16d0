"""Three replica processes on one MongoDB server: every change reaches every mirror."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from pymongo import AsyncMongoClient

from tests.servers import ServerProcess, start_replica, with_database
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)


class Cluster:
    def __init__(self, mongodb_uri: str) -> None:
        self.mongodb_uri = mongodb_uri
        self.replicas: dict[str, ServerProcess] = {}
        self.http = aiohttp.ClientSession()

    def start(self, name: str) -> None:
        self.replicas[name] = start_replica(self.mongodb_uri, name)

    def stop(self, name: str) -> None:
        assert self.replicas.pop(name).stop() == 0

    async def request(self, name: str, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.replicas[name].uri + path, **kwargs) as r:
            body = await r.json() if r.content_type == "application/json" else None
            return r.status, body

    async def mirror(self, name: str, schedule_id: str) -> dict[str, Any] | None:
        status, body = await self.request(name, "GET", f"/mirror/{schedule_id}")
        return body if status == 200 else None

    async def await_everywhere(
        self, schedule_id: str, what: str, check: Any = lambda entry: entry is not None
    ) -> None:
        async def everywhere() -> bool:
            entries = [await self.mirror(n, schedule_id) for n in self.replicas]
            return all(check(e) for e in entries)

        await wait_until(everywhere, 15, f"{what} on every replica")

    async def digests(self) -> set[str]:
        return {(await self.request(n, "GET", "/readyz"))[1]["digest"] for n in self.replicas}

    async def converged(self) -> None:
        async def one_digest() -> bool:
            return len(await self.digests()) == 1

        await wait_until(one_digest, 15, "the mirror digests to converge")

    async def close(self) -> None:
        await self.http.close()
        for process in self.replicas.values():
            process.stop()


@pytest.fixture(scope="module")
def database() -> str:
    return f"cluster_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def cluster_uri(mongo_uri: str, database: str) -> str:
    return with_database(mongo_uri, database)


@pytest.fixture
async def cluster(cluster_uri: str) -> AsyncIterator[Cluster]:
    c = Cluster(cluster_uri)
    for name in ("a", "b", "c"):
        c.start(name)
    try:
        for name in c.replicas:
            await wait_until(functools.partial(_ready, c, name), 20, f"replica {name} to be ready")
        yield c
    finally:
        await c.close()


async def _ready(c: Cluster, name: str) -> bool:
    return (await c.request(name, "GET", "/readyz"))[0] == 200


@pytest.fixture
async def admin(mongo_uri: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    yield client.admin
    await client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
    await client.close()


def schedule(schedule_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "demo.ticks",
        "jitter": 2,
        "trigger": {"kind": "cron", "cron": "*/5 * * * * *"},
        **extra,
    }


async def test_a_schedule_created_on_one_replica_reaches_every_mirror(cluster: Cluster) -> None:
    sid = f"s-{uuid.uuid4().hex[:6]}"
    status, created = await cluster.request("a", "POST", "/schedules", json=schedule(sid))
    assert status == 201
    await cluster.await_everywhere(sid, "the new schedule")
    previews = [
        (await cluster.request(n, "GET", f"/schedules/{sid}/next?count=4"))[1]
        for n in cluster.replicas
    ]
    assert previews[0] == previews[1] == previews[2]
    mirrored = [await cluster.mirror(n, sid) for n in cluster.replicas]
    assert None not in mirrored
    nominal = {m["next_nominal"] for m in mirrored if m is not None}
    assert len(nominal) == 1
    await cluster.converged()

    # Update, pause, resume, delete: each through a different replica, each everywhere.
    status, _ = await cluster.request(
        "b",
        "PUT",
        f"/schedules/{sid}",
        json=schedule(sid, name="renamed"),
        headers={"If-Match": f'"{created["revision"]}"'},
    )
    assert status == 200
    await cluster.await_everywhere(
        sid, "the update", lambda e: e is not None and e["revision"] == 2
    )
    await cluster.request("c", "POST", f"/schedules/{sid}/pause")
    await cluster.await_everywhere(sid, "the pause", lambda e: e is not None and e["paused"])
    await cluster.request("a", "POST", f"/schedules/{sid}/resume")
    await cluster.await_everywhere(sid, "the resume", lambda e: e is not None and not e["paused"])
    assert (await cluster.request("b", "DELETE", f"/schedules/{sid}"))[0] == 204
    await cluster.await_everywhere(sid, "the delete", lambda e: e is None)
    await cluster.converged()


async def test_a_restarted_replica_resyncs_what_it_missed(cluster: Cluster) -> None:
    cluster.stop("c")
    ids = [f"r-{uuid.uuid4().hex[:6]}" for _ in range(5)]
    for sid in ids:
        assert (await cluster.request("a", "POST", "/schedules", json=schedule(sid)))[0] == 201
    await cluster.request("b", "DELETE", f"/schedules/{ids[0]}")
    cluster.start("c")
    await wait_until(lambda: _ready(cluster, "c"), 20, "the restarted replica to be ready")
    await cluster.converged()
    assert await cluster.mirror("c", ids[1]) is not None
    assert await cluster.mirror("c", ids[0]) is None


async def test_dropped_stream_connections_resume_with_nothing_lost(
    cluster: Cluster, admin: Any
) -> None:
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 3},
            "data": {
                "failCommands": ["getMore"],
                "closeConnection": True,
                "appName": "hascheduler/b",
            },
        }
    )
    ids = [f"f-{uuid.uuid4().hex[:6]}" for _ in range(20)]
    for sid in ids:
        # One at a time, each seen everywhere before the next: every write is answered by
        # one of b's getMores (or the resume a failed one forces), so all three faults land.
        await cluster.request("a", "POST", "/schedules", json=schedule(sid))
        await cluster.await_everywhere(sid, f"schedule {sid}")
    await cluster.converged()
    off = await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
    assert off["count"] == 3, "the fault was not injected into b's change stream"


async def test_history_lost_makes_the_replica_resync(cluster: Cluster, admin: Any) -> None:
    before = (await cluster.request("b", "GET", "/readyz"))[1]["resyncs"]
    # Every getMore of b's until it resyncs: b has two change streams (the mirror's and
    # the lease watch's), and a fail point for one getMore could be spent on the lease's.
    await admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": "alwaysOn",
            "data": {"failCommands": ["getMore"], "errorCode": 286, "appName": "hascheduler/b"},
        }
    )
    sid = f"h-{uuid.uuid4().hex[:6]}"
    try:
        await cluster.request("a", "POST", "/schedules", json=schedule(sid))

        async def resynced() -> bool:
            status = (await cluster.request("b", "GET", "/readyz"))[1]
            return bool(status["resyncs"] > before)

        await wait_until(resynced, 15, "b to resync after history loss")
    finally:
        await admin.command({"configureFailPoint": "failCommand", "mode": "off"})
    await cluster.await_everywhere(sid, "the schedule written around the loss")
    await cluster.converged()
