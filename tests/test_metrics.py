"""GET /metrics of a real replica process: leadership, fires, mirror, HTTP."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import ServerProcess, start_replica, with_database
from tests.waiting import wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def replica(mongo_uri: str) -> Iterator[ServerProcess]:
    process = start_replica(
        with_database(mongo_uri, f"metrics_{uuid.uuid4().hex[:8]}"), "m1", "--broker", "log:"
    )
    yield process
    assert process.stop() == 0


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), math.nan)


async def test_metrics_show_leadership_fires_mirror_and_http(replica: ServerProcess) -> None:
    async with aiohttp.ClientSession() as http:

        async def ready() -> bool:
            async with http.get(f"{replica.uri}/readyz") as r:
                return r.status == 200

        # After the mirror's initial load, so that the write below reaches it as an event.
        await wait_until(ready, 20, "the replica to be ready")
        async with http.post(f"{replica.uri}/schedules", json={"name": "x"}) as r:
            assert r.status == 422
        async with http.post(
            f"{replica.uri}/schedules",
            json={
                "id": "tick",
                "name": "tick",
                "target": "metrics.test",
                "trigger": {"kind": "cron", "cron": "* * * * * *"},
            },
        ) as r:
            assert r.status == 201

        async def scraped() -> Samples | None:
            async with http.get(f"{replica.uri}/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                samples = parse(await r.text())
            published = value(samples, "hascheduler_fires_total", state="published")
            return samples if published >= 2 else None

        samples = await wait_until(scraped, 20, "two published fires in /metrics", 0.2)
    assert value(samples, "hascheduler_leader") == 1
    assert value(samples, "hascheduler_term") >= 1
    assert value(samples, "hascheduler_mirror_schedules") == 1
    assert value(samples, "hascheduler_mirror_ready") == 1
    assert value(samples, "hascheduler_fires_total", state="claimed") >= 2
    assert value(samples, "hascheduler_fires_total", state="failed") == 0
    assert value(samples, "hascheduler_lease_renew_seconds_count") >= 1
    assert value(samples, "hascheduler_fire_lateness_seconds_count") >= 2
    # Published at the due time, not before: no observation below zero, and all in 5 s.
    assert value(samples, "hascheduler_fire_lateness_seconds_bucket", le="5.0") == value(
        samples, "hascheduler_fire_lateness_seconds_count"
    )
    assert value(samples, "hascheduler_publish_seconds_count") >= 1
    lag = value(samples, "hascheduler_change_stream_lag_seconds")
    assert 0 <= lag < 60
    assert (
        value(
            samples,
            "hascheduler_http_requests_total",
            route="/schedules",
            method="POST",
            status="201",
        )
        == 1
    )
    assert (
        value(
            samples,
            "hascheduler_http_requests_total",
            route="/schedules",
            method="POST",
            status="422",
        )
        == 1
    )
