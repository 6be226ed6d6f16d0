"""``hascheduler worker`` with real processes: a broker (a nats-server, or a RabbitMQ node:
every test runs on both), the development MongoDB server (the runs ledger) and workers,
each its own process."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import nats
import pytest
from hascheduler_dev.clocks import moved_clock_env
from pymongo import AsyncMongoClient

from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream
from tests.servers import RabbitServer, ServerProcess, start_nats, with_database
from tests.waiting import wait_until


def event(
    fire_id: str, term: int, nominal: dt.datetime, payload: Any = None, replay: int = 0
) -> bytes:
    data: dict[str, Any] = {
        "schedule_id": fire_id.split("@")[0],
        "term": term,
        "nominal_at": nominal.isoformat().replace("+00:00", "Z"),
        "payload": payload or {},
    }
    if replay:
        data["replay"] = replay
    return json.dumps(
        {
            "specversion": "1.0",
            "id": fire_id,
            "source": "/hascheduler",
            "type": "io.hascheduler.fire",
            "subject": fire_id.split("@")[0],
            "data": data,
        }
    ).encode()


class NatsUnderTest:
    """A nats-server of the test's own."""

    name = "nats"

    def __init__(self) -> None:
        self.server: ServerProcess = start_nats()
        self.uri = self.server.uri

    async def publish(self, target: str, body: bytes, msg_id: str) -> None:
        endpoint = NatsEndpoint.parse(self.uri)
        nc = await nats.connect(endpoint.servers)
        try:
            js = nc.jetstream()
            await ensure_stream(js, endpoint)
            await js.publish(f"hascheduler.fire.{target}", body, headers={"Nats-Msg-Id": msg_id})
        finally:
            await nc.close()

    def kill(self) -> None:
        assert self.server.process is not None
        self.server.process.kill()
        self.server.process.wait(10)

    def restart(self) -> None:
        """On the same port and store."""
        port = int(self.uri.rsplit(":", 1)[1])
        self.server = start_nats(port=port, store_dir=self.server.store_dir)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.server.stop()


class RabbitUnderTest:
    """The session's RabbitMQ node and an exchange of the test's own; a node of its own
    when the test stops it."""

    name = "amqp"

    def __init__(self, server: RabbitServer, owned: bool = False) -> None:
        self.server = server
        self.owned = owned
        self.exchange = f"fires-{uuid.uuid4().hex[:8]}"
        self.uri = f"{server.url}?exchange={self.exchange}"

    async def publish(self, target: str, body: bytes, msg_id: str) -> None:
        async def sent() -> bool:
            connection = await aio_pika.connect(self.server.url)
            try:
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                exchange = await channel.declare_exchange(
                    self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
                )
                await exchange.publish(
                    aio_pika.Message(
                        body, message_id=msg_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                    ),
                    routing_key=target,
                    mandatory=True,
                )
                return True
            except aio_pika.exceptions.DeliveryError as exc:
                # Nacked while a restarted node's quorum queue elects its leader: again.
                if isinstance(exc, aio_pika.exceptions.PublishError):
                    raise  # returned: no queue bound, a test's mistake
                return False
            finally:
                await connection.close()

        await wait_until(sent, 30, f"RabbitMQ to confirm {msg_id}", interval_s=0.2)

    def kill(self) -> None:
        # Stopped, not SIGKILLed: RabbitMQ 3.10 left a single node's quorum queue without
        # a leader for over a minute after a SIGKILL (with three nodes, the others elect
        # one); the connection loss the worker meets is the same.
        self.server.stop()

    def restart(self) -> None:
        """On the same port and data."""
        self.server.start()

    def close(self) -> None:
        if self.owned:
            self.server.close()


BrokerUnderTest = NatsUnderTest | RabbitUnderTest


