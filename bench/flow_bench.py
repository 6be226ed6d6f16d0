"""Flow control's cost and promptness: worker throughput with a concurrency key whose limit
is never reached against no key, and the time from a slot freeing to the next parked run
of its key starting.

    python -m bench.flow_bench [--fires 10000] [--concurrency 16] [--rounds 3]
                               [--hot 500] [--tenants 10000] [--fires-per-tenant 4]
                               [--rate-seconds 60] [--crowd 10000]

Runs the development MongoDB server and a real nats-server, as bench/worker_bench.py does.

- Throughput: --fires fires in the stream, without a key, and with the schedule's key
  ``{target}`` at limit 1,000 (so every run takes and frees a slot, and none waits); a
  `hascheduler worker` at --concurrency consumes them all, the two alternated --rounds
  times, the best of each kept. Target: with the key within 1.2x of without.
- Hand-on: --hot runs of one key at limit 1, each taking no time, through two workers:
  every run but the first waits parked, and is woken when the one before it ends. From
  the handler's records, each run's start minus the previous run's end. Target: p99 under
  50 ms.
- Fairness: --crowd runs of one key at limit 2 published ahead of 50 runs of 50 other
  keys, through two workers: when each of the 50 started, after the last publish.
  Target: all within the first seconds.
- Rate: two keys at 5 starts a second, each with --rate-seconds seconds of runs waiting
  (5 a second's worth, published at once), through two workers: from the instant each
  start was counted (the ledger's woken_at, else the run's first start), the most starts
  of a key in any one second, and the mean over the full seconds. Target: never above 5,
  close to 5.
- Fan-out: a schedule fanning out to --tenants tenants with ``concurrency: {"key":
  "{tenant}", "limit": 3}``, run now --fires-per-tenant times at once (each run 20 ms),
  through one replica and four workers at concurrency 16, one of them SIGKILLed when a
  third of the runs are done (run lease 3 s). From the handler's records: the most runs
  of one tenant at once (a killed run counted as running until its worker was killed),
  and every run succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
from pymongo import AsyncMongoClient

from bench.devmongo_bench import pct
from bench.worker_bench import our_worker
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream
from hascheduler.process import logs
from tests.servers import (
    ServerProcess,
    start_devmongo,
    start_nats,
    start_replica,
    with_database,
)
from tests.waiting import wait_until

STREAM = "HASCHEDULER"


def event(
    fire_id: str,
    target: str,
    payload: dict[str, Any],
    concurrency: dict[str, Any] | None,
    rate: dict[str, Any] | None = None,
) -> bytes:
    now = dt.datetime.now(dt.UTC).isoformat()
    data: dict[str, Any] = {
        "schedule_id": fire_id.partition("@")[0],
        "term": 1,
        "nominal_at": now,
        "payload": payload,
    }
    if concurrency is not None:
        data["concurrency"] = concurrency
    if rate is not None:
        data["rate"] = rate
    return json.dumps(
        {
            "specversion": "1.0",
            "id": fire_id,
            "source": "/hascheduler",
            "type": "io.hascheduler.fire",
            "subject": data["schedule_id"],
            "data": data,
        }
    ).encode()


async def fill(nats_uri: str, messages: list[tuple[str, bytes]]) -> int:
    """Empty the stream, publish ``messages`` (subject, body); the last stream sequence."""
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        js = nc.jetstream()
        await ensure_stream(js, endpoint)
        await js.purge_stream(STREAM)
        last = 0
        for start in range(0, len(messages), 500):
            acks = await asyncio.gather(
                *(
                    js.publish(subject, body, headers={"Nats-Msg-Id": json.loads(body)["id"]})
                    for subject, body in messages[start : start + 500]
                )
            )
            last = max(a.seq for a in acks)
        return last
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def flow_workers(
    nats_uri: str, mongo_uri: str, durable: str, record: Path, count: int, *args: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """``count`` workers running tests/helpers/flow_handler.py (recording to ``record``),
    each consuming once this yields; terminated after."""
    workers: list[asyncio.subprocess.Process] = []
    try:
        for w in range(count):
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "hascheduler.cli",
                "--log-level",
                "warning",
                "worker",
                "--broker",
                nats_uri,
                "--mongodb-uri",
                mongo_uri,
                "--app",
                "tests.helpers.flow_handler:app",
                "--durable",
                durable,
                "--worker-id",
                f"w{w}",
                "--concurrency",
                "16",
                *args,
                env={**os.environ, "RECORD_FLOW_TO": str(record)},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            workers.append(worker)
            assert worker.stdout is not None
            await asyncio.wait_for(worker.stdout.readline(), 60)
        yield workers
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.terminate()
            await worker.wait()


async def throughput(
    mongo: ServerProcess, nats_uri: str, fires: int, concurrency: int, rounds: int
) -> dict[str, float]:
    best: dict[str, float] = {}
    key = {"key": "{target}", "limit": 1000}
    for n in range(rounds):
        for mode in ("no key", "key"):
            last = await fill(
                nats_uri,
                [
                    (
                        "hascheduler.fire.bench.noop",
                        event(
                            f"f{n}{mode[0]}{i}@x", "bench.noop", {}, key if mode == "key" else None
                        ),
                    )
                    for i in range(fires)
                ],
            )
            seconds, _, _ = await our_worker(
                nats_uri,
                mongo,
                f"fb_{n}_{mode[0]}",
                concurrency,
                last,
                durable=f"fb-{n}-{mode.replace(' ', '')}",
            )
            best[mode] = min(best.get(mode, seconds), seconds)
    return best


async def hand_on(mongo: ServerProcess, nats_uri: str, hot: int) -> list[float]:
    """Start of each run of the hot key minus the end of the one before it, seconds."""
    record = Path(tempfile.mkdtemp()) / "flow.txt"
    database = "fb_hot"
    await fill(
        nats_uri,
        [
            (
                "hascheduler.fire.flow.hot",
                event(
                    f"hot-{i}@x",
                    "flow.hot",
                    {"account": "hot"},
                    {"key": "{payload.account}", "limit": 1},
                ),
            )
            for i in range(hot)
        ],
    )
    async with flow_workers(nats_uri, with_database(mongo.uri, database), "fb-hot", record, 2):

        def ended() -> bool:
            return record.exists() and record.read_text().count("end ") >= hot

        await wait_until(ended, 600.0, "every hot run ended")
    lines = [line.split()[:4] for line in record.read_text().splitlines()]
    starts = sorted(float(at) for what, _, _, at in lines if what == "start")
    ends = sorted(float(at) for what, _, _, at in lines if what == "end")
    # Limit 1: runs alternate start, end, start ...; each start after the first follows
    # the end just before it.
    return [start - end for start, end in zip(starts[1:], ends, strict=False)]


def most_at_once(lines: list[list[str]], killed_at: float) -> int:
    """The most runs of one key between their start and end at one instant; a start the
    records never end (its worker was killed) ends at ``killed_at``."""
    ends = {fire for what, fire, _, _ in lines if what == "end"}
    events: list[tuple[float, int, str]] = []
    started: dict[str, int] = {}
    for what, fire, key, at in lines:
        if what == "start":
            started[fire] = started.get(fire, 0) + 1
            events.append((float(at), 1, key))
        else:
            events.append((float(at), -1, key))
    for what, fire, key, _ in lines:
        if what == "start" and started[fire] > (1 if fire in ends else 0):
            started[fire] -= 1
            events.append((killed_at, -1, key))
    running: dict[str, int] = {}
    most = 0
    for _, step, key in sorted(events):
        running[key] = running.get(key, 0) + step
        most = max(most, running[key])
    return most


async def fan_out(mongo: ServerProcess, nats_uri: str, tenants: int, fires: int) -> dict[str, Any]:
    await fill(nats_uri, [])  # the stream emptied: the parts before left theirs in it
    record = Path(tempfile.mkdtemp()) / "flow.txt"
    uri = with_database(mongo.uri, "fb_fanout")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()
    await db.tenants.insert_many([{"_id": f"t{i:05d}"} for i in range(tenants)])
    replica = start_replica(uri, "fb", "--broker", nats_uri)
    try:
        async with flow_workers(
            nats_uri, uri, "fb-fanout", record, 4, "--ack-wait", "3"
        ) as workers:
            return await _fan_out(replica.uri, db, record, workers, tenants, fires)
    finally:
        replica.stop()
        await client.close()


async def _fan_out(
    api: str,
    db: Any,
    record: Path,
    workers: list[asyncio.subprocess.Process],
    tenants: int,
    fires: int,
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:

        async def leading() -> bool:
            async with http.get(api + "/leader") as r:
                return r.status == 200 and bool((await r.json())["answered_by_leader"])

        await wait_until(leading, 30, "the replica to lead")
        body = {
            "id": "nightly",
            "name": "nightly",
            "target": "flow.nightly",
            "payload": {"sleep": 0.02},
            "fan_out": {"collection": "tenants"},
            "concurrency": {"key": "{tenant}", "limit": 3},
            "trigger": {"kind": "cron", "cron": "0 0 1 1 *"},
        }
        async with http.post(api + "/schedules", json=body) as r:
            assert r.status == 201, await r.text()
        began = time.perf_counter()
        for _ in range(fires):
            async with http.post(api + "/schedules/nightly/trigger", json={}) as r:
                assert r.status == 202, await r.text()
    total = tenants * fires

    def a_third() -> bool:
        return record.exists() and record.read_text().count("end ") >= total // 3

    await wait_until(a_third, 600.0, "a third of the runs done")
    workers[0].kill()
    killed_at = time.time()

    async def all_succeeded() -> bool:
        succeeded: int = await db.runs.count_documents({"state": "succeeded"})
        return succeeded >= total

    await wait_until(all_succeeded, 900.0, "every run succeeded")
    seconds = time.perf_counter() - began
    lines = [line.split()[:4] for line in (await asyncio.to_thread(record.read_text)).splitlines()]
    return {
        "runs": total,
        "seconds": seconds,
        "most": most_at_once(lines, killed_at),
        "succeeded": await db.runs.count_documents({"state": "succeeded"}),
        "taken_over": sum(1 for line in lines if line[0] == "start") - total,
    }


async def fairness(mongo: ServerProcess, nats_uri: str, crowd: int) -> list[float]:
    """Seconds from the last publish to each single key's run starting."""
    limit = {"key": "{payload.account}", "limit": 2}
    messages = [
        (
            "hascheduler.fire.flow.crowd",
            event(f"c-{i}@x", "flow.crowd", {"account": "crowd"}, limit),
        )
        for i in range(crowd)
    ]
    messages += [
        (
            "hascheduler.fire.flow.crowd",
            event(f"s-{i}@x", "flow.crowd", {"account": f"single{i}"}, limit),
        )
        for i in range(50)
    ]
    await fill(nats_uri, [])
    record = Path(tempfile.mkdtemp()) / "flow.txt"
    uri = with_database(mongo.uri, "fb_crowd")
    async with flow_workers(nats_uri, uri, "fb-crowd", record, 2):
        await fill(nats_uri, messages)
        published = time.time()

        def singles() -> list[float]:
            if not record.exists():
                return []
            starts = [
                float(line.split()[3]) - published
                for line in record.read_text().splitlines()
                if line.startswith("start s-")
            ]
            return starts if len(starts) == 50 else []

        starts: list[float] = await wait_until(singles, 120.0, "the 50 single runs started")
        return starts


