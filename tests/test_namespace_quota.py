"""A namespace at its fire-rate quota (real nats-server, a real replica leading): its fires
are spread to the quota, late but never lost, while another namespace's fires stay on
time."""

from __future__ import annotations

import datetime as dt
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pymongo import MongoClient

from tests.servers import ServerProcess, start_nats, start_replica, with_database
from tests.waiting import wait_until_sync

QUOTA = 5  # noisy's fires a second
NOISY, QUIET = 30, 5  # schedules firing every second


@pytest.fixture
def replica(mongo_uri: str, tmp_path: Path) -> Iterator[tuple[ServerProcess, Any]]:
    access = tmp_path / "access.yaml"
    access.write_text(yaml.safe_dump({"namespaces": {"noisy": {"max_fires_per_second": QUOTA}}}))
    nats = start_nats()
    db_name = f"quota_{uuid.uuid4().hex[:8]}"
    process = start_replica(
        with_database(mongo_uri, db_name),
        "quota",
        "--broker",
        nats.uri,
        "--write-rate",
        "0",
        "--access-file",
        str(access),
    )
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_uri, tz_aware=True)
    try:
        yield process, client[db_name]
    finally:
        process.stop(signal.SIGKILL)
        nats.stop()
        client.drop_database(db_name)
        client.close()


def test_a_namespace_at_its_quota_does_not_delay_another(
    replica: tuple[ServerProcess, Any],
) -> None:
    process, db = replica
    with httpx.Client(base_url=process.uri) as http:
        wait_until_sync(lambda: http.get("/readyz").status_code == 200, 30, "ready")
        for namespace, count in (("noisy", NOISY), ("quiet", QUIET)):
            response = http.post(
                "/schedules:batch",
                json={
                    "schedules": [
                        {
                            "id": f"{namespace}-{i}",
                            "name": f"{namespace} {i}",
                            "namespace": namespace,
                            "target": f"quota.{namespace}",
                            "trigger": {"kind": "interval", "every": 1},
                        }
                        for i in range(count)
                    ]
                },
            )
            assert response.status_code == 200, response.text
    started = dt.datetime.now(dt.UTC)
    wait_until_sync(
        lambda: (
            db.fires.count_documents({"schedule_id": {"$regex": "^quiet-"}, "state": "published"})
            >= QUIET * 8
        ),
        60,
        "eight seconds of quiet's fires",
    )
    fires = list(db.fires.find({"state": "published", "nominal_at": {"$gte": started}}))
    quiet = [f for f in fires if f["schedule_id"].startswith("quiet-")]
    noisy = [f for f in fires if f["schedule_id"].startswith("noisy-")]

    # Quiet's fires: on time, whatever noisy's backlog.
    late = sorted((f["published_at"] - f["nominal_at"]).total_seconds() for f in quiet)
    assert late[int(len(late) * 0.99) - 1] < 0.5, late[-5:]
    # Noisy's: at most the quota a second (a burst of one second's worth on top), fired
    # later and later, each fire once.
    published = sorted(f["published_at"] for f in noisy)
    for i, at in enumerate(published):
        window = [p for p in published[i : i + 4 * QUOTA] if p < at + dt.timedelta(seconds=1)]
        assert len(window) <= 2 * QUOTA, at
    span = (published[-1] - published[0]).total_seconds()
    assert len(published) <= QUOTA * (span + 2)
    assert len(published) >= QUOTA * span * 0.6
    behind = max((f["published_at"] - f["nominal_at"]).total_seconds() for f in noisy)
    assert behind > 2  # deferred, not dropped: still coming
    assert len({f["_id"] for f in noisy}) == len(noisy)
    metrics = httpx.get(f"{process.uri}/metrics").text
    deferred = [
        line
        for line in metrics.splitlines()
        if line.startswith('hascheduler_quota_deferred_total{namespace="noisy"}')
    ]
    assert deferred
    assert float(deferred[0].split()[-1]) > 0
    assert 'hascheduler_namespace_schedules{namespace="quiet"} 5.0' in metrics
