"""Partitions and clocks: failover when the leader is cut from MongoDB against SIGKILL of
the leader, and how well a replica knows the database's clock.

    python -m bench.partition_bench [--rounds 10] [--schedules 20]

Runs `hascheduler dev`'s cluster with every process in a network namespace of its own
(hascheduler_dev/netns.py; root only): the development MongoDB server, one nats-server,
three replicas (lease ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s, as the firing
benchmark) and --schedules schedules firing every second.

- Failover: --rounds rounds, each a SIGKILL of the leader (the baseline) and a cut of the
  leader from MongoDB both ways with nftables (healed once another leads), alternating in
  the same run: from the fault to the next term's lease, and to that term's first fire
  published. Target: the partition within 1.2x of the kill.
- Offset: a replica started with its wall clock moved by each of -600, -4, +4 and +600 s
  (libfaketime): its /readyz offset against the true one (the development server runs on
  the machine's clock), and the bound it gives. Then the cost of reading the estimate, the
  one thing on the firing path, against reading the wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import signal
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import aiohttp
from hascheduler_dev.clocks import moved_clock_env
from hascheduler_dev.devcluster.supervisor import DevSettings, Supervisor
from pymongo import AsyncMongoClient

from bench.devmongo_bench import pct
from hascheduler.core.clock import ServerClock
from hascheduler.process import logs

TTL, DEADLINE, INTERVAL = 2.0, 1.4, 0.4
SKEWS_S = (-600.0, -4.0, 4.0, 600.0)


async def first_publish_after(db: Any, term: int, within_s: float = 20.0) -> dt.datetime:
    """When ``term`` first published a fire (its ledger record, on the database's clock)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        doc = await db.fires.find_one(
            {"term": {"$gte": term}, "state": "published"}, sort=[("published_at", 1)]
        )
        if doc is not None and doc.get("published_at") is not None:
            return doc["published_at"]  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    raise TimeoutError(f"term {term} published nothing within {within_s:g} s")


async def new_term(sup: Supervisor, other_than: str, above: int) -> dict[str, Any]:
    return await sup.wait_leader(other_than=other_than, above_term=above, within_s=30)


async def failover_round(sup: Supervisor, db: Any, kind: str) -> dict[str, float]:
    await sup.wait_ready()
    lease = await sup.wait_leader(within_s=30)
    holder, term = lease["holder"], lease["term"]
    victim = next(c for c in sup.replicas if c.name == holder)
    assert sup.net is not None
    assert victim.node is not None
    db_node = sup.child("devmongo").node
    assert db_node is not None
    at = dt.datetime.now(dt.UTC)
    started = time.monotonic()
    if kind == "kill":
        victim.process.send_signal(signal.SIGKILL)
    else:
        sup.net.cut(victim.node, db_node)
    new = await new_term(sup, holder, term)
    takeover = time.monotonic() - started
    published = await first_publish_after(db, new["term"])
    if kind != "kill":
        sup.net.heal(victim.node)
    return {"takeover_s": takeover, "first_fire_s": max(0.0, (published - at).total_seconds())}


async def offset_error(sup: Supervisor, skew_s: float) -> dict[str, float]:
    """A replica with its clock moved by ``skew_s``: its estimate against the truth."""
    sup.next_replica_env = moved_clock_env(skew_s)
    before = {c.name for c in sup.replicas}
    sup.desired += 1
    await sup.reconcile()
    child = next(c for c in sup.replicas if c.name not in before)
    try:
        async with aiohttp.ClientSession(headers=sup.api_headers) as http:
            deadline = time.monotonic() + 20
            clock: dict[str, Any] = {}
            while time.monotonic() < deadline:
                async with http.get(child.address + "/readyz") as r:
                    clock = (await r.json()).get("clock") or {}
                if clock.get("samples", 0) >= 5:
                    break
                await asyncio.sleep(0.2)
        offset = float(clock["offset_s"])
        return {
            "skew_s": skew_s,
            "error_ms": abs(offset + skew_s) * 1000,
            "bound_ms": float(clock["error_s"]) * 1000,
        }
    finally:
        sup.desired -= 1
        await sup.reconcile()  # retires the newest: this one


