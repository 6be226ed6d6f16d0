"""Schedules as code: `hascheduler apply` of many schedules, and a no-op apply.

    python -m bench.apply_bench [--schedules 10000]

The development MongoDB server and one replica (writes unlimited). --schedules
declarations (a cron each, labelled team=bench) applied to an empty cluster, against the
same schedules created one request at a time through the client into another database of
the same server, same run; then `apply` of the same file again (nothing to do), and the
plan alone.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from hascheduler.cli.apply import plan_files
from hascheduler.client import Client
from hascheduler.client.apply import execute
from hascheduler.process import logs
from tests.servers import ServerProcess, start_devmongo, start_replica, with_database

SELECTOR = ("team", "bench")


def declaration(i: int) -> dict[str, Any]:
    return {
        "id": f"bench-{i:05d}",
        "name": f"bench {i}",
        "target": f"bench.s{i % 100}",
        "trigger": {"kind": "cron", "cron": f"{i % 60} {i % 24} * * *", "timezone": "Europe/Paris"},
        "payload": {"n": i},
        "labels": {"team": "bench"},
    }


def replica(mongo: ServerProcess, database: str) -> ServerProcess:
    return start_replica(with_database(mongo.uri, database), database, "--write-rate", "0")


def timed_apply(api: Client, path: Path) -> tuple[float, int]:
    """What `hascheduler apply -f PATH --prune --selector team=bench` does, timed."""
    started = time.perf_counter()
    outcome = execute(api, plan_files(api, [str(path)], SELECTOR, prune=True)[0])
    assert not outcome.failed, outcome.failed[:3]
    return time.perf_counter() - started, len(outcome.done)


def run(args: argparse.Namespace) -> str:
    path = Path(tempfile.mkdtemp(prefix="apply-bench-")) / "schedules.yaml"
    items = [declaration(i) for i in range(args.schedules)]
    path.write_text(yaml.safe_dump_all(items, sort_keys=False))
    mongo = start_devmongo()
    applied, one_by_one = replica(mongo, "apply_bench"), replica(mongo, "create_bench")
    try:
        with Client(applied.uri) as api:
            apply_s, written = timed_apply(api, path)
            noop_s, rewritten = timed_apply(api, path)
            started = time.perf_counter()
            steps, _ = plan_files(api, [str(path)], SELECTOR, prune=True)
            plan_s = time.perf_counter() - started
            assert all(s.action == "unchanged" for s in steps)
        with Client(one_by_one.uri) as api:
            started = time.perf_counter()
            for item in items:
                api.create_schedule(item)
            create_s = time.perf_counter() - started
    finally:
        for process in (applied, one_by_one, mongo):
            process.stop(signal.SIGKILL)
    n = args.schedules
    return "\n".join(
        [
            "| what | schedules | seconds | per second |",
            "|---|---|---|---|",
            f"| apply to an empty cluster | {written:,} | {apply_s:.2f} | {n / apply_s:,.0f} |",
            f"| the same, one create request each through the client (baseline) | {n:,} | "
            f"{create_s:.2f} | {n / create_s:,.0f} |",
            f"| apply again: nothing to do ({rewritten} written) | {n:,} | {noop_s:.2f} | "
            f"{n / noop_s:,.0f} |",
            f"| of which the plan (read the file, check it, read the cluster) | {n:,} | "
            f"{plan_s:.2f} | |",
            "",
            f"apply / one by one: {create_s / apply_s:.2f}x faster (target >= 5x); no-op apply "
            f"{noop_s:.2f} s (target < 2 s)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.apply_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--schedules", type=int, default=10_000)
    args = parser.parse_args(argv)
    if args.schedules < 1:
        parser.error("--schedules: at least 1")
    logs.configure("warning")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
