"""Firing benchmark: failover gaps, burst drain, fire lateness, each with its baseline.

    python -m bench.firing_bench [--kills 20] [--burst 10000]
                                 [--lateness 1000,10000,100000/60]
                                 [--seconds 20] [--lead 25]

Runs the development MongoDB server, a real nats-server and three `hascheduler serve`
replicas (lease ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s) as processes.

- Failover: SIGTERM, then SIGKILL, the leader --kills times each (restarting it as a
  standby); the gap is from the signal to the next leader's acquisition (lease
  ``acquired_at``) and to its first published fire of an every-second schedule.
- Burst: --burst one-off schedules due in the same second; time from that second until
  every fire is published and acknowledged. Baseline, same run: raw nats-py publishing the
  same number of messages to JetStream, pipelined, each acknowledged; and, second, the
  technique the broker uses (core publishes, acks on one wildcard subscription), raw;
  and, third, the broker's floor: the leader's own frames for as many fires, built before
  the clock starts and written at once on one connection (no scheduler, no database).
- Lateness: N schedules for --seconds, every second, or N/P: spread over P seconds (P
  divides 60), so N/P fire each second; lateness is publish-acknowledged time minus due
  time, from the fire ledger; a note under the table gives the same on the broker's clock
  (each fire's store time in the stream). Baseline, same run: plain APScheduler 3
  AsyncIOScheduler running the same N cron triggers with an empty async job, lateness
  measured when the job has run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import nats
from pymongo import AsyncMongoClient

from bench.devmongo_bench import cpu_seconds, pct
from hascheduler.brokers.base import SUBJECT_PREFIX
from hascheduler.brokers.nats.publisher import (
    NatsEndpoint,
    ack_error,
    ensure_stream,
)
from hascheduler.brokers.nats.reader import read_stream
from hascheduler.brokers.nats.wire import PublishConnection, frame
from hascheduler.core.events import EventTemplate
from hascheduler.process import logs
from tests.servers import (
    ServerProcess,
    log_lines,
    start_devmongo,
    start_nats,
    start_replica,
    with_database,
)
from tests.waiting import wait_until

# Printed after the lateness table, not inside it.
NOTES: list[str] = []
TIMINGS = ["--lease-ttl", "2", "--renew-deadline", "1.4", "--renew-interval", "0.4"]


class Cluster:
    def __init__(
        self,
        mongo: ServerProcess,
        nats_uri: str,
        database: str,
        env: dict[str, str] | None = None,
        replica_args: list[str] | None = None,
    ) -> None:
        self.env = env  # added to each replica's environment
        self.replica_args = TIMINGS if replica_args is None else replica_args
        self.uri = with_database(mongo.uri, database)
        self.nats_uri = nats_uri
        self.client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.uri, tz_aware=True)
        self.db = self.client[database]
        self.replicas: dict[str, ServerProcess] = {}

    def start(self, name: str) -> None:
        self.replicas[name] = start_replica(
            self.uri, name, "--broker", self.nats_uri, *self.replica_args, env=self.env
        )

    async def lease(self) -> dict[str, Any]:
        return await self.db.leases.find_one({"_id": "scheduler"}) or {}

    async def write_when_leading(self, schedules: list[dict[str, Any]]) -> None:
        """Write ``schedules`` once a leader is past its first catch-up, and wait until
        every replica's mirror holds them (as their heartbeats say). Written before,
        what fell due between their writing and the first term would be caught up by
        their policy (docs/RELIABILITY.md, guarantee 7): a backlog, where the benchmarks
        measure a cluster its schedules were written to."""
        await self.wait_leader()
        await self.wait_firing(ahead_s=0.0)
        await write_schedules(self, schedules)
        n = await self.db.schedules.count_documents({})

        async def holding() -> bool:
            sizes = {
                d["_id"]: d.get("size") or 0 async for d in self.db.members.find({}, {"size": 1})
            }
            return all(sizes.get(name, 0) >= n for name in self.replicas)

        await wait_until(holding, 120, f"every mirror holding {n:,} schedules", 0.2)

    async def wait_leader(self, above_term: int = 0, within_s: float = 30) -> dict[str, Any]:
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            doc = await self.lease()
            if (
                doc.get("term", 0) > above_term
                and doc.get("holder") in self.replicas
                and doc["expires_at"] > dt.datetime.now(dt.UTC)
            ):
                return doc
            await asyncio.sleep(0.01)
        raise RuntimeError("no leader")

    async def wait_firing(self, ahead_s: float = 2.0, within_s: float = 60) -> None:
        """Until the leader has handled the fires due ``ahead_s`` from now: past its
        start-up catch-up. It reads the lease's watermark, so the wait counts nothing on
        the server being measured."""
        past = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ahead_s)

        async def handled() -> bool:
            through = (await self.lease()).get("fired_through")
            return through is not None and through >= past

        await wait_until(handled, within_s, "the leader firing", 0.2)

    async def wait_landed(self, among: dict[str, Any], within_s: float = 60) -> int:
        """Until no fire matching ``among`` is claimed and unpublished; how many still are
        after ``within_s`` (a saturated firing path). Polled among the claimed fires only
        (their partial index, by term), not by counting every fire on the server."""
        claimed = {**among, "state": "claimed", "term": {"$gte": 0}}

        async def landed() -> bool:
            return await self.db.fires.count_documents(claimed) == 0

        with contextlib.suppress(AssertionError):
            await wait_until(landed, within_s, "the fires published", 0.2)
        return int(await self.db.fires.count_documents(claimed))

    async def wait_ready(self) -> None:
        async with aiohttp.ClientSession() as http:
            for replica in self.replicas.values():
                for _ in range(300):
                    async with http.get(replica.uri + "/readyz") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.05)

    def warnings(self, last: int = 8) -> str:
        """Each replica's last warning and error lines: why a benchmark's fires did not
        land."""
        lines = []
        for name, replica in self.replicas.items():
            flagged = [
                line for line in log_lines(replica) if line.get("level") in ("warning", "error")
            ]
            lines += [f"{name}: {json.dumps(line)[:400]}" for line in flagged[-last:]]
        return "\n".join(lines) or "no replica logged a warning"

    async def close(self) -> None:
        for replica in self.replicas.values():
            replica.stop(signal.SIGKILL)
        await self.client.close()


def schedule_doc(sid: str, trigger: dict[str, Any], target: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    return {
        "_id": sid,
        "name": sid,
        "trigger": trigger,
        "jitter": 0.0,
        "paused": False,
        "catchup": "all",
        "catchup_window": 3600.0,
        "target": target,
        "payload": {},
        "labels": {},
        "created_at": now,
        "updated_at": now,
        "revision": 1,
    }


async def failover(mongo: ServerProcess, nats_uri: str, kills: int) -> dict[str, list[float]]:
    c = Cluster(mongo, nats_uri, "bench_failover")
    await c.db.schedules.insert_one(
        schedule_doc("tick", {"kind": "cron", "cron": "* * * * * *"}, "bench.tick")
    )
    for name in ("a", "b", "c"):
        c.start(name)
    gaps: dict[str, list[float]] = {
        "TERM lease": [],
        "TERM first fire": [],
        "KILL lease": [],
        "KILL first fire": [],
    }
    try:
        await c.wait_ready()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            label = "TERM" if sig == signal.SIGTERM else "KILL"
            for _ in range(kills):
                doc = await c.wait_leader()
                await asyncio.sleep(1.2)  # a steady leader, firing
                leader, term = doc["holder"], doc["term"]
                t0 = dt.datetime.now(dt.UTC)
                process = c.replicas.pop(leader)
                process.stop(sig)
                new = await c.wait_leader(above_term=term)
                gaps[f"{label} lease"].append((new["acquired_at"] - t0).total_seconds())
                first = None
                for _ in range(500):
                    first = await c.db.fires.find_one(
                        {"term": new["term"], "state": "published"}, sort=[("published_at", 1)]
                    )
                    if first:
                        break
                    await asyncio.sleep(0.01)
                assert first is not None
                gaps[f"{label} first fire"].append((first["published_at"] - t0).total_seconds())
                c.start(leader)
        return gaps
    finally:
        await c.close()


RAW_BODY = json.dumps({"specversion": "1.0", "data": {"payload": {}}}).encode()


async def raw_burst(nats_uri: str, n: int) -> float:
    """Baseline: nats-py's JetStream publish of ``n`` messages, pipelined."""

    async def send(nc: Any) -> None:
        js = nc.jetstream()
        await asyncio.gather(
            *(
                js.publish(
                    "hascheduler.fire.raw",
                    RAW_BODY,
                    headers={"Nats-Msg-Id": f"raw-{time.time()}-{i}"},
                )
                for i in range(n)
            )
        )

    return await timed_on_stream(nats_uri, send)


