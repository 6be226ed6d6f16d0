"""Development-server storage and change-stream benchmark.

    python -m bench.devmongo_bench [--docs 100000] [--ops 3000] [--events 1000]

Starts ``hascheduler devmongo`` as a subprocess and measures, with PyMongo's async API
over a real socket:
- insert round trips per second into an empty collection and into one holding --docs
  documents (the baseline is the empty collection, measured in the same run: storage must
  not degrade with size, so the ratio must stay within 2x);
- find_one by _id, likewise;
- change-event latency p50/p99 from this process's insert to a watcher in another process;
- server CPU while five monitored clients sit idle;
- the server's CPU per fire for the firing path's ledger writes (the leader's claim, its
  publish mark, an overlap policy's run reservation, the run's end), with the ledgers' own
  indexes, their ordered ones built as the leader's range scans build them, against
  plain inserts of as many claim documents into a collection with only ``_id`` (baseline,
  same run); and the same writes on a second server running its modules from their sources
  (``--from-sources``) against the compiled build the first runs
  (hascheduler_dev/devmongo/native.py);
- the server's CPU per claim whose fire is in the ledger already (a new leader meeting its
  predecessor's fires), inserted and refused as a duplicate, against read first
  (``Ledger.claimed`` before the claim, baseline, same run).
Prints a Markdown table and the command line that produced it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from pymongo import AsyncMongoClient

from hascheduler.core.claims import Claim
from hascheduler.storage.fire_records import claim_record
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger
from tests.servers import devmongo_compiled, start_devmongo

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
        await full.insert_many(
            [
                {"_id": i, "payload": "x" * 64, "n": i}
                for i in range(start, min(start + batch, docs))
            ]
        )
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
        sys.executable, "-c", WATCHER, uri, str(events), stdout=asyncio.subprocess.PIPE
    )
    assert watcher.stdout is not None
    assert (await asyncio.wait_for(watcher.stdout.readline(), 30)).strip() == b"ready"
    coll = client.bench.latency
    for i in range(events):
        await coll.insert_one({"i": i, "sent_at": time.time()})
        await asyncio.sleep(0.002)
    out, _ = await asyncio.wait_for(watcher.communicate(), 60)
    return [float(x) for x in json.loads(out.decode().strip().splitlines()[-1])]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time a process has used so far, all its threads, dead ones too.

    Read from the process's CPU-time clock (Linux encodes another process's as
    ``(~pid << 3) | 2``, what clock_getcpuclockid(3) returns), to the nanosecond: /proc's
    tick count moves in 10 ms steps, coarser than the quick run's whole ledger round."""
    assert pid is not None
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu(uri: str, pid: int, seconds: float = 5.0) -> float:
    clients: list[AsyncMongoClient[dict[str, Any]]] = [AsyncMongoClient(uri) for _ in range(5)]
    for c in clients:
        await c.admin.command("ping")

    before, start = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    used = cpu_seconds(pid) - before
    elapsed = time.monotonic() - start
    for c in clients:
        await c.close()
    return used / elapsed


CLAIMED_AGAIN = ("claim met again, inserted", "claim met again, read first")
LEDGER_WRITES = ("claim", "publish mark", "run reserved", "run ended")