def reading_cost() -> tuple[float, float]:
    """Nanoseconds per call: the estimate's now() against the wall clock's."""
    clock = ServerClock()
    now = time.monotonic()
    clock.observe(now - 0.001, now, dt.datetime.now(dt.UTC))
    n = 200_000
    ours = min(timeit.repeat(clock.now, number=n, repeat=5)) / n * 1e9
    wall = min(timeit.repeat(lambda: dt.datetime.now(dt.UTC), number=n, repeat=5)) / n * 1e9
    return ours, wall


async def create_schedules(sup: Supervisor, count: int) -> None:
    async with aiohttp.ClientSession(headers=sup.api_headers) as http:
        for i in range(count):
            body = {
                "id": f"p{i:03d}",
                "name": f"p{i:03d}",
                "target": "bench.partition",
                "trigger": {"kind": "cron", "cron": "* * * * * *"},
                "catchup": "all",
            }
            async with http.post(sup.replicas[0].address + "/schedules", json=body) as r:
                if r.status != 201:
                    raise RuntimeError(f"creating {body['id']}: {await r.text()}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = DevSettings(
        replicas=3,
        workers=0,
        network=True,
        lease_ttl=TTL,
        renew_deadline=DEADLINE,
        renew_interval=INTERVAL,
        state_dir=Path(tempfile.mkdtemp(prefix="hascheduler-partition-")),
    )
    sup = Supervisor(settings)
    await sup.start()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(sup.mongodb_uri, tz_aware=True)
    try:
        db = client.get_default_database()
        await create_schedules(sup, args.schedules)
        rounds: dict[str, list[dict[str, float]]] = {"kill": [], "cut from MongoDB": []}
        for _ in range(args.rounds):
            for kind in rounds:
                rounds[kind].append(await failover_round(sup, db, kind))
        offsets = [await offset_error(sup, skew) for skew in SKEWS_S]
    finally:
        await client.close()
        await sup.stop()
    ours, wall = reading_cost()
    return {"rounds": rounds, "offsets": offsets, "now_ns": ours, "wall_ns": wall}


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "| fault of the leader | rounds | to the next lease p50 | p99 | to its first fire "
        "p50 | p99 |",
        "|---|---|---|---|---|---|",
    ]
    p99s = {}
    for kind, rounds in result["rounds"].items():
        takeover = [r["takeover_s"] for r in rounds]
        first = [r["first_fire_s"] for r in rounds]
        p99s[kind] = pct(takeover, 0.99)
        lines.append(
            f"| {kind} | {len(rounds)} | {pct(takeover, 0.5) * 1000:,.0f} ms | "
            f"{pct(takeover, 0.99) * 1000:,.0f} ms | {pct(first, 0.5) * 1000:,.0f} ms "
            f"| {pct(first, 0.99) * 1000:,.0f} ms |"
        )
    ratio = p99s["cut from MongoDB"] / p99s["kill"] if p99s["kill"] else float("nan")
    lines += [
        "",
        f"Partition against kill, takeover p99: {ratio:.2f}x (target <= 1.2x)",
        "",
        "| wall clock moved by | offset estimate's error | the bound it states |",
        "|---|---|---|",
    ]
    for o in result["offsets"]:
        lines.append(f"| {o['skew_s']:+g} s | {o['error_ms']:.2f} ms | {o['bound_ms']:.2f} ms |")
    lines += [
        "",
        f"Reading the estimate (ServerClock.now): {result['now_ns']:.0f} ns a call, "
        f"against {result['wall_ns']:.0f} ns for datetime.now(UTC); the samples (one "
        "`hello` a second, and the lease renewals the leader makes anyway) are off the "
        "firing path.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.partition_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.schedules < 1:
        parser.error("--rounds and --schedules: at least 1")
    logs.configure("warning")
    result = asyncio.run(run(args))
    print(report(result, args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
