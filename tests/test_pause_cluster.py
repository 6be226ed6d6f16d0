"""Pausing with a note, until an instant and on failure, with real processes: three
replicas (the leader killed while a pause runs out), nats-server and a worker."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from hascheduler.storage.lease import LeaseTimings
from tests.servers import start_nats
from tests.test_cli import run_cli
from tests.test_failover import Harness
from tests.test_overlap_cluster import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


async def test_a_pause_until_an_instant_ends_then_across_a_leader_kill(
    own_harness: Harness,
) -> None:
    h = own_harness
    for name in ("a", "b", "c"):
        h.start(name)
    first = await h.leader()
    sid = f"{h.prefix}-until"
    status, _ = await h.call(
        "POST",
        "/schedules",
        {
            "id": sid,
            "name": sid,
            "target": f"audit.{h.prefix}",
            "trigger": {"kind": "interval", "every": 1},
        },
    )
    assert status == 201
    until = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)).replace(microsecond=0)
    status, paused = await h.call(
        "POST", f"/schedules/{sid}/pause", {"note": "partner API down", "until": until.isoformat()}
    )
    assert status == 200, paused
    assert paused["paused"] is True
    assert (paused["pause"]["note"], paused["pause"]["by"]) == ("partner API down", "anonymous")
    assert dt.datetime.fromisoformat(paused["pause"]["until"]) == until
    paused_at = dt.datetime.fromisoformat(paused["pause"]["at"])
    h.signal(first, signal.SIGKILL)
    process = h.replicas[first].process
    assert process is not None
    process.wait(10)

    async def resumed() -> dict[str, Any] | None:
        status, body = await h.call("GET", f"/schedules/{sid}")
        return body if status == 200 and not body["paused"] else None

    schedule = await wait_until(resumed, 30, "the schedule resumed by a new leader", 0.1)
    assert schedule["pause"] is None

    async def fired_after() -> list[dict[str, Any]]:
        return [
            d
            async for d in h.db.fires.find(
                {"schedule_id": sid, "state": "published", "nominal_at": {"$gte": until}}
            )
        ]

    await wait_until(fired_after, 30, "fires from the instant on", 0.2)
    # Nothing fired while it was paused (allowing for a fire claimed before the pause).
    during = [
        d
        async for d in h.db.fires.find(
            {
                "schedule_id": sid,
                "state": "published",
                "nominal_at": {"$gt": paused_at + dt.timedelta(seconds=2), "$lt": until},
            }
        )
    ]
    assert during == []
    # The first fire at the instant itself (every second on the grid: until is on it
    # when the grid started on a whole second, else the next one).
    first_after = min(d["nominal_at"] for d in await fired_after())
    assert first_after - until < dt.timedelta(seconds=1)


async def test_a_pause_running_out_as_its_leader_is_killed_loses_no_instant_after_it(
    mongo_uri: str,
) -> None:
    """The leader is SIGKILLed just before a pause's ``until`` (its fires at ``until`` and
    the next claimed ahead): its successor's catch-up runs while its mirror still shows
    the schedule paused, and writes the resume itself. Every instant from ``until`` on is
    fired once: on 19ca195 the ones between the claimed-ahead fires and the successor's
    resume (two of them) were in neither the ledger nor the stream. A lease ttl of 4 s, so
    that the successor takes over well after the claimed-ahead fires."""
    server = start_nats()
    h = Harness(mongo_uri, server, LeaseTimings(4.0, 2.8, 0.8))
    try:
        await h.record()
        await _pause_runs_out_across_a_kill(h)
    finally:
        try:
            await h.close()
        finally:
            server.stop()


async def _pause_runs_out_across_a_kill(h: Harness) -> None:
    for name in ("a", "b", "c"):
        h.start(name)
    first = await h.leader()
    sid = f"{h.prefix}-until-kill"
    status, _ = await h.call(
        "POST",
        "/schedules",
        {
            "id": sid,
            "name": sid,
            "target": f"audit.{h.prefix}",
            "catchup": "all",
            "trigger": {"kind": "interval", "every": 1},
        },
    )
    assert status == 201
    until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=4)
    status, paused = await h.call("POST", f"/schedules/{sid}/pause", {"until": until.isoformat()})
    assert status == 200, paused
    until = dt.datetime.fromisoformat(paused["pause"]["until"])
    # The fault at its moment, 0.3 s before the pause runs out: an instant to inject at,
    # not a condition to wait for.
    await asyncio.sleep(
        (until - dt.timedelta(seconds=0.3) - dt.datetime.now(dt.UTC)).total_seconds()
    )
    h.signal(first, signal.SIGKILL)
    process = h.replicas[first].process
    assert process is not None
    process.wait(10)

    async def successor_holds() -> str | None:
        holder = (await h.lease()).get("holder")
        return holder if holder not in (None, first) else None

    successor = await wait_until(successor_holds, 20, "a successor", 0.05)

    async def fired_through() -> dt.datetime | None:
        through = (await h.lease()).get("fired_through")
        held = (await h.lease()).get("holder") == successor
        return through.replace(tzinfo=dt.UTC) if held and through else None

    # The successor has handled a few seconds past its takeover.
    took_over = dt.datetime.now(dt.UTC)

    async def handled() -> bool:
        through = await fired_through()
        return through is not None and through > took_over + dt.timedelta(seconds=3)

    await wait_until(handled, 40, "the successor to handle 3 s past its takeover", 0.2)

    async def published() -> list[dt.datetime]:
        return sorted(
            [
                d["nominal_at"].replace(tzinfo=dt.UTC)
                async for d in h.db.fires.find(
                    {
                        "schedule_id": sid,
                        "state": "published",
                        "nominal_at": {"$gte": until},
                        "manual": {"$ne": True},
                    }
                )
            ]
        )

    nominals = await wait_until(published, 20, "fires from the instant on", 0.2)
    assert nominals[0] - until < dt.timedelta(seconds=1)
    gaps = [(a, b) for a, b in itertools.pairwise(nominals) if b - a != dt.timedelta(seconds=1)]
    assert gaps == [], gaps
    assert nominals[-1] > took_over + dt.timedelta(seconds=2)
    # Each fired once, none skipped.
    assert (
        await h.db.fires.count_documents(
            {"schedule_id": sid, "state": "skipped", "nominal_at": {"$gte": until}}
        )
        == 0
    )


async def test_bad_pauses_are_refused_naming_the_field(own_harness: Harness) -> None:
    h = own_harness
    h.start("a")
    sid = f"{h.prefix}-bad"
    assert (
        await h.call(
            "POST",
            "/schedules",
            {"id": sid, "name": sid, "target": "t", "trigger": {"kind": "cron", "cron": "@daily"}},
        )
    )[0] == 201
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat()
    for body, field in (
        ({"until": past}, "until"),
        ({"until": "tomorrow"}, "until"),
        ({"note": "x" * 1001}, "note"),
        ({"why": "x"}, "why"),
    ):
        status, answer = await h.call("POST", f"/schedules/{sid}/pause", body)
        assert (status, answer["errors"][0]["field"]) == (422, field), answer
    # From the command line: refused naming the field (exit 2), then paused with a note.
    refused = await asyncio.to_thread(
        run_cli, "schedules", "--api", h.live(), "pause", sid, "--until", past
    )
    assert refused.returncode == 2
    assert "until must be in the future" in refused.stderr
    paused = await asyncio.to_thread(
        run_cli,
        "schedules",
        "--api",
        h.live(),
        "pause",
        sid,
        "--note",
        "maintenance window",
        "--json",
    )
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["pause"]["note"] == "maintenance window"
    status, answer = await h.call(
        "POST",
        "/schedules",
        {
            "name": "n",
            "target": "t",
            "pause_on_failure": 0,
            "trigger": {"kind": "cron", "cron": "@daily"},
        },
    )
    assert (status, answer["errors"][0]["field"]) == (422, "pause_on_failure")


async def test_pause_on_failure_pauses_after_that_many_dead_runs(
    own_harness: Harness, tmp_path: Path
) -> None:
    h = own_harness
    h.start("a")
    await h.leader()
    worker = await start_worker(h, tmp_path, "w1")
    sid = f"{h.prefix}-failing"
    try:
        status, _ = await h.call(
            "POST",
            "/schedules",
            {
                "id": sid,
                "name": sid,
                "target": f"jobs.{h.prefix}",
                "pause_on_failure": 3,
                "payload": {"permanent": True},
                "trigger": {"kind": "interval", "every": 1},
            },
        )
        assert status == 201

        async def paused() -> dict[str, Any] | None:
            _, body = await h.call("GET", f"/schedules/{sid}")
            return body if body["paused"] else None

        schedule = await wait_until(paused, 30, "the schedule paused on failure", 0.1)
        assert schedule["pause"]["by"] == "pause_on_failure"
        assert "3 consecutive dead runs" in schedule["pause"]["note"]
        assert "this account no longer exists" in schedule["pause"]["note"]
        dead = await h.db.runs.count_documents({"schedule_id": sid, "state": "dead"})
        assert dead >= 3
        # No fire after the pause is published, once the leader has handled the next
        # seconds.
        paused_at = dt.datetime.fromisoformat(schedule["pause"]["at"])

        async def handled_past_the_pause() -> bool:
            through = (await h.lease()).get("fired_through")
            return bool(
                through and through.replace(tzinfo=dt.UTC) > paused_at + dt.timedelta(seconds=3)
            )

        await wait_until(handled_past_the_pause, 20, "the leader to handle 3 s more", 0.2)
        later = [
            d
            async for d in h.db.fires.find(
                {
                    "schedule_id": sid,
                    "state": "published",
                    "nominal_at": {"$gt": paused_at + dt.timedelta(seconds=2)},
                }
            )
        ]
        assert later == []
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 40)
