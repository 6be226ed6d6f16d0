"""A slow link to MongoDB, through a proxy the test controls (this kernel has no netem).

The leader's link gains 150 ms each way while an every-second cron fires: claims are made
ahead of their due time, so the fires stay on time, none early, none lost. A replica
whose link to MongoDB takes 300 ms each way cannot know the database's clock within the
250 ms tolerance: it never leads, even with the lease free, and says why; a replica with
a fast link takes over instead. The lease history holds throughout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import statistics
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hascheduler_dev.slowlink import SlowLink
from pymongo import AsyncMongoClient

from hascheduler.core.triggers import Cron, fire_id, fire_times
from hascheduler.storage.lease import LeaseTimings
from hascheduler.storage.lease_history import LeaseHistory
from tests.servers import ServerProcess, start_nats, start_replica, with_database
from tests.test_failover import stream_counts
from tests.waiting import wait_until

# The slowed window times lateness against the real clock: on an otherwise idle machine.
pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]

TTL, DEADLINE, INTERVAL = 2.0, 1.4, 0.4
TIMINGS = (
    "--lease-ttl",
    str(TTL),
    "--renew-deadline",
    str(DEADLINE),
    "--renew-interval",
    str(INTERVAL),
)


async def test_a_slow_link_costs_no_fire_and_a_too_slow_one_never_leads(
    mongo_server: ServerProcess, mongo_uri: str
) -> None:
    hosts = mongo_server.uri.split("//", 1)[1].split("/", 1)[0].split("?", 1)[0]
    host, port = hosts.split(",")[0].rsplit(":", 1)
    db_name = f"slow_{uuid.uuid4().hex[:8]}"
    prefix = uuid.uuid4().hex[:6]
    nats = start_nats()
    replicas: list[ServerProcess] = []
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[db_name]
    try:
        async with (
            SlowLink(host, int(port)) as fast,
            SlowLink(host, int(port), delay_s=0.3) as slow,
            LeaseHistory(db) as history,
            aiohttp.ClientSession() as http,
        ):

            def through(link: SlowLink) -> str:
                # One member, reached only through the proxy (no discovery around it).
                return f"mongodb://127.0.0.1:{link.port}/{db_name}?directConnection=true"

            # Started from a thread: the proxies run on this event loop.
            a = await asyncio.to_thread(
                start_replica, through(fast), "a", "--broker", nats.uri, *TIMINGS
            )
            replicas.append(a)

            async def holder() -> str | None:
                doc = await db.leases.find_one({})
                live = doc is not None and doc["expires_at"] > dt.datetime.now(dt.UTC)
                return str(doc["holder"]) if live and doc is not None else None

            assert await wait_until(holder, 20, "a to lead") == "a"
            sid = f"{prefix}-every-second"
            body = {
                "id": sid,
                "name": sid,
                "target": f"audit.{prefix}",
                "catchup": "all",
                "trigger": {"kind": "cron", "cron": "* * * * * *"},
            }
            async with http.post(a.uri + "/schedules", json=body) as r:
                assert r.status == 201, await r.text()

            fast.delay_s = 0.15  # the leader's link: 300 ms round trips from now on
            # The window opens once the claims made before the link slowed (1.5 s ahead of
            # their fires) are done: its fires are all claimed over the slow link.
            start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
            slowed_until = start + dt.timedelta(seconds=8)

            b = await asyncio.to_thread(
                start_replica, through(slow), "b", "--broker", nats.uri, *TIMINGS, startup_s=60
            )
            replicas.append(b)

            async def unfit() -> str | None:
                async with http.get(b.uri + "/readyz") as r:
                    return (await r.json()).get("unfit_to_lead")  # type: ignore[no-any-return]

            reason = await wait_until(unfit, 30, "b to say why it may not lead")
            assert "tolerance" in reason, reason
            await wait_until(
                lambda: dt.datetime.now(dt.UTC) > slowed_until + dt.timedelta(seconds=1),
                30,
                "the slowed window to pass",
            )
            window = [
                fire_id(sid, n)
                for n in fire_times(Cron("* * * * * *", "UTC"), start, until=slowed_until)
            ]

            async def window_published() -> bool:
                n = await db.fires.count_documents({"_id": {"$in": window}, "state": "published"})
                return bool(n == len(window))

            # Each publish is marked over the slow link (300 ms a round trip): wait for the
            # window's last marks before a goes, so that a's own publishes are measured.
            await wait_until(window_published, 10, "a to have published the whole window")

            a.stop(signal.SIGKILL)  # the lease frees in a ttl: b may not take it
            lease = await db.leases.find_one({})
            assert lease is not None
            expired = lease["expires_at"] + dt.timedelta(seconds=2 * INTERVAL)
            await wait_until(lambda: dt.datetime.now(dt.UTC) > expired, 10, "the lease to expire")
            assert await holder() is None
            c = await asyncio.to_thread(
                start_replica,
                with_database(mongo_uri, db_name),
                "c",
                "--broker",
                nats.uri,
                *TIMINGS,
            )
            replicas.append(c)
            assert await wait_until(holder, 20, "c to take over") == "c"
            end = dt.datetime.now(dt.UTC)
            expected = {
                fire_id(sid, n): n for n in fire_times(Cron("* * * * * *", "UTC"), start, until=end)
            }

            async def published() -> bool:
                n = await db.fires.count_documents(
                    {"_id": {"$in": sorted(expected)}, "state": "published"}
                )
                return bool(n == len(expected))

            await wait_until(published, 30, "every fire published (c catching up)")
            await history.settle()
        counts, stored = await stream_counts(nats.uri, prefix)
        assert all(counts[f] == 1 for f in expected), {f: counts[f] for f in expected}
        assert not [f for f, n in expected.items() if stored[f] < n], "a fire went out early"
        slowed = sorted(
            (stored[f] - n).total_seconds() for f, n in expected.items() if n < slowed_until
        )
        # Claims go 1.5 s ahead of their fires, so 300 ms round trips cost nothing as a
        # rule; a fenced write timing out (the leader stops firing and leads again) makes
        # a fire late by at most about a second, never lost (docs/RELIABILITY.md).
        assert statistics.median(slowed) < 0.05, f"lateness over the slow link: {slowed}"
        assert max(slowed) < 1.5, f"lateness over the slow link: {slowed}"
        # Each fenced write is one round trip (the reads that decide it go before it), the
        # pool opens the connections a slowed link needs at once, and the renewals have a
        # client of their own: a keeps its lead over the slowed link.
        assert a.log_path is not None
        log = await asyncio.to_thread(Path(a.log_path).read_text)
        stops = [line for line in log.splitlines() if '"stopped_firing"' in line]
        assert stops == [], stops
        report = history.check(LeaseTimings(TTL, DEADLINE, INTERVAL))
        assert report.ok, report.as_dict()
        assert {t.holder for t in history.terms.values()} == {"a", "c"}
    finally:
        for replica in replicas:
            replica.stop(signal.SIGKILL)
        nats.stop()
        await client.drop_database(db_name)
        await client.close()
