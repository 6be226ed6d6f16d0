"""Flow control's cost and promptness: worker throughput with a concurrency key whose limit
is never reached against no key, and the time from a slot freeing to the next parked run
of its key starting.

    python -m bench.flow_bench [--fires 10000] [--concurrency 16] [--rounds 3]
                               [--hot 500]

Runs the development MongoDB server and a real nats-server, as bench/worker_bench.py does.

- Throughput: --fires fires in the stream, without a key, and with the schedule's key
  ``{target}`` at limit 1,000 (so every run takes and frees a slot, and none waits); a
  `hascheduler worker` at --concurrency consumes them all, the two alternated --rounds
  times, the best of each kept. Target: with the key within 1.2x of without.
- Hand-on: --hot runs of one key at limit 1, each taking no time, through two workers:
  every run but the first waits parked, and is woken when the one before it ends. From
  the handler's records, each run's start minus the previous run's end. Target: p99 under
  50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from bench.devmongo_bench import pct
from bench.worker_bench import our_worker
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream
from hascheduler.process import logs
from tests.servers import ServerProcess, start_devmongo, start_nats, with_database
from tests.waiting import wait_until

STREAM = "HASCHEDULER"


def event(fire_id: str, target: str, payload: dict[str, Any],
          concurrency: dict[str, Any] | None) -> bytes:
    now = dt.datetime.now(dt.UTC).isoformat()
    data: dict[str, Any] = {"schedule_id": fire_id.partition("@")[0], "term": 1,
                            "nominal_at": now, "payload": payload}
    if concurrency is not None:
        data["concurrency"] = concurrency
    return json.dumps({"specversion": "1.0", "id": fire_id, "source": "/hascheduler",
                       "type": "io.hascheduler.fire", "subject": data["schedule_id"],
                       "data": data}).encode()


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
            acks = await asyncio.gather(*(
                js.publish(subject, body, headers={"Nats-Msg-Id": json.loads(body)["id"]})
                for subject, body in messages[start:start + 500]))
            last = max(a.seq for a in acks)
        return last
    finally:
        await nc.close()


async def throughput(mongo: ServerProcess, nats_uri: str, fires: int, concurrency: int,
                     rounds: int) -> dict[str, float]:
    best: dict[str, float] = {}
    key = {"key": "{target}", "limit": 1000}
    for n in range(rounds):
        for mode in ("no key", "key"):
            last = await fill(nats_uri, [
                ("hascheduler.fire.bench.noop",
                 event(f"f{n}{mode[0]}{i}@x", "bench.noop", {},
                       key if mode == "key" else None)) for i in range(fires)])
            seconds, _, _ = await our_worker(nats_uri, mongo, f"fb_{n}_{mode[0]}",
                                             concurrency, last,
                                             durable=f"fb-{n}-{mode.replace(' ', '')}")
            best[mode] = min(best.get(mode, seconds), seconds)
    return best


async def hand_on(mongo: ServerProcess, nats_uri: str, hot: int) -> list[float]:
    """Start of each run of the hot key minus the end of the one before it, seconds."""
    record = Path(tempfile.mkdtemp()) / "flow.txt"
    database = "fb_hot"
    await fill(nats_uri, [("hascheduler.fire.flow.hot",
                           event(f"hot-{i}@x", "flow.hot", {"account": "hot"},
                                 {"key": "{payload.account}", "limit": 1}))
                          for i in range(hot)])
    workers = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hascheduler.cli", "--log-level", "warning", "worker",
        "--broker", nats_uri, "--mongodb-uri", with_database(mongo.uri, database),
        "--app", "tests.helpers.flow_handler:app", "--durable", "fb-hot",
        "--worker-id", f"w{w}", "--concurrency", "16",
        env={**os.environ, "RECORD_FLOW_TO": str(record)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        for w in range(2)]
    try:
        for worker in workers:
            assert worker.stdout is not None
            await asyncio.wait_for(worker.stdout.readline(), 60)

        def ended() -> bool:
            return record.exists() and record.read_text().count("end ") >= hot
        await wait_until(ended, 600.0, "every hot run ended")
    finally:
        for worker in workers:
            worker.terminate()
            await worker.wait()
    lines = [line.split() for line in record.read_text().splitlines()]
    starts = sorted(float(at) for what, _, _, at in lines if what == "start")
    ends = sorted(float(at) for what, _, _, at in lines if what == "end")
    # Limit 1: runs alternate start, end, start ...; each start after the first follows
    # the end just before it.
    return [start - end for start, end in zip(starts[1:], ends, strict=False)]


async def main_async(args: argparse.Namespace) -> int:
    print(f"# flow control benchmark: {platform.processor() or platform.machine()}, "
          f"python {sys.version.split()[0]}")
    mongo = start_devmongo()
    broker = start_nats()
    try:
        best = await throughput(mongo, broker.uri, args.fires, args.concurrency, args.rounds)
        print(f"\nworker, {args.fires:,} fires at concurrency {args.concurrency} "
              f"(best of {args.rounds})")
        print("| concurrency key | seconds | runs/s |")
        print("|---|---|---|")
        for mode, seconds in best.items():
            print(f"| {mode} | {seconds:.2f} | {args.fires / seconds:,.0f} |")
        print(f"key / no key: {best['key'] / best['no key']:.2f}x (target <= 1.2x)")
        began = time.perf_counter()
        gaps = await hand_on(mongo, broker.uri, args.hot)
        print(f"\nhand-on, {args.hot} runs of one key at limit 1 through two workers "
              f"({time.perf_counter() - began:.1f} s): a slot freeing to the next run "
              f"starting: p50 {pct(gaps, .5) * 1000:.1f} ms, p99 {pct(gaps, .99) * 1000:.1f}"
              f" ms, max {max(gaps) * 1000:.1f} ms (target p99 < 50 ms)")
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
    return asyncio.run(main_async(args=parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
