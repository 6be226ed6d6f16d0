"""A schedule's health: judged from its ledgers (core/health.py, a table of cases), read
through the API, the client, the CLI and /metrics of real replicas with a real worker."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hascheduler.client import Client
from hascheduler.core import triggers
from hascheduler.core.health import Judged, LastFire, LastRun, assess
from hascheduler.process.metrics import Metrics
from tests.servers import ServerProcess, start_cli, start_nats, start_replica, with_database
from tests.waiting import wait_until_sync

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def judged(**changes: Any) -> Judged:
    fields: dict[str, Any] = {
        "schedule_id": "s",
        "namespace": "default",
        "trigger": triggers.Interval(60.0, NOW - dt.timedelta(days=1), None),
        "jitter": 0.0,
        "paused": False,
        "completed": False,
        "created_at": NOW - dt.timedelta(days=1),
        "changed_at": NOW - dt.timedelta(days=1),
        "success_within": None,
    }
    return Judged(**{**fields, **changes})


def fire(minutes_ago: float) -> LastFire:
    at = NOW - dt.timedelta(minutes=minutes_ago)
    return LastFire(fire_id=f"s@{at.isoformat()}", nominal_at=at, state="published")


def run(state: str, minutes_ago: float = 1) -> LastRun:
    return LastRun(
        id=f"s@{state}-{minutes_ago}",
        state=state,
        finished_at=NOW - dt.timedelta(minutes=minutes_ago),
    )


def test_a_schedule_firing_on_time_is_ok() -> None:
    health = assess(judged(), fire(0.5), [run("succeeded")], NOW - dt.timedelta(minutes=1), NOW)
    assert (health.status, health.late, health.overdue_since) == ("ok", False, None)
    assert health.last_run is not None
    assert health.last_run.state == "succeeded"


def test_a_missing_fire_past_the_grace_is_late_from_its_due_time() -> None:
    # Every minute on the grid; the last fire 3 minutes ago: the one after it is missing.
    health = assess(judged(), fire(3), [], None, NOW, late_after_s=60)
    assert health.status == "late"
    assert health.overdue_since == NOW - dt.timedelta(minutes=2)
    # Within the grace (and its jitter) it is not late yet.
    assert not assess(judged(jitter=30.0), fire(2), [], None, NOW, late_after_s=60).late
    assert not assess(judged(), fire(2), [], None, NOW, late_after_s=90).late


def test_nothing_is_owed_before_the_last_change_nor_while_paused_or_completed() -> None:
    resumed = judged(changed_at=NOW - dt.timedelta(seconds=30))
    assert not assess(resumed, fire(600), [], None, NOW).late
    assert assess(judged(paused=True), fire(600), [], None, NOW).status == "paused"
    assert assess(judged(completed=True), fire(600), [], None, NOW).status == "completed"
    assert not assess(judged(paused=True), fire(600), [], None, NOW).late


def test_consecutive_failures_count_dead_runs_since_the_last_success() -> None:
    ended = [
        run("dead", 1),
        run("cancelled", 2),
        run("dead", 3),
        run("succeeded", 4),
        run("dead", 5),
    ]
    health = assess(judged(), fire(0.5), ended, NOW - dt.timedelta(minutes=4), NOW)
    assert (health.status, health.consecutive_failures) == ("failing", 2)
    assert (
        assess(
            judged(), fire(0.5), [run("succeeded"), run("dead", 2)], None, NOW
        ).consecutive_failures
        == 0
    )


@pytest.mark.parametrize(("success_minutes_ago", "met"), [(None, True), (30, True), (61, False)])
def test_an_objective_is_met_while_the_last_success_is_recent_enough(
    success_minutes_ago: int | None, met: bool
) -> None:
    # Created 50 minutes ago: before any success, the hour counts from the creation.
    schedule = judged(success_within=3600.0, created_at=NOW - dt.timedelta(minutes=50))
    last = None if success_minutes_ago is None else NOW - dt.timedelta(minutes=success_minutes_ago)
    health = assess(schedule, fire(0.5), [], last, NOW)
    assert health.objective_met is met
    assert health.status == ("ok" if met else "objective_missed")
    assert health.success_deadline == (last or schedule.created_at) + dt.timedelta(hours=1)
    assert assess(judged(), fire(0.5), [], None, NOW).objective_met is None


@pytest.mark.parametrize("within", ["PT0S", 0, -5, "P1Y", 401 * 86400, "soon", "PT"])
def test_a_bad_objective_is_refused_naming_the_field(within: Any) -> None:
    from pydantic import ValidationError

    from hascheduler.core.models import ScheduleIn

    with pytest.raises(ValidationError) as refused:
        ScheduleIn.model_validate(
            {
                "name": "n",
                "target": "t",
                "trigger": {"kind": "interval", "every": 60},
                "expect": {"success_within": within},
            }
        )
    assert refused.value.errors()[0]["loc"][:2] == ("expect", "success_within")


@pytest.fixture(name="late_replica")
def late_replica_fixture(mongo_uri: str) -> Iterator[ServerProcess]:
    """A replica that never leads (no clock is that precise), so nothing fires."""
    uri = with_database(mongo_uri, f"t_{uuid.uuid4().hex[:12]}")
    replica = start_replica(uri, "r-unfit", "--clock-tolerance", "0.000001", "--late-after", "1")
    yield replica
    replica.stop()


def test_a_schedule_nobody_fires_is_late_from_its_first_due_time(
    late_replica: ServerProcess,
) -> None:
    with Client(late_replica.uri) as api:
        created = api.create_schedule(
            {
                "name": "nobody fires me",
                "target": "jobs.late",
                "trigger": {"kind": "interval", "every": 1},
            }
        )
        start = created.trigger.start_at
        assert start is not None  # an interval is anchored where it was written
        health = wait_until_sync(
            lambda: h if (h := api.health(created.id)).late else None,
            20,
            "the schedule to be late",
        )
    assert health.status == "late"
    assert health.last_fire is None
    assert health.overdue_since is not None
    assert created.updated_at < health.overdue_since <= created.updated_at + dt.timedelta(seconds=1)
    since_start = (health.overdue_since - start).total_seconds()
    assert abs(since_start - round(since_start)) < 1e-3  # a time of its own grid
    with httpx.Client(base_url=late_replica.uri) as http:
        assert http.get("/schedules/no-such/health").status_code == 404
        # A run now is not a fire of its trigger: the schedule stays late, its last fire none.
        assert http.post(f"/schedules/{created.id}/trigger").status_code == 202
        again = http.get(f"/schedules/{created.id}/health").json()
        assert (again["status"], again["last_fire"]) == ("late", None)
        refused = http.get("/schedules", params={"health": "maybe"})
        assert refused.status_code == 422
        assert refused.json()["errors"][0]["field"] == "health"


def test_the_health_of_a_full_page(late_replica: ServerProcess) -> None:
    """The most a list asks for at once (500 schedules, three reads each) answers whole."""
    with httpx.Client(base_url=late_replica.uri, timeout=60) as http:
        batch = {
            "schedules": [
                {
                    "id": f"page-{i:03}",
                    "name": "p",
                    "target": "jobs.page",
                    "trigger": {"kind": "interval", "every": 3600},
                }
                for i in range(500)
            ]
        }
        assert http.post("/schedules:batch", json=batch).status_code == 200
        page = http.get("/schedules", params={"health": "true", "limit": "500"}).json()
    assert len(page["items"]) == 500
    assert {h["status"] for h in page["health"].values()} == {"ok"}
    assert sorted(page["health"]) == [s["id"] for s in page["items"]]


def test_series_of_schedules_no_longer_judged_are_removed() -> None:
    metrics = Metrics()
    with_objective = judged(success_within=3600.0)
    first = [
        assess(with_objective, fire(0.5), [run("dead")], None, NOW),
        assess(judged(schedule_id="t", success_within=60.0), fire(0.5), [], None, NOW),
    ]
    metrics.health_seen(first)
    text = metrics.render().decode()
    assert 'hascheduler_schedule_consecutive_failures{namespace="default",schedule="s"} 1.0' in text
    assert (
        'hascheduler_schedule_last_success_timestamp_seconds{namespace="default",'
        'schedule="t"} NaN' in text
    )
    metrics.health_seen(first[:1])
    assert 'schedule="t"' not in metrics.render().decode()


def test_an_objective_written_either_way_is_one_declaration() -> None:
    """apply compares what the API would store: "PT2H" and 7200 are no change."""
    from hascheduler.client.apply import _normalised
    from hascheduler.core.models import ScheduleFields

    base = {"name": "n", "target": "t", "trigger": {"kind": "cron", "cron": "0 * * * *"}}
    written = ScheduleFields.model_validate({**base, "expect": {"success_within": "PT2H"}})
    stored = ScheduleFields.model_validate({**base, "expect": {"success_within": 7200}})
    assert _normalised(written) == _normalised(stored)


@pytest.fixture(name="working")
def working_fixture(mongo_uri: str, tmp_path: Path) -> Iterator[tuple[ServerProcess, str]]:
    nats_server = start_nats()
    uri = with_database(mongo_uri, f"t_{uuid.uuid4().hex[:12]}")
    replica = start_replica(uri, "r1", "--broker", nats_server.uri)
    worker = start_cli(
        [
            "worker",
            "--broker",
            nats_server.uri,
            "--mongodb-uri",
            uri,
            "--app",
            "tests.helpers.record_handler:app",
            "--durable",
            "health",
        ],
        "worker ",
        30,
        env={"RECORD_FIRES_TO": str(tmp_path / "a.txt")},
    )
    yield replica, uri
    worker.stop()
    replica.stop()
    nats_server.stop()


def test_health_through_the_api_client_cli_and_metrics(working: tuple[ServerProcess, str]) -> None:
    replica, _ = working
    every_second = {"kind": "interval", "every": 1}
    with Client(replica.uri) as api:
        failing = api.create_schedule(
            {
                "name": "always fails",
                "target": "jobs.fail",
                "trigger": every_second,
                "payload": {"permanent": True},
                "expect": {"success_within": "PT1H"},
            }
        )
        fine = api.create_schedule(
            {
                "name": "always works",
                "target": "jobs.fine",
                "trigger": every_second,
                "expect": {"success_within": 3600},
            }
        )
        quiet = api.create_schedule(
            {"name": "no objective", "target": "jobs.quiet", "trigger": every_second}
        )
        assert failing.expect is not None
        assert failing.expect.success_within == 3600.0

        down = wait_until_sync(
            lambda: h if (h := api.health(failing.id)).consecutive_failures >= 2 else None,
            40,
            "two dead runs in a row",
        )
        assert down.status == "failing"
        assert down.last_success_at is None
        assert down.objective_met is True
        assert down.last_run is not None
        assert down.last_run.state == "dead"
        assert down.last_run.last_error == "PermanentFailure: this account no longer exists"
        up = wait_until_sync(
            lambda: h if (h := api.health(fine.id)).last_success_at else None, 40, "a success"
        )
        assert (up.status, up.consecutive_failures, up.late) == ("ok", 0, False)
        assert up.last_fire is not None
        assert up.last_fire.state in {"claimed", "published"}

        page = httpx.get(f"{replica.uri}/schedules", params={"health": "true"}).json()
        assert set(page["health"]) == {failing.id, fine.id, quiet.id}
        assert page["health"][failing.id]["status"] == "failing"
        assert httpx.get(f"{replica.uri}/schedules").json()["health"] is None

    def metrics() -> str | None:
        text = httpx.get(f"{replica.uri}/metrics").text
        failures = re.search(
            r'hascheduler_schedule_consecutive_failures\{namespace="default",'
            rf'schedule="{failing.id}"\}} (\S+)',
            text,
        )
        success = re.search(
            r"hascheduler_schedule_last_success_timestamp_seconds\{namespace="
            rf'"default",schedule="{fine.id}"\}} (\S+)',
            text,
        )
        if failures and success and float(failures[1]) >= 2 and success[1] != "NaN":
            return text
        return None

    text = wait_until_sync(metrics, 40, "the per-schedule metrics")
    assert quiet.id not in text  # only the schedules that declare an objective
    assert re.search(
        rf"hascheduler_schedule_success_deadline_timestamp_seconds\{{namespace="
        rf'"default",schedule="{failing.id}"\}} ',
        text,
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", "schedules", *args, "--api", replica.uri],
            capture_output=True,
            text=True,
            timeout=30,
        )

    shown = cli("health", failing.id)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"status\s+failing \(\d+\)", shown.stdout)
    assert "a success every 3600 s: met" in shown.stdout
    listed = cli("list", "--health")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[-1] == "HEALTH"
    assert any(r.startswith(fine.id) and r.rstrip().endswith("ok") for r in rows)
    assert cli("health", "no-such-schedule").returncode == 2
    refused = cli(
        "add", "--name", "n", "--target", "jobs.x", "--every", "60", "--success-within", "soon"
    )
    assert refused.returncode == 2
    assert "expect" in refused.stderr
