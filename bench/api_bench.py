"""HTTP API create rate and latency, and a new replica's time to ready, each with a baseline.

    python -m bench.api_bench [--creates 2000] [--concurrency 16] [--ready 10000,100000]

Runs the development MongoDB server and one `hascheduler serve` replica as processes.

- Create: --creates POST /schedules (an every-minute cron schedule each), one at a time and
  then --concurrency in flight, over one keep-alive session. Baseline, same run: raw
  PyMongo insert_one of the same documents, the same way.
- Time to ready: with N schedules stored, from spawning `hascheduler serve` until its
  /readyz answers 200 (process start, imports, change stream opened, every schedule read
  and compiled). Baseline, same run: a fresh Python process that imports PyMongo, connects
  and reads every schedule with a plain find.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from pymongo import AsyncMongoClient

from bench.devmongo_bench import pct
from tests.servers import (
    ServerProcess,
    log_lines,
    start_devmongo,
    start_replica,
    with_database,
)
from tests.waiting import wait_until


def body(i: int, prefix: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}{i:06d}",
        "name": f"bench {i}",
        "target": "bench.api",
        "trigger": {"kind": "cron", "cron": f"{i % 60} * * * *", "timezone": "UTC"},
        "payload": {"n": i},
    }


async def timed(
    calls: list[Callable[[], Awaitable[None]]], concurrency: int
) -> tuple[float, list[float]]:
    """Wall time for all calls with ``concurrency`` in flight, and each call's latency."""
    latencies: list[float] = []
    queue = list(reversed(calls))

    async def worker() -> None:
        while queue:
            call = queue.pop()
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


async def creates(api: str, db: Any, n: int, concurrency: int) -> list[str]:
    rows = []
    async with aiohttp.ClientSession() as http:
        for label, inflight in (("one at a time", 1), (f"{concurrency} in flight", concurrency)):
            prefix = f"c{inflight}-"

            def post(i: int, prefix: str = prefix) -> Callable[[], Awaitable[None]]:
                async def call() -> None:
                    async with http.post(f"{api}/schedules", json=body(i, prefix)) as r:
                        if r.status != 201:
                            raise RuntimeError(f"POST: {r.status} {await r.text()}")

                return call

            def insert(i: int, prefix: str = prefix) -> Callable[[], Awaitable[None]]:
                async def call() -> None:
                    doc = body(i, "raw" + prefix)
                    doc["_id"] = doc.pop("id")
                    await db.raw.insert_one(doc)

                return call

            api_s, api_lat = await timed([post(i) for i in range(n)], inflight)
            raw_s, raw_lat = await timed([insert(i) for i in range(n)], inflight)
            rows.append(
                f"| {label} | {n / api_s:,.0f}/s | {pct(api_lat, 0.5) * 1000:.1f} ms | "
                f"{pct(api_lat, 0.99) * 1000:.1f} ms | {n / raw_s:,.0f}/s | "
                f"{pct(raw_lat, 0.99) * 1000:.1f} ms | {raw_s / api_s:.2f}x | "
                f"{pct(api_lat, 0.99) / pct(raw_lat, 0.99):.2f}x |"
            )
    return rows


RAW_READ = r"""
import sys, time
start = float(sys.argv[2])
from pymongo import MongoClient
client = MongoClient(sys.argv[1])
n = sum(1 for _ in client.get_default_database().schedules.find({}))
print(n, time.time() - start)
"""


async def time_to_ready(uri: str, n: int) -> tuple[float, float, float]:
    db_uri = with_database(uri, f"bench_ready_{n}")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(db_uri, tz_aware=True)
    db = client.get_default_database()
    now = dt.datetime.now(dt.UTC)
    for start in range(0, n, 1000):
        await db.schedules.insert_many(
            [
                {
                    "_id": f"r{i:06d}",
                    "name": f"ready {i}",
                    "target": "bench.ready",
                    "trigger": {"kind": "cron", "cron": f"{i % 60} * * * *", "timezone": "UTC"},
                    "jitter": 0.0,
                    "paused": False,
                    "catchup": "latest",
                    "catchup_window": 3600.0,
                    "payload": {},
                    "labels": {},
                    "revision": 1,
                    "created_at": now,
                    "updated_at": now,
                }
                for i in range(start, min(n, start + 1000))
            ]
        )
    await client.close()
    spawned = time.monotonic()
    replica: ServerProcess = start_replica(db_uri, "ready", "--broker", "log:", startup_s=120)
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(f"{replica.uri}/readyz") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.02)
        ready_s = time.monotonic() - spawned

        def created_read() -> float | None:
            # The replica is the database's first leader: its catch-up reads every
            # schedule's creation time (docs/FIRING.md, becoming leader).
            return next(
                (
                    float(str(line["seconds"]))
                    for line in log_lines(replica)
                    if line.get("event") == "creation_times_read"
                ),
                None,
            )

        first_term_s = await wait_until(created_read, 120, "the first term's catch-up", 0.1)
    finally:
        replica.stop()
    # Blocking is fine here: nothing else runs on this loop meanwhile.
    out = subprocess.run(  # noqa: ASYNC221
        [sys.executable, "-c", RAW_READ, db_uri, str(time.time())],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    count, raw_s = out.stdout.split()
    assert int(count) == n
    return ready_s, float(raw_s), first_term_s


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--creates", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ready", default="10000,100000")
    args = parser.parse_args()
    print(
        f"# API and readiness benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.api_bench {' '.join(sys.argv[1:])}`".rstrip() + "\n")
    mongo = start_devmongo()
    try:
        uri = with_database(mongo.uri, "bench_api")
        # No per-client write limit: it would be what this measures (50/s by default).
        replica = start_replica(uri, "api", "--broker", "log:", "--write-rate", "0")
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
        try:
            rows = await creates(
                replica.uri, client.get_default_database(), args.creates, args.concurrency
            )
        finally:
            replica.stop()
            await client.close()
        print(
            f"POST /schedules, {args.creates:,} creates each way (baseline: raw PyMongo "
            "insert_one of the same documents):\n"
        )
        print(
            "| requests | API rate | API p50 | API p99 | raw insert rate | raw p99 | "
            "API rate / raw rate | p99 ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows) + "\n", flush=True)
        print(
            "| stored schedules | new replica: spawn to ready | raw driver: new process "
            "reads them all (baseline) | ratio | its first term: every creation time "
            "read |"
        )
        print("|---|---|---|---|---|")
        for n in [int(x) for x in args.ready.split(",") if x]:
            ready_s, raw_s, first_term_s = await time_to_ready(mongo.uri, n)
            print(
                f"| {n:,} | {ready_s:.2f} s | {raw_s:.2f} s | {ready_s / raw_s:.2f}x | "
                f"{first_term_s:.2f} s |",
                flush=True,
            )
    finally:
        mongo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
