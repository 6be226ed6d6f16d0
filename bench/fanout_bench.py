"""Fan-out benchmark: one schedule to many tenants against as many schedules, and memory.

    python -m bench.fanout_bench [--tenants 10000] [--workers 2] [--mirror 100000] [--lead 25]

Runs the development MongoDB server, a real nats-server and three replicas (as
bench.firing_bench does) as processes.

- Fan-out: one one-off schedule whose fan_out selects --tenants documents; time from its
  due time until every tenant's fire is published and acknowledged (the fire ledger's
  published_at). Baseline, same run: the burst of --tenants separate one-off schedules due
  together (bench.firing_bench's burst). Target: within 1.2x.
- Runs: --workers `hascheduler worker` processes (no-op handler) consuming the fan-out's
  fires; time from the due time until every run is succeeded in the runs ledger.
- Loop: the leader's longest event-loop stall (hascheduler_event_loop_lag_seconds) from
  before the due time until all are published, against its lease's renew interval.
- Memory: a source mirror loaded with --mirror tenant documents (a key and two filter
  fields), bytes per tenant (tracemalloc), against the documents as plain dicts.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tracemalloc

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.firing_bench import (
    TIMINGS,
    Cluster,
    due_after_leading,
    schedule_doc,
    started_cluster,
    until_all,
)
from hascheduler.core.fanout import FanOut
from hascheduler.replica.tenants import SourceMirror
from tests.servers import ServerProcess, start_devmongo, start_nats

RENEW_DEADLINE_S = float(TIMINGS[TIMINGS.index("--renew-deadline") + 1])
RENEW_INTERVAL_S = float(TIMINGS[TIMINGS.index("--renew-interval") + 1])
FAN_OUT = {"collection": "tenants", "filter": {"active": True}, "key": "_id"}


async def loop_lag_buckets(c: Cluster) -> dict[float, float]:
    """The leader's event-loop lag histogram: bucket bound -> observations at or under."""
    holder = (await c.lease())["holder"]
    async with aiohttp.ClientSession() as http, http.get(c.replicas[holder].uri + "/metrics") as r:
        text = await r.text()
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "hascheduler_event_loop_lag_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


def longest_lag(before: dict[float, float], after: dict[float, float]) -> float:
    """The bound of the smallest bucket holding every observation made in between."""
    total = after[math.inf] - before.get(math.inf, 0.0)
    return min(le for le, count in after.items() if count - before.get(le, 0.0) >= total)


async def separate(
    mongo: ServerProcess, nats_uri: str, n: int, lead_s: float
) -> tuple[float, float]:
    """Seconds from the due time to every fire published, and the leader's longest loop
    lag meanwhile."""
    c = await started_cluster(mongo, nats_uri, "fanout_bench_separate", [])
    try:
        due = await due_after_leading(
            c,
            lead_s,
            lambda due: [
                schedule_doc(f"s{i:05d}", {"kind": "at", "at": [due]}, "bench.separate")
                for i in range(n)
            ],
        )
        before = await loop_lag_buckets(c)
        published = await until_all(c.db.fires, "published", "published_at", n, due, 180)
        return published, longest_lag(before, await loop_lag_buckets(c))
    finally:
        await c.close()


async def fanned(
    mongo: ServerProcess, nats_uri: str, n: int, workers: int, lead_s: float
) -> tuple[float, float, float]:
    """Seconds from the due time to every tenant's fire published, and to every run
    succeeded; the leader's longest loop lag until all were published."""
    database = "fanout_bench_fanned"
    seed = Cluster(mongo, nats_uri, database)
    for i in range(0, n, 1000):
        await seed.db.tenants.insert_many(
            [{"_id": f"t{j:06d}", "active": True} for j in range(i, min(n, i + 1000))]
        )
    await seed.client.close()
    c = await started_cluster(mongo, nats_uri, database, [])
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hascheduler.cli",
            "--log-level",
            "warning",
            "worker",
            "--broker",
            nats_uri,
            "--mongodb-uri",
            c.uri,
            "--app",
            "bench.worker_bench:app",
            "--durable",
            "fanout-bench",
            "--concurrency",
            "16",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for _ in range(workers)
    ]
    try:
        due = await due_after_leading(
            c,
            lead_s,
            lambda due: [
                {
                    **schedule_doc("fan", {"kind": "at", "at": [due]}, "bench.fan"),
                    "fan_out": FAN_OUT,
                }
            ],
        )
        before = await loop_lag_buckets(c)
        published = await until_all(c.db.fires, "published", "published_at", n, due, 180)
        lag = longest_lag(before, await loop_lag_buckets(c))
        ran = await until_all(c.db.runs, "succeeded", "finished_at", n, due, 300)
        return published, ran, lag
    finally:
        for proc in procs:
            proc.terminate()
            await proc.wait()
        await c.close()


def mirror_bytes(n: int) -> tuple[float, float]:
    """Bytes per tenant in a source mirror, and per tenant as plain dicts (baseline)."""
    docs = [{"_id": f"t{i:06d}", "active": True, "plan": "pro", "name": "x" * 40} for i in range(n)]
    fields = FanOut.model_validate({**FAN_OUT, "filter": {"active": True, "plan": "pro"}})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mirror = SourceMirror(collection=None, fields=fields.fields())  # type: ignore[arg-type]
    mirror.load(docs)
    kept = tracemalloc.get_traced_memory()[0] - before
    before = tracemalloc.get_traced_memory()[0]
    plain = {d["_id"]: {"_id": d["_id"], "active": d["active"], "plan": d["plan"]} for d in docs}
    baseline = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert mirror.size == len(plain) == n
    return kept / n, baseline / n


async def main_async(args: argparse.Namespace) -> int:
    mongo = start_devmongo()
    broker = start_nats()
    try:
        base, base_lag = await separate(mongo, broker.uri, args.tenants, args.lead)
        published, ran, lag = await fanned(mongo, broker.uri, args.tenants, args.workers, args.lead)
    finally:
        broker.stop()
        mongo.stop()
    per_tenant, plain = mirror_bytes(args.mirror)
    print(
        f"| due time to every fire published and acknowledged | {args.tenants:,} separate "
        "schedules (baseline) | one schedule fanning out | fan-out / separate |"
    )
    print("|---|---|---|---|")
    print(
        f"| {args.tenants:,} fires | {base:.2f} s | {published:.2f} s | {published / base:.2f}x |"
    )
    print()
    print(
        f"The leader's longest event-loop stall from before the due time until all were "
        f"published (the lag histogram's bucket): at most {lag:g} s fanning out, at most "
        f"{base_lag:g} s for the separate schedules (baseline); its lease is renewed every "
        f"{RENEW_INTERVAL_S:g} s and lost after {RENEW_DEADLINE_S:g} s without a renewal."
    )
    print()
    print(
        f"Due time to every tenant's run succeeded, {args.workers} workers at concurrency "
        f"16: {ran:.2f} s."
    )
    print()
    print(
        f"Memory per mirrored tenant ({args.mirror:,} documents, a key and two filter "
        f"fields): {per_tenant:,.0f} bytes in a source mirror, {plain:,.0f} bytes as plain "
        "dicts of the same fields (baseline)."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fanout_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mirror", type=int, default=100_000)
    parser.add_argument(
        "--lead",
        type=float,
        default=25.0,
        help="seconds from writing the schedules (once the replicas lead) to their due time",
    )
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
