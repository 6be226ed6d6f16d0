"""The guard against time bombs: the tests that reason about dates run again with the clock
moved years ahead, to just before a DST change and to a year's last seconds.

A test that compares a fixed calendar date with the wall clock passes on the day it is
written and fails on some later day; here it fails at once. The files listed are those whose
tests run in this process (another process keeps the real clock).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests.conftest import TRAVEL_ENV

ROOT = Path(__file__).resolve().parent.parent
DATE_SENSITIVE = [
    "tests/test_triggers.py",
    "tests/test_cron.py",
    "tests/test_catchup.py",
    "tests/test_fire_queue.py",
    "tests/test_events.py",
    "tests/test_dispatch.py",
    "tests/test_chaos.py",
    "tests/test_mirror.py",
    "tests/test_api.py",
]
# Runs a cluster of processes, which keep the real clock.
SOAK = "tests/test_chaos.py::test_short_soak_loses_duplicates_and_fires_early_nothing"


def next_offset_change(zone: str, after: dt.datetime) -> dt.datetime:
    """The first whole hour after ``after`` at which ``zone``'s UTC offset differs from the
    hour before (a DST change)."""
    tz = ZoneInfo(zone)
    hour = after.replace(minute=0, second=0, microsecond=0)
    for _ in range(24 * 400):
        nxt = hour + dt.timedelta(hours=1)
        if hour.astimezone(tz).utcoffset() != nxt.astimezone(tz).utcoffset():
            return nxt
        hour = nxt
    raise AssertionError(f"{zone} has no offset change within 400 days")


def destinations(now: dt.datetime) -> dict[str, dt.datetime]:
    years_ahead = now + dt.timedelta(days=7 * 365 + 123)
    return {
        "seven years ahead": years_ahead,
        "before a DST change in Paris": next_offset_change("Europe/Paris", years_ahead)
        - dt.timedelta(seconds=3),
        "a year's last seconds": dt.datetime(years_ahead.year, 12, 31, 23, 59, 57, tzinfo=dt.UTC),
    }


def test_destinations_are_what_they_say() -> None:
    now = dt.datetime(2026, 11, 23, 12, tzinfo=dt.UTC)
    change = next_offset_change("Europe/Paris", now)
    assert change == dt.datetime(2027, 3, 28, 1, tzinfo=dt.UTC)  # 02:00 CET -> 03:00 CEST
    assert next_offset_change("Europe/Paris", change) == dt.datetime(2027, 10, 31, 1, tzinfo=dt.UTC)


@pytest.mark.long(41)
@pytest.mark.timeout(300)
def test_date_sensitive_tests_pass_with_the_clock_moved() -> None:
    """One pytest process per destination, all at once: they run pure tests only (nothing
    timed), so they share the cores without changing a result."""
    runs = {}
    for name, destination in destinations(dt.datetime.now(dt.UTC)).items():
        env = {**os.environ, TRAVEL_ENV: destination.isoformat()}
        runs[name] = (
            destination,
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-x",
                    "--deselect",
                    SOAK,
                    *DATE_SENSITIVE,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
    failed = []
    try:
        for name, (destination, process) in runs.items():
            out, _ = process.communicate(timeout=280)
            if process.returncode != 0 or " passed" not in out:
                failed.append(f"{name}, the clock at {destination}:\n{out[-4000:]}")
    finally:
        for _, process in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not failed, "\n\n".join(failed)
