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
from hascheduler.worker import FireFilter
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


async def start_worker(nats_uri: str, record: Path,
                       log: Path | None = None) -> asyncio.subprocess.Process:
    """``hascheduler worker`` on target ``jobs``, recording each fire it runs to ``record``
    (and its debug log to ``log``); returned once it consumes."""
    with open(log or os.devnull, "wb") as stderr:  # noqa: ASYNC230 - opened once
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hascheduler.cli", "--log-level", "debug", "worker",
            "--broker", nats_uri, "--target", "jobs",
            "--handler", "tests.helpers.record_handler:handle",
            env={**os.environ, "RECORD_FIRES_TO": str(record)},
            stdout=asyncio.subprocess.PIPE, stderr=stderr)
    assert worker.stdout is not None
    assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
    return worker


async def test_worker_runs_each_fire_once(nats_server: ServerProcess, tmp_path: Path) -> None:
    record = tmp_path / "fires.txt"
    worker = await start_worker(nats_server.uri, record)
    try:
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


async def test_worker_rides_out_idle_streams_a_broker_restart_and_hostile_messages(
        nats_server: ServerProcess, tmp_path: Path) -> None:
    record = tmp_path / "fires.txt"
    log = tmp_path / "worker.log"
    worker = await start_worker(nats_server.uri, record, log)
    restarted: ServerProcess | None = None

    def logged(event: str) -> int:
        return log.read_text().count(f'"event": "{event}"')
    try:
        now = dt.datetime.now(dt.UTC)

        async def publish(uri: str, body: bytes, msg_id: str) -> None:
            nc = await nats.connect(uri)
            js = nc.jetstream()
            await ensure_stream(js, "HASCHEDULER", 600)
            await js.publish("hascheduler.fire.jobs", body, headers={"Nats-Msg-Id": msg_id})
            await nc.close()

        # Messages that are not fires, each terminated instead of crashing the worker.
        for i, hostile in enumerate([b"not json", b"[1, 2]", b'{"id": "x", "data": "text"}',
                                     b'{"id": "x", "data": {"term": "one"}}',
                                     b'{"id": "x", "data": {"term": 1, "nominal_at": 5}}',
                                     json.dumps({"id": "y", "data": {"term": 0}}).encode()
                                     + b"\xff"]):
            await publish(nats_server.uri, hostile, f"hostile-{i}")
        await publish(nats_server.uri, event("s@1", 1, now), "a")

        async def recorded(line: str) -> bool:
            return record.exists() and line in record.read_text().splitlines()

        await wait_until(lambda: recorded("s@1 1"), 15, "the first fire to run")
        # Idle: several fetches time out with nothing delivered.
        idle_before = logged("fetch_idle")

        async def idle_fetches() -> bool:
            return logged("fetch_idle") >= idle_before + 3 or worker.returncode is not None

        await wait_until(idle_fetches, 15, "three idle fetches")
        assert worker.returncode is None, "the worker exited on an idle stream"
        # The broker goes away and comes back on the same port and store.
        port = int(nats_server.uri.rsplit(":", 1)[1])
        store = nats_server.store_dir  # type: ignore[attr-defined]
        nats_server.process.kill()  # type: ignore[union-attr]
        nats_server.process.wait(10)  # type: ignore[union-attr]
        async def met_the_outage() -> bool:
            return logged("broker_disconnected") >= 1

        await wait_until(met_the_outage, 15, "the worker to meet the outage")
        restarted = start_nats(port=port, store_dir=store)
        await publish(restarted.uri, event("s@2", 1, now), "b")
        await wait_until(lambda: recorded("s@2 1"), 30, "a fire published after the restart")
        assert logged("broker_reconnected") >= 1
        assert worker.returncode is None
        assert record.read_text().splitlines() == ["s@1 1", "s@2 1"]
    finally:
        worker.terminate()
        assert await asyncio.wait_for(worker.wait(), 15) == 0
        if restarted is not None:
            restarted.stop()


def minute(minutes: float) -> dt.datetime:
    return dt.datetime(2030, 1, 1, tzinfo=dt.UTC) + dt.timedelta(minutes=minutes)


def fire_event(fire_id: str, term: int, nominal: dt.datetime) -> dict[str, object]:
    return {"id": fire_id, "data": {"term": term,
                                    "nominal_at": nominal.isoformat().replace("+00:00", "Z")}}


def test_worker_drops_repeats_and_fires_a_deposed_leader_made_after_the_new_term() -> None:
    f = FireFilter()
    assert f.verdict(fire_event("a", 1, minute(1)), minute(1)) == "run"
    f.done(fire_event("a", 1, minute(1)))
    assert f.verdict(fire_event("a", 2, minute(1)), minute(1.1)) == "duplicate"
    assert f.verdict(fire_event("b", 2, minute(2)), minute(2)) == "run"  # term 2 first seen at 2:00
    f.done(fire_event("b", 2, minute(2)))
    # Claimed by term 1 in time (nominal before term 2 appeared), delivered late: run it.
    assert f.verdict(fire_event("c", 1, minute(1.5)), minute(3)) == "run"
    # A term-1 fire for a time after term 2 was acting: a deposed leader's, dropped.
    assert f.verdict(fire_event("d", 1, minute(4)), minute(4)) == "stale"
    # A handler that failed leaves the fire unseen, so the redelivery runs.
    assert f.verdict(fire_event("e", 2, minute(5)), minute(5)) == "run"
    assert f.verdict(fire_event("e", 2, minute(5)), minute(5.1)) == "run"
