"""Schedules benchmark: mirror load time and memory, and change propagation latency.

    python -m bench.schedules_bench [--sizes 10000,100000] [--creates 300]

Mirror: N schedule documents (a realistic mix: crons from a pool of 60 expressions in
5 zones, intervals with their own anchors, one-off instants) are loaded by a Mirror in a
fresh process from the development server until it is ready. Baseline, in the same run:
plain APScheduler 3 (AsyncIOScheduler, not started) add_job of the same triggers.
Memory is what stays allocated afterwards (tracemalloc, after a collection), per schedule.

Propagation: three `hascheduler serve` replicas; a schedule is created on A and the time
from sending the POST (so API work is included) to "applied" in B's and C's mirrors is
read from each mirror's record.
Baseline: a raw PyMongo insert in this process to a raw change-stream watcher in another.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import subprocess
import sys
import time
from typing import Any

import aiohttp
import bson
from pymongo import AsyncMongoClient

from bench.devmongo_bench import event_latency, pct
from tests.servers import start_devmongo, start_replica, with_database

ZONES = ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo", "Australia/Sydney"]
CRONS = (
    [f"{m} {h} * * *" for m in (0, 15, 30, 45) for h in (1, 6, 12)]
    + [f"*/{s} * * * * *" for s in (5, 10, 15, 20, 30)]
    + [f"0 {h} * * mon-fri" for h in range(8, 18)]
    + [f"{m} * * * *" for m in range(0, 60, 2)]
)


def schedule_documents(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    docs = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.6:
            trigger: dict[str, Any] = {
                "kind": "cron",
                "cron": rng.choice(CRONS[:60]),
                "timezone": rng.choice(ZONES),
            }
        elif kind < 0.9:
            trigger = {
                "kind": "interval",
                "every": float(rng.choice((5, 30, 60, 300, 3600))),
                "start_at": now + dt.timedelta(milliseconds=rng.randrange(3_600_000)),
                "end_at": None,
            }
        else:
            trigger = {"kind": "at", "at": [now + dt.timedelta(seconds=rng.randrange(10**7))]}
        docs.append(
            {
                "_id": f"sched-{i:07d}",
                "name": f"schedule {i}",
                "trigger": trigger,
                "jitter": float(rng.choice((0, 0, 5, 30))),
                "paused": False,
                "catchup": "latest",
                "catchup_window": 3600.0,
                "target": f"jobs.{rng.choice(('a', 'b', 'c'))}",
                "payload": {"job": i, "args": ["x" * 20]},
                "labels": {"tier": "std"},
                "created_at": now,
                "updated_at": now,
                "revision": 1,
            }
        )
    return docs


MEASURE_MIRROR = r"""
import asyncio, gc, json, sys, time, tracemalloc
from pymongo import AsyncMongoClient
from hascheduler.process import gcpolicy, logs
from hascheduler.replica.mirror import Mirror
logs.configure("warning")
gcpolicy.freeze_survivors()  # as `hascheduler serve` does before its mirror loads

async def main(uri, traced):
    client = AsyncMongoClient(uri, tz_aware=True)
    coll = client.get_default_database().schedules
    if traced:
        tracemalloc.start()
    gc.collect()
    start = time.perf_counter()
    mirror = Mirror(coll)
    task = asyncio.create_task(mirror.run())
    await mirror.wait_ready()
    elapsed = time.perf_counter() - start
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] if traced else 0
    print(json.dumps({"seconds": elapsed, "size": mirror.size, "bytes": retained}))
    task.cancel()
    await client.close()

asyncio.run(main(sys.argv[1], sys.argv[2] == "1"))
"""

MEASURE_APSCHEDULER = r"""
import gc, json, sys, time, tracemalloc, datetime as dt
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.triggers.date import DateTrigger
sys.path.insert(0, ".")
from bench.schedules_bench import schedule_documents

def job():
    pass

def build(t):
    if t["kind"] == "cron":
        f = t["cron"].split()
        if len(f) == 5:
            f = ["0"] + f
        return CronTrigger(second=f[0], minute=f[1], hour=f[2], day=f[3], month=f[4],
                           day_of_week=f[5], timezone=t["timezone"])
    if t["kind"] == "interval":
        return IntervalTrigger(seconds=t["every"], start_date=t["start_at"])
    return DateTrigger(run_date=t["at"][0])

n, traced = int(sys.argv[1]), sys.argv[2] == "1"
docs = schedule_documents(n)
specs = [(d["_id"], d["trigger"]) for d in docs]
del docs
scheduler = AsyncIOScheduler(timezone="UTC")
if traced:
    tracemalloc.start()
gc.collect()
start = time.perf_counter()
for sid, t in specs:
    scheduler.add_job(job, build(t), id=sid)
elapsed = time.perf_counter() - start
gc.collect()
retained = tracemalloc.get_traced_memory()[0] if traced else 0
print(json.dumps({"seconds": elapsed, "size": len(scheduler.get_jobs()), "bytes": retained}))
"""


# Baseline of the load: the same projection the mirror reads (replica/mirror.py), drained
# by the raw driver in a fresh process, nothing built from it.
MEASURE_RAW_DRAIN = r"""
import asyncio, json, sys, time
from pymongo import AsyncMongoClient

async def main(uri):
    client = AsyncMongoClient(uri, tz_aware=True)
    coll = client.get_default_database().schedules
    await client.admin.command("ping")
    start = time.perf_counter()
    n = 0
    async for _ in coll.find({}, {"payload": 0, "name": 0, "labels": 0, "created_at": 0,
                                  "updated_at": 0}):
        n += 1
    print(json.dumps({"seconds": time.perf_counter() - start, "size": n}))
    await client.close()

