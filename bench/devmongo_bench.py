"""Development-server storage and change-stream benchmark.

    python -m bench.devmongo_bench [--docs 100000] [--ops 3000] [--events 1000]

Starts ``hascheduler devmongo`` as a subprocess and measures, with PyMongo's async API
over a real socket:
- insert round trips per second into an empty collection and into one holding --docs
  documents (the baseline is the empty collection, measured in the same run: storage must
  not degrade with size, so the ratio must stay within 2x);
- find_one by _id, likewise;
- change-event latency p50/p99 from this process's insert to a watcher in another process;
- server CPU while five monitored clients sit idle.
Prints a Markdown table and the command line that produced it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from pymongo import AsyncMongoClient

from tests.servers import start_devmongo

WATCHER = r"""
import asyncio, json, sys, time
from pymongo import AsyncMongoClient
async def main(uri, count):
    client = AsyncMongoClient(uri)
    lat = []
    async with await client.bench.latency.watch(max_await_time_ms=1000) as stream:
        print("ready", flush=True)
        async for event in stream:
            lat.append(time.time() - event["fullDocument"]["sent_at"])
            if len(lat) == count:
                break
    await client.close()
    print(json.dumps(lat), flush=True)
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def rate(label: str, ops: int, call: Any) -> float:
    start = time.perf_counter()
    for i in range(ops):
        await call(i)
    elapsed = time.perf_counter() - start
    return ops / elapsed


async def storage_rates(client: Any, docs: int, ops: int) -> dict[str, float]:
    db = client.bench
    empty, full = db.empty, db.full
    await empty.drop()
    await full.drop()
    batch = 1000
    load_start = time.perf_counter()
    for start in range(0, docs, batch):
        await full.insert_many([{"_id": i, "payload": "x" * 64, "n": i}
                                for i in range(start, min(start + batch, docs))])
    load_s = time.perf_counter() - load_start
    await empty.insert_one({"_id": -1})
    out = {"load_s": load_s}
    out["insert_empty"] = await rate("insert", ops, lambda i: empty.insert_one({"k": i}))
    out["insert_full"] = await rate("insert", ops, lambda i: full.insert_one({"k": i}))
    out["find_empty"] = await rate("find", ops, lambda i: empty.find_one({"_id": -1}))
    out["find_full"] = await rate("find", ops, lambda i: full.find_one({"_id": (i * 7919) % docs}))
    return out


async def event_latency(uri: str, client: Any, events: int) -> list[float]:
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WATCHER, uri, str(events), stdout=asyncio.subprocess.PIPE)
    assert watcher.stdout is not None
    assert (await asyncio.wait_for(watcher.stdout.readline(), 30)).strip() == b"ready"
    coll = client.bench.latency
    for i in range(events):
        await coll.insert_one({"i": i, "sent_at": time.time()})
        await asyncio.sleep(0.002)
    out, _ = await asyncio.wait_for(watcher.communicate(), 60)
    return [float(x) for x in json.loads(out.decode().strip().splitlines()[-1])]


async def idle_cpu(uri: str, pid: int, seconds: float = 5.0) -> float:
    clients = [AsyncMongoClient(uri) for _ in range(5)]
    for c in clients:
        await c.admin.command("ping")

    def cpu() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before, start = cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    used = cpu() - before
    elapsed = time.monotonic() - start
    for c in clients:
        await c.close()
    return used / elapsed


def pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--events", type=int, default=1000)
    args = parser.parse_args()
    server = start_devmongo()
    try:
        client: Any = AsyncMongoClient(server.uri)
        r = await storage_rates(client, args.docs, args.ops)
        lat = await event_latency(server.uri, client, args.events)
        assert server.pid is not None
        cpu = await idle_cpu(server.uri, server.pid)
        await client.close()
    finally:
        server.stop()
    command = "python -m bench.devmongo_bench " + " ".join(sys.argv[1:])
    print(f"# devmongo benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"command: `{command.strip()}`\n")
    print("| measure | empty collection (baseline) | " f"{args.docs:,} documents | ratio |")
    print("|---|---|---|---|")
    print(f"| insert_one round trips/s | {r['insert_empty']:,.0f} | {r['insert_full']:,.0f} | "
          f"{r['insert_empty'] / r['insert_full']:.2f}x |")
    print(f"| find_one by _id round trips/s | {r['find_empty']:,.0f} | {r['find_full']:,.0f} | "
          f"{r['find_empty'] / r['find_full']:.2f}x |")
    print(f"\nloading {args.docs:,} documents (insert_many, 1000 a batch): {r['load_s']:.1f} s")
    print(f"change-event latency, insert here -> watcher in another process "
          f"({len(lat)} events): p50 {pct(lat, 0.5) * 1000:.2f} ms, "
          f"p99 {pct(lat, 0.99) * 1000:.2f} ms, max {max(lat) * 1000:.2f} ms, "
          f"mean {statistics.mean(lat) * 1000:.2f} ms")
    print(f"server CPU with 5 idle monitored clients: {cpu * 100:.2f} % of one core")
    worst = max(r["insert_empty"] / r["insert_full"], r["find_empty"] / r["find_full"])
    if worst > 2.0:
        print(f"FAIL: a rate degraded {worst:.2f}x with size (limit 2x)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
