"""Three replicas firing to a real RabbitMQ and a `hascheduler worker` consuming from it:
the leader SIGTERMed, then the next SIGKILLed. Every fire due in the window reaches the
worker's queue at least once and runs exactly once (the runs ledger and the handler's own
record); RabbitMQ's extra copies, if any, are dropped by the claim."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RabbitServer
from tests.test_failover import TTL, Harness, expected_fires
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


class Rabbit:
    """The session's node with an exchange of this test's own (Harness reads ``uri``)."""

    def __init__(self, server: RabbitServer) -> None:
        self.uri = f"{server.url}?exchange=fires-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def harness(mongo_uri: str, rabbit: RabbitServer) -> AsyncIterator[Harness]:
    h = Harness(mongo_uri, Rabbit(rabbit))  # type: ignore[arg-type]
    try:
        await h.record()
        yield h
    finally:
        await h.close()


async def test_leader_sigterm_then_sigkill_every_fire_runs_exactly_once(
    harness: Harness, tmp_path: Path
) -> None:
    h = harness
    record = tmp_path / "attempts.txt"
    with open(tmp_path / "worker.log", "wb") as log:  # noqa: ASYNC230 - opened once
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hascheduler.cli",
            "worker",
            "--broker",
            h.nats.uri,
            "--mongodb-uri",
            h.mongo_uri,
            "--handler",
            "tests.helpers.record_handler:handle",
            "--target",
            f"audit.{h.prefix}",
            "--durable",
            f"audit-{h.prefix}",
            "--worker-id",
            "w1",
            env={**os.environ, "RECORD_FIRES_TO": str(record)},
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
    try:
        assert worker.stdout is not None
        assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
        for name in ("a", "b", "c"):
            h.start(name)
        schedules = await h.create_schedules()
        start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)

        async def runs_after(moment: dt.datetime, count: int) -> bool:
            n = await h.db.runs.count_documents(
                {"state": "succeeded", "nominal_at": {"$gt": moment}}
            )
            return bool(n >= count)

        await wait_until(lambda: runs_after(start, 3), 20, "runs before the faults")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            leader = await h.leader()
            at = dt.datetime.now(dt.UTC)
            h.signal(leader, sig)
            h.replicas.pop(leader).stop(sig)
            await h.leader()
        # The window closes a lease ttl after the SIGKILL (fires the dead leader owed are
        # the new one's catch-up) and once the new leader's own fires are running.
        end = at + dt.timedelta(seconds=TTL + 1)
        await wait_until(lambda: runs_after(end, 3), 30, "runs after the SIGKILL's takeover")
        expected = expected_fires(schedules, start, end)
        assert len(expected) >= 8

        async def all_ran() -> dict[str, Any] | None:
            docs = {d["_id"]: d async for d in h.db.runs.find({"_id": {"$in": list(expected)}})}
            done = all(d["state"] == "succeeded" for d in docs.values())
            return docs if done and set(docs) == expected else None

        runs = await wait_until(all_ran, 30, "every fire of the window to have run")
        assert all(d["attempts"] == 1 for d in runs.values())
        ran = Counter(line.split()[0] for line in record.read_text().splitlines())
        assert {f: ran[f] for f in expected} == dict.fromkeys(expected, 1)
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 40)
