"""Fan-out through the whole cluster: 3 replicas, nats-server, a worker and a tenants
collection changing while a fan-out schedule fires every second; the leader is SIGKILLed.
Each (fire, tenant) is in the stream and run exactly once; added tenants start, removed
ones stop; every replica's mirror of the tenants is the same."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from pymongo import AsyncMongoClient

from tests.servers import ServerProcess, start_nats, start_replica, with_database
from tests.test_failover import Harness, stream_counts
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


@pytest.fixture
async def cluster(mongo_uri: str, tmp_path: Path) -> AsyncIterator[tuple[Harness, Path]]:
    server: ServerProcess = start_nats()
    h = Harness(mongo_uri, server)
    record = tmp_path / "runs.txt"
    worker = None
    try:
        for name in ("a", "b", "c"):
            h.start(name)
        with open(tmp_path / "worker.log", "wb") as log:  # noqa: ASYNC230 - opened once
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "hascheduler.cli",
                "worker",
                "--broker",
                server.uri,
                "--mongodb-uri",
                h.mongo_uri,
                "--handler",
                "tests.helpers.record_handler:handle",
                "--target",
                f"audit.{h.prefix}",
                env={**os.environ, "RECORD_FIRES_TO": str(record)},
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        assert worker.stdout is not None
        assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
        yield h, record
    finally:
        if worker is not None and worker.returncode is None:
            worker.terminate()
            await asyncio.wait_for(worker.wait(), 30)
        try:
            await h.close()
        finally:
            server.stop()


def second(at: dt.datetime) -> dt.datetime:
    return at.replace(microsecond=0)


async def test_each_fire_runs_once_per_tenant_through_changes_and_a_leader_kill(
    cluster: tuple[Harness, Path],
) -> None:
    h, record = cluster
    tenants = h.db.tenants
    await tenants.insert_many(
        [{"_id": f"t{i}", "active": True} for i in range(1, 6)]
        + [{"_id": "sleeper", "active": False}]
    )
    sid = f"{h.prefix}-fan"
    any_replica = next(iter(h.replicas))
    before = await h.lease()
    async with h.http.post(
        h.replicas[any_replica].uri + "/schedules",
        json={
            "id": sid,
            "name": "per tenant",
            "target": f"audit.{h.prefix}",
            "catchup": "all",
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
            "fan_out": {"collection": "tenants", "filter": {"active": True}},
        },
    ) as r:
        assert r.status == 201, await r.text()
    start = second(dt.datetime.now(dt.UTC)) + dt.timedelta(seconds=3)

    async def fired(tenant: str, after: dt.datetime) -> bool:
        counts, _ = await stream_counts(h.nats.uri, h.prefix)
        return any(
            f.endswith(f"/{tenant}") and f.split("@")[1].split("/")[0] > after.isoformat()
            for f in counts
        )

    await wait_until(lambda: fired("t1", start), 20, "the first fan-out fires")
    # A source new to every replica is loaded without the leader handing over: its first
    # fires wait for it rather than being skipped.
    assert (await h.lease())["term"] == before["term"]
    added_at = dt.datetime.now(dt.UTC)
    await tenants.update_one({"_id": "sleeper"}, {"$set": {"active": True}})
    await tenants.update_one({"_id": "t2"}, {"$set": {"active": False}})
    await wait_until(lambda: fired("sleeper", added_at), 20, "the added tenant's first fire")

    leader = await h.leader()
    lease = await h.lease()
    h.signal(leader, signal.SIGKILL)
    h.replicas.pop(leader).stop(signal.SIGKILL)  # reaped, its pipe closed

    async def new_term() -> bool:
        doc = await h.lease()
        return bool(
            doc.get("term", 0) > lease["term"]
            and doc.get("holder") in h.replicas
            and doc["expires_at"] > dt.datetime.now(dt.UTC)
        )

    await wait_until(new_term, 20, "a new leader")
    after_kill = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    await wait_until(lambda: fired("t1", after_kill), 20, "fires from the new leader")
    end = second(dt.datetime.now(dt.UTC)) - dt.timedelta(seconds=1)

    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    assert all(n == 1 for n in counts.values()), [f for f, n in counts.items() if n > 1]
    by_second: dict[str, set[str]] = {}
    for fire in counts:
        nominal, _, tenant = fire.split("@", 1)[1].partition("/")
        assert fire.startswith(f"{sid}@"), fire
        assert tenant, fire
        by_second.setdefault(nominal, set()).add(tenant)
    change_from = second(added_at) - dt.timedelta(seconds=2)  # claims are made 1.5 s ahead
    change_to = second(added_at) + dt.timedelta(seconds=3)
    steady = {"t1", "t3", "t4", "t5"}
    moment = start
    checked = 0
    while moment <= end:
        key = moment.isoformat().replace("+00:00", ".000Z")
        got = by_second.get(key, set())
        if moment < change_from:
            assert got == steady | {"t2"}, (key, got)
        elif moment > change_to:
            assert got == steady | {"sleeper"}, (key, got)
        else:  # either side of the change, each tenant at most once (checked above)
            assert steady <= got <= steady | {"t2", "sleeper"}, (key, got)
        checked += 1
        moment += dt.timedelta(seconds=1)
    assert checked >= 5

    # Each stored fire run once, as the runs ledger and the handler's record say.
    async def all_run() -> bool:
        done = await h.db.runs.count_documents({"_id": {"$in": list(counts)}, "state": "succeeded"})
        return done == len(counts)

    await wait_until(all_run, 30, "every fan-out fire to be run")
    # The API counts a fire's tenants and runs by state, newest fire first.
    async with h.http.get(
        h.replicas[next(iter(h.replicas))].uri + f"/schedules/{sid}/runs?by=fire&limit=500"
    ) as r:
        groups = (await r.json())["fires"]
    assert [g["nominal_at"] for g in groups] == sorted(
        (g["nominal_at"] for g in groups), reverse=True
    )
    first = next(
        g for g in groups if g["fire"] == f"{sid}@{start.isoformat().replace('+00:00', '.000Z')}"
    )
    assert first["fires"] == {
        "requested": 0,
        "claimed": 0,
        "buffered": 0,
        "published": 5,
        "skipped": 0,
        "failed": 0,
        "total": 5,
    }, first
    assert first["runs"] == {
        "pending": 0,
        "running": 0,
        "succeeded": 5,
        "retrying": 0,
        "dead": 0,
        "cancelled": 0,
        "waiting": 0,
        "total": 5,
    }, first
    ran = Counter(line.split()[0] for line in record.read_text().splitlines())
    assert {f for f in counts} <= set(ran)
    assert all(ran[f] == 1 for f in counts)
    # And a skipped tenant is recorded, not silent: t2's fires claimed before its removal
    # and due after it (if any) are in the ledger as skipped with the reason.
    skipped = [d async for d in h.db.fires.find({"schedule_id": sid, "state": "skipped"})]
    assert all(
        d["_id"].endswith("/t2") and d["reason"] == "tenant no longer selected at its due time"
        for d in skipped
    ), skipped

    # Every surviving replica mirrors the tenants identically.
    async def same_sources() -> set[str] | None:
        digests = set()
        for name in h.replicas:
            status = await h.get(name, "/readyz")
            digests.add(json.dumps(status.get("sources"), sort_keys=True))
        return digests if len(digests) == 1 and '"count": 1' in next(iter(digests)) else None

    await wait_until(same_sources, 20, "equal tenant mirrors on every replica")


async def test_run_now_of_a_fan_out_runs_once_per_tenant_selected_now(
    cluster: tuple[Harness, Path],
) -> None:
    h, record = cluster
    await h.db.tenants.insert_many(
        [
            {"_id": "r1", "plan": "pro"},
            {"_id": "r2", "plan": "pro"},
            {"_id": 7, "plan": "pro"},
            {"_id": "r3", "plan": "free"},
        ]
    )
    sid = f"{h.prefix}-fan-now"
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    status, _ = await h.call(
        "POST",
        "/schedules",
        {
            "id": sid,
            "name": "per tenant, on demand",
            "target": f"audit.{h.prefix}",
            "trigger": {"kind": "at", "at": [later]},
            "payload": {"from": "schedule"},
            "fan_out": {"collection": "tenants", "filter": {"plan": "pro"}},
        },
    )
    assert status == 201
    status, fired = await h.call(
        "POST",
        f"/schedules/{sid}/trigger",
        {"payload": {"from": "request"}},
        headers={"Idempotency-Key": "backfill-pro"},
    )
    assert status == 202, fired
    fire = fired["fire_id"]
    assert fire.startswith(f"{sid}@manual-")
    assert fired["created"] is True
    # The same key again: the same fire, nothing more requested.
    status, again = await h.call(
        "POST", f"/schedules/{sid}/trigger", {}, headers={"Idempotency-Key": "backfill-pro"}
    )
    assert (status, again["fire_id"], again["created"]) == (202, fire, False)

    tenant_fires = {f"{fire}/{t}" for t in ("r1", "r2", "7")}

    async def all_run() -> bool:
        return (
            await h.db.runs.count_documents(
                {"_id": {"$in": sorted(tenant_fires)}, "state": "succeeded"}
            )
            == 3
        )

    await wait_until(all_run, 30, "the run now of each selected tenant")
    assert await h.db.fires.count_documents({"schedule_id": sid}) == 3
    async for doc in h.db.fires.find({"schedule_id": sid}):
        assert doc["_id"] in tenant_fires
        assert (doc["state"], doc["payload"], doc["manual"]) == (
            "published",
            {"from": "request"},
            True,
        )
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    assert {f: n for f, n in counts.items() if f.startswith(fire)} == dict.fromkeys(tenant_fires, 1)
    ran = Counter(line.split()[0] for line in record.read_text().splitlines())
    assert all(ran[f] == 1 for f in tenant_fires)
    # The fire itself reads as its tenants' entries and runs counted.
    status, shown = await h.call("GET", fired["url"])
    assert status == 200, shown
    assert (
        shown["id"],
        shown["fan_out"]["fires"]["published"],
        shown["fan_out"]["runs"]["succeeded"],
    ) == (fire, 3, 3)

    # A fan-out selecting nobody now has nothing to run.
    await h.db.tenants.update_many({}, {"$set": {"plan": "gone"}})
    status, refused = await h.call("POST", f"/schedules/{sid}/trigger", {})
    assert status == 409
    assert "selects no tenant" in refused["title"]


async def test_a_fan_out_above_the_bound_is_refused_when_written(mongo_uri: str) -> None:
    database = f"bound_{os.getpid()}_{id(mongo_uri)}"
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongo_uri)
    await client[database].tenants.insert_many([{"_id": f"t{i}", "active": True} for i in range(5)])
    replica = start_replica(with_database(mongo_uri, database), "bounded", "--max-fan-out", "4")
    body = {"name": "n", "target": "x", "trigger": {"kind": "cron", "cron": "* * * * *"}}
    try:
        async with aiohttp.ClientSession() as http:
            for fan_out, message in (
                ({"collection": "tenants"}, "selects more than 4 documents"),
                ({"collection": "fires"}, "hascheduler's own collections"),
                ({"collection": "tenants", "filter": {"$where": "1"}}, "a field path"),
            ):
                async with http.post(
                    replica.uri + "/schedules", json={**body, "fan_out": fan_out}
                ) as r:
                    answer = await r.json()
                    assert r.status == 422, answer
                    assert answer["errors"][0]["field"].startswith("fan_out"), answer
                    assert message in answer["errors"][0]["message"], answer
            async with http.post(
                replica.uri + "/schedules",
                json={
                    **body,
                    "fan_out": {"collection": "tenants", "filter": {"_id": {"$in": ["t0", "t1"]}}},
                },
            ) as r:
                assert r.status == 201, await r.text()
                assert (await r.json())["fan_out"]["filter"] == {"_id": {"$in": ["t0", "t1"]}}

            # A source that grows past the bound after the write: its fires run for no
            # tenant and say why; back under the bound, they run for all again.
            await client[database].tenants.insert_many(
                [{"_id": f"g{i}", "group": "g"} for i in range(3)]
            )
            async with http.post(
                replica.uri + "/schedules",
                json={
                    **body,
                    "id": "grows",
                    "trigger": {"kind": "cron", "cron": "* * * * * *"},
                    "fan_out": {"collection": "tenants", "filter": {"group": "g"}},
                },
            ) as r:
                assert r.status == 201, await r.text()
            fires = client[database].fires

            async def fired_for(count: int, after: dt.datetime) -> bool:
                """Whether a fire after ``after`` was published for ``count`` tenants."""
                tenants = Counter(
                    [
                        d["nominal_at"]
                        async for d in fires.find(
                            {
                                "schedule_id": "grows",
                                "state": "published",
                                "nominal_at": {"$gt": after},
                            }
                        )
                    ]
                )
                return count in tenants.values()

            created = dt.datetime.now(dt.UTC)
            await wait_until(lambda: fired_for(3, created), 20, "fires for the 3 tenants")
            await client[database].tenants.insert_many(
                [{"_id": f"g{i}", "group": "g"} for i in range(3, 5)]
            )
            grown = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)  # past claims made

            async def refused() -> dict[str, object] | None:
                return await fires.find_one(
                    {"schedule_id": "grows", "state": "skipped", "nominal_at": {"$gt": grown}}
                )

            skipped = await wait_until(refused, 20, "a fire refused above the bound")
            assert "selects 5 tenants at the claim, above the bound of 4" in str(
                skipped["reason"]
            ), skipped
            assert (
                await fires.count_documents(
                    {
                        "schedule_id": "grows",
                        "state": "published",
                        "nominal_at": skipped["nominal_at"],
                    }
                )
                == 0
            )
            # Nor is a run now above the bound: refused whole, nothing requested.
            async with http.post(replica.uri + "/schedules/grows/trigger", json={}) as r:
                answer = await r.json()
                assert r.status == 409, answer
                assert "more than 4 documents" in answer["title"], answer
            assert await fires.count_documents({"schedule_id": "grows", "manual": True}) == 0
            await client[database].tenants.delete_one({"_id": "g4"})
            shrunk = dt.datetime.now(dt.UTC)
            await wait_until(lambda: fired_for(4, shrunk), 20, "fires for the 4 tenants again")
    finally:
        replica.stop()
        await client.drop_database(database)
        await client.close()
