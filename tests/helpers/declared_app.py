"""Worker apps that declare the schedules feeding their handlers, for the tests of
``--sync-schedules`` and ``apply --app``. DECLARED_VARIANT=less drops one declaration
(a deploy that removed it)."""

from __future__ import annotations

import os

from hascheduler.worker import Run, WorkerApp

alpha = WorkerApp(name="alpha")


@alpha.schedule(
    id="alpha-nightly", cron="0 2 * * *", timezone="Europe/Paris", payload={"report": "nightly"}
)
@alpha.handler("alpha.nightly")
def nightly(run: Run) -> None:
    pass


@alpha.handler("alpha.poll.*")
def poll(run: Run) -> None:
    pass


alpha.schedules(
    [
        {
            "id": "alpha-poll-eu",
            "name": "poll eu",
            "target": "alpha.poll.eu",
            "trigger": {"kind": "interval", "every": 30},
            "jitter": 5,
        }
    ]
)
if os.environ.get("DECLARED_VARIANT") != "less":
    alpha.schedules(
        [
            {
                "id": "alpha-poll-us",
                "name": "poll us",
                "target": "alpha.poll.us",
                "trigger": {"kind": "interval", "every": 30},
                "jitter": 5,
            }
        ]
    )

beta = WorkerApp(name="beta")


@beta.schedule(id="beta-hourly", cron="0 * * * *")
@beta.handler("beta.hourly")
def hourly(run: Run) -> None:
    pass
