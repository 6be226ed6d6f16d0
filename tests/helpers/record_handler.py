"""Worker handlers for tests, configured by environment variables.

``handle`` appends "<fire id> <term> <attempt>" to RECORD_FIRES_TO (the side effect the
tests count). ``app`` routes target ``jobs.*`` with behaviours chosen by the schedule's
payload: {"fail": N} fails the first N attempts, {"fail_on": [N, ...]} those attempts,
{"hold": PATH} waits until PATH exists (at most 60 s), {"permanent": true} raises
PermanentFailure, {"dead_until_replay": true} raises it unless the delivery is a replay
of the dead run, {"sleep": S} runs S seconds (a long run), {"always_fail": true} never
succeeds; each attempt is recorded first. ``long.*`` is an async run of {"sleep": S}
seconds (cancelled outright by a cancel), ``polite.*`` a synchronous one that stops early
when its run is cancelled. ``traced.*`` opens a span of its own ("handler work") and logs a
line inside it, failing the first {"fail": N} attempts (tests/test_tracing.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hascheduler.worker import PermanentFailure, RetryPolicy, Run, WorkerApp


def _record(run: Run) -> None:
    with open(os.environ["RECORD_FIRES_TO"], "a") as out:
        out.write(f"{run.fire_id} {run.event['data']['term']} {run.attempt} {time.time():.3f}\n")


def handle(run: Run) -> None:
    _record(run)


app = WorkerApp(RetryPolicy(max_attempts=4, backoff_base_s=0.4, backoff_cap_s=2.0, timeout_s=60.0))


@app.handler("jobs.>")
def behave(run: Run) -> None:
    _record(run)
    payload = run.payload if isinstance(run.payload, dict) else {}
    if payload.get("dead_until_replay") and not run.event["data"].get("replay"):
        raise PermanentFailure("this fire works only when replayed")
    if payload.get("permanent"):
        raise PermanentFailure("this account no longer exists")
    if payload.get("always_fail"):
        raise RuntimeError(f"attempt {run.attempt} failed")
    if run.attempt <= int(payload.get("fail", 0)) or run.attempt in payload.get("fail_on", ()):
        raise RuntimeError(f"transient failure on attempt {run.attempt}")
    if "hold" in payload:
        _hold(Path(payload["hold"]))
    time.sleep(float(payload.get("sleep", 0)))


def _hold(until_exists: Path) -> None:
    """Until the test creates the file (at most 60 s): an attempt it decides the end of."""
    deadline = time.monotonic() + 60
    while not until_exists.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


@app.handler(
    "async.>",
    policy=RetryPolicy(max_attempts=2, backoff_base_s=0.1, backoff_cap_s=0.2, timeout_s=1.0),
)
async def slow(run: Run) -> None:
    import asyncio

    _record(run)
    await asyncio.sleep(float((run.payload or {}).get("sleep", 0)))


@app.handler("long.>", policy=RetryPolicy(max_attempts=2, timeout_s=120.0))
async def long_run(run: Run) -> None:
    import asyncio

    _record(run)
    await asyncio.sleep(float((run.payload or {}).get("sleep", 0)))


@app.handler("polite.>", policy=RetryPolicy(max_attempts=2, timeout_s=120.0))
def polite(run: Run) -> None:
    _record(run)
    until = time.monotonic() + float((run.payload or {}).get("sleep", 0))
    while time.monotonic() < until and not run.cancel_requested:
        time.sleep(0.02)


@app.handler(
    "traced.>",
    policy=RetryPolicy(max_attempts=3, backoff_base_s=0.1, backoff_cap_s=0.2, timeout_s=30.0),
)
def traced(run: Run) -> None:
    import structlog
    from opentelemetry import trace

    _record(run)
    with trace.get_tracer("tests.handler").start_as_current_span("handler work") as span:
        span.set_attribute("attempt", run.attempt)
        structlog.get_logger("tests.handler").info(
            "handler_working", fire_id=run.fire_id, attempt=run.attempt
        )
        if run.attempt <= int((run.payload or {}).get("fail", 0)):
            raise RuntimeError(f"transient failure on attempt {run.attempt}")