async def raw_core_burst(nats_uri: str, n: int) -> float:
    """The broker's technique with plain nats-py: core publishes whose replies (the
    JetStream acks) all land on one wildcard subscription, counted until the last."""

    async def send(nc: Any) -> None:
        inbox, left, all_acked = nc.new_inbox(), n, asyncio.Event()

        async def acked(_msg: Any) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                all_acked.set()

        await nc.subscribe(f"{inbox}.>", cb=acked, pending_msgs_limit=-1)
        for i in range(n):
            await nc.publish(
                "hascheduler.fire.raw",
                RAW_BODY,
                reply=f"{inbox}.{i}",
                headers={"Nats-Msg-Id": f"core-{time.time()}-{i}"},
            )
        await asyncio.wait_for(all_acked.wait(), 60)

    return await timed_on_stream(nats_uri, send)


def fire_frames(
    n: int, inbox: str, subject: Callable[[int], str], reply: Callable[[int], str] | None = None
) -> list[bytes]:
    """``n`` fires' HPUB frames as the leader writes them (its event bodies, fire ids as
    ``Nats-Msg-Id`` and the term header), the i-th on ``subject(i)``, each acknowledged to
    ``reply(i)`` (by default ``<inbox>.<i>``); the fire ids are new in each call."""
    due = dt.datetime.now(dt.UTC).replace(microsecond=0)
    stamp = due.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    frames = []
    for i in range(n):
        sid = f"floor{i:06d}"
        fire_id = f"{sid}@{stamp}-{inbox[-8:]}"
        body = (
            EventTemplate.of(schedule_doc(sid, {"kind": "at", "at": [due]}, "bench.burst"))
            .render(fire_id, due, None, 1, 1, stamp)
            .body
        )
        frames.append(
            frame(
                subject(i),
                reply(i) if reply else f"{inbox}.{i}",
                f"Nats-Msg-Id: {fire_id}\r\nHascheduler-Term: 1\r\n",
                body,
            )
        )
    return frames


