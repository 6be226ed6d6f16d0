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
    for section in ("## Firing", "## Schedules", "## HTTP API", "## Cron",
                    "## Development MongoDB"):
        assert section in text
    for measure in ("TERM lease", "KILL first fire", "burst:",
                    "APScheduler p50 (baseline)", "propagation", "bytes/schedule",
                    "API rate / raw rate", "spawn to ready", "insert_one round trips/s",
                    "cronsim (baseline)", "plan 'latest'"):
        assert measure in text, measure
    assert text.count("Command: `python -m bench.") == 5
