"""Run now and cancel, through the API, with real processes: a replica, nats-server and a
worker (tests/helpers/record_handler.py's app)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
from typing import Any

from pymongo import AsyncMongoClient

from tests.test_cli import run_cli
from tests.test_runs_api import Stack, stack_fixture  # noqa: F401 - the fixture
from tests.waiting import wait_until


async def post(s: Stack, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    async with s.http.post(s.replica.uri + path, json=body, headers=headers) as response:
        return response.status, await response.json()


async def not_firing(s: Stack, target: str, payload: dict[str, Any], **extra: Any) -> str:
    """A schedule that fires only when run now (its one instant is a day away)."""
    at = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    status, body = await post(
        s,
        "/schedules",
        {
            "name": "by hand",
            "target": target,
            "payload": payload,
            "trigger": {"kind": "at", "at": [at.isoformat()]},
            **extra,
        },
    )
    assert status == 201, body
    return str(body["id"])


async def run_state(s: Stack, fire: str, state: str, within_s: float = 30) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        status, body = await s.get(f"/runs/{fire}")
        return body if status == 200 and body["state"] == state else None

    value: dict[str, Any] = await wait_until(reached, within_s, f"run {fire} {state}", 0.05)
    return value


def attempts_of(s: Stack, fire: str) -> int:
    path = s.tmp / "attempts.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if line.split()[0] == fire)


async def test_run_now_once_per_idempotency_key_with_its_own_payload(stack: Stack) -> None:
    await stack.worker()
    sid = await not_firing(stack, "long.now", {"sleep": 60})
    status, first = await post(
        stack,
        f"/schedules/{sid}/trigger",
        {"payload": {"sleep": 0}},
        **{"Idempotency-Key": "deploy-42"},
    )
    assert status == 202, first
    assert first["fire_id"].startswith(f"{sid}@manual-")
    assert first["created"] is True
    status, again = await post(
        stack,
        f"/schedules/{sid}/trigger",
        {"payload": {"sleep": 0}},
        **{"Idempotency-Key": "deploy-42"},
    )
    assert (status, again["fire_id"], again["created"]) == (202, first["fire_id"], False)
    # Its own payload (no sleep) rather than the schedule's (a minute): it succeeds.
    await run_state(stack, first["fire_id"], "succeeded")
    status, fire = await stack.get(first["url"])
    assert status == 200
    assert (fire["state"], fire["manual"], fire["requested_by"]) == ("published", True, "anonymous")
    assert fire["run"]["state"] == "succeeded"
    assert attempts_of(stack, first["fire_id"]) == 1

    # Another key is another fire.
    status, other = await post(
        stack,
        f"/schedules/{sid}/trigger",
        {"payload": {"sleep": 0}},
        **{"Idempotency-Key": "deploy-43"},
    )
    assert status == 202
    assert other["fire_id"] != first["fire_id"]
    await run_state(stack, other["fire_id"], "succeeded")

    # A paused schedule runs now only when forced.
    assert (await post(stack, f"/schedules/{sid}/pause"))[0] == 200
    status, refused = await post(stack, f"/schedules/{sid}/trigger")
    assert status == 409
    assert "force" in refused["title"]
    status, forced = await post(
        stack, f"/schedules/{sid}/trigger", {"force": True, "payload": {"sleep": 0}}
    )
    assert status == 202
    await run_state(stack, forced["fire_id"], "succeeded")


async def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_cli, args[0], "--api", stack.replica.uri, *args[1:])


async def test_cancel_stops_async_and_sync_handlers_and_ends_waiting_runs(stack: Stack) -> None:
    await stack.worker()
    for target in ("long.cancel", "polite.cancel"):
        sid = await not_firing(stack, target, {"sleep": 60})
        # Run now and cancel from the command line, as an operator would.
        fired = await cli(stack, "schedules", "trigger", sid)
        assert fired.returncode == 0, fired.stderr
        fire = fired.stdout.strip()
        assert fire.startswith(f"{sid}@manual-")
        await run_state(stack, fire, "running")
        done = await cli(stack, "runs", "cancel", fire, "--json")
        # The cancel is recorded once the command has answered: from then on, the worker's
        # look every half second (the command's own start-up is not the worker's).
        recorded = dt.datetime.now(dt.UTC)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert (body["state"], body["cancel_requested"]) == ("running", True)
        ended = await run_state(stack, fire, "cancelled", within_s=10)
        took = dt.datetime.fromisoformat(ended["finished_at"]) - recorded
        assert took < dt.timedelta(seconds=3), f"{target}: cancelled {took} after it was asked"
        assert ended["cancelled_by"] == "anonymous"
        assert attempts_of(stack, fire) == 1  # not retried
        again = await cli(stack, "runs", "cancel", fire)
        assert again.returncode == 2
        assert "already ended (cancelled)" in again.stderr

    # A retrying run (as a worker leaves one waiting for its backoff) ends at once.
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(stack.mongo_uri, tz_aware=True)
    try:
        runs = client.get_default_database().runs
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        await runs.insert_one(
            {
                "_id": "waiting@1",
                "schedule_id": "waiting",
                "target": "t",
                "state": "retrying",
                "attempts": 1,
                "next_attempt_at": later,
                "recorded_at": dt.datetime.now(dt.UTC),
            }
        )
        status, body = await post(stack, "/runs/waiting@1/cancel")
        assert (status, body["state"]) == (200, "cancelled")
        stored = await runs.find_one({"_id": "waiting@1"})
        assert stored is not None
        assert "next_attempt_at" not in stored
    finally:
        await client.close()

    status, _ = await post(stack, "/runs/nobody@1/cancel")
    assert status == 404


async def test_a_fire_cancelled_before_any_worker_claims_it_never_runs(stack: Stack) -> None:
    """Published with no worker consuming: the cancel makes a cancelled run, and the
    worker that comes later terminates the message without running it."""
    sid = await not_firing(stack, "jobs.unclaimed", {})
    status, fired = await post(stack, f"/schedules/{sid}/trigger")
    fire = fired["fire_id"]

    async def published() -> bool:
        _, body = await stack.get(f"/fires/{fire}")
        return bool(body.get("state") == "published")

    await wait_until(published, 10, "the fire published", 0.05)
    status, body = await post(stack, f"/runs/{fire}/cancel")
    assert (status, body["state"]) == (200, "cancelled")
    await stack.worker()
    log = stack.tmp / "w0.log"
    await wait_until(
        lambda: "fire_cancelled_dropped" in log.read_text(),
        30,
        "the worker to drop the cancelled fire",
    )
    assert attempts_of(stack, fire) == 0


async def test_bad_run_control_requests_get_a_4xx_naming_the_field(stack: Stack) -> None:
    sid = await not_firing(stack, "jobs.bad", {})
    status, body = await post(
        stack,
        "/schedules",
        {
            "name": "n",
            "target": "t",
            "overlap": "sometimes",
            "trigger": {"kind": "cron", "cron": "@daily"},
        },
    )
    assert status == 422
    assert body["errors"][0]["field"] == "overlap"
    for request, field in (
        ({"overlap": "never"}, "overlap"),
        ({"payload": []}, "payload"),
        ({"payload": {"x": "y" * 70_000}}, "payload"),
        ({"force": "yes"}, "force"),
        ({"when": "now"}, "when"),
    ):
        status, body = await post(stack, f"/schedules/{sid}/trigger", request)
        assert status == 422, (request, body)
        assert body["errors"][0]["field"] == field, (request, body)
    for key in ("has space", "x" * 201, "caf\u00e9"):
        status, body = await post(
            stack,
            f"/schedules/{sid}/trigger",
            **{"Idempotency-Key": key.encode().decode("latin-1")},
        )
        assert (status, body["errors"][0]["field"]) == (422, "Idempotency-Key"), body
    async with stack.http.post(
        f"{stack.replica.uri}/schedules/{sid}/trigger",
        data=b"{",
        headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 400
    status, _ = await post(stack, "/schedules/nobody/trigger")
    assert status == 404
    status, _ = await stack.get("/fires/nobody@manual-x")
    assert status == 404


async def test_a_replay_under_skip_waits_for_the_open_run(stack: Stack) -> None:
    """Replaying a dead run of a `skip` schedule beside its open run is a 409 naming that
    run; once it has ended, the replay goes."""
    await stack.worker()
    sid = await not_firing(stack, "jobs.replay", {"permanent": True}, overlap="skip")
    _, dead = await post(stack, f"/schedules/{sid}/trigger", {})
    await run_state(stack, dead["fire_id"], "dead")
    _, long = await post(stack, f"/schedules/{sid}/trigger", {"payload": {"sleep": 3}})
    await run_state(stack, long["fire_id"], "running")
    status, refused = await post(stack, f"/runs/{dead['fire_id']}/retry")
    assert status == 409, refused
    assert long["fire_id"] in refused["title"]
    _, still = await stack.get(f"/runs/{dead['fire_id']}")
    assert (still["state"], still["replays"]) == ("dead", 0)
    await run_state(stack, long["fire_id"], "succeeded")
    status, replayed = await post(stack, f"/runs/{dead['fire_id']}/retry")
    assert status == 202, replayed
    assert replayed["replays"] == 1
    await run_state(stack, dead["fire_id"], "dead")  # permanent again, its key free again