async def raw_frames_burst(nats_uri: str, n: int) -> float:
    """The broker's floor for a client with nothing else to do: ``n`` fires' HPUB frames as
    the leader writes them (the same event bodies and headers), all built before the clock
    starts and written at once on one connection, until the last JetStream ack is in."""
    inbox, left, all_acked = f"_INBOX.floor{time.time_ns()}", n, asyncio.Event()
    errors: list[BaseException] = []

    def acked(_subject: bytes, data: bytes, status: bytes | None) -> None:
        nonlocal left
        error = ack_error(data, status)  # a refusal is no floor: it comes back at once
        if error is not None:
            errors.append(error)
        left -= 1
        if left == 0:
            all_acked.set()

    frames = fire_frames(n, inbox, lambda i: f"{SUBJECT_PREFIX}.bench.burst")
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        await ensure_stream(nc.jetstream(), endpoint)
    finally:
        await nc.close()
    connection = PublishConnection(endpoint.servers, endpoint.tls_context(), acked)
    await connection.start(f"{inbox}.>")
    try:
        start = time.perf_counter()
        await connection.send(frames)
        await asyncio.wait_for(all_acked.wait(), 60)
        took = time.perf_counter() - start
    finally:
        await connection.close()
    assert not errors, f"{len(errors)} of the floor's {n} publishes refused: {errors[0]!r}"
    return took


async def timed_on_stream(nats_uri: str, send: Callable[[Any], Awaitable[None]]) -> float:
    """Seconds ``send`` takes on a fresh connection, the fire stream ensured first."""
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        await ensure_stream(nc.jetstream(), endpoint)
        start = time.perf_counter()
        await send(nc)
        return time.perf_counter() - start
    finally:
        await nc.close()


async def started_cluster(
    mongo: ServerProcess,
    nats_uri: str,
    database: str,
    schedules: list[dict[str, Any]],
    env: dict[str, str] | None = None,
    cluster: Cluster | None = None,
) -> Cluster:
    """Three replicas, ready and leading, with ``schedules`` in every mirror
    (``Cluster.write_when_leading``); in ``cluster`` if given (a Cluster whose replicas
    start otherwise)."""
    c = cluster or Cluster(mongo, nats_uri, database, env)
    for name in ("a", "b", "c"):
        # In a thread: a replica's start blocks until it announces its port, and the
        # caller's tasks (a stand-in worker taking fires from the first one on) must not
        # stall while the first replica already fires.
        await asyncio.to_thread(c.start, name)
    await c.wait_ready()
    await c.write_when_leading(schedules)
    return c


