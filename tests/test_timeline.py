"""The dashboard's timeline: each fire's mark (pure, core/timeline.py) and the /timeline
route's refusals."""

from __future__ import annotations

import datetime as dt
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hascheduler.core.timeline import LATE_MARK_S, SEVERITY, kind_of, lateness_buckets, worst
from tests.servers import ServerProcess, start_replica, with_database

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("fire", "late", "run", "kind"),
    [
        ("published", 0.01, "succeeded", "on_time"),
        ("published", None, None, "on_time"),
        ("published", LATE_MARK_S, "succeeded", "late"),
        ("published", 5.0, "dead", "dead"),  # the worse of the two
        ("published", 0.01, "dead", "dead"),
        ("failed", None, None, "failed"),
        ("skipped", None, None, "skipped"),
        ("published", 0.01, "running", "running"),
        ("published", 0.01, "retrying", "running"),
        ("published", 0.01, "cancelled", "cancelled"),
        ("claimed", None, None, "waiting"),
        ("buffered", None, None, "waiting"),
    ],
)
def test_a_fire_is_the_worst_mark_that_holds(
    fire: str, late: float | None, run: str | None, kind: str
) -> None:
    assert kind_of(fire, late, run) == kind


def test_a_fan_out_fire_is_its_worst_tenant() -> None:
    assert worst(["on_time", "late", "on_time"]) == "late"
    assert worst(["skipped", "dead"]) == "dead"
    assert worst([]) == "on_time"
    assert SEVERITY[0] == "dead"


def test_lateness_is_bucketed_over_the_window() -> None:
    samples = [
        (T0 + dt.timedelta(seconds=s), late)
        for s, late in [
            (0, 0.1),
            (5, 0.3),
            (59, 0.2),
            (60, 2.0),
            (3599, 0.05),
            (3600, 9.0),
            (-1, 9.0),
        ]
    ]
    buckets = lateness_buckets(samples, T0, T0 + dt.timedelta(hours=1), 60)
    assert len(buckets) == 60
    assert (buckets[0].count, buckets[0].p50_s, buckets[0].max_s) == (3, 0.2, 0.3)
    assert (buckets[1].count, buckets[1].p99_s) == (1, 2.0)
    assert buckets[59].count == 1  # the window's end is excluded, and before its start
    assert buckets[30].count == 0
    assert buckets[30].p99_s is None
    assert sum(b.count for b in buckets) == 5


DATABASE = f"tl_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    started = start_replica(with_database(mongo_uri, DATABASE), "tl")
    yield started
    started.stop(signal.SIGKILL)


@pytest.mark.parametrize("hours", ["abc", "0", "0.01", "25", "nan", "inf", "-1", "1e9", ""])
def test_a_window_out_of_bounds_is_refused_naming_hours(replica: ServerProcess, hours: str) -> None:
    answer = httpx.get(replica.uri + "/timeline", params={"hours": hours})
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["field"] == "hours"


def test_the_timeline_of_a_schedule_that_does_not_exist_is_404(replica: ServerProcess) -> None:
    assert httpx.get(replica.uri + "/timeline", params={"schedule": "nobody"}).status_code == 404
    empty = httpx.get(replica.uri + "/timeline", params={"hours": "24"}).json()
    assert empty["schedules"] == []
    assert len(empty["lateness"]) == 60
    assert empty["in_flight"] == []


def test_a_window_of_many_fires_is_bounded(replica: ServerProcess, mongo_uri: str) -> None:
    """Valid but expensive: 25 schedules with 1,000 ledger entries each in the last day
    (one a fan-out of 50 tenants a fire): the timeline reads the first 20 schedules and the
    latest 600 entries of each, says so, and a fan-out fire is one mark."""
    from pymongo import MongoClient

    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    with httpx.Client(base_url=replica.uri) as http:
        for i in range(25):
            made = http.post(
                "/schedules",
                json={
                    "id": f"busy-{i:02d}",
                    "name": "busy",
                    "target": "t.x",
                    "trigger": {"kind": "cron", "cron": "0 3 * * *"},
                },
            )
            assert made.status_code == 201, made.text
    docs = []
    for i in range(25):
        for n in range(1000):
            nominal = now - dt.timedelta(seconds=60 * n + 1)
            late = dt.timedelta(seconds=2 if n % 7 == 0 else 0.01)
            if i == 0:  # the fan-out: 50 tenants at each of 20 nominal times
                nominal = now - dt.timedelta(seconds=60 * (n // 50) + 1)
            docs.append(
                {
                    "_id": f"busy-{i:02d}@{nominal.isoformat()}/{n}",
                    "schedule_id": f"busy-{i:02d}",
                    "nominal_at": nominal,
                    "due_at": nominal,
                    "published_at": nominal + late,
                    "state": "published",
                    "recorded_at": now,
                    **({"tenant": f"t{n}"} if i == 0 else {}),
                }
            )
    with MongoClient[dict[str, Any]](mongo_uri) as client:
        client[DATABASE].fires.insert_many(docs)
    answer = httpx.get(replica.uri + "/timeline", params={"hours": "24"}, timeout=30)
    assert answer.status_code == 200
    body = answer.json()
    assert [s["id"] for s in body["schedules"]] == [f"busy-{i:02d}" for i in range(20)]
    fanned, plain = body["schedules"][0], body["schedules"][1]
    assert fanned["truncated"]
    assert len(fanned["marks"]) == 12  # 600 entries of 50 tenants each nominal time
    assert {m["tenants"] for m in fanned["marks"]} == {50}
    assert plain["truncated"]
    assert len(plain["marks"]) == 600
    assert {m["kind"] for m in plain["marks"]} == {"on_time", "late"}
    assert sum(b["count"] for b in body["lateness"]) == 600 * 20
