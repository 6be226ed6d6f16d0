"""Backfill with real processes: three replicas and nats-server. A range is fired once,
never twice (repeated, overlapping, across a leader SIGKILL midway), audited from the
stream itself."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import subprocess
from typing import Any

import pytest

from hascheduler.core.triggers import Cron, fire_id, fire_times
from tests.test_cli import run_cli as cli
from tests.test_failover import Harness, stream_counts
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


async def add(h: Harness, sid: str, cron: str) -> None:
    status, body = await h.call("POST", "/schedules", {
        "id": sid, "name": sid, "target": f"audit.{h.prefix}",
        "trigger": {"kind": "cron", "cron": cron}})
    assert status == 201, body


async def finished(h: Harness, backfill: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        _, body = await h.call("GET", f"/backfills/{backfill}")
        return body if body["state"] != "running" else None

    return await wait_until(done, 60, f"backfill {backfill} to finish", 0.1)


async def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, *args)


def midnight(days_ago: int) -> dt.datetime:
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - dt.timedelta(days=days_ago)


async def test_a_nightly_backfill_fires_each_night_once_and_a_repeat_nothing(
        own_harness: Harness) -> None:
    h = own_harness
    h.start("a")
    await h.leader()
    sid = f"{h.prefix}-nightly"
    await add(h, sid, "30 2 * * *")
    span = {"start": midnight(4).isoformat(), "end": midnight(1).isoformat()}
    status, first = await h.call("POST", f"/schedules/{sid}/backfill", span)
    assert status == 202, first
    assert (first["total"], first["state"], first["requested_by"]) == (3, "running",
                                                                      "anonymous")
    done = await finished(h, first["id"])
    assert (done["state"], done["fired"], done["skipped"], done["remaining"]) == (
        "done", 3, 0, 0)
    status, again = await h.call("POST", f"/schedules/{sid}/backfill", span)
    assert status == 202
    repeat = await finished(h, again["id"])
    assert (repeat["fired"], repeat["skipped"]) == (0, 3)
    nights = {fire_id(sid, midnight(d) + dt.timedelta(hours=2, minutes=30))
              for d in (4, 3, 2)}

    async def all_published() -> bool:
        return await h.db.fires.count_documents({"_id": {"$in": sorted(nights)},
                                                 "state": "published"}) == 3

    await wait_until(all_published, 20, "the three nights published", 0.1)
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    assert {f: counts[f] for f in nights} == dict.fromkeys(nights, 1)


async def test_a_backfill_goes_on_across_a_leader_kill_firing_each_time_once(
        own_harness: Harness) -> None:
    h = own_harness
    for name in ("a", "b", "c"):
        h.start(name)
    first = await h.leader()
    sid = f"{h.prefix}-seconds"
    await add(h, sid, "* * * * * *")
    end = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=1)
    start = end - dt.timedelta(seconds=3000)
    status, backfill = await h.call("POST", f"/schedules/{sid}/backfill",
                                  {"start": start.isoformat(), "end": end.isoformat()})
    assert status == 202
    assert backfill["total"] == 3000

    async def begun() -> bool:
        _, body = await h.call("GET", f"/backfills/{backfill['id']}")
        return bool(body["fired"] > 0)

    await wait_until(begun, 20, "the backfill's first chunk", 0.05)
    h.signal(first, signal.SIGKILL)
    process = h.replicas[first].process
    assert process is not None
    process.wait(10)
    done = await finished(h, backfill["id"])
    assert done["state"] == "done"
    assert done["fired"] + done["skipped"] >= 3000  # a chunk redone counts as skipped
    expected = {fire_id(sid, n) for n in fire_times(Cron("* * * * * *"),
                                                    start - dt.timedelta(microseconds=1),
                                                    until=end - dt.timedelta(microseconds=1))}
    assert len(expected) == 3000

    async def all_published() -> bool:
        return await h.db.fires.count_documents({"_id": {"$in": sorted(expected)},
                                                 "state": "published"}) == 3000

    await wait_until(all_published, 60, "every backfilled time published", 0.2)
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    missing = sorted(f for f in expected if counts[f] == 0)
    twice = sorted(f for f in expected if counts[f] > 1)
    assert (missing[:5], twice[:5]) == ([], [])


async def test_bad_backfills_are_refused_naming_the_field(own_harness: Harness) -> None:
    h = own_harness
    h.start("a")
    sid = f"{h.prefix}-bad"
    await add(h, sid, "* * * * * *")
    now = dt.datetime.now(dt.UTC)
    for body, field in (
            ({"start": now.isoformat(), "end": (now - dt.timedelta(hours=1)).isoformat()},
             "end"),
            ({"start": (now - dt.timedelta(hours=1)).isoformat(),
              "end": (now + dt.timedelta(hours=1)).isoformat()}, "end"),
            # 200,000 seconds: above the default bound of 100,000 fire times.
            ({"start": (now - dt.timedelta(seconds=200_001)).isoformat(),
              "end": (now - dt.timedelta(seconds=1)).isoformat()}, "end"),
            ({"start": "yesterday", "end": now.isoformat()}, "start"),
            # Valid, and as far back as the calendar goes: counted, and far too many.
            ({"start": "0001-01-01T00:00:00Z", "end": now.isoformat()}, "end"),
            ({"start": (now - dt.timedelta(hours=1)).isoformat(), "end": now.isoformat(),
              "overlap": "maybe"}, "overlap")):
        status, answer = await h.call("POST", f"/schedules/{sid}/backfill", body)
        assert (status, answer["errors"][0]["field"]) == (422, field), (body, answer)
    status, _ = await h.call("GET", "/backfills/nothing")
    assert status == 404
    status, _ = await h.call("DELETE", "/backfills/nothing")
    assert status == 404
    # The largest allowed, worked in chunks and cancelled midway; the CLI names it.
    cli = await run_cli("schedules", "--api", h.live(), "backfill", sid, "--start",
                        (now - dt.timedelta(seconds=100_000)).isoformat(),
                        "--end", now.replace(microsecond=0).isoformat(), "--json")
    assert cli.returncode == 0, cli.stderr
    largest = json.loads(cli.stdout)
    assert largest["total"] <= 100_000
    status, cancelled = await h.call("DELETE", f"/backfills/{largest['id']}")
    assert (status, cancelled["state"]) == (200, "cancelled")
    status, _again = await h.call("DELETE", f"/backfills/{largest['id']}")
    assert status == 409
    bad = await run_cli("schedules", "--api", h.live(), "backfill", sid, "--start",
                        now.isoformat(), "--end", now.isoformat())
    assert bad.returncode == 2
    assert "end must be after start" in bad.stderr