async def write_schedules(c: Cluster, schedules: list[dict[str, Any]]) -> None:
    for i in range(0, len(schedules), 1000):
        await c.db.schedules.insert_many(schedules[i : i + 1000])


async def due_after_leading(
    c: Cluster, lead_s: float, schedules: Callable[[dt.datetime], list[dict[str, Any]]]
) -> dt.datetime:
    """Write ``schedules(due)``, one-offs due on the whole second ``lead_s`` from now (room
    for the replicas' mirrors to load them), once ``c`` has a leader; returns ``due``.
    Written before, a one-off could fall due before a slow start's first term, and be
    fired by its catch-up: late, which a burst would count as the scheduler's lateness."""
    await c.wait_leader()
    due = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=lead_s)).replace(microsecond=0)
    await write_schedules(c, schedules(due))
    return due


async def until_all(
    collection: Any,
    state: str,
    stamp: str,
    n: int,
    since: dt.datetime,
    within_s: float,
    among: dict[str, Any] | None = None,
) -> float:
    """Seconds from ``since`` to the latest ``stamp`` once ``n`` documents of
    ``collection`` (those matching ``among``, or all) are in ``state``. The figure comes
    from the ledger's own times, not from when this loop notices; polling slowly keeps the
    measurement off the server it measures."""
    query = {**(among or {}), "state": state}
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if await collection.count_documents(query) >= n:
            break
        await asyncio.sleep(0.5)
    last = await collection.find_one(query, sort=[(stamp, -1)])
    assert last is not None, f"no document reached {state}: {await states_of(collection, among)}"
    return float((last[stamp] - since).total_seconds())


async def states_of(collection: Any, among: dict[str, Any] | None = None) -> str:
    """How many documents are in each state, with the last errors recorded: what a
    benchmark that found none done says of them."""
    counts = {
        doc["_id"]: doc["n"]
        async for doc in await collection.aggregate(
            [{"$match": among or {}}, {"$group": {"_id": "$state", "n": {"$sum": 1}}}]
        )
    }
    errors = await collection.distinct(
        "last_error", {**(among or {}), "last_error": {"$exists": True}}
    )
    return f"states {counts}, last errors {errors[:3]}"


def process_cpu(mongo: ServerProcess, broker: ServerProcess, c: Cluster) -> dict[str, float]:
    pids = {
        "development server": mongo.pid,
        "nats-server": broker.pid,
        **{f"replica {name}": r.pid for name, r in c.replicas.items()},
    }
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


async def burst_cluster(
    mongo: ServerProcess, broker_uri: str, database: str, n: int, lead_s: float
) -> tuple[dt.datetime, Cluster]:
    """Three replicas, then ``n`` one-off schedules all due on the whole second ``lead_s``
    after they lead; that second and the cluster."""
    c = await started_cluster(mongo, broker_uri, database, [])
    due = await due_after_leading(
        c,
        lead_s,
        lambda due: [
            schedule_doc(f"b{i:05d}", {"kind": "at", "at": [due]}, "bench.burst") for i in range(n)
        ],
    )
    return due, c


async def scheduler_burst(
    mongo: ServerProcess, broker_uri: str, database: str, n: int, lead_s: float
) -> float:
    """Seconds from the burst's second until its last fire is published and acknowledged."""
    due, c = await burst_cluster(mongo, broker_uri, database, n, lead_s)
    try:
        return await until_all(c.db.fires, "published", "published_at", n, due, 180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.warnings()}") from None
    finally:
        await c.close()


async def burst(
    mongo: ServerProcess, broker: ServerProcess, n: int, lead_s: float
) -> tuple[float, float, float, float, dict[str, float]]:
    """Drain time, the three raw baselines, and each process's CPU seconds during the
    burst."""
    due, c = await burst_cluster(mongo, broker.uri, "bench_burst", n, lead_s)
    try:
        # CPU is counted from three seconds before the burst, after start-up and catch-up.
        await asyncio.sleep(max(0.0, (due - dt.datetime.now(dt.UTC)).total_seconds() - 3))
        before = process_cpu(mongo, broker, c)
        drained = await until_all(c.db.fires, "published", "published_at", n, due, 120)
        cpu = {k: v - before[k] for k, v in process_cpu(mongo, broker, c).items()}
    finally:
        await c.close()
    return (
        drained,
        await raw_burst(broker.uri, n),
        await raw_core_burst(broker.uri, n),
        await raw_frames_burst(broker.uri, n),
        cpu,
    )


