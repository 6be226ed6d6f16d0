"""The local cluster: `hascheduler dev` from its start to ready, and Ctrl-C to every
process gone.

    python -m bench.dev_bench [--replicas 1 3] [--rounds 3]

Each round starts `hascheduler dev --replicas N` in a fresh directory (the development
MongoDB server's build and the virtualenv are ready before: what a second start costs)
and times it to its `ready:` line. Then it stops it one of two ways, alternated:

- Ctrl-C: SIGINT to dev alone, as a terminal delivers it to dev now that its children run
  in sessions of their own; dev stops the workers, then the replicas, then the broker and
  the database.
- baseline: SIGINT to dev and to every child at the same instant, as a terminal's Ctrl-C
  reached the whole foreground process group before: each process stops on its own, the
  database with the others.

Each: from the signal to the last process of the cluster gone, and the shutdown steps that
timed out (`shutdown_step_failed` in the children's logs). Target: Ctrl-C under 2 s with no
step timed out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.servers import DevCluster
from tests.waiting import wait_until_sync

GONE_WITHIN_S = 60.0


@dataclass(frozen=True)
class Stop:
    replicas: int
    way: str  # "ctrl-c" or "baseline"
    started_s: float  # from `hascheduler dev` to its ready line
    gone_s: float  # from the signal to the last process gone
    timed_out: int  # shutdown steps that timed out, over every child's log


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped has stopped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def _children(state_dir: Path, cwd: Path) -> list[int]:
    """Every process of the cluster dev runs, as `dev status --json` lists them."""
    status = subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "dev", "status", "--json",
         "--state-dir", str(state_dir)],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    summary = json.loads(status.stdout)
    return [p["pid"] for kind in ("replicas", "workers", "others") for p in summary[kind]]


def one_round(replicas: int, way: str) -> Stop:
    with tempfile.TemporaryDirectory(prefix="dev-bench-") as tmp:
        cwd = Path(tmp)
        state_dir = cwd / ".hascheduler-dev"
        began = time.monotonic()
        dev = DevCluster(str(state_dir), "--replicas", str(replicas), cwd=cwd)
        started_s = time.monotonic() - began
        pids = _children(state_dir, cwd)
        signalled = time.monotonic()
        dev.process.send_signal(signal.SIGINT)
        if way == "baseline":
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
        dev.process.wait(GONE_WITHIN_S)
        wait_until_sync(
            lambda: not any(_alive(p) for p in pids), GONE_WITHIN_S, "every child gone", 0.01
        )
        gone_s = time.monotonic() - signalled
        if dev.process.stdout is not None:
            dev.process.stdout.close()
        timed_out = sum(
            log.read_text().count("shutdown_step_failed")
            for log in (state_dir / "logs").glob("*.log")
        )
        return Stop(replicas, way, started_s, gone_s, timed_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--rounds", type=int, default=3, help="of each way, alternated")
    args = parser.parse_args()
    stops = [
        one_round(replicas, way)
        for replicas in args.replicas
        for _ in range(args.rounds)
        for way in ("ctrl-c", "baseline")
    ]
    print(
        "| replicas | stopped by | start to ready, median (s) | signal to every process gone, "
        "median (max) (s) | shutdown steps timed out |"
    )
    print("|---|---|---|---|---|")
    for replicas in args.replicas:
        for way in ("ctrl-c", "baseline"):
            mine = [s for s in stops if s.replicas == replicas and s.way == way]
            gone = [s.gone_s for s in mine]
            print(
                f"| {replicas} | {way} | {statistics.median(s.started_s for s in mine):.1f} | "
                f"{statistics.median(gone):.2f} ({max(gone):.2f}) | "
                f"{sum(s.timed_out for s in mine)} |"
            )
    worst = max(s.gone_s for s in stops if s.way == "ctrl-c")
    untimely = sum(s.timed_out for s in stops if s.way == "ctrl-c")
    print(
        f"\nCtrl-C: every process gone within {worst:.2f} s at worst (target 2 s), "
        f"{untimely} shutdown steps timed out (target 0)"
    )


if __name__ == "__main__":
    main()
