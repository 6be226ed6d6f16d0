"""The chaos soak's worker app: a handler with a side effect to count, failing on purpose.

Each attempt appends "<fire id> <worker id> <attempt> start" to CHAOS_SIDE_EFFECTS before
its work and "... done" after it (one short O_APPEND write each: whole lines from several
processes). It fails with a transient error at the rate CHAOS_FAIL_RATE (seeded by fire id
and attempt, so a rerun of the soak fails the same attempts), and raises PermanentFailure
for the fires ``doomed`` picks, which must end dead.
"""

from __future__ import annotations

import hashlib
import os
import time

from hascheduler.worker import PermanentFailure, RetryPolicy, Run, WorkerApp

# Enough attempts that random failures at a few percent never exhaust a run: only the
# doomed fires may end dead.
POLICY = RetryPolicy(max_attempts=10, backoff_base_s=0.2, backoff_cap_s=2.0, timeout_s=30.0)
DOOMED_ONE_IN = 53

app = WorkerApp(POLICY)


def _draw(*parts: object) -> float:
    digest = hashlib.sha256(" ".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def doomed(fire_id: str) -> bool:
    return _draw("doomed", fire_id) < 1 / DOOMED_ONE_IN


def _note(run: Run, what: str) -> None:
    line = f"{run.fire_id} {run.worker_id} {run.attempt} {what}\n".encode()
    fd = os.open(os.environ["CHAOS_SIDE_EFFECTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@app.handler(">")
def side_effect(run: Run) -> None:
    _note(run, "start")
    if doomed(run.fire_id):
        raise PermanentFailure("doomed by the soak")
    if _draw("fail", run.fire_id, run.attempt) < float(os.environ.get("CHAOS_FAIL_RATE", "0")):
        raise RuntimeError(f"injected failure on attempt {run.attempt}")
    time.sleep(_draw("work", run.fire_id) * 0.05)
    _note(run, "done")
