"""The runs through the API and /metrics, with real processes: a replica, nats-server and
workers. A dead run is listed, replayed and succeeds; a stalled worker's run shows stuck."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.servers import ServerProcess, free_port, start_nats, start_replica, with_database
from tests.waiting import wait_until


class Stack:
    def __init__(
        self,
        replica: ServerProcess,
        nats_server: ServerProcess,
        mongo_uri: str,
        tmp: Path,
        http: aiohttp.ClientSession,
    ) -> None:
        self.replica, self.nats, self.mongo_uri, self.tmp = replica, nats_server, mongo_uri, tmp
        self.http = http
        self.workers: list[asyncio.subprocess.Process] = []

    async def worker(self, *args: str) -> asyncio.subprocess.Process:
        with open(self.tmp / f"w{len(self.workers)}.log", "wb") as log:  # noqa: ASYNC230
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "hascheduler.cli",
                "worker",
                "--broker",
                self.nats.uri,
                "--mongodb-uri",
                self.mongo_uri,
                "--app",
                "tests.helpers.record_handler:app",
                "--durable",
                "api-test",
                *args,
                env={**os.environ, "RECORD_FIRES_TO": str(self.tmp / "attempts.txt")},
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        assert worker.stdout is not None
        assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
        self.workers.append(worker)
        return worker

    async def get(self, path: str, **params: str) -> tuple[int, Any]:
        async with self.http.get(self.replica.uri + path, params=params) as response:
            return response.status, await response.json()

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.post(self.replica.uri + path, json=body) as response:
            return response.status, await response.json()

    async def schedule_once(self, target: str, payload: dict[str, Any]) -> str:
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        status, body = await self.post(
            "/schedules",
            {
                "name": "once",
                "target": target,
                "payload": payload,
                "trigger": {"kind": "at", "at": [at.isoformat()]},
            },
        )
        assert status == 201, body
        return str(body["id"])

    async def run_in(self, fire_of: str, state: str) -> dict[str, Any]:
        async def found() -> dict[str, Any] | None:
            _, body = await self.get(f"/schedules/{fire_of}/runs")
            return next((r for r in body["items"] if r["state"] == state), None)

        value: dict[str, Any] = await wait_until(
            found, 40, f"a run of {fire_of} to be {state}", 0.2
        )
        return value


@pytest.fixture(name="stack")
async def stack_fixture(mongo_uri: str, tmp_path: Path) -> AsyncIterator[Stack]:
    nats_server = start_nats()
    uri = with_database(mongo_uri, f"t_{uuid.uuid4().hex[:12]}")
    replica = start_replica(uri, "r1", "--broker", nats_server.uri)
    async with aiohttp.ClientSession() as http:
        s = Stack(replica, nats_server, uri, tmp_path, http)
        try:
            yield s
        finally:
            for worker in s.workers:
                if worker.returncode is None:
                    worker.send_signal(signal.SIGCONT)
                    worker.terminate()
                await asyncio.wait_for(worker.wait(), 40)
            replica.stop()
            nats_server.stop()


async def test_a_dead_run_is_listed_replayed_and_succeeds(stack: Stack) -> None:
    port = free_port()
    await stack.worker("--metrics-port", str(port))
    schedule_id = await stack.schedule_once("jobs.replay", {"dead_until_replay": True})
    dead = await stack.run_in(schedule_id, "dead")
    assert dead["attempts"] == 1
    assert dead["last_error"] == "PermanentFailure: this fire works only when replayed"
    status, page = await stack.get("/runs", state="dead")
    assert status == 200
    assert [r["id"] for r in page["items"]] == [dead["id"]]
    assert page["next"] is None
    assert "event" not in page["items"][0]
    status, one = await stack.get(f"/runs/{dead['id']}")
    assert (status, one["state"]) == (200, "dead")

    status, replayed = await stack.post(f"/runs/{dead['id']}/retry")
    assert status == 202
    assert (replayed["state"], replayed["replays"], replayed["attempts"]) == ("retrying", 1, 0)
    done = await stack.run_in(schedule_id, "succeeded")
    assert (done["id"], done["replays"], done["attempts"]) == (dead["id"], 1, 1)
    status, again = await stack.post(f"/runs/{dead['id']}/retry")
    assert status == 409
    assert "only a dead run" in again["title"]
    status, _ = await stack.post("/runs/no-such-fire/retry")
    assert status == 404
    status, _ = await stack.get("/runs/no-such-fire")
    assert status == 404
    status, gone = await stack.get("/runs", after="no-such-fire")
    assert status == 404
    assert "after names no run" in gone["title"]
    attempts = (stack.tmp / "attempts.txt").read_text().splitlines()
    assert [line.split()[0] for line in attempts] == [dead["id"], dead["id"]]

    async with stack.http.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    assert 'hascheduler_worker_runs_total{outcome="dead",target="jobs.replay"} 1.0' in text
    assert 'hascheduler_worker_runs_total{outcome="succeeded",target="jobs.replay"} 1.0' in text
    assert 'hascheduler_worker_run_duration_seconds_count{target="jobs.replay"} 2.0' in text


@pytest.mark.parametrize(
    ("query", "field"),
    [({"state": "bogus"}, "state"), ({"limit": "0"}, "limit"), ({"limit": "100000"}, "limit")],
)
async def test_bad_run_queries_are_422_naming_the_field(
    stack: Stack, query: dict[str, str], field: str
) -> None:
    status, body = await stack.get("/runs", **query)
    assert status == 422
    assert body["errors"][0]["field"] == field


async def test_a_stalled_workers_run_shows_stuck_then_is_taken_over(stack: Stack) -> None:
    stalled = await stack.worker("--ack-wait", "2", "--worker-id", "stalled")
    schedule_id = await stack.schedule_once("jobs.stall", {"sleep": 4})
    running = await stack.run_in(schedule_id, "running")
    stalled.send_signal(signal.SIGSTOP)

    async def stuck() -> bool:
        async with stack.http.get(stack.replica.uri + "/metrics") as response:
            text = await response.text()
        return bool(re.search(r'hascheduler_runs_stuck\{target="jobs.stall"\} 1\.0', text))

    await wait_until(stuck, 30, "the run to show stuck", 0.5)
    await stack.worker("--ack-wait", "2", "--worker-id", "heir")
    done = await stack.run_in(schedule_id, "succeeded")
    assert (done["id"], done["worker_id"], done["attempts"]) == (running["id"], "heir", 2)
    stalled.send_signal(signal.SIGCONT)  # it wakes, finishes, and its write changes nothing

    async def settled() -> bool:
        _, body = await stack.get(f"/runs/{running['id']}")
        log = (stack.tmp / "w0.log").read_text()
        return body["worker_id"] == "heir" and '"run_lease_lost"' in log

    await wait_until(settled, 30, "the stalled worker to find its claim lost")


@pytest.mark.parametrize("kept", [None, b"not json", b"[1]", b'{"data": "x"}'])
async def test_a_dead_run_without_a_readable_event_is_refused_not_replayed(
    stack: Stack, kept: bytes | None
) -> None:
    """A run document written around the workers: the replay is refused, nothing sent."""
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(stack.mongo_uri)
    try:
        doc: dict[str, Any] = {
            "_id": "odd@1",
            "schedule_id": "odd",
            "target": "jobs.odd",
            "state": "dead",
            "attempts": 1,
            "replays": 0,
            "recorded_at": dt.datetime.now(dt.UTC),
        }
        if kept is not None:
            doc["event"] = kept
        await client.get_default_database().runs.insert_one(doc)
    finally:
        await client.close()
    status, body = await stack.post("/runs/odd@1/retry")
    assert status == 409
    assert "keeps no event to replay" in body["title"]
    status, run = await stack.get("/runs/odd@1")
    assert (status, run["state"], run["last_error"]) == (200, "dead", "no event kept to replay")
