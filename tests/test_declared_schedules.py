"""Schedules declared beside their handlers (WorkerApp.schedule / .schedules): applied by
``hascheduler worker --sync-schedules`` and ``hascheduler apply --app``, pruned by the
app's own label, converging when many workers of one app start at once."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from hascheduler.client import Client
from hascheduler.worker import Run, WorkerApp
from hascheduler.worker.app import WorkerConfigError
from tests.conftest import API_WRITE_TOKEN, ApiReplica

pytestmark = [pytest.mark.timeout(180)]


def cli(replica: ApiReplica, *args: str, variant: str = "full") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hascheduler.cli", *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            **os.environ,
            "HASCHEDULER_API": replica.url,
            "HASCHEDULER_TOKEN": API_WRITE_TOKEN,
            "DECLARED_VARIANT": variant,
        },
    )


def revisions(replica: ApiReplica) -> dict[str, int]:
    with Client(replica.url, API_WRITE_TOKEN) as api:
        return {s.id: s.revision for s in api.schedules()}


def test_three_workers_of_one_app_started_together_converge(
    api_replica: ApiReplica, api_nats: Any
) -> None:
    workers = [
        cli(
            api_replica,
            "worker",
            "--broker",
            api_nats.uri,
            "--mongodb-uri",
            api_replica.mongo_uri,
            "--app",
            "tests.helpers.declared_app:alpha",
            "--worker-id",
            f"w{i}",
            "--sync-schedules",
        )
        for i in range(3)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            lines = [worker.stdout.readline() for _ in range(2)]
            assert lines[0].startswith("schedules of alpha: 3 declared"), lines
            assert "consuming" in lines[1], lines
        # Each created exactly once, never rewritten by the others.
        assert revisions(api_replica) == {
            "alpha-nightly": 1,
            "alpha-poll-eu": 1,
            "alpha-poll-us": 1,
        }
        with Client(api_replica.url, API_WRITE_TOKEN) as api:
            nightly = api.get_schedule("alpha-nightly")
            assert nightly.target == "alpha.nightly"
            assert nightly.labels == {"app": "alpha"}
            assert nightly.payload == {"report": "nightly"}
    finally:
        for worker in workers:
            worker.terminate()
            worker.communicate(timeout=60)


def test_a_removed_declaration_is_pruned_and_apps_keep_apart(api_replica: ApiReplica) -> None:
    for app in ("alpha", "beta"):
        done = cli(api_replica, "apply", "--app", f"tests.helpers.declared_app:{app}")
        out, err = done.communicate(timeout=60)
        assert done.returncode == 0, err
    assert set(revisions(api_replica)) == {
        "alpha-nightly",
        "alpha-poll-eu",
        "alpha-poll-us",
        "beta-hourly",
    }
    again = cli(api_replica, "apply", "--app", "tests.helpers.declared_app:alpha")
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert "0 written" in out  # nothing changed: an interval keeps its anchor
    less = cli(api_replica, "apply", "--app", "tests.helpers.declared_app:alpha", variant="less")
    out, err = less.communicate(timeout=60)
    assert less.returncode == 0, err
    assert set(revisions(api_replica)) == {"alpha-nightly", "alpha-poll-eu", "beta-hourly"}


def test_declarations_are_checked_where_they_are_written() -> None:
    app = WorkerApp(name="gamma")

    @app.handler("gamma.*")
    def any_gamma(run: Run) -> None:
        pass

    with pytest.raises(WorkerConfigError, match="name its target"):
        app.schedule(id="g", cron="* * * * *")(any_gamma)
    with pytest.raises(WorkerConfigError, match="one of cron=, every= or at="):
        app.schedule(id="g", cron="* * * * *", every=5)
    app.schedules(
        [
            {
                "id": "g1",
                "name": "g1",
                "target": "gamma.one",
                "trigger": {"kind": "interval", "every": 60},
            }
        ]
    )
    with pytest.raises(WorkerConfigError, match="an id of its own"):
        app.schedules([{"id": "g1"}])
    unnamed = WorkerApp()
    unnamed.schedules([{"id": "u"}])
    with pytest.raises(WorkerConfigError, match="needs a name"):
        unnamed.declarations()
