"""``hascheduler worker`` against a real nats-server: run once, drop repeats and stale."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from hascheduler.brokers.nats import ensure_stream
from tests.servers import ServerProcess, start_nats
from tests.waiting import wait_until


@pytest.fixture
def nats_server() -> Iterator[ServerProcess]:
    server = start_nats()
    yield server
    server.stop()


def event(fire_id: str, term: int, nominal: dt.datetime) -> bytes:
    return json.dumps({"specversion": "1.0", "id": fire_id, "source": "/hascheduler",
                       "type": "io.hascheduler.fire", "subject": fire_id.split("@")[0],
                       "data": {"term": term, "nominal_at": nominal.isoformat()
                                .replace("+00:00", "Z"), "payload": {}}}).encode()


async def test_worker_runs_each_fire_once(nats_server: ServerProcess, tmp_path: Path) -> None:
    record = tmp_path / "fires.txt"
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hascheduler.cli", "worker", "--broker", nats_server.uri,
        "--target", "jobs", "--handler", "tests.helpers.record_handler:handle",
        env={**os.environ, "RECORD_FIRES_TO": str(record)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert worker.stdout is not None
        assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
        nc = await nats.connect(nats_server.uri)
        js = nc.jetstream()
        await ensure_stream(js, "HASCHEDULER", 600)
        now = dt.datetime.now(dt.UTC)
        later = now + dt.timedelta(minutes=5)
        sends = [("s@1", 1, now, "m1"), ("s@2", 2, now, "m2"),
                 ("s@1", 2, now, "m3"),      # the same fire again (new broker message id)
                 ("s@0", 1, now, "m4"),      # old term, but claimed in time: runs
                 ("s@9", 1, later, "m5"),    # old term, after term 2 acted: stale
                 ("s@2", 2, now, "m2"),      # a republish the broker itself deduplicates
                 ("s@3", 2, now, "m6")]      # the last: once it is run, all were seen
        for fire_id, term, nominal, msg_id in sends:
            await js.publish("hascheduler.fire.jobs", event(fire_id, term, nominal),
                             headers={"Nats-Msg-Id": msg_id})
        await nc.close()

        async def last_one_run() -> bool:
            return record.exists() and "s@3 2" in record.read_text()

        await wait_until(last_one_run, 15, "the worker to run the last fire")
        assert record.read_text().splitlines() == ["s@1 1", "s@2 2", "s@0 1", "s@3 2"]
    finally:
        worker.terminate()
        assert await asyncio.wait_for(worker.wait(), 10) == 0


def test_worker_refuses_bad_settings() -> None:
    result = subprocess.run([sys.executable, "-m", "hascheduler.cli", "worker", "--broker",
                             "http://x", "--target", "t"], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2
    assert "nats://" in result.stderr