asyncio.run(main(sys.argv[1]))
"""


def bson_bytes(n: int) -> float:
    """The mean BSON size of the same documents the mirror loads (bson.encode)."""
    docs = schedule_documents(n)
    return sum(len(bson.encode(d)) for d in docs) / n


def run_json(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def load(uri: str, n: int) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    coll = client.get_default_database().schedules
    await coll.drop()
    docs = schedule_documents(n)
    for i in range(0, n, 1000):
        await coll.insert_many(docs[i : i + 1000])
    await client.close()


async def propagation(mongo_uri: str, creates: int) -> tuple[list[float], list[float]]:
    uri = with_database(mongo_uri, "propagation")
    # Writes back to back from one client: no per-client limit, so propagation is measured.
    replicas = {name: start_replica(uri, name, "--write-rate", "0") for name in ("a", "b", "c")}
    latencies: list[float] = []
    try:
        async with aiohttp.ClientSession() as http:
            for name, replica in replicas.items():
                for _ in range(200):
                    async with http.get(replica.uri + "/readyz") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError(f"replica {name} never became ready")
            for i in range(creates):
                body = {
                    "id": f"p{i}",
                    "name": "p",
                    "target": "t",
                    "trigger": {"kind": "cron", "cron": "0 0 * * *"},
                }
                sent_at = time.time()
                async with http.post(replicas["a"].uri + "/schedules", json=body) as r:
                    assert r.status == 201, await r.text()
                for name in ("b", "c"):
                    for _ in range(1000):
                        async with http.get(f"{replicas[name].uri}/mirror/p{i}") as r:
                            if r.status == 200:
                                latencies.append((await r.json())["applied_at"] - sent_at)
                                break
                        await asyncio.sleep(0.002)
                    else:
                        raise RuntimeError(f"p{i} never reached {name}")
    finally:
        for replica in replicas.values():
            replica.stop()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    raw = await event_latency(mongo_uri, client, creates)
    await client.close()
    return latencies, raw


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--creates", type=int, default=300)
    parser.add_argument(
        "--million",
        type=int,
        default=1_000_000,
        help="schedules loaded to ready against a raw drain (0: skip)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    server = start_devmongo()
    rows = []
    try:
        for n in sizes:
            uri = with_database(server.uri, f"mirror{n}")
            await load(uri, n)
            timed = run_json(MEASURE_MIRROR, uri, "0")
            traced = run_json(MEASURE_MIRROR, uri, "1")
            assert timed["size"] == n, timed
            base_timed = run_json(MEASURE_APSCHEDULER, str(n), "0")
            base_traced = run_json(MEASURE_APSCHEDULER, str(n), "1")
            rows.append((n, timed, traced, base_timed, base_traced, bson_bytes(n)))
        big = None
        if args.million:
            uri = with_database(server.uri, "mirror_big")
            await load(uri, args.million)
            # Alternated, the best of two each: the development server's own pace varies.
            loads = [
                run_json(code, uri, *extra)
                for _ in range(2)
                for code, extra in ((MEASURE_MIRROR, ["0"]), (MEASURE_RAW_DRAIN, []))
            ]
            assert all(x["size"] == args.million for x in loads), loads
            big = (min(x["seconds"] for x in loads[0::2]), min(x["seconds"] for x in loads[1::2]))
        latencies, raw = await propagation(server.uri, args.creates)
    finally:
        server.stop()

    print(
        f"# schedules benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.schedules_bench {' '.join(sys.argv[1:])}`".rstrip())
    print()
    print(
        "| schedules | mirror: load to ready | mirror: bytes/schedule | "
        "APScheduler add_job (baseline) | APScheduler bytes/job | memory ratio | "
        "BSON bytes/schedule (bson.encode, baseline) | mirror / BSON |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for n, timed, traced, base_timed, base_traced, encoded in rows:
        per, base_per = traced["bytes"] / n, base_traced["bytes"] / n
        print(
            f"| {n:,} | {timed['seconds']:.2f} s | {per:,.0f} | "
            f"{base_timed['seconds']:.2f} s ({n / base_timed['seconds']:,.0f}/s) | "
            f"{base_per:,.0f} | {per / base_per:.2f}x | {encoded:,.0f} | "
            f"{per / encoded:.2f}x |"
        )
        ok = ok and per <= encoded and (n < 100_000 or timed["seconds"] <= 5.0)
    print()
    if big is not None:
        mirror_s, raw_s = big
        print(
            f"{args.million:,} schedules, load to ready: mirror {mirror_s:.2f} s; raw "
            f"find() drain of the same projection in a fresh process (baseline) "
            f"{raw_s:.2f} s; ratio {mirror_s / raw_s:.2f}x (target <= 1.5x)\n"
        )
        ok = ok and mirror_s <= 1.5 * raw_s
    print(
        "propagation, POST sent to A -> applied in B's and C's mirrors "
        f"({len(latencies)} samples): "
        f"p50 {pct(latencies, 0.5) * 1000:.1f} ms, p99 {pct(latencies, 0.99) * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms"
    )
    print(
        f"baseline, raw insert -> raw watcher in another process ({len(raw)} samples): "
        f"p50 {pct(raw, 0.5) * 1000:.1f} ms, p99 {pct(raw, 0.99) * 1000:.1f} ms; "
        f"ratio p50 {pct(latencies, 0.5) / pct(raw, 0.5):.2f}x, "
        f"p99 {pct(latencies, 0.99) / pct(raw, 0.99):.2f}x"
    )
    if not ok:
        print(
            "FAIL: a target was missed (mirror bytes/schedule <= the BSON size, 100k "
            "ready in <= 5 s, the large load within 1.5x of the raw drain)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
