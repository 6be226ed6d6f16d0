"""The benchmark entry point runs every benchmark and writes its report (small versions)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SECTIONS

ROOT = Path(__file__).resolve().parent.parent


# Benchmarks measure: on an otherwise idle machine (scripts/test).
@pytest.mark.alone
@pytest.mark.timeout(400)
def test_bench_entry_point_writes_every_section_with_its_baseline(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--jobs", "4", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    for section in (
        "## Firing",
        "## Schedules",
        "## HTTP API",
        "## Cron",
        "## Worker",
        "## Fan-out",
        "## High availability",
        "## RabbitMQ",
        "## Celery",
        "## Run control",
        "## Partitions and clocks",
        "## Schedules as code",
        "## Many teams",
        "## Tracing",
        "## Flow control",
        "## Ramp",
        "## Lease at ttl 1 s",
        "## Broker floor",
        "## Development MongoDB",
        "## Local cluster",
    ):
        assert section in text
    for measure in (
        "TERM lease",
        "KILL first fire",
        "burst:",
        "the broker's floor",
        "APScheduler p50 (baseline)",
        "propagation",
        "bytes/schedule",
        "API rate / raw rate",
        "spawn to ready",
        "signal to every process gone",
        "insert_one round trips/s",
        "cronsim (baseline)",
        "plan 'latest'",
        "raw nats-py consumer (ack only)",
        "raw aio-pika consumer (ack only)",
        "the handler's start",
        "one schedule fanning out",
        "bytes in a source mirror",
        "3-node cluster, stream R3",
        "SIGKILL of the NATS node leading the stream",
        "the database steps down",
        "raw aio-pika (baseline)",
        "copies beyond the first",
        "Celery send_task (baseline)",
        "Runs per fire id",
        "p99 skip / allow",
        "CPU during each window",
        "buffered p99",
        "backfill rate",
        "Partition against kill",
        "offset estimate's error",
        "apply / one by one",
        "create rate with the audit trail / without",
        "on / off",
        "key / no key",
        "a slot freeing to the next run starting",
        "fairness:",
        "rate 5 a second",
        "fan-out to 100 tenants",
        "highest sustained rate",
        "leadership changes",
        "watermark",
        "its first fire",
        "mirror / BSON",
        "raw find() drain",
        "plain inserts' worth",
        "the lowest p99 of a durable layout",
    ):
        # A benchmark that failed leaves its section without tables: its traceback is in
        # the entry point's stderr.
        assert measure in text, f"{measure}\n{done.stderr[-4000:]}"
    assert text.count("Command: `python -m bench.") == len(SECTIONS)
    assert (tmp_path / "ramp.png").stat().st_size > 0  # the ramp's plot, beside the report
    # --only reruns one benchmark and replaces its section, leaving the others.
    before, after = text.split("## Cron", 1)[0], text.split("## Worker", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "bench.cron_bench", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rerun = out.read_text()
    assert rerun.startswith(before)
    assert rerun.endswith(after)
    assert "plan 'latest'" in rerun
    cron = rerun.split("## Cron", 1)[1].split("## Worker", 1)[0]
    assert f" on {dt.date.today().isoformat()})." in cron  # the rerun section, dated