def seconds_field(i: int, period: int) -> str:
    """Schedule i of those spread over ``period`` seconds (a divisor of 60): its cron
    seconds field, the same for APScheduler's baseline."""
    if period == 1:
        return "*"
    return str(i % 60) if period == 60 else f"{i % period}/{period}"


async def broker_clock_note(broker_uri: str, fires: list[dict[str, Any]], n: int) -> str:
    """The window's lateness on the broker's clock (the time the stream stored each fire,
    minus its due time), and how long after that store the ledger's ``published_at`` (the
    leader reading the batch's last acknowledgement) came."""
    stored = {m.event.get("id"): m.stored_at for m in await read_stream(broker_uri)}
    on_broker, after = [], []
    for f in fires:
        at = stored.get(f["_id"])
        if at is not None:
            at = at if at.tzinfo else at.replace(tzinfo=dt.UTC)
            on_broker.append((at - f["due_at"]).total_seconds())
            after.append((f["published_at"] - at).total_seconds())
    if not on_broker:
        return f"no fire of the window at {n:,} found in the stream"
    return (
        f"lateness on the broker's clock at {n:,} (stored - due_at, {len(on_broker):,} "
        f"fires): p50 {pct(on_broker, 0.5) * 1000:.0f} ms, p99 "
        f"{pct(on_broker, 0.99) * 1000:.0f} ms; published_at after the store: p50 "
        f"{pct(after, 0.5) * 1000:.0f} ms, p99 {pct(after, 0.99) * 1000:.0f} ms"
    )


async def lateness(
    mongo: ServerProcess,
    broker: ServerProcess,
    n: int,
    period: int,
    seconds: float,
    env: dict[str, str] | None = None,
    database: str | None = None,
    broker_clock: bool = False,
) -> list[float]:
    """Publish-acknowledged minus due time of each fire due in the window; with
    ``broker_clock``, a note of the same on the stream's store times too."""
    c = await started_cluster(
        mongo,
        broker.uri,
        database or f"bench_late_{n}",
        [
            schedule_doc(
                f"l{i:06d}",
                {"kind": "cron", "cron": f"{seconds_field(i, period)} * * * * *"},
                "bench.late",
            )
            for i in range(n)
        ],
        env,
    )
    try:
        await c.wait_firing()
        start = dt.datetime.now(dt.UTC)
        cpu_before = process_cpu(mongo, broker, c)
        await asyncio.sleep(seconds)
        end = dt.datetime.now(dt.UTC)
        cpu = {k: (v - cpu_before[k]) / seconds for k, v in process_cpu(mongo, broker, c).items()}
        NOTES.append(
            f"CPU at {n:,} schedules, share of one core during the window: "
            + ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
        )
        left = await c.wait_landed({"due_at": {"$gte": start, "$lt": end}})
        if left:
            NOTES.append(
                f"{left:,} fires of the window at {n:,} still unpublished a minute after it"
            )
        fires = [
            f
            async for f in c.db.fires.find(
                {"due_at": {"$gte": start, "$lt": end}, "state": "published"},
                {"published_at": 1, "due_at": 1, "claimed_at": 1},
            )
        ]
        if broker_clock:
            NOTES.append(await broker_clock_note(broker.uri, fires, n))
        late = [(f["published_at"] - f["due_at"]).total_seconds() for f in fires]
        claim = [(f["claimed_at"] - f["due_at"]).total_seconds() for f in fires]
        if claim:
            NOTES.append(
                f"claim lateness at {n:,} (claimed_at - due_at): "
                f"p50 {pct(claim, 0.5) * 1000:.0f} ms, p99 {pct(claim, 0.99) * 1000:.0f} ms"
            )
        expected = n * int(seconds) // period
        if len(late) < 0.95 * expected:
            NOTES.append(
                f"{len(late):,} of about {expected:,} fires published in the window at {n:,}"
            )
        return late
    finally:
        await c.close()


APSCHEDULER = r"""
import asyncio, json, sys, time
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.events import EVENT_JOB_EXECUTED
n, period, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
late = []
async def job():
    pass
async def main():
    scheduler = AsyncIOScheduler(timezone="UTC")
    def executed(event):
        late.append(time.time() - event.scheduled_run_time.timestamp())
    scheduler.add_listener(executed, EVENT_JOB_EXECUTED)
    for i in range(n):
        second = "*" if period == 1 else str(i % 60) if period == 60 else f"{i % period}/{period}"
        scheduler.add_job(job, "cron", second=second, id=f"j{i}", misfire_grace_time=None,
                          coalesce=False, max_instances=10)
    scheduler.start()
    await asyncio.sleep(3)
    late.clear()
    await asyncio.sleep(seconds)
    scheduler.shutdown(wait=False)
    print(json.dumps(late))
asyncio.run(main())
"""


