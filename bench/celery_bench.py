"""Celery end to end: fires due together, each run by an unmodified Celery worker as its own
task, against the same tasks sent with Celery's own ``send_task``.

    python -m bench.celery_bench [--fires 1000] [--lead 8] [--processes 2]

Runs a RabbitMQ node (Debian's rabbitmq-server, our child), the development MongoDB server,
three `hascheduler serve` replicas (bench.firing_bench's timings) and a `celery worker`
(prefork, --processes, acks_late, prefetch 1: what docs/FIRING.md asks of Celery users) on
the app tests/helpers/celery_app.py, whose task records each run with its time.

- Baseline: --fires tasks sent with the app's ``send_task`` from one process, from the
  first send until the worker has run the last.
- Scheduled: --fires one-off schedules with a ``celery:`` target due in the same second,
  from that second until the worker has run the last; each fire's task id is its fire id,
  so the runs per fire id are counted too (exactly one each here: no failover).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bench.firing_bench import due_after_leading, schedule_doc, started_cluster
from tests.servers import CeleryWorker, RabbitServer, start_devmongo
from tests.waiting import wait_until

TASK = "tests.helpers.celery_app.record"


async def all_ran(
    worker: CeleryWorker, marker: str, n: int, within_s: float
) -> list[dict[str, Any]]:
    """The worker's runs carrying ``marker`` once there are ``n`` of them (polled slowly:
    the worker and this loop share two cores)."""

    def ran() -> list[dict[str, Any]] | None:
        found = [r for r in worker.runs() if r["args"][:1] == [marker]]
        return found if len(found) >= n else None

    found: list[dict[str, Any]] = await wait_until(ran, within_s, f"{n} {marker} runs", 0.25)
    return found


def send_tasks(url: str, queue: str, n: int) -> float:
    """Celery's own way: ``send_task`` n times; the wall-clock time of the first send."""
    from celery import Celery

    app = Celery("bench_sender", broker=url)
    app.conf.update(task_serializer="json", result_backend=None)
    started = time.time()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            app.send_task(TASK, args=["send_task", i], queue=queue, producer=producer)
    return started


async def main_async(args: argparse.Namespace) -> int:
    mongo = start_devmongo()
    rabbit = RabbitServer().start()
    queue = f"celery-bench-{uuid.uuid4().hex[:8]}"
    record = Path(tempfile.mkdtemp(prefix="celery-bench-")) / "runs.jsonl"
    worker = CeleryWorker(rabbit.url, [queue], record, processes=args.processes)
    n = args.fires
    try:
        await worker.consuming(60)
        # Warm the worker's processes before either measurement.
        send_tasks(rabbit.url, queue, 20)
        await all_ran(worker, "send_task", 20, 60)
        record.unlink()

        first_send = send_tasks(rabbit.url, queue, n)
        baseline = max(r["ran_at"] for r in await all_ran(worker, "send_task", n, 300))
        baseline_s = baseline - first_send

        def schedules(due: dt.datetime) -> list[dict[str, Any]]:
            return [
                {
                    **schedule_doc(f"c{i:05d}", {"kind": "at", "at": [due]}, f"celery:{TASK}"),
                    "payload": {"args": ["scheduled", i]},
                }
                for i in range(n)
            ]

        cluster = await started_cluster(
            mongo, f"{rabbit.url}?celery_queue={queue}", "bench_celery", []
        )
        try:
            due = await due_after_leading(cluster, args.lead, schedules)
            scheduled = await all_ran(worker, "scheduled", n, 300)
        finally:
            await cluster.close()
        scheduled_s = max(r["ran_at"] for r in scheduled) - due.timestamp()
        per_fire = Counter(r["id"] for r in scheduled)
    finally:
        worker.stop()
        rabbit.close()
        mongo.stop()
    print(
        f"| {n:,} tasks to all run by a {args.processes}-process Celery worker | seconds "
        "| tasks/s | vs send_task |"
    )
    print("|---|---|---|---|")
    print(
        f"| Celery send_task (baseline): first send to last run | {baseline_s:.2f} | "
        f"{n / baseline_s:,.0f} | 1.00x |"
    )
    print(
        f"| hascheduler, 3 replicas: due time to last run | {scheduled_s:.2f} | "
        f"{n / scheduled_s:,.0f} | {scheduled_s / baseline_s:.2f}x |"
    )
    print()
    print(
        f"Runs per fire id: {len(per_fire):,} fire ids, "
        f"{sum(per_fire.values()) - len(per_fire)} run more than once."
    )
    return 0 if len(per_fire) == n else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fires", type=int, default=1000)
    parser.add_argument(
        "--lead",
        type=float,
        default=8.0,
        help="seconds from writing the schedules (once the replicas lead) to the fires' due time",
    )
    parser.add_argument("--processes", type=int, default=2)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
