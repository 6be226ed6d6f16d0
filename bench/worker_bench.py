"""Worker benchmark: throughput with the runs ledger, and due time to handler start.

    python -m bench.worker_bench [--fires 10000] [--concurrency 1,16] [--rounds 3]
                                 [--rate 1000] [--seconds 20]

Runs the development MongoDB server and a real nats-server as processes.

- Throughput: --fires fires already in the stream; one `hascheduler worker` process with a
  no-op async handler at each --concurrency (claim in the runs ledger, run, record, ack),
  from its start to the consumer's ack floor at the last message. Baseline, same run: a
  raw nats-py pull consumer fetching as many at a time and acknowledging each, no ledger.
  --rounds rounds of the two alternated, each with a consumer of its own; the median
  round of each is compared. CPU lines: the median round of ours.
- The same on RabbitMQ (--amqp-concurrency, default 16): --fires fires already in a
  quorum queue bound to the fire exchange, one `hascheduler worker --broker amqp://...`
  from its start until the queue is empty and every run recorded; baseline, same run: a
  raw aio-pika consumer of another queue holding the same messages, with the worker's
  prefetch, acknowledging each; --rounds rounds alternated, medians compared. Target:
  within 1.3x of the raw consumer on either broker.
- Latency: --rate schedules firing every second for --seconds, one replica leading and one
  worker (concurrency 16) whose handler notes when it starts; handler start minus due
  time. Baseline, same run: the scheduler half alone, publish-acknowledged minus due time
  (the fire ledger), so the difference is what the broker's delivery and the run's claim
  add.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pymongo import AsyncMongoClient

from bench.devmongo_bench import cpu_seconds, pct
from bench.firing_bench import Cluster, schedule_doc
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream
from hascheduler.process import logs
from hascheduler.worker import Run, WorkerApp
from hascheduler.worker.claiming import pushed_prefetch
from tests.servers import RabbitServer, ServerProcess, start_devmongo, start_nats, with_database
from tests.waiting import wait_until

STREAM = "HASCHEDULER"
SUBJECT = "hascheduler.fire.bench.noop"

app = WorkerApp()


@app.handler("bench.>")
async def noted(run: Run) -> None:
    """No work; with BENCH_STARTS set, note how late after its due time the run started."""
    path = os.environ.get("BENCH_STARTS")
    if path and run.nominal_at is not None:
        with open(path, "a") as out:  # noqa: ASYNC230 - a short append is the measurement
            nominal = run.nominal_at.timestamp()
            out.write(f"{nominal:.3f} {time.time() - nominal:.6f}\n")


def event(i: int, nominal: dt.datetime, sampled_one_in: int | None = None) -> bytes:
    """A fire's CloudEvent; with ``sampled_one_in``, traced as a leader sampling that
    share of its fires sends it (every fire has a traceparent, one in so many sampled)."""
    fire_id = f"bench-{i}@{nominal.isoformat()}"
    fields: dict[str, Any] = {}
    if sampled_one_in is not None:
        flags = "01" if i % sampled_one_in == 0 else "00"
        fields["traceparent"] = f"00-{i + 1:032x}-{i + 1:016x}-{flags}"
    return json.dumps(
        {
            "specversion": "1.0",
            "id": fire_id,
            "source": "/hascheduler",
            "type": "io.hascheduler.fire",
            "subject": f"bench-{i}",
            **fields,
            "data": {
                "schedule_id": f"bench-{i}",
                "term": 1,
                "payload": {},
                "nominal_at": nominal.isoformat(),
            },
        }
    ).encode()


async def fill_stream(nats_uri: str, fires: int, sampled_one_in: int | None = None) -> int:
    """Publish ``fires`` fires (pipelined, each acknowledged); the last stream sequence."""
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await nats.connect(endpoint.servers)
    try:
        js = nc.jetstream()
        await ensure_stream(js, endpoint)
        nominal = dt.datetime.now(dt.UTC)
        last = 0
        for start in range(0, fires, 500):
            acks = await asyncio.gather(
                *(
                    js.publish(
                        SUBJECT, event(i, nominal, sampled_one_in), headers={"Nats-Msg-Id": f"m{i}"}
                    )
                    for i in range(start, min(fires, start + 500))
                )
            )
            last = max(a.seq for a in acks)
        return last
    finally:
        await nc.close()


async def empty_stream(nats_uri: str) -> None:
    """Purge the fires stream: a new durable starts at its first message, and what the
    throughput phases left there would queue ahead of the fires being measured."""
    nc = await nats.connect(NatsEndpoint.parse(nats_uri).servers)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().purge_stream(STREAM)
    finally:
        await nc.close()


async def acked_through(js: Any, durable: str, last: int) -> bool:
    try:
        info = await js.consumer_info(STREAM, durable)
    except nats.js.errors.NotFoundError:  # the worker has not created it yet
        return False
    return bool(info.ack_floor.stream_seq >= last and info.num_ack_pending == 0)


async def pull_consumer(nc: Any, durable: str, subject: str, **config: Any) -> Any:
    """A durable pull subscription on the fires stream, filtered to ``subject`` (the
    other ConsumerConfig fields as given)."""
    js = nc.jetstream()
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name=durable, filter_subject=subject, **config)
    )
    return await js.pull_subscribe_bind(durable=durable, stream=STREAM)


async def raw_consumer(nats_uri: str, concurrency: int, last: int, durable: str = "") -> float:
    nc = await nats.connect(nats_uri)
    try:
        sub = await pull_consumer(
            nc,
            durable or f"raw-{concurrency}",
            SUBJECT,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
        )
        started = time.perf_counter()
        done = 0
        while done < last:
            messages = await sub.fetch(concurrency, timeout=5)
            await asyncio.gather(*(m.ack_sync() for m in messages))
            done += len(messages)
        return time.perf_counter() - started
    finally:
        await nc.close()


AMQP_TARGET = "bench.noop"


def start_worker(
    broker: str, mongo_uri: str, durable: str, concurrency: int, env: dict[str, str] | None = None
) -> Any:
    """``hascheduler worker`` on this module's app, its stdout piped (it announces itself
    there once consuming); ``env`` added to ours."""
    return asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hascheduler.cli",
        "--log-level",
        "warning",
        "worker",
        "--broker",
        broker,
        "--mongodb-uri",
        mongo_uri,
        "--app",
        "bench.worker_bench:app",
        "--durable",
        durable,
        "--concurrency",
        str(concurrency),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


async def timed_worker(
    broker: str,
    mongo: ServerProcess,
    mongo_uri: str,
    durable: str,
    concurrency: int,
    done: Callable[[], Awaitable[bool]],
    env: dict[str, str] | None = None,
) -> tuple[float, float, float]:
    """Seconds from the worker's announcement (consuming) until ``done``, and the CPU
    seconds the worker and the development server spent meanwhile; the worker stopped
    after."""
    worker = await start_worker(broker, mongo_uri, durable, concurrency, env)
    try:
        assert worker.stdout is not None
        await asyncio.wait_for(worker.stdout.readline(), 90)
        started = time.perf_counter()
        cpu = cpu_seconds(worker.pid), cpu_seconds(mongo.pid)
        await wait_until(done, 300, "the worker to be done", 0.02)
        return (
            time.perf_counter() - started,
            cpu_seconds(worker.pid) - cpu[0],
            cpu_seconds(mongo.pid) - cpu[1],
        )
    finally:
        worker.terminate()
        await worker.wait()


async def our_worker(
    nats_uri: str,
    mongo: ServerProcess,
    database: str,
    concurrency: int,
    last: int,
    env: dict[str, str] | None = None,
    durable: str | None = None,
) -> tuple[float, float, float]:
    """Seconds to acknowledge every fire, and the CPU seconds the worker and the
    development server spent meanwhile (``env`` added to the worker's environment)."""
    durable = durable or f"ours-{concurrency}"
    nc = await nats.connect(nats_uri)
    js = nc.jetstream()
    try:
        return await timed_worker(
            nats_uri,
            mongo,
            with_database(mongo.uri, database),
            durable,
            concurrency,
            lambda: acked_through(js, durable, last),
            env,
        )
    finally:
        await nc.close()


async def throughput(
    mongo: ServerProcess, nats_uri: str, fires: int, levels: list[int], rounds: int
) -> list[dict[str, Any]]:
    """At each concurrency, ``rounds`` rounds alternating the raw consumer and ours, each
    a consumer of its own reading the whole stream (ours on a runs ledger of its own):
    the median round of each, so that a slow second on this shared machine decides
    neither."""
    last = await fill_stream(nats_uri, fires)
    rows = []
    for concurrency in levels:
        raws: list[float] = []
        ours: list[tuple[float, float, float]] = []
        for round_ in range(rounds):
            raws.append(
                await raw_consumer(nats_uri, concurrency, last, f"raw-{concurrency}-{round_}")
            )
            ours.append(
                await our_worker(
                    nats_uri,
                    mongo,
                    f"wb_{concurrency}_{round_}",
                    concurrency,
                    last,
                    durable=f"ours-{concurrency}-{round_}",
                )
            )
        raw = statistics.median(raws)
        mine, worker_cpu, mongo_cpu = sorted(ours)[len(ours) // 2]
        rows.append(
            {
                "concurrency": concurrency,
                "fires": last,
                "raw_s": raw,
                "ours_s": mine,
                "raw_per_s": last / raw,
                "ours_per_s": last / mine,
                "ratio": mine / raw,
                "worker_cpu_s": worker_cpu,
                "mongo_cpu_s": mongo_cpu,
                "raw_rounds": raws,
                "ours_rounds": [o[0] for o in ours],
            }
        )
    return rows


async def amqp_throughput(
    mongo: ServerProcess, fires: int, concurrency: int, rounds: int
) -> dict[str, Any]:
    """Raw aio-pika against `hascheduler worker` on RabbitMQ, each draining ``fires``
    messages already queued (the same messages, published to both queues at once), in
    ``rounds`` rounds (ours on a runs ledger of its own each): the median round of each."""
    rabbit = RabbitServer().start()
    try:
        durable, raw_queue = f"ours-amqp-{concurrency}", f"raw-amqp-{concurrency}"
        # The worker declares its queue (quorum, a dead-letter exchange) and binds it: once
        # started and stopped, the queue is there to fill.
        worker = await start_worker(
            rabbit.url, with_database(mongo.uri, "wb_amqp_declare"), durable, concurrency
        )
        assert worker.stdout is not None
        await asyncio.wait_for(worker.stdout.readline(), 90)
        worker.terminate()
        await worker.wait()
        raws: list[float] = []
        ours: list[tuple[float, float, float]] = []
        for round_ in range(rounds):
            connection = await aio_pika.connect(rabbit.url)
            try:
                channel = await connection.channel(publisher_confirms=True)
                exchange = await channel.declare_exchange(
                    "hascheduler", aio_pika.ExchangeType.TOPIC, durable=True
                )
                raw = await channel.declare_queue(
                    raw_queue, durable=True, arguments={"x-queue-type": "quorum"}
                )
                await raw.bind(exchange, AMQP_TARGET)
                nominal = dt.datetime.now(dt.UTC)
                for start in range(0, fires, 500):
                    await asyncio.gather(
                        *(
                            exchange.publish(
                                aio_pika.Message(
                                    event(i, nominal),
                                    message_id=f"bench-{i}",
                                    content_type="application/json",
                                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                ),
                                routing_key=AMQP_TARGET,
                            )
                            for i in range(start, min(fires, start + 500))
                        )
                    )
                raws.append(await raw_amqp_consumer(connection, raw_queue, concurrency, fires))
            finally:
                await connection.close()
            ours.append(
                await amqp_worker(
                    rabbit.url,
                    mongo,
                    with_database(mongo.uri, f"wb_amqp_{concurrency}_{round_}"),
                    durable,
                    concurrency,
                    fires,
                )
            )
        raw_s = statistics.median(raws)
        ours_s, worker_cpu, mongo_cpu = sorted(ours)[len(ours) // 2]
        return {
            "concurrency": concurrency,
            "fires": fires,
            "raw_s": raw_s,
            "ours_s": ours_s,
            "raw_per_s": fires / raw_s,
            "ours_per_s": fires / ours_s,
            "ratio": ours_s / raw_s,
            "worker_cpu_s": worker_cpu,
            "mongo_cpu_s": mongo_cpu,
            "raw_rounds": raws,
            "ours_rounds": [o[0] for o in ours],
        }
    finally:
        rabbit.close()


async def raw_amqp_consumer(
    connection: Any, queue_name: str, concurrency: int, fires: int
) -> float:
    """Seconds for a raw aio-pika consumer (the prefetch of a worker of ``concurrency``)
    to receive and acknowledge ``fires`` messages."""
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=pushed_prefetch(concurrency))
    queue = await channel.declare_queue(queue_name, passive=True)
    done = asyncio.Event()
    count = 0

    async def on_message(message: Any) -> None:
        nonlocal count
        await message.ack()
        count += 1
        if count == fires:
            done.set()

    started = time.perf_counter()
    await queue.consume(on_message)
    await asyncio.wait_for(done.wait(), 300)
    elapsed = time.perf_counter() - started
    await channel.close()
    return elapsed


async def amqp_worker(
    url: str, mongo: ServerProcess, mongo_uri: str, durable: str, concurrency: int, fires: int
) -> tuple[float, float, float]:
    """Seconds from the worker's start until its queue is empty and every run succeeded;
    the CPU seconds of the worker and the development server meanwhile."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        runs = client.get_default_database().runs

        async def done() -> bool:
            queue = await channel.declare_queue(durable, passive=True)
            return (
                queue.declaration_result.message_count == 0
                and await runs.count_documents({"state": "succeeded"}) >= fires
            )

        return await timed_worker(url, mongo, mongo_uri, durable, concurrency, done)
    finally:
        await connection.close()
        await client.close()


async def latency(mongo: ServerProcess, nats_uri: str, rate: int, seconds: float) -> dict[str, Any]:
    database = "wb_latency"
    await empty_stream(nats_uri)
    c = Cluster(mongo, nats_uri, database)
    starts = Path(tempfile.mkdtemp(prefix="worker-bench-")) / "starts.txt"
    worker = await start_worker(nats_uri, c.uri, "latency", 16, {"BENCH_STARTS": str(starts)})
    try:
        assert worker.stdout is not None
        await asyncio.wait_for(worker.stdout.readline(), 60)
        c.start("a")
        await c.wait_ready()
        await c.write_when_leading(
            [
                schedule_doc(
                    f"tick-{i}",
                    {"kind": "cron", "cron": "* * * * * *", "timezone": "UTC"},
                    "bench.tick",
                )
                for i in range(rate)
            ]
        )
        await c.wait_firing()
        begin = dt.datetime.now(dt.UTC)
        await asyncio.sleep(seconds)  # the window itself, not a wait for something
        end = dt.datetime.now(dt.UTC)
        await c.wait_landed({"due_at": {"$gte": begin, "$lt": end}})
        fires = [
            f
            async for f in c.db.fires.find(
                {"due_at": {"$gte": begin, "$lt": end}, "state": "published"},
                {"published_at": 1, "due_at": 1},
            )
        ]
        published = [(f["published_at"] - f["due_at"]).total_seconds() for f in fires]

        def start_lateness() -> list[float]:
            lines = starts.read_text().splitlines() if starts.exists() else []
            return [
                float(late)
                for nominal, late in (line.split() for line in lines)
                if begin.timestamp() <= float(nominal) < end.timestamp()
            ]

        async def all_started() -> bool:  # the window's last fires reach the worker
            return len(start_lateness()) >= len(fires)

        with contextlib.suppress(AssertionError):  # fewer starts are reported as such
            await wait_until(all_started, 30, "the window's handlers started", 0.2)
        started_late = start_lateness()
        return {
            "rate": rate,
            "seconds": seconds,
            "fires": len(fires),
            "handler_starts": len(started_late),
            "start_p50": pct(started_late, 0.5),
            "start_p99": pct(started_late, 0.99),
            "publish_p50": pct(published, 0.5),
            "publish_p99": pct(published, 0.99),
        }
    finally:
        worker.terminate()
        await worker.wait()
        await c.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


async def main_async(args: argparse.Namespace) -> int:
    mongo = start_devmongo()
    broker = start_nats()
    try:
        rows = await throughput(mongo, broker.uri, args.fires, args.concurrency, args.rounds)
        print(
            "| worker, no-op handler | fires | raw nats-py consumer (ack only) | "
            "`hascheduler worker` (claim, run, record, ack) | ours / raw |"
        )
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| concurrency {r['concurrency']} | {r['fires']:,} | {r['raw_s']:.2f} s "
                f"({r['raw_per_s']:,.0f}/s) | {r['ours_s']:.2f} s ({r['ours_per_s']:,.0f}/s)"
                f" | {r['ratio']:.2f}x |"
            )
        print()
        for r in rows:
            print(
                f"rounds at concurrency {r['concurrency']}, alternated (the table: the "
                f"median of each): raw {', '.join(f'{t:.2f} s' for t in r['raw_rounds'])};"
                f" ours {', '.join(f'{t:.2f} s' for t in r['ours_rounds'])}."
            )
        print()
        for r in rows:
            print(
                f"CPU while `hascheduler worker` ran at concurrency {r['concurrency']}: the "
                f"worker {r['worker_cpu_s']:.2f} s, the development MongoDB server "
                f"{r['mongo_cpu_s']:.2f} s ({r['mongo_cpu_s'] / r['ours_s']:.0%} of a core; "
                f"{r['mongo_cpu_s'] / r['fires'] * 1e6:.0f} us per run for its claim and "
                "its record)."
            )
        if args.amqp_concurrency:
            r = await amqp_throughput(mongo, args.fires, args.amqp_concurrency, args.rounds)
            print()
            print(
                "| worker on RabbitMQ, no-op handler | fires | raw aio-pika consumer (ack only) "
                "| `hascheduler worker` (claim, run, record, ack) | ours / raw |"
            )
            print("|---|---|---|---|---|")
            print(
                f"| concurrency {r['concurrency']} | {r['fires']:,} | {r['raw_s']:.2f} s "
                f"({r['raw_per_s']:,.0f}/s) | {r['ours_s']:.2f} s ({r['ours_per_s']:,.0f}/s)"
                f" | {r['ratio']:.2f}x |"
            )
            print()
            print(
                f"rounds on RabbitMQ, alternated (the table: the median of each): raw "
                f"{', '.join(f'{t:.2f} s' for t in r['raw_rounds'])}; ours "
                f"{', '.join(f'{t:.2f} s' for t in r['ours_rounds'])}."
            )
            print()
            print(
                f"CPU while `hascheduler worker` ran on RabbitMQ (its median round): the worker "
                f"{r['worker_cpu_s']:.2f} s, the development MongoDB server "
                f"{r['mongo_cpu_s']:.2f} s ({r['mongo_cpu_s'] / r['fires'] * 1e6:.0f} us per "
                "run)."
            )
        late = await latency(mongo, broker.uri, args.rate, args.seconds)
        print()
        print("| due time to ... | fires/s | fires | p50 | p99 |")
        print("|---|---|---|---|---|")
        print(
            f"| published and acknowledged (the scheduler alone, baseline) | {late['rate']:,} | "
            f"{late['fires']:,} | {_ms(late['publish_p50'])} | {_ms(late['publish_p99'])} |"
        )
        print(
            f"| the handler's start (broker delivery and the run's claim added) | "
            f"{late['rate']:,} | {late['handler_starts']:,} | {_ms(late['start_p50'])} | "
            f"{_ms(late['start_p99'])} |"
        )
    finally:
        broker.stop()
        mongo.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--fires", type=int, default=10_000)
    parser.add_argument(
        "--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16]
    )
    parser.add_argument(
        "--amqp-concurrency",
        type=int,
        default=16,
        help="the RabbitMQ comparison's concurrency (0: skip it)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of raw and ours alternated at each concurrency",
    )
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    logs.configure("warning")  # to stderr: stdout is the report
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
