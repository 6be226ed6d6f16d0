"""What the runs ledger records (storage/runs.py): a claim's answer, the fire a run
belongs to, how an attempt ended, and the documents its writes are built from."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hascheduler.core.flow import Paced, Wanted, rank
from hascheduler.core.instants import as_utc
from hascheduler.core.run_states import ENDED, RETRYING, RUNNING, WAITING

Document = dict[str, Any]

CONCURRENCY, RATE = "concurrency", "rate"  # what a parked run waits for
ATTEMPTS_KEPT = 20


@dataclass(frozen=True, slots=True)
class RunClaim:
    """The answer to a claim: ``claimed`` (run the handler, this is attempt ``attempt``),
    or the state that stopped it: ``running`` elsewhere or ``retrying`` not yet due (both
    with ``wait_s`` until it may be claimed), ``succeeded`` or ``dead``."""

    outcome: str  # "claimed", or the run's state
    attempt: int = 0
    wait_s: float = 0.0
    took_over: str | None = None  # the worker whose lapsed run this claim took over

    @property
    def claimed(self) -> bool:
        return self.outcome == "claimed"


@dataclass(frozen=True, slots=True)
class FireRef:
    """What the ledger records about the fire a run belongs to."""

    fire_id: str
    schedule_id: str
    target: str
    nominal_at: dt.datetime | None
    event: Mapping[str, Any]  # the CloudEvent as delivered
    body: bytes  # ... as its bytes: what a dead run keeps for a replay
    fire: str = ""  # a fan-out run's fire (the fire id without the tenant); else fire_id
    tenant: str | None = None
    namespace: str | None = None  # its schedule's, as the fire's event says: kept for life


# Unset when a parked run is claimed; ``woken_at`` stays: when its waker took what it
# waited for (for a rate key, the instant its start was counted).
PARKED_FIELDS = dict.fromkeys(
    (
        "waiting_on",
        "waiting_since",
        "wait_rank",
        "wait_key",
        "wait_limit",
        "wait_interval_s",
        "wait_template",
    ),
    "",
)


def mine(fire_id: str, worker_id: str, attempt: int) -> Document:
    """The fence: this worker's claim of this attempt, still running."""
    return {"_id": fire_id, "state": RUNNING, "worker_id": worker_id, "attempts": attempt}


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended, to be recorded (``RunLedger.record``)."""

    fire_id: str
    worker_id: str
    attempt: int
    started: dt.datetime
    finished: dt.datetime
    state: str  # SUCCEEDED, RETRYING, DEAD or CANCELLED
    error: str | None = None
    retry_in_s: float = 0.0
    event: bytes | None = None  # a dead run keeps its event: a replay sends it again
    trace_id: str | None = None  # the fire's trace (tracing on), for the dashboard's link

    def update(self) -> Document:
        duration = (self.finished - self.started).total_seconds()
        fields: Document = {
            "state": self.state,
            "started_at": self.started,
            "finished_at": self.finished,
            "recorded_at": self.finished,
            "duration_s": duration,
        }
        if self.error is not None:
            fields["last_error"] = self.error
        if self.trace_id is not None:
            fields["trace_id"] = self.trace_id
        # Each attempt as it ended, the last ATTEMPTS_KEPT: the run's page lists them.
        attempt = {
            "attempt": self.attempt,
            "worker_id": self.worker_id,
            "started_at": self.started,
            "finished_at": self.finished,
            "duration_s": duration,
            "state": self.state,
            "error": self.error,
        }
        pushed = {"attempt_history": {"$each": [attempt], "$slice": -ATTEMPTS_KEPT}}
        if self.state == RETRYING:
            fields["next_attempt_at"] = self.finished + dt.timedelta(seconds=self.retry_in_s)
        if self.event is not None:
            fields["event"] = self.event
        if self.state in ENDED:  # no longer holds its schedule (invariant 11)
            return {"$set": fields, "$unset": {"open_key": ""}, "$push": pushed}
        return {"$set": fields, "$push": pushed}


def new_run(fire: FireRef, running: Document, now: dt.datetime) -> Document:
    doc = {
        "_id": fire.fire_id,
        "schedule_id": fire.schedule_id,
        "target": fire.target,
        "nominal_at": fire.nominal_at,
        "attempts": 1,
        "first_started_at": now,
        "replays": 0,
        **running,
    }
    if fire.tenant is not None:
        doc.update(fire=fire.fire or fire.fire_id, tenant=fire.tenant)
    if fire.namespace is not None:
        doc["namespace"] = fire.namespace
    return doc


def claimed_by(worker_id: str, now: dt.datetime, lease_s: float) -> Document:
    return {
        "state": RUNNING,
        "worker_id": worker_id,
        "started_at": now,
        "heartbeat_at": now,
        "lease_until": now + dt.timedelta(seconds=lease_s),
        "recorded_at": now,
    }


def parked_fields(fire: FireRef, on: Wanted | Paced, priority: int, now: dt.datetime) -> Document:
    kind = CONCURRENCY if isinstance(on, Wanted) else RATE
    return {
        "state": WAITING,
        "waiting_on": {kind: on.key},
        "wait_key": f"{kind}:{on.key}",
        "wait_template": on.template,
        "priority": priority,
        "event": fire.body,
        # served by this, lowest first (core/flow.rank: priority, aged)
        "wait_rank": rank(priority, now.timestamp()),
        "recorded_at": now,
        **(
            {"wait_limit": on.limit}
            if isinstance(on, Wanted)
            else {"wait_interval_s": on.interval_s}
        ),
    }


def blocked(current: Document, now: dt.datetime) -> RunClaim:
    """Why a run cannot be claimed now: its state, and how long until it might be."""
    state = current["state"]
    until = current.get("lease_until" if state == RUNNING else "next_attempt_at")
    wait = (as_utc(until) - now).total_seconds() if isinstance(until, dt.datetime) else 0.0
    return RunClaim(state, wait_s=max(0.0, wait))