def apscheduler_lateness(n: int, period: int, seconds: float) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", APSCHEDULER, str(n), str(period), str(seconds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return [float(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]


def ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1000:,.0f} ms"


async def main() -> int:
    logs.configure("warning")  # to stderr: stdout is the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument(
        "--lateness",
        default="1000,10000,100000/60",
        help="schedule counts, each N (every second) or N/P (spread over P seconds, P dividing 60)",
    )
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--lead",
        type=float,
        default=25.0,
        help="seconds from writing the burst (once the replicas lead) to its due "
        "time: room for their mirrors to load it",
    )
    args = parser.parse_args()
    print(
        f"# firing benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.firing_bench {' '.join(sys.argv[1:])}`".rstrip())
    print(
        "lease ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s; everything on this "
        "one machine\n",
        flush=True,
    )
    mongo = start_devmongo()
    broker = start_nats()
    try:
        if args.kills:
            gaps = await failover(mongo, broker.uri, args.kills)
            # No in-run baseline exists for a failover; the reference is the bound the design
            # promises: 1 s for a graceful handover, ttl + renew interval (2.4 s) for a crash,
            # plus the every-second schedule's period for its first fire.
            bounds = {
                "TERM lease": 1.0,
                "TERM first fire": 2.0,
                "KILL lease": 2.4,
                "KILL first fire": 3.4,
            }
            print("| failover (signal to ...) | samples | p50 | p99 | max | bound | p99 / bound |")
            print("|---|---|---|---|---|---|---|")
            for label, values in gaps.items():
                print(
                    f"| {label} | {len(values)} | {ms(values, 0.5)} | {ms(values, 0.99)} | "
                    f"{max(values) * 1000:,.0f} ms | {bounds[label]:g} s | "
                    f"{pct(values, 0.99) / bounds[label]:.2f}x |"
                )
            print(flush=True)
        if args.burst:
            drained, raw, core, floor, cpu = await burst(mongo, broker, args.burst, args.lead)
            print(
                f"burst: {args.burst:,} fires due in one second published and acknowledged "
                f"{drained:.2f} s after it; raw nats-py pipelined publish of as many "
                f"messages (baseline): {raw:.2f} s; ratio {drained / raw:.2f}x"
            )
            print(
                f"the broker's technique raw (core publishes, their acks on one wildcard "
                f"subscription): {core:.2f} s; ratio {drained / core:.2f}x"
            )
            print(
                f"the broker's floor (the leader's frames for as many fires built ahead, "
                f"written at once on one connection, acknowledged): {floor * 1000:.0f} ms; "
                f"ratio {drained / floor:.2f}x"
            )
            print(
                "CPU seconds from 3 s before the burst until it drained (polling "
                "included): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + "\n",
                flush=True,
            )
        sizes = [
            (int(n), int(p or 1))
            for n, _, p in (x.partition("/") for x in args.lateness.split(",") if x)
        ]
        if sizes:
            print(
                "| schedules | fires/s | hascheduler p50 | p99 | fires published | "
                "APScheduler p50 (baseline) | p99 | runs | p99 ratio |"
            )
            print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for n, period in sizes:
            values = await lateness(mongo, broker, n, period, args.seconds, broker_clock=True)
            b = apscheduler_lateness(n, period, args.seconds)
            expected = n * int(args.seconds) // period
            row = f"| {n:,} | {n // period:,} |"
            if values:
                print(
                    f"{row} {ms(values, 0.5)} | {ms(values, 0.99)} | "
                    f"{len(values):,} of {expected:,} | {ms(b, 0.5)} | {ms(b, 0.99)} | "
                    f"{len(b):,} | {pct(values, 0.99) / pct(b, 0.99):.2f}x |",
                    flush=True,
                )
            else:
                print(
                    f"{row} backlog: none of {expected:,} published within 5 s of the "
                    f"window | | | {ms(b, 0.5)} | {ms(b, 0.99)} | {len(b):,} | |",
                    flush=True,
                )
        print("\n".join(["", *NOTES]), flush=True)
    finally:
        broker.stop()
        mongo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
