"""Backfill with real processes: three replicas and nats-server. A range is fired once,
never twice (repeated, overlapping, across a leader SIGKILL midway), audited from the
stream itself."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import signal
import subprocess
from typing import Any

import pytest

from hascheduler.core.backfill import PUBLISH_FAILED, chunk_outcome
from hascheduler.core.claims import PAUSED_BEFORE_DUE
from hascheduler.core.triggers import Cron, fire_id, fire_times
from tests.test_cli import run_cli as cli
from tests.test_failover import Harness, stream_counts
from tests.waiting import still_pending, wait_until

pytestmark = [pytest.mark.timeout(240)]


async def add(h: Harness, sid: str, cron: str) -> None:
    status, body = await h.call(
        "POST",
        "/schedules",
        {
            "id": sid,
            "name": sid,
            "target": f"audit.{h.prefix}",
            "trigger": {"kind": "cron", "cron": cron},
        },
    )
    assert status == 201, body


async def finished(h: Harness, backfill: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        _, body = await h.call("GET", f"/backfills/{backfill}")
        return body if body["state"] != "running" else None

    value: dict[str, Any] = await wait_until(done, 60, f"backfill {backfill} to finish", 0.1)
    return value


async def seconds_backfilled(
    h: Harness, sid: str, count: int
) -> tuple[dt.datetime, dt.datetime, dict[str, Any]]:
    """An every-second schedule ``sid`` and a backfill of its ``count`` seconds ending a
    minute ago, once its first chunk is fired: (start, end, the backfill)."""
    await add(h, sid, "* * * * * *")
    end = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=1)
    start = end - dt.timedelta(seconds=count)
    status, backfill = await h.call(
        "POST", f"/schedules/{sid}/backfill", {"start": start.isoformat(), "end": end.isoformat()}
    )
    assert status == 202, backfill

    async def fired() -> bool:
        _, body = await h.call("GET", f"/backfills/{backfill['id']}")
        return bool(body["fired"] > 0)

    await wait_until(fired, 20, "the backfill's first chunk", 0.02)
    return start, end, backfill


async def every_second_published(
    h: Harness, sid: str, start: dt.datetime, end: dt.datetime
) -> set[str]:
    """Wait until every second of [start, end) of ``sid`` is published; their fire ids."""
    expected = {
        fire_id(sid, n)
        for n in fire_times(
            Cron("* * * * * *"),
            start - dt.timedelta(microseconds=1),
            until=end - dt.timedelta(microseconds=1),
        )
    }

    async def published() -> bool:
        return await h.db.fires.count_documents(
            {"_id": {"$in": sorted(expected)}, "state": "published"}
        ) == len(expected)

    await wait_until(published, 60, "every backfilled time published", 0.2)
    return expected


async def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, *args)


def midnight(days_ago: int) -> dt.datetime:
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - dt.timedelta(days=days_ago)


async def test_a_nightly_backfill_fires_each_night_once_and_a_repeat_nothing(
    own_harness: Harness,
) -> None:
    h = own_harness
    h.start("a")
    await h.leader()
    sid = f"{h.prefix}-nightly"
    await add(h, sid, "30 2 * * *")
    span = {"start": midnight(4).isoformat(), "end": midnight(1).isoformat()}
    status, first = await h.call("POST", f"/schedules/{sid}/backfill", span)
    assert status == 202, first
    assert (first["total"], first["state"], first["requested_by"]) == (3, "running", "anonymous")
    done = await finished(h, first["id"])
    assert (done["state"], done["fired"], done["skipped"], done["remaining"]) == ("done", 3, 0, 0)
    status, again = await h.call("POST", f"/schedules/{sid}/backfill", span)
    assert status == 202
    repeat = await finished(h, again["id"])
    assert (repeat["fired"], repeat["skipped"]) == (0, 3)
    nights = {fire_id(sid, midnight(d) + dt.timedelta(hours=2, minutes=30)) for d in (4, 3, 2)}

    async def all_published() -> bool:
        return (
            await h.db.fires.count_documents({"_id": {"$in": sorted(nights)}, "state": "published"})
            == 3
        )

    await wait_until(all_published, 20, "the three nights published", 0.1)
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    assert {f: counts[f] for f in nights} == dict.fromkeys(nights, 1)


async def test_a_backfill_goes_on_across_a_leader_kill_firing_each_time_once(
    own_harness: Harness,
) -> None:
    h = own_harness
    for name in ("a", "b", "c"):
        h.start(name)
    first = await h.leader()
    sid = f"{h.prefix}-seconds"
    start, end, backfill = await seconds_backfilled(h, sid, 3000)
    assert backfill["total"] == 3000
    h.signal(first, signal.SIGKILL)
    process = h.replicas[first].process
    assert process is not None
    process.wait(10)
    done = await finished(h, backfill["id"])
    assert done["state"] == "done"
    # Counted from the ledger: a chunk redone by the successor counts each claim once.
    assert (done["fired"], done["skipped"], done["withdrawn"]) == (3000, 0, 0), done
    expected = await every_second_published(h, sid, start, end)
    assert len(expected) == 3000
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    missing = sorted(f for f in expected if counts[f] == 0)
    twice = sorted(f for f in expected if counts[f] > 1)
    assert (missing[:5], twice[:5]) == ([], [])


async def test_a_backfill_a_pause_interrupts_waits_and_fires_every_time_after_the_resume(
    own_harness: Harness,
) -> None:
    """Paused midway, a backfill of 1,200 one-second instants stays running and fires
    nothing more; resumed, it fires the rest: every instant published once, its counts
    exact (on 19ca195 the rest were recorded skipped, the backfill said done with all
    fired, a repeat fired nothing, and each chunk boundary counted one skipped)."""
    h = own_harness
    h.start("a")
    await h.leader()
    sid = f"{h.prefix}-paused"
    start, end, backfill = await seconds_backfilled(h, sid, 1200)
    status, _ = await h.call("POST", f"/schedules/{sid}/pause", {"note": "mid-backfill"})
    assert status == 200
    _, at_pause = await h.call("GET", f"/backfills/{backfill['id']}")

    # Through several of the leader's backfill turns (one at least every 2 s), nothing
    # more is fired (a chunk in flight at most) and the backfill stays running: waited on
    # with a deadline, as a task that ends only if it moves on.
    async def moved_on() -> dict[str, Any] | None:
        _, now_ = await h.call("GET", f"/backfills/{backfill['id']}")
        return (
            now_ if now_["state"] != "running" or now_["fired"] > at_pause["fired"] + 500 else None
        )

    watching = asyncio.create_task(wait_until(moved_on, 30, "the paused backfill", 0.25))
    try:
        await still_pending(watching, 5, "a paused schedule's backfill went on")
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError, AssertionError):
            await watching
    _, held = await h.call("GET", f"/backfills/{backfill['id']}")
    assert held["fired"] < 1200
    assert held["remaining"] == 1200 - held["fired"], held
    status, _ = await h.call("POST", f"/schedules/{sid}/resume")
    assert status == 200
    done = await finished(h, backfill["id"])
    assert (
        done["state"],
        done["fired"],
        done["skipped"],
        done["withdrawn"],
        done["remaining"],
    ) == ("done", 1200, 0, 0, 0), done
    expected = await every_second_published(h, sid, start, end)
    counts, _ = await stream_counts(h.nats.uri, h.prefix)
    assert {f: counts[f] for f in expected} == dict.fromkeys(expected, 1)
    # A repeat finds every time fired: none fired again, each counted skipped.
    status, again = await h.call(
        "POST", f"/schedules/{sid}/backfill", {"start": start.isoformat(), "end": end.isoformat()}
    )
    assert status == 202
    repeat = await finished(h, again["id"])
    assert (repeat["fired"], repeat["skipped"]) == (0, 1200), repeat


def test_a_chunks_counts_come_from_the_ledger_and_a_pause_sends_its_cursor_back() -> None:
    """chunk_outcome: this backfill's claims count as fired (published or on their way) or
    withdrawn (skipped at their publish, with the reason); others' as held; one a pause
    withdrew is released and the cursor goes back to it, what lies past it left for when
    the chunk is worked again."""
    t = [dt.datetime(2030, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=k) for k in range(6)]
    ours = "b1"
    docs = [
        {"_id": "s@0", "nominal_at": t[0], "state": "published", "backfill": ours},
        {"_id": "s@1", "nominal_at": t[1], "state": "published"},  # the trigger's own
        {
            "_id": "s@2",
            "nominal_at": t[2],
            "state": "skipped",
            "backfill": ours,
            "reason": "an overlapping run",
        },
        {
            "_id": "s@3",
            "nominal_at": t[3],
            "state": "skipped",
            "backfill": ours,
            "reason": PAUSED_BEFORE_DUE,
        },
        {"_id": "s@4", "nominal_at": t[4], "state": "published", "backfill": ours},
    ]
    outcome = chunk_outcome(docs, ours, t[5])
    assert (outcome.cursor, outcome.fired, outcome.held, outcome.withdrawn, outcome.released) == (
        t[3],
        1,
        1,
        {"an overlapping run": 1},
        ["s@3"],
    )
    # A claim whose publish failed for good is not counted fired: withdrawn, saying so.
    failed = chunk_outcome([{**docs[0], "state": "failed"}, docs[1]], ours, t[2])
    assert (failed.fired, failed.held, failed.withdrawn) == (0, 1, {PUBLISH_FAILED: 1})
    # Worked again after the resume from t[3]: s@3 fired anew, s@4 counted now, once.
    again = chunk_outcome([{**docs[3], "state": "published", "reason": None}, docs[4]], ours, t[5])
    assert (again.cursor, again.fired, again.held, again.released) == (t[5], 2, 0, [])


async def test_bad_backfills_are_refused_naming_the_field(own_harness: Harness) -> None:
    h = own_harness
    h.start("a")
    sid = f"{h.prefix}-bad"
    await add(h, sid, "* * * * * *")
    now = dt.datetime.now(dt.UTC)
    for body, field in (
        ({"start": now.isoformat(), "end": (now - dt.timedelta(hours=1)).isoformat()}, "end"),
        (
            {
                "start": (now - dt.timedelta(hours=1)).isoformat(),
                "end": (now + dt.timedelta(hours=1)).isoformat(),
            },
            "end",
        ),
        # 200,000 seconds: above the default bound of 100,000 fire times.
        (
            {
                "start": (now - dt.timedelta(seconds=200_001)).isoformat(),
                "end": (now - dt.timedelta(seconds=1)).isoformat(),
            },
            "end",
        ),
        ({"start": "yesterday", "end": now.isoformat()}, "start"),
        # Valid, and as far back as the calendar goes: counted, and far too many.
        ({"start": "0001-01-01T00:00:00Z", "end": now.isoformat()}, "end"),
        (
            {
                "start": (now - dt.timedelta(hours=1)).isoformat(),
                "end": now.isoformat(),
                "overlap": "maybe",
            },
            "overlap",
        ),
    ):
        status, answer = await h.call("POST", f"/schedules/{sid}/backfill", body)
        assert (status, answer["errors"][0]["field"]) == (422, field), (body, answer)
    status, _ = await h.call("GET", "/backfills/nothing")
    assert status == 404
    status, _ = await h.call("DELETE", "/backfills/nothing")
    assert status == 404
    # The largest allowed, worked in chunks and cancelled midway; the CLI names it.
    cli = await run_cli(
        "schedules",
        "--api",
        h.live(),
        "backfill",
        sid,
        "--start",
        (now - dt.timedelta(seconds=100_000)).isoformat(),
        "--end",
        now.replace(microsecond=0).isoformat(),
        "--json",
    )
    assert cli.returncode == 0, cli.stderr
    largest = json.loads(cli.stdout)
    assert largest["total"] <= 100_000
    status, cancelled = await h.call("DELETE", f"/backfills/{largest['id']}")
    assert (status, cancelled["state"]) == (200, "cancelled")
    status, _again = await h.call("DELETE", f"/backfills/{largest['id']}")
    assert status == 409
    bad = await run_cli(
        "schedules",
        "--api",
        h.live(),
        "backfill",
        sid,
        "--start",
        now.isoformat(),
        "--end",
        now.isoformat(),
    )
    assert bad.returncode == 2
    assert "end must be after start" in bad.stderr
