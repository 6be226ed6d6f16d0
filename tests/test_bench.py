"""The benchmark entry point runs every benchmark and writes its report (small versions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_bench_entry_point_writes_every_section_with_its_baseline(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    for section in ("## Firing", "## Schedules", "## HTTP API", "## Cron", "## Worker",
                    "## Development MongoDB"):
        assert section in text
    for measure in ("TERM lease", "KILL first fire", "burst:",
                    "APScheduler p50 (baseline)", "propagation", "bytes/schedule",
                    "API rate / raw rate", "spawn to ready", "insert_one round trips/s",
                    "cronsim (baseline)", "plan 'latest'", "raw nats-py consumer (ack only)",
                    "the handler's start"):
        assert measure in text, measure
    assert text.count("Command: `python -m bench.") == 6


@pytest.mark.timeout(200)
def test_bench_only_replaces_one_section(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Worker: throughput with the runs ledger, due time to "
                   "handler start\n\nold figures\n\n## Development MongoDB server\n\nkept\n")
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only",
                           "bench.worker_bench", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert "old figures" not in text
    assert "the handler's start" in text
    assert text.endswith("## Development MongoDB server\n\nkept\n")
