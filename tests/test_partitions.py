"""Partitions for real: every process in a network namespace of its own, links cut with
nftables while schedules fire every second.

The development MongoDB server, a nats-server, three replicas and two workers each run in
their own namespace on one bridge (hascheduler_dev/netns.py); the test talks to them from
an observer namespace no fault touches. One fault at a time, each healed before the next:

- the leader cut from MongoDB (both ways), the broker still reachable;
- the leader cut from the broker, MongoDB still reachable;
- a worker cut from MongoDB while its handlers run;
- the leader isolated from everything;
- a one-way cut: what the leader sends to MongoDB is dropped, what MongoDB sends arrives;
- a lossy link: 30% of the packets between the leader and MongoDB dropped, each way.

Then the audit: every (schedule, nominal time) of the window in the stream exactly once and
never before its due time by the broker's clock, published once in the fires ledger, its
run succeeded in the runs ledger; and the lease history (every acquisition, renewal,
release and claim, on the server's clock) shows no two terms valid at once and no claim
outside its term.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hascheduler_dev.netns import Network, Node
from pymongo import AsyncMongoClient

from hascheduler.core.triggers import Cron, fire_id, fire_times
from hascheduler.storage.lease import LeaseTimings
from hascheduler.storage.lease_history import LeaseHistory
from tests.servers import (
    ServerProcess,
    nats_server_binary,
    start_cli,
    started,
    with_database,
)
from tests.test_failover import stream_counts
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]

TTL, DEADLINE, INTERVAL = 2.0, 1.4, 0.4
TOKEN = "partition-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
REPLICAS = ("r1", "r2", "r3")
WORKERS = ("w1", "w2")


class Partitioned:
    """The cluster in its namespaces, and what the test reads it with."""

    def __init__(self, net: Network, tmp: Path) -> None:
        self.net = net
        self.tmp = tmp
        self.prefix = uuid.uuid4().hex[:6]
        self.db_name = f"partitions_{self.prefix}"
        self.processes: list[ServerProcess] = []
        self.replicas: dict[str, ServerProcess] = {}
        self.nodes = {name: net.add(name) for name in ("db", "nats", *REPLICAS, *WORKERS)}
        self.observer = net.add("observer")
        self.mongo_uri = ""
        self.nats_uri = f"nats://{self.nodes['nats'].address}:4222"
        self.record = tmp / "attempts.txt"

    def start(self) -> None:
        db = self.nodes["db"]
        mongo = start_cli(
            ["devmongo", "--host", db.address, "--port", "27017"],
            "mongodb://",
            20.0,
            prefix=db.run_in,
        )
        self.processes.append(mongo)
        self.mongo_uri = with_database(mongo.uri, self.db_name)
        self._start_nats()
        for name in REPLICAS:
            node = self.nodes[name]
            replica = start_cli(
                [
                    "serve",
                    "--mongodb-uri",
                    self.mongo_uri,
                    "--broker",
                    self.nats_uri,
                    "--http-host",
                    "0.0.0.0",
                    "--http-port",
                    "8080",
                    "--replica-id",
                    name,
                    "--lease-ttl",
                    str(TTL),
                    "--renew-deadline",
                    str(DEADLINE),
                    "--renew-interval",
                    str(INTERVAL),
                ],
                "http",
                30.0,
                env={"HASCHEDULER_WRITE_TOKENS": TOKEN},
                prefix=node.run_in,
            )
            replica.uri = f"http://{node.address}:8080"
            self.replicas[name] = replica
            self.processes.append(replica)
        for name in WORKERS:
            self.processes.append(
                start_cli(
                    [
                        "worker",
                        "--broker",
                        self.nats_uri,
                        "--mongodb-uri",
                        self.mongo_uri,
                        "--app",
                        "tests.helpers.record_handler:app",
                        "--worker-id",
                        name,
                        "--durable",
                        f"partitions-{self.prefix}",
                        "--ack-wait",
                        "3",
                    ],
                    "worker",
                    30.0,
                    env={"RECORD_FIRES_TO": str(self.record)},
                    prefix=self.nodes[name].run_in,
                )
            )

    def _start_nats(self) -> None:
        node = self.nodes["nats"]
        log = self.tmp / "nats.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    *node.run_in,
                    nats_server_binary(),
                    "-js",
                    "-sd",
                    str(self.tmp / "js"),
                    "-a",
                    node.address,
                    "-p",
                    "4222",
                ],
                stdout=out,
                stderr=out,
            )
        self.processes.append(ServerProcess(self.nats_uri, process, str(log)))

        def listening() -> bool:
            with socket.socket() as probe:
                probe.settimeout(0.5)
                return probe.connect_ex((node.address, 4222)) == 0

        assert started(process, listening, 20.0, "nats-server to listen", 0.05)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop(signal.SIGKILL)


async def lease(db: Any) -> dict[str, Any]:
    return await db.leases.find_one({"_id": "scheduler"}) or {}


async def current_leader(db: Any) -> tuple[str, int]:
    """The replica holding a live lease (renewed within the last renew deadline)."""

    async def held() -> tuple[str, int] | None:
        doc = await lease(db)
        renewed = doc.get("renewed_at")
        fresh = (
            renewed is not None and (dt.datetime.now(dt.UTC) - renewed).total_seconds() < DEADLINE
        )
        if doc.get("holder") in REPLICAS and fresh and doc["expires_at"] > renewed:
            return str(doc["holder"]), int(doc["term"])
        return None

    value: tuple[str, int] = await wait_until(held, 30, "a leader renewing its lease", 0.1)
    return value


async def all_ready(http: aiohttp.ClientSession, cluster: Partitioned) -> None:
    """Every replica answers /readyz in sync and knows the database's clock."""

    async def ready() -> bool:
        for replica in cluster.replicas.values():
            try:
                async with http.get(
                    replica.uri + "/readyz", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    body = await r.json()
            except (aiohttp.ClientError, TimeoutError):
                return False
            if r.status != 200 or (body.get("clock") or {}).get("problem"):
                return False
        return True

    await wait_until(ready, 30, "every replica ready again", 0.2)


# What shows a fault has bitten: the term it hit and when it began, to a condition.
Bitten = Callable[[int, dt.datetime], Awaitable[bool]]


async def fires_since(db: Any, since: dt.datetime, **query: Any) -> int:
    return int(await db.fires.count_documents({"due_at": {"$gte": since}, **query}))


def attempts_since(cluster: Partitioned, since: dt.datetime) -> int:
    """Handler attempts started since ``since`` (the record: fire, term, attempt, time)."""
    if not cluster.record.exists():
        return 0
    lines = cluster.record.read_text().split("\n")
    return sum(1 for line in lines if line and float(line.split()[3]) >= since.timestamp())


async def run_faults(
    cluster: Partitioned, db: Any, http: aiohttp.ClientSession
) -> list[dict[str, Any]]:
    """Each fault in turn. A fault holds until it has shown its effect (a condition with a
    deadline, never a fixed time), then is healed and the cluster is let recover."""
    net, nodes = cluster.net, cluster.nodes
    everyone = [*nodes.values(), cluster.observer]
    outcomes = []
    # (kind, whether the leadership must move, the cut, what shows the fault has bitten)

    async def new_term_fires(term: int, since: dt.datetime) -> bool:
        """The next leader has published two fires due since the cut."""
        return await fires_since(db, since, term={"$gt": term}, state="published") >= 2

    async def stuck_claims(term: int, since: dt.datetime) -> bool:
        """Two fires claimed since the cut have waited 2 s past their due time for the
        broker (a publish in flight takes milliseconds)."""
        waited = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
        return (
            await fires_since(
                db, since, term=term, state="claimed", due_at={"$gte": since, "$lt": waited}
            )
            >= 2
        )

    async def work_goes_on(term: int, since: dt.datetime) -> bool:
        """Handlers still start (the other worker; the cut one's own)."""
        return attempts_since(cluster, since) >= 3

    async def published_through(term: int, since: dt.datetime) -> bool:
        """Three fires due since the loss began were published through it."""
        return await fires_since(db, since, state="published") >= 3

    faults: list[tuple[str, bool, Callable[[Node], None], Bitten]] = [
        ("leader cut from MongoDB", True, lambda n: net.cut(n, nodes["db"]), new_term_fires),
        ("leader cut from the broker", False, lambda n: net.cut(n, nodes["nats"]), stuck_claims),
        ("worker cut from MongoDB", False, lambda n: net.cut(n, nodes["db"]), work_goes_on),
        (
            "leader isolated from everything",
            True,
            lambda n: net.cut(n, *[o for o in everyone if o is not n]),
            new_term_fires,
        ),
        (
            "leader's packets to MongoDB dropped (one way)",
            True,
            lambda n: net.cut(n, nodes["db"], incoming=False),
            new_term_fires,
        ),
        (
            "lossy link between the leader and MongoDB (30%)",
            False,
            lambda n: net.lossy(n, nodes["db"], 30),
            published_through,
        ),
    ]
    for kind, moves, cut, bitten in faults:
        holder, term = await current_leader(db)
        target = nodes["w1"] if kind.startswith("worker") else nodes[holder]
        cut(target)
        began, began_at = time.monotonic(), dt.datetime.now(dt.UTC)
        new_holder, new_term = holder, term
        if moves:

            async def moved(holder: str = holder) -> tuple[str, int] | None:
                found = await current_leader(db)
                return found if found[0] != holder else None

            new_holder, new_term = await wait_until(moved, 20, f"a new leader ({kind})", 0.1)
        took = time.monotonic() - began
        await wait_until(
            functools.partial(bitten, term, began_at), 30, f"the effect of: {kind}", 0.2
        )
        if not moves and not kind.startswith("lossy"):
            still = await lease(db)
            assert (still.get("holder"), still.get("term")) == (holder, term), (kind, still)
        net.heal(target)
        healed_at = dt.datetime.now(dt.UTC)
        await all_ready(http, cluster)
        outcomes.append(
            {
                "fault": kind,
                "leader": holder,
                "term": term,
                "new_leader": new_holder,
                "new_term": new_term,
                "moved_after_s": round(took, 2) if moves else None,
                "began_at": began_at,
                "healed_at": healed_at,
            }
        )
    return outcomes


@pytest.mark.long(21)
async def test_partitions_lose_nothing_duplicate_nothing_and_fire_nothing_early(
    tmp_path: Path,
) -> None:
    with Network() as net:
        cluster = Partitioned(net, tmp_path)
        with net.observe(cluster.observer):
            try:
                await _partitioned(cluster)
            finally:
                cluster.stop()


async def _partitioned(cluster: Partitioned) -> None:
    # Here, not in a thread: a socket belongs to its thread's namespace, the observer's.
    cluster.start()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(cluster.mongo_uri, tz_aware=True)
    db = client[cluster.db_name]
    schedules = {
        f"{cluster.prefix}-fast": ("* * * * * *", None),
        f"{cluster.prefix}-slow": ("*/2 * * * * *", {"sleep": 1.5}),
    }
    try:
        async with aiohttp.ClientSession(headers=HEADERS) as http, LeaseHistory(db) as history:
            await current_leader(db)
            await all_ready(http, cluster)
            for sid, (cron, payload) in schedules.items():
                body = {
                    "id": sid,
                    "name": sid,
                    "target": f"jobs.{cluster.prefix}.{sid}",
                    "trigger": {"kind": "cron", "cron": cron},
                    "catchup": "all",
                    **({"payload": payload} if payload else {}),
                }
                async with http.post(cluster.replicas["r1"].uri + "/schedules", json=body) as r:
                    assert r.status == 201, await r.text()
            start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
            outcomes = await run_faults(cluster, db, http)
            end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
            expected = {
                fire_id(sid, n): n
                for sid, (cron, _) in schedules.items()
                for n in fire_times(Cron(cron, "UTC"), start, until=end)
            }

            async def settled() -> bool:
                published = await db.fires.count_documents(
                    {"_id": {"$in": sorted(expected)}, "state": "published"}
                )
                succeeded = await db.runs.count_documents(
                    {"_id": {"$in": sorted(expected)}, "state": "succeeded"}
                )
                return published == succeeded == len(expected)

            await wait_until(settled, 90, "every fire published and its run succeeded", 0.5)
            await history.settle()
        counts, stored = await stream_counts(
            cluster.nats_uri, f"hascheduler.fire.jobs.{cluster.prefix}.>"
        )
        missing = sorted(f for f in expected if counts[f] == 0)
        duplicated = sorted(f for f in expected if counts[f] > 1)
        early = sorted(f for f, nominal in expected.items() if f in stored and stored[f] < nominal)
        assert not missing, (missing[:5], outcomes)
        assert not duplicated, (duplicated[:5], outcomes)
        assert not early, (early[:5], outcomes)
        for o in outcomes:  # what the fault cost: the latest fire due while it lasted
            during = [
                (stored[f] - n).total_seconds()
                for f, n in expected.items()
                if o["began_at"] <= n <= o["healed_at"] and f in stored
            ]
            o["latest_fire_s"] = round(max(during, default=0.0), 3)
            o["began_at"] = o["healed_at"] = None
        report = history.check(LeaseTimings(TTL, DEADLINE, INTERVAL))
        assert report.ok, (report.as_dict(), outcomes)
        assert report.acts >= len(expected)
        assert sum(1 for o in outcomes if o["new_leader"] != o["leader"]) >= 3, outcomes
        print(
            json.dumps(
                {"outcomes": outcomes, "fires": len(expected), "history": report.as_dict()},
                indent=1,
            )
        )
    finally:
        await client.close()
