"""Bounded trigger work (invariant 8, docs/ARCHITECTURE.md), against a real cluster:
thousands of distinct rare, impossible and expensive cron expressions written and previewed
while a schedule fires every second. The second keeps firing, each time exactly once and on
time, and leadership never changes: no trigger work held a replica's event loop past a
lease renewal."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hascheduler.core.triggers import fire_id
from tests.test_failover import Harness
from tests.waiting import wait_until

# The lease and the loop lag are timed: on an otherwise idle machine (scripts/test).
pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]

RARE = [
    "{s} {m} {h} 29 2 *",
    "{s} {m} {h} * 2 mon#5",
    "{s} {m} {h} L 2 5L",
    "{s} {m} {h} 31W 2 *",
    "{s} {m} {h} 29 2 1#5",
    "{s} {m} {h} 30 1/12 sat#5",
    "{s} {m} {h} LW 2 0L",
]
IMPOSSIBLE = ["{s} {m} {h} 30 2 *", "{s} {m} {h} 31 4,6,9,11 *", "{s} {m} {h} 31 2,4 *"]
# Valid and as long as the parser takes: every value spelled out.
EXPENSIVE = " ".join(
    [
        ",".join(str(i) for i in range(0, 60, 2)),
        ",".join(str(i) for i in range(1, 60, 2)),
        "*",
        "29",
        "2",
        "mon#5",
    ]
)


def expressions(pattern: str, count: int, rng: random.Random) -> list[str]:
    seen: set[str] = set()
    while len(seen) < count:
        seen.add(pattern.format(s=rng.randrange(60), m=rng.randrange(60), h=rng.randrange(24)))
    return sorted(seen)


async def test_thousands_of_rare_and_adversarial_crons_never_starve_the_lease(
    own_harness: Harness,
) -> None:
    h = own_harness
    for name in ("a", "b"):
        # The local cluster's lease timings (hascheduler dev), and no per-client write limit:
        # one client writes as fast as it can.
        h.start(
            name,
            "--write-rate",
            "0",
            "--lease-ttl",
            "4",
            "--renew-deadline",
            "3",
            "--renew-interval",
            "1",
        )
    leader = await h.leader()
    term = (await h.lease())["term"]
    uris = [r.uri for r in h.replicas.values()]
    every_second = f"{h.prefix}-every-second"
    async with h.http.post(
        uris[0] + "/schedules",
        json={
            "id": every_second,
            "name": "every second",
            "target": f"audit.{h.prefix}",
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
            "catchup": "all",
        },
    ) as r:
        assert r.status == 201, await r.text()

    rng = random.Random(14)
    rare = [e for p in RARE for e in expressions(p, 200, rng)]  # 1,400 distinct
    impossible = [e for p in IMPOSSIBLE for e in expressions(p, 100, rng)]
    statuses: Counter[int] = Counter()
    refusals: list[dict[str, Any]] = []
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for i, expr in enumerate([*rare, *impossible, EXPENSIVE]):
        queue.put_nowait((f"{h.prefix}-rare-{i}", expr))

    async def writer(uri: str) -> None:
        while not queue.empty():
            sid, expr = queue.get_nowait()
            body = {
                "id": sid,
                "name": sid,
                "target": f"rare.{h.prefix}",
                "trigger": {"kind": "cron", "cron": expr, "timezone": "Europe/Paris"},
            }
            async with h.http.post(uri + "/schedules", json=body) as r:
                statuses[r.status] += 1
                if r.status == 422:
                    refusals.append(await r.json())
                elif r.status == 201:
                    # Previews of a rare schedule walk decades per time asked for; some ask
                    # for as many as the API gives.
                    count = 1000 if sid.endswith("7") else 20
                    async with h.http.get(f"{uri}/schedules/{sid}/next?count={count}") as p:
                        assert p.status == 200, await p.text()

    window_start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    await asyncio.gather(*(writer(uris[i % 2]) for i in range(16)))
    window_end = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    assert statuses == {201: len(rare) + 1, 422: len(impossible)}
    assert all(
        r["errors"][0]["field"] == "trigger.cron" and "can never fire" in r["errors"][0]["message"]
        for r in refusals
    )

    # Both mirrors hold every schedule written.
    async def mirrored() -> bool:
        sizes = [(await h.get(name, "/readyz"))["size"] for name in h.replicas]
        return all(size == len(rare) + 2 for size in sizes)

    await wait_until(mirrored, 60, "every mirror to hold every schedule")

    lease = await h.lease()
    assert (lease["holder"], lease["term"]) == (leader, term), "leadership changed"
    for replica in h.replicas.values():  # nor did the leader stop and take it back
        assert replica.log_path is not None
        assert "stopped_firing" not in Path(replica.log_path).read_text()  # noqa: ASYNC240
    nominals = {
        fire_id(every_second, window_start.replace(microsecond=0) + dt.timedelta(seconds=k))
        for k in range(1, int((window_end - window_start).total_seconds()))
    }
    assert len(nominals) >= 5, "the writes took too little time to prove anything"

    async def all_published() -> bool:
        found = await h.db.fires.count_documents(
            {"_id": {"$in": sorted(nominals)}, "state": "published"}
        )
        return found == len(nominals)

    await wait_until(all_published, 15, "every second of the window to be published")
    lateness = [
        (d["published_at"] - d["due_at"]).total_seconds()
        async for d in h.db.fires.find({"_id": {"$in": sorted(nominals)}})
    ]
    # On time: no fire waited as long as the renew deadline, which is what a held loop
    # would cost (the lease lost with it). Typically well under a second.
    assert max(lateness) < 3.0, f"a fire was {max(lateness):.2f} s late: {lateness}"
    # Exactly once: the fire ledger's unique id, and the stream's deduplication checked
    # by the failover tests; here nothing was republished either.
    attempts = [
        d.get("attempts") async for d in h.db.fires.find({"_id": {"$in": sorted(nominals)}})
    ]
    assert set(attempts) == {1}
