"""Run-control benchmark: what an overlap policy costs the firing path, how soon a buffered
fire follows its run's end, and a backfill beside regular fires, each with its baseline.

    python -m bench.run_control_bench [--schedules 1000,10000] [--seconds 20] [--warmup 5]
                                      [--buffered 50] [--backfill 100000] [--regular 1000]
                                      [--baseline 60]

Runs the development MongoDB server, a real nats-server and three `hascheduler serve`
replicas (as bench.firing_bench) on this machine.

- Overlap cost: N schedules every second, all ``overlap: skip``, against the same N with
  ``allow`` (the baseline), each its own cluster in the same run. Runs end at once, under
  both policies: a task standing in for the workers takes each fire from the stream and
  records its run ended, one runs-ledger write per batch (inserting the runs under allow,
  ending the leader's reservations under skip), so a fire is skipped only if its previous
  run outlived that. The stand-in starts before the cluster, and each cluster fires
  --warmup seconds before its window. Lateness is publish-acknowledged minus due time,
  from the fire ledger.
- Buffered release: B schedules every second with ``buffer_one`` whose runs take 1.5 s (a
  task plays the worker, claiming each pending run and ending it 1.5 s later): from a run's
  end recorded to its buffered successor's publish acknowledged. Baseline, same run: from a
  raw insert to a raw change-stream watcher in another process seeing it (the soonest
  another process learns of a write).
- Backfill: a per-second schedule backfilled over K past seconds beside R schedules firing
  every second; its rate, and the regular fires' lateness over all the time it runs
  against windows of --baseline seconds without it, one before and one after (together
  the baseline: the ledgers grow through the run), same cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import time
from typing import Any

import aiohttp
import nats
import nats.errors
from nats.js.api import AckPolicy, DeliverPolicy
from pymongo import AsyncMongoClient

from bench.devmongo_bench import event_latency, pct
from bench.firing_bench import Cluster, ms, process_cpu, schedule_doc, started_cluster
from bench.worker_bench import pull_consumer
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream
from hascheduler.process import logs
from tests.servers import ServerProcess, start_devmongo, start_nats
from tests.waiting import wait_until

NOTES: list[str] = []
CPU: list[str] = []  # the CPU the servers took during each overlap window


def governed(sid: str, overlap: str) -> dict[str, Any]:
    return {
        **schedule_doc(sid, {"kind": "cron", "cron": "* * * * * *"}, "bench.runs"),
        "overlap": overlap,
    }


async def workers_ending_at_once(
    c: Cluster,
    nats_uri: str,
    overlap: str,
    since: dt.datetime,
    ready: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """The workers, as fast as can be, the same under every policy: each fire is taken
    from the stream as a worker takes it, and its run recorded ended at once, one ledger
    write per fetched batch (as a worker's recorder writes a batch of outcomes). Under
    ``allow`` that write inserts the runs (a worker's claim, ended); under a policy it ends
    the runs the leader reserved (``pending``). It takes the fires published from
    ``since`` on (the cluster's start), and no other cluster's."""
    nc = await nats.connect(nats_uri)
    try:
        # The stream made here as the replicas make it, so that this can take fires from
        # the first one on, before the cluster starts.
        await ensure_stream(nc.jetstream(), NatsEndpoint.parse(nats_uri))
        sub = await pull_consumer(
            nc,
            f"ender-{c.db.name}",
            "hascheduler.fire.bench.runs",
            ack_policy=AckPolicy.ALL,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since.isoformat().replace("+00:00", "Z"),
            max_ack_pending=-1,
        )
        ready.set()
        while not stop.is_set():
            try:
                messages = await sub.fetch(2000, timeout=0.05)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            if not messages:
                continue
            now = dt.datetime.now(dt.UTC)
            # The fire id is the message's deduplication header: no event body is parsed
            # (a worker runs elsewhere; this stand-in shares the measured machine).
            fires = [m.headers["Nats-Msg-Id"] for m in messages if m.headers]
            if overlap == "allow":
                await c.db.runs.insert_many(
                    [
                        {
                            "_id": fire,
                            "schedule_id": fire.split("@", 1)[0],
                            "target": "bench.runs",
                            "nominal_at": dt.datetime.fromisoformat(fire.split("@", 1)[1]),
                            "attempts": 1,
                            "replays": 0,
                            "state": "succeeded",
                            "first_started_at": now,
                            "finished_at": now,
                            "recorded_at": now,
                        }
                        for fire in fires
                    ],
                    ordered=False,
                )
            else:
                await c.db.runs.update_many(
                    {"_id": {"$in": fires}, "state": "pending"},
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
            await messages[-1].ack()
    finally:
        await nc.close()


async def lateness_window(
    c: Cluster, seconds: float, among: dict[str, Any], label: str = ""
) -> list[float]:
    """Publish lateness of the fires due in the next ``seconds`` (the measured window)."""
    start = dt.datetime.now(dt.UTC)
    await asyncio.sleep(seconds)  # the window itself, not a wait for something
    return await lateness_between(c, start, dt.datetime.now(dt.UTC), among, label)


async def lateness_between(
    c: Cluster, start: dt.datetime, end: dt.datetime, among: dict[str, Any], label: str = ""
) -> list[float]:
    """Publish lateness of the fires due in [start, end), once none of them is still
    waiting for its publish, or a minute after the window (a saturated firing path: noted,
    and the fires published by then measured)."""
    left = await c.wait_landed({**among, "due_at": {"$gte": start, "$lt": end}})
    if left:
        NOTES.append(
            f"{label}: {left:,} fires due in the {(end - start).total_seconds():g} "
            "s window were still claimed and unpublished a minute after it (the "
            "firing path saturated); the table measures those published by then"
        )
    return [
        (f["published_at"] - f["due_at"]).total_seconds()
        async for f in c.db.fires.find(
            {
                **among,
                "due_at": {"$gte": start, "$lt": end},
                "state": "published",
                "manual": {"$exists": False},
            },
            {"published_at": 1, "due_at": 1},
        )
    ]


async def overlap_cost(
    mongo: ServerProcess, broker: ServerProcess, n: int, seconds: float, warmup: float, overlap: str
) -> tuple[list[float], int]:
    since = dt.datetime.now(dt.UTC)
    c = Cluster(mongo, broker.uri, f"bench_overlap_{overlap}_{n}")
    stop, ready = asyncio.Event(), asyncio.Event()
    ender = asyncio.create_task(workers_ending_at_once(c, broker.uri, overlap, since, ready, stop))
    try:
        # The workers first: runs end from the first fire on, as they would on a cluster
        # whose workers were up before its schedules came due.
        await asyncio.wait_for(ready.wait(), 30)
        await started_cluster(
            mongo,
            broker.uri,
            c.db.name,
            [governed(f"o{i:06d}", overlap) for i in range(n)],
            cluster=c,
        )
        await c.wait_firing()
        await asyncio.sleep(warmup)  # a duration, alike for both policies: not measured
        before = process_cpu(mongo, broker, c)
        opened = dt.datetime.now(dt.UTC)
        window = asyncio.create_task(
            lateness_window(c, seconds, {}, f"{overlap} at {n:,} schedules")
        )
        await asyncio.sleep(seconds)  # beside the window: the CPU it took
        CPU.append(
            f"{overlap} at {n:,} schedules: "
            + ", ".join(
                f"{k} {(v - before[k]) / seconds:.0%}"
                for k, v in process_cpu(mongo, broker, c).items()
            )
        )
        late = await window
        skipped = await c.db.fires.count_documents(
            {
                "reason": "overlap",
                "due_at": {"$gte": opened, "$lt": opened + dt.timedelta(seconds=seconds)},
            }
        )
        return late, skipped
    finally:
        stop.set()
        await ender
        await c.close()
        await drop(mongo, c.db.name)  # the next cluster shares the server: not its data


async def drop(mongo: ServerProcess, database: str) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.uri)
    try:
        await client.drop_database(database)
    finally:
        await client.close()


async def play_worker(c: Cluster, run_s: float, stop: asyncio.Event) -> None:
    """Claim each pending run and end it ``run_s`` later, as a worker would."""
    ending: dict[str, float] = {}
    while not stop.is_set():
        now = dt.datetime.now(dt.UTC)
        async for run in c.db.runs.find({"state": "pending"}, {"_id": 1}):
            await c.db.runs.update_one(
                {"_id": run["_id"], "state": "pending"},
                {"$set": {"state": "running", "first_started_at": now, "recorded_at": now}},
            )
            ending[run["_id"]] = time.monotonic() + run_s
        for fire, at in list(ending.items()):
            if time.monotonic() >= at:
                done = dt.datetime.now(dt.UTC)
                await c.db.runs.update_one(
                    {"_id": fire},
                    {
                        "$set": {"state": "succeeded", "finished_at": done, "recorded_at": done},
                        "$unset": {"open_key": ""},
                    },
                )
                del ending[fire]
        await asyncio.sleep(0.01)


async def buffered_release(
    mongo: ServerProcess, broker: ServerProcess, n: int, seconds: float
) -> list[float]:
    c = await started_cluster(
        mongo, broker.uri, "bench_buffered", [governed(f"b{i:04d}", "buffer_one") for i in range(n)]
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(play_worker(c, 1.5, stop))
    samples = max(1, n * int(seconds) // 2)  # about one buffered fire per run of 1.5 s

    async def enough() -> bool:
        return (
            await c.db.fires.count_documents(
                {"buffered_at": {"$exists": True}, "state": "published"}
            )
            >= samples
        )

    try:
        try:
            await wait_until(enough, 10 * seconds + 60, f"{samples} buffered fires published", 0.2)
        finally:
            stop.set()
            await worker
        gaps = []
        async for fire in c.db.fires.find({"buffered_at": {"$exists": True}, "state": "published"}):
            run = await c.db.runs.find_one({"_id": fire["open_run"]}, {"finished_at": 1})
            if run and run.get("finished_at"):
                gaps.append((fire["published_at"] - run["finished_at"]).total_seconds())
        return gaps
    finally:
        await c.close()


async def backfill(
    mongo: ServerProcess, broker: ServerProcess, k: int, regular: int, baseline_s: float
) -> tuple[float, list[float], list[float], list[float]]:
    schedules = [
        schedule_doc(f"r{i:05d}", {"kind": "cron", "cron": "* * * * * *"}, "bench.regular")
        for i in range(regular)
    ]
    schedules.append(
        schedule_doc("filled", {"kind": "cron", "cron": "* * * * * *"}, "bench.backfill")
    )
    c = await started_cluster(mongo, broker.uri, "bench_backfill", schedules)
    regulars = {"schedule_id": {"$ne": "filled"}}
    try:
        await c.wait_firing()
        before = await lateness_window(c, baseline_s, regulars, "before the backfill")
        end = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=1)
        start = end - dt.timedelta(seconds=k)
        api = next(iter(c.replicas.values())).uri
        async with aiohttp.ClientSession() as http:
            began, began_at = time.monotonic(), dt.datetime.now(dt.UTC)
            async with http.post(
                f"{api}/schedules/filled/backfill",
                json={"start": start.isoformat(), "end": end.isoformat()},
            ) as r:
                assert r.status == 202, await r.text()
                made = await r.json()

            async def finished() -> bool:
                async with http.get(f"{api}/backfills/{made['id']}") as r:
                    return bool((await r.json())["state"] != "running")

            # At the least rate worth reporting (100 a second), and a minute more.
            await wait_until(finished, k / 100 + 60, "the backfill done", 0.5)
            took = time.monotonic() - began
        # Every regular fire due while the backfill ran, however long that was: a window
        # of the backfill's whole length has as many slow seconds to show as the baseline.
        during = await lateness_between(
            c, began_at, dt.datetime.now(dt.UTC), regulars, "during the backfill"
        )
        # A second window without, after: the ledgers grow through the run, and a baseline
        # only from before would count their growth against the backfill.
        after = await lateness_window(c, baseline_s, regulars, "after the backfill")
        return k / took, before, during, after
    finally:
        await c.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schedules",
        default="1000,10000",
        help="schedule counts, each measured with skip and with allow",
    )
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--warmup",
        type=float,
        default=5,
        help="seconds each overlap cluster fires before its window",
    )
    parser.add_argument(
        "--buffered",
        type=int,
        default=50,
        help="buffer_one schedules (0: skip the buffered release)",
    )
    parser.add_argument(
        "--backfill", type=int, default=100_000, help="fires backfilled (0: skip the backfill)"
    )
    parser.add_argument("--regular", type=int, default=1_000)
    parser.add_argument(
        "--baseline",
        type=float,
        default=60,
        help="seconds of regular fires measured before the backfill, and "
        "again after it (the baseline)",
    )
    args = parser.parse_args()
    logs.configure("warning")  # to stderr: stdout is the report
    print(
        f"# run-control benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.run_control_bench {' '.join(sys.argv[1:])}`".rstrip())
    mongo = start_devmongo()
    broker = start_nats()
    code = 0
    try:
        print(
            "| overlap at every second | schedules | fires published | p50 | p99 | "
            "skipped for overlap | p99 skip / allow |"
        )
        print("|---|---|---|---|---|---|---|", flush=True)
        for n in (int(x) for x in args.schedules.split(",") if x):
            skip, skipped = await overlap_cost(mongo, broker, n, args.seconds, args.warmup, "skip")
            allow, _ = await overlap_cost(mongo, broker, n, args.seconds, args.warmup, "allow")
            ratio = pct(skip, 0.99) / pct(allow, 0.99)
            print(
                f"| skip (runs ending at once) | {n:,} | {len(skip):,} | {ms(skip, 0.5)} | "
                f"{ms(skip, 0.99)} | {skipped:,} | {ratio:.2f}x |"
            )
            print(
                f"| allow (baseline) | {n:,} | {len(allow):,} | {ms(allow, 0.5)} | "
                f"{ms(allow, 0.99)} | | |",
                flush=True,
            )
        print(f"\nCPU during each window, share of one core: {'; '.join(CPU)}.")
        print("\np99 skip / allow: see the table (target <= 1.2x)\n", flush=True)
        if args.buffered:
            gaps = await buffered_release(mongo, broker, args.buffered, args.seconds)
            c = Cluster(mongo, broker.uri, "bench_raw_latency")
            try:
                raw = await event_latency(mongo.uri, c.client, 200)
            finally:
                await c.close()
            print(
                "| buffered fire: run end recorded to its publish acknowledged | samples | "
                "p50 | p99 | max |"
            )
            print("|---|---|---|---|---|")
            print(
                f"| buffer_one, {args.buffered} schedules, runs of 1.5 s every second | "
                f"{len(gaps):,} | {ms(gaps, 0.5)} | {ms(gaps, 0.99)} | "
                f"{max(gaps) * 1000:,.0f} ms |"
            )
            print(
                f"| raw insert to a raw change-stream watcher in another process "
                f"(baseline) | {len(raw)} | "
                f"{ms(raw, 0.5)} | {ms(raw, 0.99)} | {max(raw) * 1000:,.0f} ms |"
            )
            print(
                f"\nbuffered p99 {pct(gaps, 0.99) * 1000:.0f} ms (target <= 100 ms)\n", flush=True
            )
        if args.backfill:
            rate, before, during, after = await backfill(
                mongo, broker, args.backfill, args.regular, args.baseline
            )
            without = before + after
            print("| regular fires, every second | schedules | fires | p50 | p99 |")
            print("|---|---|---|---|---|")
            print(
                f"| while a {args.backfill:,}-fire backfill runs | {args.regular:,} | "
                f"{len(during):,} | {ms(during, 0.5)} | {ms(during, 0.99)} |"
            )
            for label, fires in (
                ("before it", before),
                ("after it", after),
                ("without, before and after together (baseline)", without),
            ):
                print(
                    f"| {label} | {args.regular:,} | {len(fires):,} | {ms(fires, 0.5)} | "
                    f"{ms(fires, 0.99)} |"
                )
            print(
                f"\nbackfill rate: {rate:,.0f} fires/s; regular p99 with / without: "
                f"{pct(during, 0.99) / pct(without, 0.99):.2f}x (target <= 1.2x)"
            )
        print("\n".join(["", *NOTES]), flush=True)
    finally:
        broker.stop()
        mongo.stop()
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