async def paced(mongo: ServerProcess, nats_uri: str, seconds: int) -> dict[str, Any]:
    database = "fb_rate"
    rate = {"key": "{payload.account}", "limit": 5, "per": "PT1S"}
    await fill(
        nats_uri,
        [
            (
                "hascheduler.fire.flow.paced",
                event(f"p-{account}-{i}@x", "flow.paced", {"account": account}, None, rate),
            )
            for i in range(5 * seconds)
            for account in ("a", "b")
        ],
    )
    record = Path(tempfile.mkdtemp()) / "flow.txt"
    uri = with_database(mongo.uri, database)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    try:
        async with flow_workers(nats_uri, uri, "fb-rate", record, 2):
            return await _paced(client.get_default_database().runs, seconds)
    finally:
        await client.close()


async def _paced(runs: Any, seconds: int) -> dict[str, Any]:
    async def done() -> bool:
        succeeded: int = await runs.count_documents({"state": "succeeded"})
        return succeeded >= 10 * seconds

    await wait_until(done, seconds * 3 + 60, "every paced run succeeded")
    out: dict[str, Any] = {}
    for account in ("a", "b"):
        per_second: dict[int, int] = {}
        async for d in runs.find({"_id": {"$regex": f"^p-{account}-"}}):
            at = int((d.get("woken_at") or d["first_started_at"]).timestamp())
            per_second[at] = per_second.get(at, 0) + 1
        full = [per_second.get(s, 0) for s in range(min(per_second) + 1, max(per_second))]
        out[account] = (
            max(per_second.values()),
            sum(full) / len(full) if full else float("nan"),
            len(full),
        )
    return out


