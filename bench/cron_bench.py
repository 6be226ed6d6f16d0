"""Cron benchmark: the cost of one next-fire computation, of refusing an impossible
expression, and of a catch-up plan after a long outage.

    python -m bench.cron_bench [--calls 2000] [--days 1,30,365]

Next fire: for each kind of expression, the mean time of one uncached next-fire computation
in Europe/Paris from instants spread over a year. Baselines in the same run: APScheduler 3's
CronTrigger in the zone (where one trigger can say the expression: no day-of-month OR
day-of-week) and cronsim.
Refusal: parsing an expression that can never fire, against APScheduler searching for its
next time until it gives up (year 9999).
Catch-up: planning 'latest' and 'none' for a per-second cron after outages of several
lengths (the latest time found by bisection, the skipped ones counted), against listing
every missed time of the shortest outage (what the plan did before).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import time
from collections.abc import Callable
from zoneinfo import ZoneInfo

from apscheduler.triggers.cron import CronTrigger
from cronsim import CronSim, CronSimError

from hascheduler.core import cron, triggers
from hascheduler.core.catchup import plan_catchup

ZONE = "Europe/Paris"
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
# (label, expression, APScheduler fields or None when one trigger cannot say it)
KINDS = [
    ("every second", "* * * * * *", {"second": "*"}),
    ("weekly", "0 9 * * mon", {"minute": "0", "hour": "9", "day_of_week": "mon"}),
    ("1st or Monday (OR)", "0 9 1 * mon", None),
    ("last Friday", "0 9 * * 5L", {"minute": "0", "hour": "9", "day": "last fri"}),
    ("Feb 29th", "0 0 29 2 *", {"minute": "0", "hour": "0", "day": "29", "month": "2"}),
    (
        "Feb 29th on a Monday",
        "0 0 * 2 mon#5",
        {"minute": "0", "hour": "0", "day": "5th mon", "month": "2"},
    ),
]


def mean_us(call: Callable[[dt.datetime], object], calls: int) -> float:
    step = dt.timedelta(seconds=365 * 86400 / calls)
    began = time.perf_counter()
    for i in range(calls):
        call(START + i * step)
    return (time.perf_counter() - began) / calls * 1e6


def ours(expression: str) -> Callable[[dt.datetime], object]:
    trigger = triggers.Cron(expression, ZONE)

    def call(after: dt.datetime) -> object:
        triggers._cron_next_after.cache_clear()
        return trigger.next_after(after)

    return call


def apscheduler(fields: dict[str, str]) -> Callable[[dt.datetime], object]:
    trigger = CronTrigger(**fields, timezone=ZoneInfo(ZONE))
    return lambda after: trigger.get_next_fire_time(None, after)


def cronsim_next(expression: str) -> Callable[[dt.datetime], object]:
    tz = ZoneInfo(ZONE)
    return lambda after: next(CronSim(expression, after.astimezone(tz)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--days", default="1,30,365")
    args = parser.parse_args()
    days = [int(d) for d in args.days.split(",")]

    print("| expression | hascheduler | APScheduler (baseline) | cronsim (baseline) |")
    print("|---|---|---|---|")
    for label, expression, fields in KINDS:
        calls = args.calls if "#" not in expression else max(20, args.calls // 20)
        mine = mean_us(ours(expression), calls)
        aps = f"{mean_us(apscheduler(fields), calls):,.0f} us" if fields else "cannot say it"
        sim = f"{mean_us(cronsim_next(expression), calls):,.0f} us"
        print(f"| {label} `{expression}` | {mine:,.0f} us | {aps} | {sim} |")

    impossible = "0 0 30 2 *"
    began = time.perf_counter()
    with contextlib.suppress(cron.CronError):
        cron.parse(impossible)
    refuse_ms = (time.perf_counter() - began) * 1000
    trigger = CronTrigger(minute="0", hour="0", day="30", month="2", timezone=ZoneInfo(ZONE))
    began = time.perf_counter()
    assert trigger.get_next_fire_time(None, START) is None
    search_ms = (time.perf_counter() - began) * 1000
    began = time.perf_counter()
    with contextlib.suppress(StopIteration, CronSimError):
        next(CronSim(impossible, START))
    sim_ms = (time.perf_counter() - began) * 1000
    print(
        f"\nrefusing `{impossible}`: hascheduler {refuse_ms:.2f} ms (parse); APScheduler "
        f"searching to year 9999 (baseline) {search_ms:.0f} ms; cronsim (it refuses some, "
        f"gives up on others after 50 years) {sim_ms:.0f} ms"
    )

    every_second = triggers.Cron("* * * * * *", ZONE)
    now = START + dt.timedelta(days=max(days) + 1, milliseconds=400)
    print("\n| outage | plan 'latest' | plan 'none' | missed times |")
    print("|---|---|---|---|")
    for outage in days:
        since = now - dt.timedelta(days=outage)
        timings = []
        for policy in ("latest", "none"):
            began = time.perf_counter()
            _, skipped = plan_catchup(every_second, policy, 3600, since, now)
            timings.append(time.perf_counter() - began)
        assert skipped is not None
        print(
            f"| {outage} d | {timings[0] * 1000:,.0f} ms | {timings[1] * 1000:,.0f} ms | "
            f"{skipped.count:,} |"
        )
    began = time.perf_counter()
    listed = sum(
        1 for _ in triggers.fire_times(every_second, now - dt.timedelta(days=days[0]), until=now)
    )
    print(
        f"\nbaseline: listing the {listed:,} missed times of the {days[0]}-day outage one "
        f"by one: {(time.perf_counter() - began) * 1000:,.0f} ms"
    )


if __name__ == "__main__":
    main()
