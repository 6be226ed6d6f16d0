"""HA benchmark: a 3-node NATS cluster with the fire stream at 3 replicas against one node,
and what a broker node's or the database primary's loss costs.

    python -m bench.ha_bench [--burst 10000] [--steady 1000] [--seconds 20] [--ticks 100]
                             [--lead 25] [--settle 15]

Runs the development MongoDB server, nats-servers and three `hascheduler serve` replicas
(bench.firing_bench's timings: lease ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s)
as processes.

- Burst: --burst one-off schedules due in the same second, from that second until every
  fire is published and acknowledged: on a 3-node cluster (stream R3) against a single
  node (R1, the baseline), same run.
- Lateness: --steady schedules firing every second for --seconds; publish-acknowledged
  minus due time, p50 and p99, on each.
- Stream leader lost: --ticks schedules every second on the cluster; SIGKILL of the node
  leading the stream; the fires due from a second before the kill: the latest one's
  lateness (the gap in fires), and how many were over a second late.
- Database step-down: the same on the single node, the development server stepping down
  for 2 s (longer than the renew deadline: the leader loses the lease, and a replica takes
  it once there is a primary again).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import AsyncMongoClient

from bench.devmongo_bench import pct
from bench.firing_bench import (
    Cluster,
    schedule_doc,
    scheduler_burst,
    started_cluster,
    until_all,
)
from hascheduler.brokers.nats.reader import stream_leader
from tests.servers import (
    NatsCluster,
    ServerProcess,
    start_devmongo,
    start_nats,
    start_nats_cluster,
)

STEP_DOWN_S = 2


async def every_second(
    mongo: ServerProcess,
    nats_uri: str,
    database: str,
    n: int,
    run: Callable[[Cluster], Awaitable[tuple[dt.datetime, dt.datetime]]],
) -> list[tuple[dt.datetime, float]]:
    """``n`` schedules firing every second while ``run`` returns the window to measure:
    each fire due in it, with its lateness (published minus due), by due time."""
    c = await started_cluster(
        mongo,
        nats_uri,
        database,
        [
            schedule_doc(f"t{i:05d}", {"kind": "cron", "cron": "* * * * * *"}, "bench.tick")
            for i in range(n)
        ],
    )
    try:
        # Measured once every schedule's fire of the second after the first one published
        # is published too: the leader's start-up catch-up is behind it.
        await until_all(c.db.fires, "published", "published_at", 1, dt.datetime.now(dt.UTC), 30)
        first = await c.db.fires.find_one({"state": "published"}, sort=[("due_at", 1)])
        assert first is not None
        next_second = first["due_at"] + dt.timedelta(seconds=1)
        await until_all(
            c.db.fires, "published", "published_at", n, next_second, 30, {"due_at": next_second}
        )
        start, end = await run(c)
        expected = n * int((end - start).total_seconds())
        window = {"due_at": {"$gte": start, "$lt": end}}
        await until_all(c.db.fires, "published", "published_at", expected, start, 60, window)
        fires = [
            f
            async for f in c.db.fires.find(
                {**window, "state": "published"}, {"published_at": 1, "due_at": 1}
            )
        ]
        return sorted(
            (f["due_at"], (f["published_at"] - f["due_at"]).total_seconds()) for f in fires
        )
    finally:
        await c.close()


def steady(seconds: float) -> Callable[[Cluster], Awaitable[tuple[dt.datetime, dt.datetime]]]:
    async def run(c: Cluster) -> tuple[dt.datetime, dt.datetime]:
        start = dt.datetime.now(dt.UTC)
        await asyncio.sleep(seconds)
        return start, dt.datetime.now(dt.UTC)

    return run


def after(
    fault: Callable[[], Awaitable[None]], settle_s: float = 15.0
) -> Callable[[Cluster], Awaitable[tuple[dt.datetime, dt.datetime]]]:
    async def run(c: Cluster) -> tuple[dt.datetime, dt.datetime]:
        at = dt.datetime.now(dt.UTC)
        await fault()
        await asyncio.sleep(settle_s)
        return at - dt.timedelta(seconds=1), at + dt.timedelta(seconds=settle_s - 3)

    return run


def gap(fires: list[tuple[dt.datetime, float]]) -> tuple[float, int, int]:
    """The latest fire's lateness, how many were over a second late, of how many."""
    late = [lateness for _, lateness in fires]
    return max(late, default=0.0), sum(v > 1.0 for v in late), len(late)