async def ledger_cost(client: Any, pid: int, fires: int, rounds: int) -> dict[str, float]:
    """Server CPU microseconds per fire for each ledger write (the rounds after two warm
    ones), and for the baseline's plain insert."""
    db = client.bench_ledgers
    fires_ledger, runs = Ledger(db.fires), RunLedger(db.runs)
    await fires_ledger.ensure_indexes(86400)
    await runs.ensure_indexes(86400)
    epoch = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    for coll, scan in (
        (db.fires, {"state": "claimed", "next_attempt_at": {"$lte": epoch}}),
        (db.fires, {"state": "claimed", "term": {"$lt": 0}}),
        (db.fires, {"recorded_at": {"$lt": epoch}}),
        (db.runs, {"recorded_at": {"$lt": epoch}}),
        (db.runs, {"state": "waiting"}),
    ):
        await coll.find_one(scan)  # as the leader's scans do: the ordered indexes built
    targets = {f"s{i:06d}": "bench" for i in range(fires)}
    spent = dict.fromkeys([*LEDGER_WRITES, "plain insert", *CLAIMED_AGAIN], 0.0)
    base = dt.datetime.now(dt.UTC).replace(microsecond=0)
    for round_ in range(rounds + 2):
        nominal = base + dt.timedelta(seconds=round_)
        now = dt.datetime.now(dt.UTC)
        claims = [Claim(f"{sid}@{nominal.isoformat()}", sid, nominal, nominal) for sid in targets]
        ids = [c.fire_id for c in claims]
        docs = [claim_record(c, 1, now, now + dt.timedelta(seconds=5)) for c in claims]
        marks = [cpu_seconds(pid)]
        for start in range(0, fires, 1000):
            await fires_ledger.claim(docs[start : start + 1000])
        marks.append(cpu_seconds(pid))
        for start in range(0, fires, 500):
            await fires_ledger.mark_published(ids[start : start + 500], 1, now, 1)
        marks.append(cpu_seconds(pid))
        for start in range(0, fires, 1000):
            await runs.reserve(claims[start : start + 1000], targets, now, 1)
        marks.append(cpu_seconds(pid))
        for start in range(0, fires, 1000):
            await db.runs.update_many(
                {"_id": {"$in": ids[start : start + 1000]}, "state": "pending"},
                {
                    "$set": {
                        "state": "succeeded",
                        "attempts": 1,
                        "first_started_at": now,
                        "finished_at": now,
                        "recorded_at": now,
                    },
                    "$unset": {"open_key": ""},
                },
            )
        marks.append(cpu_seconds(pid))
        for start in range(0, fires, 1000):
            await db.plain.insert_many(
                [{**d, "_id": f"{d['_id']}#"} for d in docs[start : start + 1000]]
            )
        marks.append(cpu_seconds(pid))
        # The round's claims met again (a successor's): inserted and refused, then read
        # first as the leader does near the start of its term (none left to insert).
        for start in range(0, fires, 1000):
            await fires_ledger.claim(docs[start : start + 1000])
        marks.append(cpu_seconds(pid))
        for start in range(0, fires, 1000):
            batch = docs[start : start + 1000]
            there = await fires_ledger.claimed([d["_id"] for d in batch])
            await fires_ledger.claim([d for d in batch if d["_id"] not in there])
        marks.append(cpu_seconds(pid))
        if round_ >= 2:
            for name, before, after in zip(spent, marks[:-1], marks[1:], strict=True):
                spent[name] += after - before
    await client.drop_database("bench_ledgers")
    return {name: s / (rounds * fires) * 1e6 for name, s in spent.items()}


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
    parser.add_argument(
        "--ledger-fires",
        type=int,
        default=10_000,
        help="fires per round of the ledger writes (0: skip them)",
    )
    parser.add_argument("--ledger-rounds", type=int, default=10)
    args = parser.parse_args()
    server = start_devmongo()
    compiled = devmongo_compiled(server)
    try:
        client: Any = AsyncMongoClient(server.uri)
        r = await storage_rates(client, args.docs, args.ops)
        lat = await event_latency(server.uri, client, args.events)
        assert server.pid is not None
        cpu = await idle_cpu(server.uri, server.pid)
        ledgers = (
            await ledger_cost(client, server.pid, args.ledger_fires, args.ledger_rounds)
            if args.ledger_fires
            else {}
        )
        await client.close()
    finally:
        server.stop()
    sourced: dict[str, float] = {}
    if args.ledger_fires and compiled:
        plain = start_devmongo("--from-sources")
        try:
            client = AsyncMongoClient(plain.uri)
            assert plain.pid is not None
            sourced = await ledger_cost(client, plain.pid, args.ledger_fires, args.ledger_rounds)
            await client.close()
        finally:
            plain.stop()
    command = "python -m bench.devmongo_bench " + " ".join(sys.argv[1:])
    print(
        f"# devmongo benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `{command.strip()}`\n")
    print(
        "development server: "
        + (
            "its compiled build (mypyc; hascheduler_dev/devmongo/native.py)"
            if compiled
            else "from its sources (no "
            "compiled build for them: `python -m "
            "hascheduler_dev.devmongo.native build`)"
        )
        + "\n"
    )
    print(f"| measure | empty collection (baseline) | {args.docs:,} documents | ratio |")
    print("|---|---|---|---|")
    print(
        f"| insert_one round trips/s | {r['insert_empty']:,.0f} | {r['insert_full']:,.0f} | "
        f"{r['insert_empty'] / r['insert_full']:.2f}x |"
    )
    print(
        f"| find_one by _id round trips/s | {r['find_empty']:,.0f} | {r['find_full']:,.0f} | "
        f"{r['find_empty'] / r['find_full']:.2f}x |"
    )
    print(f"\nloading {args.docs:,} documents (insert_many, 1000 a batch): {r['load_s']:.1f} s")
    print(
        f"change-event latency, insert here -> watcher in another process "
        f"({len(lat)} events): p50 {pct(lat, 0.5) * 1000:.2f} ms, "
        f"p99 {pct(lat, 0.99) * 1000:.2f} ms, max {max(lat) * 1000:.2f} ms, "
        f"mean {statistics.mean(lat) * 1000:.2f} ms"
    )
    print(f"server CPU with 5 idle monitored clients: {cpu * 100:.2f} % of one core")
    if ledgers:
        print(
            f"\n| ledger write, {args.ledger_fires:,} fires a round, {args.ledger_rounds} "
            "rounds | server CPU per fire |"
        )
        print("|---|---|")
        for name in LEDGER_WRITES:
            print(f"| {name} | {ledgers[name]:.1f} us |")
        total = sum(ledgers[name] for name in LEDGER_WRITES)
        print(f"| all four (a governed fire) | {total:.1f} us |")
        print(
            f"| plain insert of a claim document, `_id` index only (baseline) | "
            f"{ledgers['plain insert']:.1f} us |"
        )
        print(
            f"\nfiring path per governed fire: {total / ledgers['plain insert']:.1f} plain "
            "inserts' worth of server CPU"
        )
        inserted, read = (ledgers[name] for name in CLAIMED_AGAIN)
        print(
            f"a claim whose fire is in the ledger already (a successor meeting its "
            f"predecessor's): inserted, refused as a duplicate {inserted:.1f} us; read first "
            f"(Ledger.claimed before the claim, baseline) {read:.1f} us; "
            f"ratio {inserted / read:.1f}x"
        )
    if sourced:
        print("\n| ledger write | compiled build | from its sources (baseline) | ratio |")
        print("|---|---|---|---|")
        for name in [*LEDGER_WRITES, "plain insert"]:
            print(
                f"| {name} | {ledgers[name]:.1f} us | {sourced[name]:.1f} us | "
                f"{ledgers[name] / sourced[name]:.2f}x |"
            )
        total_sourced = sum(sourced[name] for name in LEDGER_WRITES)
        print(
            f"| all four (a governed fire) | {total:.1f} us | {total_sourced:.1f} us | "
            f"{total / total_sourced:.2f}x |"
        )
    worst = max(r["insert_empty"] / r["insert_full"], r["find_empty"] / r["find_full"])
    if worst > 2.0:
        print(f"FAIL: a rate degraded {worst:.2f}x with size (limit 2x)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