async def main_async(args: argparse.Namespace) -> int:
    print(
        f"# flow control benchmark: {platform.processor() or platform.machine()}, "
        f"python {sys.version.split()[0]}"
    )
    mongo = start_devmongo()
    broker = start_nats()
    try:
        # First, on a server that holds nothing yet: parking 10,000 runs is the
        # development server's work, and the parts after fill it.
        if args.crowd:
            starts = await fairness(mongo, broker.uri, args.crowd)
            print(
                f"\nfairness: {args.crowd:,} runs of one key at limit 2 ahead of 50 runs "
                f"of 50 other keys: those 50 started {min(starts):.1f} s to "
                f"{max(starts):.1f} s after the last publish (target: the first seconds)"
            )
        best = await throughput(mongo, broker.uri, args.fires, args.concurrency, args.rounds)
        print(
            f"\nworker, {args.fires:,} fires at concurrency {args.concurrency} "
            f"(best of {args.rounds})"
        )
        print("| concurrency key | seconds | runs/s |")
        print("|---|---|---|")
        for mode, seconds in best.items():
            print(f"| {mode} | {seconds:.2f} | {args.fires / seconds:,.0f} |")
        print(f"key / no key: {best['key'] / best['no key']:.2f}x (target <= 1.2x)")
        began = time.perf_counter()
        gaps = await hand_on(mongo, broker.uri, args.hot)
        print(
            f"\nhand-on, {args.hot} runs of one key at limit 1 through two workers "
            f"({time.perf_counter() - began:.1f} s): a slot freeing to the next run "
            f"starting: p50 {pct(gaps, 0.5) * 1000:.1f} ms, p99 {pct(gaps, 0.99) * 1000:.1f}"
            f" ms, max {max(gaps) * 1000:.1f} ms (target p99 < 50 ms)"
        )
        if args.rate_seconds:
            rates = await paced(mongo, broker.uri, args.rate_seconds)
            for account, (most, mean, seconds) in rates.items():
                print(
                    f"rate 5 a second, key {account}: at most {most} starts in a second, "
                    f"mean {mean:.2f} over {seconds} full seconds (target <= 5, close "
                    "to 5)"
                )
        if args.tenants:
            out = await fan_out(mongo, broker.uri, args.tenants, args.fires_per_tenant)
            print(
                f"\nfan-out to {args.tenants:,} tenants, run now {args.fires_per_tenant} "
                f"times: {out['runs']:,} runs at limit 3 per tenant through four workers "
                f"(one SIGKILLed a third of the way) in {out['seconds']:.1f} s: "
                f"{out['succeeded']:,} succeeded; most runs of one tenant at once: "
                f"{out['most']} (limit 3); runs started again after the kill: "
                f"{out['taken_over']}"
            )
    finally:
        broker.stop()
        mongo.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logs.configure("warning")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fires", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hot", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--fires-per-tenant", type=int, default=4)
    parser.add_argument("--rate-seconds", type=int, default=60)
    parser.add_argument("--crowd", type=int, default=10_000)
    return asyncio.run(main_async(args=parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
