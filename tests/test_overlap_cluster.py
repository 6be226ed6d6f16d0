"""Overlap policies with real processes: replicas, nats-server and workers running handlers
longer than their schedules' period. Whatever the policy, the runs ledger is the witness:
under every policy but allow, no two runs of one schedule are ever open together."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ServerProcess
from tests.test_db_elections import step_down
from tests.test_failover import Harness
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


async def start_worker(h: Harness, tmp: Path, name: str, *args: str) -> asyncio.subprocess.Process:
    assert isinstance(h.nats, ServerProcess)
    with open(tmp / f"{name}.log", "wb") as log:  # noqa: ASYNC230 - opened once
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hascheduler.cli",
            "worker",
            "--broker",
            h.nats.uri,
            "--mongodb-uri",
            h.mongo_uri,
            "--app",
            "tests.helpers.record_handler:app",
            "--durable",
            "overlap",
            "--worker-id",
            name,
            *args,
            env={**os.environ, "RECORD_FIRES_TO": str(tmp / "attempts.txt")},
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
    assert worker.stdout is not None
    assert b"consuming" in await asyncio.wait_for(worker.stdout.readline(), 30)
    return worker


async def add(h: Harness, sid: str, target: str, overlap: str, sleep_s: float) -> None:
    any_replica = next(iter(h.replicas))
    body = {
        "id": sid,
        "name": sid,
        "target": target,
        "overlap": overlap,
        "payload": {"sleep": sleep_s},
        "trigger": {"kind": "interval", "every": 1},
    }
    async with h.http.post(h.replicas[any_replica].uri + "/schedules", json=body) as r:
        assert r.status == 201, await r.text()


async def runs_of(h: Harness, sid: str) -> list[dict[str, Any]]:
    return [d async for d in h.db.runs.find({"schedule_id": sid}).sort("nominal_at", 1)]


async def fires_of(h: Harness, sid: str, **query: Any) -> list[dict[str, Any]]:
    return [d async for d in h.db.fires.find({"schedule_id": sid, **query}).sort("nominal_at", 1)]


def assert_one_at_a_time(runs: list[dict[str, Any]], sid: str) -> None:
    """Each run started after the one before it ended (a run taken over after its worker
    died counts from its first start to its end)."""
    ended = [r for r in runs if r.get("finished_at") and r.get("first_started_at")]
    ended.sort(key=lambda r: r["first_started_at"])
    for before, after in itertools.pairwise(ended):
        assert after["first_started_at"] >= before["finished_at"], (
            f"{sid}: {after['_id']} began at {after['first_started_at']} while "
            f"{before['_id']} ran until {before['finished_at']}"
        )


async def settle(h: Harness, sids: list[str], within_s: float, cancel: str | None = None) -> None:
    """Pause the schedules, then wait until nothing of theirs is open or claimed (their
    buffered fires wait for a resume); the last run of ``cancel`` (a schedule whose runs
    never end by themselves) is cancelled."""
    api = h.live()
    for sid in sids:
        async with h.http.post(f"{api}/schedules/{sid}/pause") as r:
            assert r.status == 200

    async def cancelled_last() -> bool:
        waiting = await h.db.fires.count_documents({"schedule_id": cancel, "state": "claimed"})
        if waiting:
            return False
        async for run in h.db.runs.find(
            {"schedule_id": cancel, "state": {"$in": ["pending", "running"]}}
        ):
            async with h.http.post(f"{api}/runs/{run['_id']}/cancel") as r:
                assert r.status in (200, 202, 409), await r.text()
        return True

    if cancel is not None:
        await wait_until(cancelled_last, within_s, "the last run of cancel_other", 0.2)

    async def quiet() -> bool:
        open_runs = await h.db.runs.count_documents(
            {"schedule_id": {"$in": sids}, "state": {"$in": ["pending", "running", "retrying"]}}
        )
        # A paused schedule's buffered fires wait for its resume: claimed ones must go.
        waiting = await h.db.fires.count_documents(
            {"schedule_id": {"$in": sids}, "state": "claimed"}
        )
        return open_runs == 0 and waiting == 0

    await wait_until(quiet, within_s, "every run ended and no fire waiting", 0.2)


async def test_each_policy_on_a_schedule_firing_faster_than_its_runs(
    own_harness: Harness, tmp_path: Path
) -> None:
    h = own_harness
    h.start("a")
    await h.leader()
    worker = await start_worker(h, tmp_path, "w1", "--concurrency", "8")
    p = h.prefix
    await add(h, f"{p}-skip", f"jobs.{p}.skip", "skip", 2.5)
    await add(h, f"{p}-one", f"jobs.{p}.one", "buffer_one", 2.5)
    await add(h, f"{p}-all", f"jobs.{p}.all", "buffer_all", 1.2)
    await add(h, f"{p}-cancel", f"long.{p}.cancel", "cancel_other", 60)
    await add(h, f"{p}-allow", f"jobs.{p}.allow", "allow", 2.5)
    sids = [f"{p}-{s}" for s in ("skip", "one", "all", "cancel", "allow")]

    # Sampled (the most buffer_one ever holds waiting) until every policy has shown what
    # is checked below.
    most_waiting = 0

    async def every_policy_shown() -> bool:
        nonlocal most_waiting
        waiting = await h.db.fires.count_documents({"schedule_id": f"{p}-one", "state": "buffered"})
        most_waiting = max(most_waiting, waiting)
        fires, runs = h.db.fires.count_documents, h.db.runs.count_documents
        return (
            await fires({"schedule_id": f"{p}-skip", "reason": "overlap"}) >= 3
            and await fires({"schedule_id": f"{p}-one", "reason": "overlap"}) >= 1
            and await fires(
                {"schedule_id": f"{p}-one", "state": "published", "buffered_at": {"$exists": True}}
            )
            >= 1
            and await runs({"schedule_id": f"{p}-all"}) >= 6
            and await runs({"schedule_id": f"{p}-cancel", "state": "cancelled"}) >= 2
            and await runs({"schedule_id": f"{p}-allow"}) >= 3
        )

    await wait_until(every_policy_shown, 60, "every policy at work", 0.1)
    await settle(h, sids, 60, cancel=f"{p}-cancel")
    try:
        # skip: the fires met by an open run are skipped, naming it; one run at a time.
        skip_runs = await runs_of(h, f"{p}-skip")
        # (Pausing them at the end skips the fires claimed ahead, with that reason.)
        skipped = await fires_of(h, f"{p}-skip", state="skipped", reason="overlap")
        assert len(skipped) >= 3, skipped
        run_ids = {r["_id"] for r in skip_runs}
        unnamed = [
            (f["_id"], f.get("open_run")) for f in skipped if f.get("open_run") not in run_ids
        ]
        assert not unnamed, unnamed
        assert_one_at_a_time(skip_runs, "skip")
        assert all(r["state"] == "succeeded" for r in skip_runs), skip_runs

        # buffer_one: never more than one waiting; a waiting fire goes once the run ends.
        assert most_waiting == 1
        one_runs = {r["_id"]: r for r in await runs_of(h, f"{p}-one")}
        assert_one_at_a_time(list(one_runs.values()), "buffer_one")
        waited = [f for f in await fires_of(h, f"{p}-one", state="published") if "buffered_at" in f]
        assert waited, "no fire of buffer_one waited"
        for fire in waited:
            blocker = one_runs[fire["open_run"]]
            gap = fire["published_at"] - blocker["finished_at"]
            assert dt.timedelta(0) <= gap < dt.timedelta(seconds=1), (fire["_id"], gap)
        assert await fires_of(h, f"{p}-one", state="skipped", reason="overlap")

        # buffer_all: nothing skipped, every fire run in order, one at a time.
        assert not await fires_of(h, f"{p}-all", state="skipped", reason="overlap")
        all_runs = await runs_of(h, f"{p}-all")
        assert len(all_runs) >= 6
        assert_one_at_a_time(all_runs, "buffer_all")
        starts = [r["first_started_at"] for r in all_runs]
        assert starts == sorted(starts), "buffer_all ran its fires out of order"

        # cancel_other: each run but the last was cancelled, and had ended before the next
        # began.
        cancel_runs = await runs_of(h, f"{p}-cancel")
        assert len(cancel_runs) >= 3
        assert_one_at_a_time(cancel_runs, "cancel_other")
        assert all(r["state"] == "cancelled" for r in cancel_runs), [
            r["state"] for r in cancel_runs
        ]
        assert all(
            r["cancelled_by"] == "overlap policy cancel_other" for r in cancel_runs[:-1]
        )  # the last one, by the test

        # allow: runs overlap (the baseline the others are measured against).
        allow_runs = await runs_of(h, f"{p}-allow")
        allow_runs.sort(key=lambda r: r["first_started_at"])
        assert any(
            b["first_started_at"] < a["finished_at"] for a, b in itertools.pairwise(allow_runs)
        )
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 40)


@pytest.mark.long(16)
async def test_skip_holds_across_a_leader_kill_a_worker_kill_and_a_step_down(
    own_harness: Harness, tmp_path: Path
) -> None:
    h = own_harness
    for name in ("a", "b", "c"):
        h.start(name)
    first = await h.leader()
    workers = {
        name: await start_worker(h, tmp_path, name, "--ack-wait", "3") for name in ("w1", "w2")
    }
    sid = f"{h.prefix}-skip"
    await add(h, sid, f"jobs.{h.prefix}.skip", "skip", 2.5)

    async def running() -> dict[str, Any] | None:
        return await h.db.runs.find_one({"schedule_id": sid, "state": "running"})

    try:
        await wait_until(running, 20, "a first run", 0.05)
        h.signal(first, signal.SIGKILL)

        async def new_leader() -> bool:
            lease = await h.lease()
            return lease.get("holder") not in (None, first) and lease[
                "expires_at"
            ] > dt.datetime.now(dt.UTC)

        await wait_until(new_leader, 30, "a new leader", 0.1)
        run = await wait_until(running, 30, "a run under the new leader", 0.05)
        victim = run["worker_id"]
        workers[victim].kill()
        await workers[victim].wait()

        async def taken_over() -> bool:
            doc = await h.db.runs.find_one({"_id": run["_id"]})
            return bool(doc and doc.get("worker_id") != victim)

        await wait_until(taken_over, 30, "the killed worker's run taken over", 0.1)
        # And the database steps down for longer than the leader's renew deadline.
        await step_down(h.mongo_uri)
        seen = await h.db.fires.count_documents({"schedule_id": sid})

        async def three_more() -> bool:
            return await h.db.fires.count_documents({"schedule_id": sid}) >= seen + 3

        await wait_until(three_more, 20, "three more fires after the takeover", 0.1)
        await settle(h, [sid], 60)
        runs = await runs_of(h, sid)
        assert_one_at_a_time(runs, "skip")
        assert all(r["state"] == "succeeded" for r in runs), [r["state"] for r in runs]
        skipped = await fires_of(h, sid, state="skipped", reason="overlap")
        assert skipped
        published = await fires_of(h, sid, state="published")
        assert {f["_id"] for f in published} == {r["_id"] for r in runs}
    finally:
        for worker in workers.values():
            if worker.returncode is None:
                worker.terminate()
                await asyncio.wait_for(worker.wait(), 40)
