"""A replica whose wall clock is wrong fires on the database's clock (invariant 12).

Each replica runs under libfaketime with its wall clock moved (seconds and minutes, ahead
and behind) and leads its own cluster (a database of its own, one nats-server), beside one
with a correct clock, all in the same run. An every-second cron fires for 20 s; the stream
is read back: every nominal time exactly once, none stored before its nominal time by the
broker's clock, and each cluster's lateness p99 under 100 ms.
"""

from __future__ import annotations

import datetime as dt
import re
import signal
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hascheduler_dev.clocks import moved_clock_env
from pymongo import AsyncMongoClient

from bench.devmongo_bench import pct
from hascheduler.core.triggers import Cron, fire_id, fire_times
from tests.servers import (
    ServerProcess,
    start_nats,
    start_replica,
    with_database,
)
from tests.test_failover import stream_counts
from tests.waiting import wait_until

# Timed against the broker's clock: on an otherwise idle machine (scripts/test).
pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]

SKEWS_S = (0.0, 4.0, -4.0, 600.0, -600.0)
WINDOW_S = 20.0


class Skewed:
    """One replica with its wall clock moved by ``skew_s``, alone in its database."""

    def __init__(self, mongo_uri: str, nats: ServerProcess, skew_s: float) -> None:
        self.skew_s = skew_s
        self.db_name = f"skew_{uuid.uuid4().hex[:8]}"
        self.prefix = uuid.uuid4().hex[:6]
        self.schedule_id = f"{self.prefix}-every-second"
        env = moved_clock_env(skew_s) if skew_s else None
        self.replica_id = f"skewed{skew_s:+g}"
        self.replica = start_replica(
            with_database(mongo_uri, self.db_name), self.replica_id, "--broker", nats.uri, env=env
        )


@pytest.fixture
async def clusters(mongo_uri: str) -> AsyncIterator[tuple[ServerProcess, list[Skewed]]]:
    nats = start_nats()
    skewed: list[Skewed] = []
    try:
        for skew in SKEWS_S:
            skewed.append(Skewed(mongo_uri, nats, skew))
        yield nats, skewed
    finally:
        for s in skewed:
            s.replica.stop(signal.SIGKILL)
        nats.stop()
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
        for s in skewed:
            await client.drop_database(s.db_name)
        await client.close()


async def test_replicas_with_wrong_clocks_never_fire_early_and_stay_on_time(
    clusters: tuple[ServerProcess, list[Skewed]], mongo_uri: str
) -> None:
    nats, skewed = clusters
    async with aiohttp.ClientSession() as http:
        for s in skewed:
            # The replica knows how far off its clock is (to within its error bound).
            async def clock_known(s: Skewed = s) -> dict[str, Any] | None:
                async with http.get(s.replica.uri + "/readyz") as r:
                    body = await r.json()
                clock = body.get("clock") or {}
                return clock if clock.get("offset_s") is not None else None

            clock = await wait_until(clock_known, 20, f"replica {s.skew_s:+g}s to know its offset")
            assert abs(clock["offset_s"] + s.skew_s) <= clock["error_s"] + 0.005, clock
            assert clock["problem"] is None
            async with http.get(s.replica.uri + "/metrics") as r:
                text = await r.text()
            gauge = re.search(r"^hascheduler_clock_offset_seconds (\S+)$", text, re.M)
            assert gauge is not None
            assert abs(float(gauge[1]) + s.skew_s) < 0.05, gauge[0]

            async def leads(s: Skewed = s) -> bool:
                async with http.get(s.replica.uri + "/leader") as r:
                    return bool((await r.json())["holder"] == s.replica_id)

            await wait_until(leads, 20, f"replica {s.skew_s:+g}s to lead")
            body = {
                "id": s.schedule_id,
                "name": s.schedule_id,
                "target": f"audit.{s.prefix}",
                "trigger": {"kind": "cron", "cron": "* * * * * *"},
                "catchup": "all",
            }
            async with http.post(s.replica.uri + "/schedules", json=body) as r:
                assert r.status == 201, await r.text()

    # The window starts once every schedule exists, on the test's (correct) clock.
    start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    end = start + dt.timedelta(seconds=WINDOW_S)

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    try:
        report = {s.skew_s: await lateness_p99(client, nats, s, start, end) for s in skewed}
    finally:
        await client.close()
    for skew, p99 in report.items():
        assert p99 < 0.1, f"replica {skew:+g}s: lateness p99 {p99:.3f}s; all: {report}"


async def lateness_p99(
    client: Any, nats: ServerProcess, s: Skewed, start: dt.datetime, end: dt.datetime
) -> float:
    """Every nominal time of the window in the stream once and never early; the p99 of
    broker store time minus nominal time."""
    nominals = list(fire_times(Cron("* * * * * *", "UTC"), start, until=end))
    expected = {fire_id(s.schedule_id, n): n for n in nominals}

    async def all_published() -> bool:
        n = await client[s.db_name].fires.count_documents(
            {"_id": {"$in": sorted(expected)}, "state": "published"}
        )
        return bool(n == len(expected))

    # Every fire of the window published: the window's length plus the time to publish.
    await wait_until(all_published, WINDOW_S + 20, f"the fires of replica {s.skew_s:+g}s", 0.25)
    counts, stored = await stream_counts(nats.uri, s.prefix)
    assert all(counts[f] == 1 for f in expected), (
        s.skew_s,
        {f: counts[f] for f in expected if counts[f] != 1},
    )
    early = {f: (stored[f] - n).total_seconds() for f, n in expected.items() if stored[f] < n}
    assert not early, f"replica {s.skew_s:+g}s published early: {early}"
    return pct([(stored[f] - n).total_seconds() for f, n in expected.items()], 0.99)
