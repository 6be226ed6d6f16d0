"""A 3-node NATS JetStream cluster with the fire stream replicated 3 ways: the node leading
the stream is SIGKILLed during a burst of fires and steady firing at once. Every fire is in
the stream and the ledger exactly once, and a worker runs each steady one once (the runs
ledger and the handler's own record)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.js.errors
import pytest

from bench.firing_bench import schedule_doc
from tests.servers import NatsCluster, start_nats_cluster
from tests.test_failover import Harness, audit, published_by, stream_counts
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]

BURST = 2_000


@pytest.fixture
async def cluster(mongo_uri: str) -> AsyncIterator[tuple[Harness, NatsCluster]]:
    nodes = start_nats_cluster(3)
    h = Harness(mongo_uri, nodes)
    try:
        await h.record()
        yield h, nodes
    finally:
        try:
            await h.close()
        finally:
            nodes.stop()


async def replicas_of_the_stream(nodes: NatsCluster) -> int:
    nc = await nats.connect([n.uri for n in nodes.nodes.values()])
    try:
        info = await nc.jetstream().stream_info("HASCHEDULER")
        return int(info.config.num_replicas or 1)
    finally:
        await nc.close()


@pytest.mark.long(16)
async def test_killing_the_stream_leader_mid_burst_and_steady_firing_runs_each_once(
    cluster: tuple[Harness, NatsCluster], tmp_path: Path
) -> None:
    """One election serves both cases: schedules firing steadily (run by a worker) and a
    burst of one-off fires (a target of its own, not the worker's) due together, the
    stream's leader SIGKILLed as the burst is claimed, before it is published."""
    h, nodes = cluster
    burst_target = f"audit.{h.prefix}.burst"
    record = tmp_path / "runs.txt"
    with open(tmp_path / "worker.log", "wb") as log:  # noqa: ASYNC230 - opened once
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hascheduler.cli",
            "worker",
            "--broker",
            nodes.uri,
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
    try:
        assert worker.stdout is not None
        for name in ("a", "b", "c"):
            h.start(name)
        assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
        term = (await h.lease())["term"] if await h.leader() else 0
        assert await replicas_of_the_stream(nodes) == 3  # auto: the cluster has 3 nodes
        schedules = await h.create_schedules()
        start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
        await published_by(h, term, 3, after=start)
        # Written once the cluster fires (its start-up takes seconds, varying), due soon
        # after: the mirrors take it from the change stream.
        due = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=4)).replace(microsecond=0)
        await h.db.schedules.insert_many(
            [
                schedule_doc(f"{h.prefix}-{i:05d}", {"kind": "at", "at": [due]}, burst_target)
                for i in range(BURST)
            ]
        )

        # The burst is claimed from 1.5 s ahead of its due time and published at it: once
        # its first claims are in, the stream loses its leader before the publishes go out
        # (waiting for every claim can take past the due time, when most are published).
        in_burst = {"schedule_id": {"$regex": f"^{h.prefix}-\\d{{5}}$"}}

        async def claims_begun() -> bool:
            return await h.db.fires.count_documents(in_burst) > 0

        killed = await nodes.stream_leader()  # asked before: the lookup takes time
        await wait_until(claims_begun, 30, "the burst's claims to begin", 0.05)
        nodes.nodes[killed].stop(signal.SIGKILL)
        killed_at = dt.datetime.now(dt.UTC)
        assert killed_at < due, "the burst was claimed too late to meet the kill"

        async def all_published() -> bool:
            n = await h.db.fires.count_documents({**in_burst, "state": "published"})
            return n == BURST

        await wait_until(all_published, 60, "every fire of the burst published", 0.2)

        # The stream has a leader again (the publishes were confirmed), but its API can stay
        # silent while the cluster's meta leader, if it was the killed node too, is elected.
        async def answered_by_a_new_leader() -> bool:
            try:
                return await nodes.stream_leader() != killed
            except (nats.errors.TimeoutError, AssertionError):  # silent, or no leader yet
                return False

        await wait_until(answered_by_a_new_leader, 30, "the stream's API answering", 0.5)

        # Reading it back makes a consumer, which the cluster's meta leader answers: that
        # can still be in election after the stream's own leader answers.
        async def counted() -> tuple[Counter[str], dict[str, dt.datetime]] | None:
            try:
                return await stream_counts(h.nats.uri, f"{h.prefix}.burst")
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError,
            ):
                return None

        counts, _ = await wait_until(counted, 30, "the stream read back", 0.5)
        assert len(counts) == BURST, f"{BURST - len(counts)} fires missing from the stream"
        assert all(n == 1 for n in counts.values()), [f for f, n in counts.items() if n > 1][:5]
        # The kill met the burst: its publishes (all, or the rest) went out after it.
        assert (
            await h.db.fires.count_documents({**in_burst, "published_at": {"$gt": killed_at}}) > 0
        )

        await published_by(h, term, 6, after=killed_at)  # firing goes on, same leader
        end = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=0.5)
        result = await audit(h, schedules, start, end)
        fires = [d["_id"] for d in result["ledger"]]

        async def all_run() -> bool:
            done = await h.db.runs.count_documents({"_id": {"$in": fires}, "state": "succeeded"})
            return done == len(fires)

        await wait_until(all_run, 60, "every steady fire run by the worker", 0.2)
        ran = Counter(line.split()[0] for line in record.read_text().splitlines())
        assert all(ran[f] == 1 for f in fires), {f: ran[f] for f in fires if ran[f] != 1}
        assert not any(f in ran for f in counts), "the worker took the burst's target"
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 30)
