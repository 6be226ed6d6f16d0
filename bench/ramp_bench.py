"""Ramp benchmark: the highest firing rate each system sustains, hascheduler against
APScheduler 3, stepped up in the same run.

    python -m bench.ramp_bench [--spread 5000,10000,...] [--aligned 2000,4000,...]
                               [--baseline-spread ...] [--baseline-aligned ...]
                               [--seconds 10] [--plot docs/ramp.png] [--profile]

R schedules each firing every second, in two shapes. Spread: their phases spread over the
second (schedule i's grid is offset by i mod 1000 milliseconds: an interval trigger of 1 s
anchored there), so R fires fall due each second at 1,000 instants. Aligned: a cron
`* * * * * *` each, so all R fall due on the same instant every second (the firing
benchmark's lateness shape: what one instant costs the broker and the database). A step
sustains its rate when, over the
window, every fire due in it was published (hascheduler: acknowledged by the broker and
recorded in the fire ledger; APScheduler: its job ran) and the p99 of publish-acknowledged
(ran) time minus due time is at most 100 ms. Each system is stepped up until a step fails;
its highest sustained rate is the last that passed.

hascheduler: the development MongoDB server, a real nats-server and three replicas (lease
ttl 2 s, renew deadline 1.4 s, renew interval 0.4 s), fresh servers for each step (the
development server's change log keeps the last million writes: a shared server would make
each step slower than the one before). Baseline, same run: APScheduler 3's
AsyncIOScheduler with the same interval triggers and an empty async job (no broker, no
database: its best case). --profile samples the leader and the development server with
py-spy during the step past the ceiling and prints where their time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.devmongo_bench import pct
from bench.firing_bench import process_cpu, schedule_doc, started_cluster
from hascheduler.process import logs
from tests.servers import start_devmongo, start_nats

LATE_P99_S = 0.1


@dataclass
class Step:
    shape: str
    rate: int
    late: list[float]
    expected: int
    cpu: dict[str, float] = field(default_factory=dict)
    profile: list[str] = field(default_factory=list)
    system: str = "hascheduler"

    @property
    def published(self) -> int:
        return len(self.late)

    @property
    def sustained(self) -> bool:
        return self.published >= self.expected and pct(self.late, 0.99) <= LATE_P99_S


def trigger(shape: str, i: int, base: dt.datetime) -> dict[str, Any]:
    if shape == "aligned":
        return {"kind": "cron", "cron": "* * * * * *"}
    return {
        "kind": "interval",
        "every": 1.0,
        "start_at": base + dt.timedelta(milliseconds=i % 1000),
    }


def anchor() -> dt.datetime:
    """A whole second in the past: every schedule's grid starts there plus its phase."""
    return (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)).replace(microsecond=0)


async def hascheduler_step(shape: str, rate: int, seconds: int, profile: bool) -> Step:
    mongo, broker = start_devmongo(), start_nats()
    base = anchor()
    try:
        c = await started_cluster(
            mongo,
            broker.uri,
            "bench_ramp",
            [schedule_doc(f"r{i:06d}", trigger(shape, i, base), "bench.ramp") for i in range(rate)],
        )
        try:
            await c.wait_firing()
            # The window: whole seconds, starting past the leader's start-up.
            start = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)).replace(microsecond=0)
            await asyncio.sleep((start - dt.datetime.now(dt.UTC)).total_seconds())
            end = start + dt.timedelta(seconds=seconds)
            before = process_cpu(mongo, broker, c)
            sampling = []
            if profile:
                leader = (await c.lease())["holder"]
                sampling = [
                    spy(name, pid, seconds)
                    for name, pid in (
                        ("leader", c.replicas[leader].pid),
                        ("development server", mongo.pid),
                    )
                ]
            await asyncio.sleep((end - dt.datetime.now(dt.UTC)).total_seconds())
            cpu = {k: (v - before[k]) / seconds for k, v in process_cpu(mongo, broker, c).items()}
            window = {"due_at": {"$gte": start, "$lt": end}}
            await c.wait_landed(window, within_s=10)
            late = [
                (f["published_at"] - f["due_at"]).total_seconds()
                async for f in c.db.fires.find(
                    {**window, "state": "published"}, {"published_at": 1, "due_at": 1}
                )
            ]
            lines = [line for name, process, out in sampling for line in spied(name, process, out)]
            return Step(shape, rate, late, rate * seconds, cpu, lines)
        finally:
            await c.close()
    finally:
        broker.stop()
        mongo.stop()