class Workers:
    """A broker, a database of its own and any number of worker processes sharing one
    durable consumer; every handler attempt lands in ``record`` as
    "<fire id> <term> <attempt> <unix time>"."""

    def __init__(self, broker: BrokerUnderTest, mongo_uri: str, tmp: Path) -> None:
        self.broker = broker
        # Each test its own consumer: on RabbitMQ its queues outlive the test.
        self.durable = f"test-workers-{uuid.uuid4().hex[:8]}"
        self.db_name = f"t_{uuid.uuid4().hex[:12]}"
        self.mongo_uri = with_database(mongo_uri, self.db_name)
        self.client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.mongo_uri, tz_aware=True
        )
        self.record = tmp / "attempts.txt"
        self.tmp = tmp
        self.processes: list[asyncio.subprocess.Process] = []
        self.logs: list[Path] = []

    async def start(
        self, *args: str, name: str | None = None, env: dict[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        """A worker (``args`` added to the defaults: --app of tests.helpers.record_handler;
        ``env`` added to ours); returned once it consumes."""
        name = name or f"w{len(self.processes) + 1}"
        log = self.tmp / f"{name}.log"
        if not any(a in args for a in ("--app", "--handler")):
            args = ("--app", "tests.helpers.record_handler:app", *args)
        with open(log, "wb") as stderr:  # noqa: ASYNC230 - opened once
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "hascheduler.cli",
                "--log-level",
                "debug",
                "worker",
                "--broker",
                self.broker.uri,
                "--mongodb-uri",
                self.mongo_uri,
                "--durable",
                self.durable,
                "--worker-id",
                name,
                *args,
                env={**os.environ, "RECORD_FIRES_TO": str(self.record), **(env or {})},
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        assert worker.stdout is not None
        line = await asyncio.wait_for(worker.stdout.readline(), 30)
        assert b"consuming" in line, log.read_text()
        self.processes.append(worker)
        self.logs.append(log)
        return worker

    async def publish(self, target: str, body: bytes, msg_id: str) -> None:
        await self.broker.publish(target, body, msg_id)

    def attempts(self) -> list[list[str]]:
        if not self.record.exists():
            return []
        return [line.split() for line in self.record.read_text().splitlines()]

    def runs_of(self, fire_id: str) -> int:
        return sum(1 for a in self.attempts() if a[0] == fire_id)

    async def run(self, fire_id: str) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = await self.client[self.db_name].runs.find_one({"_id": fire_id})
        return doc

    async def wait_state(self, fire_id: str, state: str, within_s: float = 30) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            doc = await self.run(fire_id)
            return doc if doc is not None and doc["state"] == state else None

        value: dict[str, Any] = await wait_until(reached, within_s, f"run {fire_id} to be {state}")
        return value

    def logged(self, event_name: str) -> int:
        return sum(log.read_text().count(f'"event": "{event_name}"') for log in self.logs)

    async def close(self) -> None:
        for worker in self.processes:
            if worker.returncode is None:
                worker.send_signal(signal.SIGCONT)
                worker.terminate()
        for worker in self.processes:
            await asyncio.wait_for(worker.wait(), 40)
        await self.client.drop_database(self.db_name)
        await self.client.close()


@pytest.fixture(params=["nats", "amqp"])
async def workers(
    request: pytest.FixtureRequest, mongo_uri: str, tmp_path: Path
) -> AsyncIterator[Workers]:
    broker: BrokerUnderTest
    if request.param == "nats":
        broker = NatsUnderTest()
    elif request.node.get_closest_marker("stops_broker"):
        broker = RabbitUnderTest(RabbitServer().start(), owned=True)
    else:
        broker = RabbitUnderTest(request.getfixturevalue("rabbit"))
    harness = Workers(broker, mongo_uri, tmp_path)
    try:
        yield harness
    finally:
        await harness.close()
        harness.broker.close()


NOW = dt.datetime.now(dt.UTC)


async def test_each_fire_runs_once_whatever_the_deliveries(workers: Workers) -> None:
    await workers.start("--handler", "tests.helpers.record_handler:handle", "--target", "jobs")
    now = dt.datetime.now(dt.UTC)  # not the module's NOW: "later" must be after delivery
    later = now + dt.timedelta(minutes=5)
    sends = [
        ("s@1", 1, now, "m1"),
        ("s@2", 2, now, "m2"),
        ("s@1", 2, now, "m3"),  # the same fire again (new broker message id)
        ("s@0", 1, now, "m4"),  # old term, but claimed in time: runs
        ("s@9", 1, later, "m5"),  # old term, after term 2 acted: stale
        ("s@2", 2, now, "m2"),  # a republish the broker itself deduplicates
        ("s@3", 2, now, "m6"),
    ]
    for fire_id, term, nominal, msg_id in sends:
        await workers.publish("jobs", event(fire_id, term, nominal), msg_id)
    for fire_id in ("s@1", "s@2", "s@0", "s@3"):
        doc = await workers.wait_state(fire_id, "succeeded")
        assert doc["attempts"] == 1
        assert doc["worker_id"] == "w1"
        assert doc["duration_s"] >= 0
        assert doc["finished_at"] >= doc["started_at"]
    # The repeat finds the run finished (dropped), or, in the same fetch as the first,
    # still running (given back until it could be claimed): either way it never runs.
    await wait_until(
        lambda: workers.logged("fire_duplicate_dropped") + workers.logged("fire_busy") >= 1,
        10,
        "the repeated fire to be set aside",
    )
    assert Counter(a[0] for a in workers.attempts()) == {"s@1": 1, "s@2": 1, "s@0": 1, "s@3": 1}
    assert await workers.run("s@9") is None  # stale: never claimed


async def test_transient_failures_retry_with_growing_jittered_delays(workers: Workers) -> None:
    await workers.start("--concurrency", "16")
    fires = [f"flaky{i}@{NOW.isoformat()}" for i in range(12)]
    for fire_id in fires:
        await workers.publish("jobs.flaky", event(fire_id, 1, NOW, {"fail": 3}), fire_id)
    for fire_id in fires:
        doc = await workers.wait_state(fire_id, "succeeded", 60)
        assert doc["attempts"] == 4
        assert doc["last_error"].startswith("RuntimeError: transient")
    times: dict[str, list[float]] = {}
    for fire_id, _, attempt, at in workers.attempts():
        times.setdefault(fire_id, []).append(float(at))
        assert int(attempt) == len(times[fire_id])
    gaps = [[b - a for a, b in itertools.pairwise(t)] for t in times.values()]
    # RetryPolicy(backoff_base_s=0.4, cap 2.0): waits drawn from [0, 0.4], [0, 0.8],
    # [0, 1.6], plus the redelivery's own latency.
    for per_fire in gaps:
        for n, gap in enumerate(per_fire):
            assert gap <= 0.4 * 2**n + 1.0, per_fire
    mean = [sum(g[n] for g in gaps) / len(gaps) for n in range(3)]
    assert mean[0] < mean[2], mean  # growing: 0.2 s against 0.8 s on average
    assert len({round(g[2], 2) for g in gaps}) > 3, "no jitter: the waits are all equal"


async def test_permanent_failure_and_exhaustion_go_dead_with_their_error(workers: Workers) -> None:
    await workers.start()
    await workers.publish("jobs.a", event("perm@1", 1, NOW, {"permanent": True}), "p")
    await workers.publish("jobs.a", event("never@1", 1, NOW, {"always_fail": True}), "n")
    perm = await workers.wait_state("perm@1", "dead")
    assert perm["attempts"] == 1
    assert perm["last_error"] == "PermanentFailure: this account no longer exists"
    never = await workers.wait_state("never@1", "dead", 60)
    assert never["attempts"] == 4
    assert never["last_error"] == "RuntimeError: attempt 4 failed (attempt 4 of 4)"
    assert workers.runs_of("perm@1") == 1
    assert workers.runs_of("never@1") == 4


async def test_an_async_handler_past_its_timeout_fails_the_attempt(workers: Workers) -> None:
    await workers.start()
    await workers.publish("async.slow", event("slow@1", 1, NOW, {"sleep": 30}), "s")
    dead = await workers.wait_state("slow@1", "dead", 30)
    assert dead["attempts"] == 2
    assert dead["last_error"].startswith("RunTimeout: the run took longer than 1 s")


async def test_a_run_longer_than_the_ack_wait_is_not_run_twice(workers: Workers) -> None:
    for _ in range(2):
        await workers.start("--ack-wait", "1")
    await workers.publish("jobs.long", event("long@1", 1, NOW, {"sleep": 4}), "l")
    doc = await workers.wait_state("long@1", "succeeded", 30)
    assert doc["attempts"] == 1
    assert doc["duration_s"] >= 4
    assert workers.runs_of("long@1") == 1


async def test_the_same_fire_delivered_to_two_workers_at_once_runs_once(workers: Workers) -> None:
    for _ in range(2):
        await workers.start("--concurrency", "4")
    fires = [f"twice{i}@1" for i in range(8)]
    for fire_id in fires:  # two broker messages per fire: a republish after the window
        for copy in ("a", "b"):
            await workers.publish(
                "jobs.twice", event(fire_id, 1, NOW, {"sleep": 0.5}), f"{fire_id}-{copy}"
            )
    for fire_id in fires:
        await workers.wait_state(fire_id, "succeeded")
    await wait_until(
        lambda: workers.logged("fire_busy") + workers.logged("fire_duplicate_dropped") >= 8,
        20,
        "every second copy to be set aside",
    )
    assert Counter(a[0] for a in workers.attempts()) == dict.fromkeys(fires, 1)


# NATS: a durable consumer made after the publish still gets the message.
@pytest.mark.parametrize("workers", ["nats"], indirect=True)
async def test_a_worker_whose_clock_runs_ahead_never_takes_over_a_held_run(
    workers: Workers,
) -> None:
    """Run leases are judged on the database's clock: a worker ten minutes ahead sees a
    held run as held, where its own clock would call the lease long lapsed."""
    await workers.start("--ack-wait", "3", name="right")
    await workers.publish("jobs.skew", event("skew@1", 1, NOW, {"sleep": 4}), "s")
    await wait_until(lambda: workers.runs_of("skew@1") == 1, 20, "the run to start")
    # A consumer of its own: it gets the same fire while the first worker runs it.
    await workers.start(
        "--ack-wait",
        "3",
        "--durable",
        f"{workers.durable}-ahead",
        name="ahead",
        env=moved_clock_env(600),
    )
    await wait_until(
        lambda: workers.logged("fire_busy") >= 1, 20, "the worker ahead to find the run held"
    )
    doc = await workers.wait_state("skew@1", "succeeded", 30)
    assert (doc["worker_id"], doc["attempts"]) == ("right", 1)
    assert workers.runs_of("skew@1") == 1
    assert workers.logged("run_taken_over") == 0


async def test_a_killed_workers_run_is_taken_over_and_finishes_once(workers: Workers) -> None:
    first = await workers.start("--ack-wait", "2", name="doomed")
    await workers.publish("jobs.k", event("kill@1", 1, NOW, {"sleep": 3}), "k")
    await wait_until(lambda: workers.runs_of("kill@1") == 1, 20, "the run to start")
    first.kill()
    await first.wait()
    await workers.start("--ack-wait", "2", name="heir")
    doc = await workers.wait_state("kill@1", "succeeded", 40)
    assert doc["worker_id"] == "heir"
    assert doc["attempts"] == 2
    assert workers.runs_of("kill@1") == 2  # started twice, finished once
    assert workers.logged("run_taken_over") == 1


@pytest.mark.parametrize("workers", ["nats"], indirect=True)
async def test_a_worker_that_lost_its_run_leaves_the_new_owners_retry_to_come(
    workers: Workers,
) -> None:
    """A worker stalled past its run's lease finishes the attempt it began after another
    worker took the run over and asked the broker for a retry. Both hold the same NATS
    message: the stalled one's ack settled it, the retry never came, and the run stayed
    retrying for ever (seen in the chaos soak). Given back undecided, the retry comes."""
    release = workers.tmp / "release-lost"  # the first attempt ends once it exists
    stalled = await workers.start("--ack-wait", "2", name="stalled")
    await workers.publish(
        "jobs.lost", event("lost@1", 1, NOW, {"hold": str(release), "fail_on": [2]}), "lost"
    )
    await wait_until(lambda: workers.runs_of("lost@1") == 1, 20, "the first attempt")
    stalled.send_signal(signal.SIGSTOP)
    await workers.start("--ack-wait", "2", name="heir")
    await wait_until(
        lambda: workers.logged("run_failed") >= 1,
        30,
        "the heir's attempt to fail and ask for a retry",
    )
    release.touch()
    stalled.send_signal(signal.SIGCONT)  # its attempt ends at once, and it answers
    await wait_until(
        lambda: workers.logged("run_lease_lost") >= 1,
        20,
        "the stalled worker to find its run taken over",
    )
    doc = await workers.wait_state("lost@1", "succeeded", 30)
    assert doc["attempts"] == 3
    assert [a[2] for a in workers.attempts()] == ["1", "2", "3"]


@pytest.mark.parametrize("workers", ["amqp"], indirect=True)
async def test_a_run_taken_over_while_it_waited_for_a_runner_is_given_back_to_the_broker(
    workers: Workers,
) -> None:
    """A run claimed ahead of the runners, then taken over before one started it, is
    handed back undecided. On RabbitMQ an unanswered delivery stays on its channel until
    the connection closes: before, the run was never delivered again and never ran (on
    NATS its ack wait brings it back, so NATS would not show the fault)."""
    release = workers.tmp / "release-first"  # the run ahead of it holds the only runner
    await workers.start("--concurrency", "1", "--ack-wait", "2")
    await workers.publish("jobs.ahead", event("ahead@1", 1, NOW, {"hold": str(release)}), "ahead")
    await wait_until(lambda: workers.runs_of("ahead@1") == 1, 20, "the first run to start")
    await workers.publish("jobs.queued", event("queued@1", 1, NOW), "queued")
    claimed = await workers.wait_state("queued@1", "running", 20)
    assert workers.runs_of("queued@1") == 0  # claimed, waiting for the runner
    # Another worker's takeover, as the ledger records one: a later attempt, a live lease.
    taken = await workers.client[workers.db_name].runs.update_one(
        {"_id": "queued@1", "worker_id": claimed["worker_id"]},
        {
            "$set": {
                "worker_id": "elsewhere",
                "attempts": claimed["attempts"] + 1,
                "lease_until": dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3),
            }
        },
    )
    assert taken.modified_count == 1
    await wait_until(
        lambda: workers.logged("run_lease_lost") >= 1,
        20,
        "the worker's heartbeat to find the run taken over",
    )
    release.touch()
    # Back from the broker at once, it meets the live lease (busy); once that lapses, a
    # claim takes the run over and runs it here.
    await wait_until(
        lambda: workers.logged("fire_busy") >= 1, 20, "the handed-back run to be delivered again"
    )
    doc = await workers.wait_state("queued@1", "succeeded", 30)
    assert doc["attempts"] == claimed["attempts"] + 2
    assert workers.runs_of("queued@1") == 1
    assert (await workers.wait_state("ahead@1", "succeeded", 20))["attempts"] == 1


@pytest.mark.long(40)
@pytest.mark.timeout(200)  # past the wait for every run to end, which names those left
@pytest.mark.parametrize("workers", ["amqp"], indirect=True)
async def test_workers_killed_and_stalled_on_rabbitmq_leave_every_run_ended(
    workers: Workers,
) -> None:
    """A short soak of the workers alone on RabbitMQ (the chaos soak's are on NATS): fires
    published ten a second for 16 s, a third failing their first attempt, while every 2 s
    one worker is SIGKILLed (and replaced) or SIGSTOPped for 4 s, past its run lease and
    its broker heartbeat, so RabbitMQ closes its connection and its runs are taken over.
    Every run ends: succeeded, or dead after its last attempt; none is left running or
    retrying."""
    rng = random.Random(33)
    common = ("--ack-wait", "3", "--concurrency", "2")
    live = [await workers.start(*common, name=f"w{i}") for i in range(3)]
    fire_ids: list[str] = []
    stalls: set[asyncio.Task[None]] = set()

    async def publish() -> None:
        for i in range(160):
            fire_id = f"soak{i:03d}@1"
            payload: dict[str, Any] = {"sleep": 0.5}
            if i % 3 == 0:
                payload["fail_on"] = [1]
            await workers.publish("jobs.soak", event(fire_id, 1, NOW, payload), fire_id)
            fire_ids.append(fire_id)
            await asyncio.sleep(0.1)  # the fires' pace, ten a second: part of the load

    async def stall(worker: asyncio.subprocess.Process) -> None:
        worker.send_signal(signal.SIGSTOP)
        await asyncio.sleep(4)  # the fault's length, not a wait for a condition
        worker.send_signal(signal.SIGCONT)

    publishing = asyncio.create_task(publish())
    for n in range(8):
        await asyncio.sleep(2)  # the fault's cadence
        victim = rng.choice(live)
        if rng.random() < 0.5:
            victim.kill()
            await victim.wait()
            live.remove(victim)
            live.append(await workers.start(*common, name=f"r{n}"))
        else:
            task = asyncio.create_task(stall(victim))
            stalls.add(task)
    await publishing
    await asyncio.gather(*stalls)

    left: dict[str, Any] = {}  # the runs not ended at the last look, for the failure

    async def all_ended() -> bool:
        runs = {
            d["_id"]: d
            async for d in workers.client[workers.db_name].runs.find({"_id": {"$in": fire_ids}})
        }
        left.clear()
        left.update({f: None for f in fire_ids if f not in runs})
        left.update(
            {
                f: {k: d.get(k) for k in ("state", "attempts", "worker_id", "lease_until")}
                for f, d in runs.items()
                if not (d["state"] == "succeeded" or (d["state"] == "dead" and d["attempts"] == 4))
            }
        )
        return not left

    try:
        await wait_until(all_ended, 120, "every run to end (succeeded, or dead after 4 attempts)")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; not ended: {left}") from None
    assert {a[0] for a in workers.attempts()} == set(fire_ids)  # each handler ran
    # The faults did what they are for: runs taken over, a stalled worker cut off.
    assert workers.logged("run_taken_over") >= 1
    assert workers.logged("worker_resubscribing") >= 1


async def test_sigterm_drains_a_run_in_flight_then_gives_back_what_overruns(
    workers: Workers,
) -> None:
    worker = await workers.start("--drain-timeout", "5")
    await workers.publish("jobs.d", event("drain@1", 1, NOW, {"sleep": 1.5}), "d")
    await wait_until(lambda: workers.runs_of("drain@1") == 1, 20, "the run to start")
    worker.terminate()
    assert await asyncio.wait_for(worker.wait(), 20) == 0
    assert (await workers.run("drain@1") or {}).get("state") == "succeeded"

    short = await workers.start("--drain-timeout", "1", name="short")
    await workers.publish("jobs.d", event("overrun@1", 1, NOW, {"sleep": 4}), "o")
    await wait_until(lambda: workers.runs_of("overrun@1") == 1, 20, "the run to start")
    short.terminate()
    assert await asyncio.wait_for(short.wait(), 20) == 0
    given_back = await workers.run("overrun@1")
    assert given_back is not None
    assert given_back["state"] == "retrying"
    assert given_back["attempts"] == 0  # the interrupted attempt is not counted
    await workers.start(name="next")
    doc = await workers.wait_state("overrun@1", "succeeded", 30)
    assert doc["worker_id"] == "next"


@pytest.mark.stops_broker
async def test_hostile_messages_are_terminated_and_the_worker_rides_a_broker_restart(
    workers: Workers,
) -> None:
    await workers.start("--handler", "tests.helpers.record_handler:handle")
    hostile = [
        b"not json",
        b"[1, 2]",
        b'{"id": "x", "data": "text"}',
        b'{"id": "x", "data": {"term": "one"}}',
        b'{"id": "x", "data": {"term": 1, "nominal_at": 5}}',
        b'{"id": "x", "data": {"term": -1, "nominal_at": "2030-01-01T00:00:00Z"}}',
        b'{"id": "x", "data": {"term": 1, "nominal_at": "2030-01-01T00:00:00"}}',
        json.dumps({"id": "x" * 5000, "data": {"term": 1}}).encode(),
        json.dumps({"id": "y", "data": {"term": 0}}).encode() + b"\xff",
    ]
    for i, body in enumerate(hostile):
        await workers.publish("jobs", body, f"hostile-{i}")
    await workers.publish("jobs", event("ok@1", 1, NOW), "ok")
    await workers.wait_state("ok@1", "succeeded")
    assert workers.logged("fire_unreadable") == len(hostile)
    # The broker goes away and comes back on the same port and store.
    workers.broker.kill()
    # nats-py reconnects by itself; on RabbitMQ the connection is made again.
    met, back, times = (
        ("broker_disconnected", "broker_reconnected", 1)
        if workers.broker.name == "nats"
        else ("worker_resubscribing", "worker_subscribed", 2)
    )
    await wait_until(lambda: workers.logged(met) >= 1, 15, "the worker to meet the outage")
    workers.broker.restart()
    await workers.publish("jobs", event("ok@2", 1, NOW), "ok2")
    await workers.wait_state("ok@2", "succeeded", 40)
    assert workers.logged(back) >= times
    assert all(p.returncode is None for p in workers.processes)
    assert Counter(a[0] for a in workers.attempts()) == {"ok@1": 1, "ok@2": 1}


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--broker", "http://x", "--mongodb-uri", "mongodb://h"], "nats://"),
        (["--broker", "nats://h:4222"], "--mongodb-uri"),
        (["--broker", "nats://h:4222", "--mongodb-uri", "nope"], "--mongodb-uri"),
        (
            ["--broker", "nats://h:4222", "--mongodb-uri", "mongodb://h", "--app", "nomodule"],
            "module:attribute",
        ),
        (
            ["--broker", "nats://h:4222", "--mongodb-uri", "mongodb://h", "--app", "os:path"],
            "not a hascheduler.worker.WorkerApp",
        ),
        (
            [
                "--broker",
                "nats://h:4222",
                "--mongodb-uri",
                "mongodb://h",
                "--app",
                "tests.helpers.record_handler:app",
                "--target",
                "x",
            ],
            "--target goes with --handler",
        ),
        (
            [
                "--broker",
                "nats://h:4222",
                "--mongodb-uri",
                "mongodb://h",
                "--handler",
                "tests.helpers.record_handler:handle",
                "--target",
                "a.>.b",
            ],
            "target pattern",
        ),
        (
            ["--broker", "nats://h:4222", "--mongodb-uri", "mongodb://h", "--concurrency", "0"],
            "--concurrency",
        ),
        (
            [
                "--broker",
                "nats://h:4222",
                "--mongodb-uri",
                "mongodb://h",
                "--backoff-base",
                "9",
                "--backoff-cap",
                "1",
            ],
            "backoff_cap_s",
        ),
    ],
)
def test_worker_refuses_bad_settings(args: list[str], complaint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "worker", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert complaint in result.stderr
