"""Worker handlers for flow-control tests (tests/test_flow.py): each run appends
"start <fire id> <key> <time> <worker>" and "end <fire id> <key> <time> <worker>" to
RECORD_FLOW_TO around an async sleep of {"sleep": S} seconds (the worker named by
FLOW_WORKER), so a test can count the runs of a key running at once from the handler's
side, and see which worker held a run."""

from __future__ import annotations

import asyncio
import os
import time

from hascheduler.worker import RetryPolicy, Run, WorkerApp


def _note(what: str, run: Run) -> None:
    payload = run.payload if isinstance(run.payload, dict) else {}
    key = run.tenant or payload.get("account") or "-"
    with open(os.environ["RECORD_FLOW_TO"], "a") as out:
        out.write(
            f"{what} {run.fire_id} {key} {time.time():.6f} {os.environ.get('FLOW_WORKER', '-')}\n"
        )


async def _run(run: Run) -> None:
    _note("start", run)
    await asyncio.sleep(float((run.payload or {}).get("sleep", 0)))  # the run's own work
    _note("end", run)


# A timeout past the 120 s a "stuck" run sleeps: it holds its key while a test looks.
app = WorkerApp(RetryPolicy(max_attempts=3, backoff_base_s=0.1, backoff_cap_s=0.2, timeout_s=180.0))
# The schedule (its event's data.concurrency) says the limit.
app.add("flow.>", _run)
# The handler says it: at most 3 runs of a tenant at once.
app.add("tenant.>", _run, concurrency={"key": "{tenant}", "limit": 3})