def spy(name: str, pid: int | None, seconds: int) -> tuple[str, subprocess.Popen[bytes], str]:
    out = tempfile.mktemp(prefix="ramp-spy-", suffix=".txt")
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    process = subprocess.Popen(
        [binary, "record", "-p", str(pid), "-d", str(seconds), "-r", "100", "-f", "raw", "-o", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return name, process, out


def spied(name: str, process: subprocess.Popen[bytes], out: str, top: int = 12) -> list[str]:
    """The functions ``name`` spent most samples in (its own time), a line each."""
    process.wait()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        with open(out) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                frame = stack.split(";")[-1]
                where = frame.split(" (")[0]
                module = frame.rsplit("/", 1)[-1].split(":")[0] if "/" in frame else ""
                if "_worker" in where and "thread.py" in module:
                    continue  # an idle thread-pool thread waiting for work
                own[f"{where} ({module})"] += int(count)
                total += int(count)
        os.unlink(out)
    except OSError:
        return [f"{name}: no py-spy profile (is py-spy installed?)"]
    return [f"{name}: " + ", ".join(f"{k} {v / total:.0%}" for k, v in own.most_common(top))]


APSCHEDULER = r"""
import asyncio, datetime as dt, json, sys, time
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.events import EVENT_JOB_EXECUTED, EVENT_JOB_MISSED
shape, rate, seconds, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
late, missed = [], []
window = [None, None]
async def job():
    pass
def inside(event):
    t = event.scheduled_run_time.timestamp()
    return window[0] is not None and window[0] <= t < window[1]
async def main():
    scheduler = AsyncIOScheduler(timezone="UTC")
    def executed(event):
        if inside(event):
            late.append(time.time() - event.scheduled_run_time.timestamp())
    def miss(event):
        if inside(event):
            missed.append(1)
    scheduler.add_listener(executed, EVENT_JOB_EXECUTED)
    scheduler.add_listener(miss, EVENT_JOB_MISSED)
    start_of = dt.datetime.fromtimestamp(base, dt.timezone.utc)
    for i in range(rate):
        if shape == "aligned":
            trigger = CronTrigger(second="*", timezone="UTC")
        else:
            trigger = IntervalTrigger(seconds=1, start_date=start_of + dt.timedelta(
                milliseconds=i % 1000), timezone="UTC")
        scheduler.add_job(job, trigger, id=f"j{i}", misfire_grace_time=None,
                          coalesce=False, max_instances=10)
    scheduler.start()
    await asyncio.sleep(3)
    start = float(int(time.time()) + 1)
    window[:] = [start, start + seconds]
    await asyncio.sleep(start + seconds - time.time() + 2)
    scheduler.shutdown(wait=False)
    print(json.dumps({"late": late, "missed": len(missed)}))
asyncio.run(main())
"""


def apscheduler_step(shape: str, rate: int, seconds: int) -> Step:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            APSCHEDULER,
            shape,
            str(rate),
            str(seconds),
            str(anchor().timestamp()),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Step(shape, rate, [float(x) for x in result["late"]], rate * seconds)


def ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1000:,.0f} ms"


def row(system: str, step: Step) -> str:
    verdict = (
        "sustained"
        if step.sustained
        else ("fires lost" if step.published < step.expected else "p99 over 100 ms")
    )
    return (
        f"| {step.shape} | {system} | {step.rate:,} | {ms(step.late, 0.5)} | "
        f"{ms(step.late, 0.99)} | "
        f"{step.published:,} of {step.expected:,} | {verdict} |"
    )


def plot(path: Path, steps: list[Step]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(s.shape for s in steps))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for system, name, colour in (
            ("hascheduler", "hascheduler (3 replicas, NATS)", "tab:blue"),
            ("APScheduler", "APScheduler 3 (empty job)", "tab:orange"),
        ):
            shown = [s for s in steps if s.shape == shape and s.system == system and s.late]
            rates = [s.rate for s in shown]
            ax.plot(
                rates,
                [max(pct(s.late, 0.5), 1e-4) * 1000 for s in shown],
                "o--",
                color=colour,
                label=f"{name} p50",
            )
            ax.plot(
                rates,
                [max(pct(s.late, 0.99), 1e-4) * 1000 for s in shown],
                "o-",
                color=colour,
                label=f"{name} p99",
            )
        ax.axhline(LATE_P99_S * 1000, color="grey", linestyle=":", label="p99 limit (100 ms)")
        ax.set_xlabel("fires per second (schedules firing every second)")
        ax.set_ylabel("lateness (ms, log scale)")
        ax.set_yscale("log")
        ax.set_title(
            f"{shape}: "
            + ("all due on the second" if shape == "aligned" else "phases spread over the second")
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Ramp on {os.cpu_count()} cores, {dt.date.today().isoformat()}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def ramp(shape: str, rates: list[int], seconds: int, profile: bool) -> list[Step]:
    steps: list[Step] = []
    for rate in rates:
        step = await hascheduler_step(shape, rate, seconds, False)
        steps.append(step)
        print(row("hascheduler", step), flush=True)
        if not step.sustained:
            if profile:
                spied_step = await hascheduler_step(shape, rate, seconds, True)
                NOTES.extend(
                    [
                        f"profile, {shape} at {rate:,} fires/s (own time, top functions):",
                        *spied_step.profile,
                    ]
                )
            break
        NOTES.append(
            f"CPU, {shape} at {rate:,} fires/s, share of one core: "
            + ", ".join(f"{k} {v:.0%}" for k, v in step.cpu.items())
        )
    return steps


def baseline_ramp(shape: str, rates: list[int], seconds: int) -> list[Step]:
    steps: list[Step] = []
    for rate in rates:
        step = apscheduler_step(shape, rate, seconds)
        step.system = "APScheduler"
        steps.append(step)
        print(row("APScheduler 3 (baseline)", step), flush=True)
        if not step.sustained:
            break
    return steps


NOTES: list[str] = []


def highest(steps: list[Step]) -> int:
    passed = [s.rate for s in steps if s.sustained]
    return max(passed) if passed else 0


async def main() -> int:
    logs.configure("warning")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spread", default="5000,10000,12500,15000,17500,20000,25000")
    parser.add_argument("--aligned", default="2000,4000,6000,8000,10000,12000")
    parser.add_argument("--baseline-spread", default="5000,10000,15000,20000,25000,30000,40000")
    parser.add_argument("--baseline-aligned", default="250,500,750,1000,1500,2000,3000")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path(os.environ.get("BENCH_DOCS", "docs")) / "ramp.png",
        help="where the plot goes (python -m bench: beside its --out)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the leader and the development server past the ceiling",
    )
    args = parser.parse_args()
    print(
        f"# ramp benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"command: `python -m bench.ramp_bench {' '.join(sys.argv[1:])}`".rstrip())
    print("\n| shape | system | fires/s | p50 | p99 | fires published (ran) | verdict |")
    print("|---|---|---|---|---|---|---|", flush=True)
    steps: list[Step] = []
    summary = []
    for shape in ("spread", "aligned"):
        ours = await ramp(
            shape, [int(r) for r in getattr(args, shape).split(",")], args.seconds, args.profile
        )
        theirs = baseline_ramp(
            shape, [int(r) for r in getattr(args, f"baseline_{shape}").split(",")], args.seconds
        )
        steps += ours + theirs
        ceiling, baseline = highest(ours), highest(theirs)
        ratio = f"{ceiling / baseline:.1f}x" if baseline else "n/a"
        top = " (the highest step tried)" if all(s.sustained for s in theirs) else ""
        summary.append(
            f"highest sustained rate, {shape}: hascheduler {ceiling:,} fires/s, "
            f"APScheduler {baseline:,} fires/s{top} (baseline); ratio {ratio}"
        )
    print("\n" + "\n".join(summary))
    plot(args.plot, steps)
    print(
        f"\n![fires per second against lateness p50 and p99, both systems, both shapes]"
        f"({args.plot.name})"
    )
    print("\n".join(["", *NOTES]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