async def kill_stream_leader(cluster: NatsCluster) -> None:
    leader = await cluster.stream_leader()
    cluster.nodes[leader].stop(signal.SIGKILL)


async def step_down(mongo: ServerProcess) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.uri)
    try:
        await client.admin.command({"replSetStepDown": STEP_DOWN_S})
    finally:
        await client.close()


def ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1000:,.0f} ms"


async def main_async(args: argparse.Namespace) -> int:
    mongo = start_devmongo()
    single = start_nats()
    cluster = start_nats_cluster(3)
    try:
        bursts = {
            "single": await scheduler_burst(mongo, single.uri, "ha_burst_1", args.burst, args.lead),
            "cluster": await scheduler_burst(
                mongo, cluster.uri, "ha_burst_3", args.burst, args.lead
            ),
        }
        _, replicas = await stream_leader(cluster.uri)
        late = {
            "single": await every_second(
                mongo, single.uri, "ha_late_1", args.steady, steady(args.seconds)
            ),
            "cluster": await every_second(
                mongo, cluster.uri, "ha_late_3", args.steady, steady(args.seconds)
            ),
        }
        node_lost = gap(
            await every_second(
                mongo,
                cluster.uri,
                "ha_kill",
                args.ticks,
                after(lambda: kill_stream_leader(cluster), args.settle),
            )
        )
        stepped = gap(
            await every_second(
                mongo,
                single.uri,
                "ha_step",
                args.ticks,
                after(lambda: step_down(mongo), args.settle),
            )
        )
    finally:
        cluster.stop()
        single.stop()
        mongo.stop()
    print(
        f"| | 1 nats-server, stream R1 (baseline) | 3-node cluster, stream R{replicas} | "
        "cluster / single |"
    )
    print("|---|---|---|---|")
    print(
        f"| burst: {args.burst:,} fires due together, to all acknowledged | "
        f"{bursts['single']:.2f} s | {bursts['cluster']:.2f} s | "
        f"{bursts['cluster'] / bursts['single']:.2f}x |"
    )
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        one = [v for _, v in late["single"]]
        three = [v for _, v in late["cluster"]]
        print(
            f"| lateness {name}, {args.steady:,} schedules every second for "
            f"{args.seconds:g} s | {ms(one, q)} | {ms(three, q)} | "
            f"{pct(three, q) / max(pct(one, q), 1e-9):.2f}x |"
        )
    print()
    print(
        "| fault, with "
        f"{args.ticks} schedules firing every second | the latest fire's "
        "lateness (the gap) | fires over 1 s late | fires measured |"
    )
    print("|---|---|---|---|")
    print(
        f"| SIGKILL of the NATS node leading the stream (3-node cluster) | "
        f"{node_lost[0]:.2f} s | {node_lost[1]:,} | {node_lost[2]:,} |"
    )
    print(
        f"| the database steps down for {STEP_DOWN_S} s (the leader loses its lease) | "
        f"{stepped[0]:.2f} s | {stepped[1]:,} | {stepped[2]:,} |"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ha_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--steady", type=int, default=1_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ticks", type=int, default=100)
    parser.add_argument(
        "--lead",
        type=float,
        default=25.0,
        help="seconds from writing the burst (once the replicas lead) to its due "
        "time: room for their mirrors to load it",
    )
    parser.add_argument(
        "--settle", type=float, default=15.0, help="seconds measured after each fault"
    )
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
