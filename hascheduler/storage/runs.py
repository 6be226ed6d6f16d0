"""The runs ledger: every read and write of the ``runs`` collection (invariant 9,
docs/ARCHITECTURE.md).

A run is what a worker does with one fire, keyed by the fire id. Its states:

    pending -> running | cancelled
    running -> succeeded | retrying | dead | cancelled        retrying -> running | cancelled
    running (lease lapsed) -> running (taken over by another worker)
    dead -> retrying (replayed by POST /runs/{id}/retry)
    pending | retrying | running (lease lapsed) -> waiting -> running   (flow control)

A run is *open* until it is succeeded, dead or cancelled. The leader inserts a ``pending``
run for each fire of a schedule with an overlap policy before publishing it, carrying
``open_key`` (the schedule, and the tenant of a fan-out fire) under a unique index: the
database itself refuses a second open run of a key (invariant 11). Every write that ends
a run removes ``open_key``. Other runs begin ``running``, without it. An operator's
cancel (POST /runs/{id}/cancel) ends a pending or retrying run at once, and asks the worker
of a running one to stop it (``cancel_requested``).

A run over its concurrency key's limit is *parked*: ``waiting``, with ``waiting_on`` (the
key) and its event, until a worker holding a slot of that key for it claims it
(storage/flow.py, docs/WORKERS.md).

A worker claims a run here *before* its handler starts: inserting the document, or moving
a ``retrying`` run whose wait is over, or a ``running`` one whose lease lapsed, to
``running`` under its own name. Whoever loses that race does not run the handler. While
the run is held, the worker renews ``lease_until``; its later writes match only its own
claim (``_mine``: the worker id and the attempt number), so a worker that stalled past its
lease and was taken over changes nothing when it wakes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne
from pymongo.errors import DuplicateKeyError, OperationFailure

from hascheduler.core.errors import BrokerRefused, RunConflict, RunNotFound
from hascheduler.core.events import FireMessage
from hascheduler.core.flow import Paced, Wanted, rank
from hascheduler.core.instants import as_utc
from hascheduler.core.run_states import (
    CANCELLED,
    DEAD,
    ENDED,
    PARKED,
    PENDING,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    WAITING,
)
from hascheduler.storage.audit_log import recording, with_record
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.fires import state_counts
from hascheduler.storage.pages import older_than
from hascheduler.storage.reservations import Reservations
from hascheduler.storage.streams import aggregate

CONCURRENCY, RATE = "concurrency", "rate"  # what a parked run waits for
ONE_OPEN_RUN = "one_open_run"  # the unique index on open_key

Document = dict[str, Any]


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


# Unset when a parked run is claimed; ``woken_at`` stays: when its waker took what it
# waited for (for a rate key, the instant its start was counted).
_PARKED_FIELDS = dict.fromkeys(
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


def _mine(fire_id: str, worker_id: str, attempt: int) -> Document:
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


def _new_run(fire: FireRef, running: Document, now: dt.datetime) -> Document:
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
    return doc


def _running(worker_id: str, now: dt.datetime, lease_s: float) -> Document:
    return {
        "state": RUNNING,
        "worker_id": worker_id,
        "started_at": now,
        "heartbeat_at": now,
        "lease_until": now + dt.timedelta(seconds=lease_s),
        "recorded_at": now,
    }


REPLAY_PUBLISH_TIMEOUT_S = 10.0


class Publishes(Protocol):
    """The broker, as an operator's replay publishes through it (brokers.base.Broker)."""

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]: ...


def _stored_event(raw: Any) -> dict[str, Any] | None:
    """The CloudEvent a dead run kept, or None when it kept none that reads as one."""
    try:
        event = json.loads(raw) if isinstance(raw, bytes) else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        return None
    return event


def _parked(fire: FireRef, on: Wanted | Paced, priority: int, now: dt.datetime) -> Document:
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


def _blocked(current: Document, now: dt.datetime) -> RunClaim:
    """Why a run cannot be claimed now: its state, and how long until it might be."""
    state = current["state"]
    until = current.get("lease_until" if state == RUNNING else "next_attempt_at")
    wait = (as_utc(until) - now).total_seconds() if isinstance(until, dt.datetime) else 0.0
    return RunClaim(state, wait_s=max(0.0, wait))


class RunLedger(Reservations):
    """The runs ledger: a worker's writes, an operator's, and the reads; the leader's
    reservations are its own room (storage/reservations.py)."""

    runs: Collection

    def __init__(self, runs: Collection) -> None:
        self.runs = runs

    async def ensure_indexes(self, retention_s: float) -> None:
        await self.runs.create_index(
            [("schedule_id", ASCENDING), ("nominal_at", DESCENDING)], name="schedule_runs"
        )
        await self.runs.create_index(
            [("state", ASCENDING), ("recorded_at", DESCENDING), ("_id", DESCENDING)],
            name="runs_by_state",
        )
        # At most one open run per key of a schedule with an overlap policy.
        await self.runs.create_index(
            [("open_key", ASCENDING)],
            name=ONE_OPEN_RUN,
            unique=True,
            partialFilterExpression={"open_key": {"$exists": True}},
        )
        # Parked runs by key, in the order they are woken.
        await self.runs.create_index(
            [("wait_key", ASCENDING), ("wait_rank", ASCENDING)],
            name="parked",
            partialFilterExpression={"wait_key": {"$exists": True}},
        )
        # Every write sets recorded_at and a live run renews it with each heartbeat, so
        # only runs nobody touched for the retention period expire, dead ones included.
        # Replicas and workers both create it: the first one's period stands.
        with contextlib.suppress(OperationFailure):
            await self.runs.create_index(
                [("recorded_at", ASCENDING)], name="retention", expireAfterSeconds=int(retention_s)
            )

    # -- a worker's writes ----------------------------------------------------------------

    async def claim_many(
        self, fires: list[FireRef], worker_id: str, now: dt.datetime, lease_s: float
    ) -> list[RunClaim]:
        """``claim`` for each of ``fires`` (distinct fire ids), in one insert for those
        seen for the first time (the common case), and one update for those the leader
        reserved (``pending``: an overlap policy's)."""
        if not fires:
            return []
        running = _running(worker_id, now, lease_s)
        taken = {
            e["index"]
            for e in await insert_new(self.runs, [_new_run(f, running, now) for f in fires])
        }
        started = await self._start_reserved(
            [fires[i].fire_id for i in sorted(taken)], running, now
        )
        return [
            RunClaim("claimed", attempt=1)
            if i not in taken or f.fire_id in started
            else await self._claim_existing(f, worker_id, now, lease_s)
            for i, f in enumerate(fires)
        ]

    async def _start_reserved(
        self, fire_ids: list[str], running: Document, now: dt.datetime
    ) -> set[str]:
        """Move those of ``fire_ids`` still ``pending`` to ``running`` under this claim, in
        one write; the ones it moved (marked with a token of this call's own)."""
        if not fire_ids:
            return set()
        token = uuid.uuid4().hex
        result = await self.runs.update_many(
            {"_id": {"$in": fire_ids}, "state": PENDING},
            {"$set": {**running, "first_started_at": now, "attempts": 1, "claim_token": token}},
        )
        if not result.modified_count:
            return set()
        return {
            d["_id"]
            async for d in self.runs.find(
                {"_id": {"$in": fire_ids}, "claim_token": token}, {"_id": 1}
            )
        }

    async def claim(
        self, fire: FireRef, worker_id: str, now: dt.datetime, lease_s: float
    ) -> RunClaim:
        """Claim the run of ``fire`` for ``worker_id`` until ``now + lease_s``."""
        try:
            await self.runs.insert_one(_new_run(fire, _running(worker_id, now, lease_s), now))
            return RunClaim("claimed", attempt=1)
        except DuplicateKeyError:
            return await self._claim_existing(fire, worker_id, now, lease_s)

    async def _claim_existing(
        self, fire: FireRef, worker_id: str, now: dt.datetime, lease_s: float
    ) -> RunClaim:
        running = _running(worker_id, now, lease_s)
        before = await self.runs.find_one_and_update(
            {
                "_id": fire.fire_id,
                "$or": [
                    {"state": PENDING},
                    {"state": RETRYING, "next_attempt_at": {"$lte": now}},
                    {"state": RUNNING, "lease_until": {"$lt": now}},
                    # parked: the caller holds the slot it waited for
                    {"state": WAITING},
                ],
            },
            {
                "$set": running,
                "$inc": {"attempts": 1},
                "$unset": {
                    "next_attempt_at": "",
                    "finished_at": "",
                    "duration_s": "",
                    **_PARKED_FIELDS,
                },
            },
            return_document=ReturnDocument.BEFORE,
        )
        if before is not None:
            if before["state"] in (PENDING, WAITING) and before.get("first_started_at") is None:
                # reserved by the leader, or parked on its first delivery: its start
                await self.runs.update_one(
                    {"_id": fire.fire_id, "first_started_at": None},
                    {"$set": {"first_started_at": now}},
                )
            took_over = before.get("worker_id") if before["state"] == RUNNING else None
            return RunClaim("claimed", attempt=int(before["attempts"]) + 1, took_over=took_over)
        current = await self.runs.find_one(
            {"_id": fire.fire_id}, {"state": 1, "lease_until": 1, "next_attempt_at": 1}
        )
        if current is None:  # expired between the two writes: as if never run
            return await self.claim(fire, worker_id, now, lease_s)
        return _blocked(current, now)

    async def park(
        self, parking: Sequence[tuple[FireRef, Wanted | Paced, int]], now: dt.datetime
    ) -> dict[str, RunClaim]:
        """Park the runs of these fires (each with what it waits for, and its priority):
        ``waiting`` on the key (no slot of it was free, or no start in its rate budget),
        keeping the event for the worker that wakes it. By fire id: RunClaim("parked"), or
        the state that stops it as ``claim`` says (running elsewhere, ended, a retry not
        yet due). The new ones (the common case) in one write."""
        parked = {fire.fire_id: _parked(fire, on, priority, now) for fire, on, priority in parking}
        docs = [
            {
                "_id": fire.fire_id,
                "schedule_id": fire.schedule_id,
                "target": fire.target,
                "nominal_at": fire.nominal_at,
                "attempts": 0,
                "first_started_at": None,
                "replays": 0,
                "waiting_since": now,
                **parked[fire.fire_id],
                **(
                    {"fire": fire.fire or fire.fire_id, "tenant": fire.tenant}
                    if fire.tenant is not None
                    else {}
                ),
            }
            for fire, _, _ in parking
        ]
        existing = {docs[e["index"]]["_id"] for e in await insert_new(self.runs, docs)}
        answers = {fire.fire_id: RunClaim(PARKED) for fire, _, _ in parking}
        for fire_id in existing:
            before = await self.runs.find_one_and_update(
                {
                    "_id": fire_id,
                    "$or": [
                        {"state": PENDING},
                        {"state": RETRYING, "next_attempt_at": {"$lte": now}},
                        {"state": RUNNING, "lease_until": {"$lt": now}},
                        {"state": WAITING},
                    ],
                },
                {
                    "$set": {k: v for k, v in parked[fire_id].items() if k != "wait_rank"},
                    # parked again (woken, and no slot after all): its place kept
                    "$min": {"waiting_since": now, "wait_rank": parked[fire_id]["wait_rank"]},
                    "$unset": {"next_attempt_at": "", "woken_at": "", "lease_until": ""},
                },
                return_document=ReturnDocument.BEFORE,
            )
            if before is None:
                current = await self.runs.find_one(
                    {"_id": fire_id}, {"state": 1, "lease_until": 1, "next_attempt_at": 1}
                )
                if current is not None:
                    answers[fire_id] = _blocked(current, now)
        return answers

    async def next_waiting(
        self, kind: str, key: str, now: dt.datetime, lease_s: float
    ) -> Document | None:
        """The run parked on ``key`` (for ``kind``: CONCURRENCY or RATE) that comes next,
        by its rank (its priority, aged: core/flow.rank), that nobody is waking; marked as
        being woken (by the caller, until ``lease_s`` from now). None when there is
        none."""
        doc: Document | None = await self.runs.find_one_and_update(
            {
                "wait_key": f"{kind}:{key}",
                "state": WAITING,
                "$or": [
                    {"woken_at": None},
                    {"woken_at": {"$lt": now - dt.timedelta(seconds=lease_s)}},
                ],
            },
            {"$set": {"woken_at": now}},
            sort=[("wait_rank", ASCENDING), ("_id", ASCENDING)],
            projection={
                "event": 1,
                "wait_limit": 1,
                "wait_interval_s": 1,
                "wait_template": 1,
                "target": 1,
            },
            return_document=ReturnDocument.AFTER,
        )
        return doc

    async def unwake(self, fire_id: str) -> None:
        """The caller found no slot for it after all: back to waiting as it was."""
        await self.runs.update_one({"_id": fire_id, "state": WAITING}, {"$unset": {"woken_at": ""}})

    async def still_waiting(self, kind: str, key: str) -> bool:
        return (
            await self.runs.find_one({"wait_key": f"{kind}:{key}", "state": WAITING}, {"_id": 1})
            is not None
        )

    async def waiting_counts(self) -> dict[str, int]:
        """Parked runs, by the template of their key (the metrics' label)."""
        return {
            str(d["_id"]): int(d["n"])
            for d in await aggregate(
                self.runs,
                [
                    {"$match": {"state": WAITING}},
                    {"$group": {"_id": "$wait_template", "n": {"$sum": 1}}},
                ],
            )
        }

    async def heartbeat(
        self, claims: dict[str, int], worker_id: str, now: dt.datetime, lease_s: float
    ) -> set[str]:
        """Extend this worker's claims (fire id -> attempt) in one write; the fire ids no
        longer its own (taken over after their lease lapsed)."""
        if not claims:
            return set()
        result = await self.runs.update_many(
            {"_id": {"$in": sorted(claims)}, "state": RUNNING, "worker_id": worker_id},
            {
                "$set": {
                    "heartbeat_at": now,
                    "lease_until": now + dt.timedelta(seconds=lease_s),
                    "recorded_at": now,
                }
            },
        )
        if result.matched_count == len(claims):
            return set()
        held = {
            d["_id"]
            async for d in self.runs.find(
                {"_id": {"$in": sorted(claims)}, "state": RUNNING, "worker_id": worker_id},
                {"attempts": 1},
            )
            if d.get("attempts") == claims[d["_id"]]
        }
        return set(claims) - held

    async def record(self, outcomes: list[Outcome]) -> set[str]:
        """Record how attempts ended, in one write; the fire ids whose claim was no longer
        this worker's (taken over after its lease lapsed: their record is dropped)."""
        if not outcomes:
            return set()
        result = await self.runs.bulk_write(
            [UpdateOne(_mine(o.fire_id, o.worker_id, o.attempt), o.update()) for o in outcomes],
            ordered=False,
        )
        if result.matched_count == len(outcomes):
            return set()
        wanted = {o.fire_id: (o.worker_id, o.attempt, o.state) for o in outcomes}
        kept = {
            d["_id"]
            async for d in self.runs.find(
                {"_id": {"$in": list(wanted)}}, {"state": 1, "worker_id": 1, "attempts": 1}
            )
            if (d.get("worker_id"), d.get("attempts"), d.get("state")) == wanted[d["_id"]]
        }
        return set(wanted) - kept

    async def release(
        self, fire_id: str, worker_id: str, attempt: int, now: dt.datetime, reason: str
    ) -> bool:
        """Give a claim back unfinished (the worker is shutting down): due again at once,
        and the attempt it cost is not counted."""
        result = await self.runs.update_one(
            _mine(fire_id, worker_id, attempt),
            {
                "$set": {
                    "state": RETRYING,
                    "last_error": reason,
                    "next_attempt_at": now,
                    "recorded_at": now,
                },
                "$inc": {"attempts": -1},
            },
        )
        return bool(result.matched_count)

    async def cancels_requested(self, fire_ids: list[str], worker_id: str) -> set[str]:
        """Those of this worker's runs an operator asked to cancel."""
        if not fire_ids:
            return set()
        return {
            d["_id"]
            async for d in self.runs.find(
                {
                    "_id": {"$in": sorted(fire_ids)},
                    "worker_id": worker_id,
                    "cancel_requested": True,
                },
                {"_id": 1},
            )
        }

    # -- operators' writes ----------------------------------------------------------------

    async def cancel(
        self,
        fire_id: str,
        now: dt.datetime,
        by: str,
        fire: FireRef | None = None,
        record: Document | None = None,
    ) -> tuple[Document, bool]:
        """Cancel a run: a pending, retrying or waiting one (or, given ``fire``, one no worker has
        claimed yet) ends ``cancelled`` at once; a running one is marked for its worker to
        stop. Returns the run and whether it ended now.

        Raises RunNotFound (no run, and no ``fire``) or RunConflict (it had already ended).
        ``record``: the audit trail's, written with whichever write cancels it.
        """

        def audited(update: Document) -> Document:
            return update if record is None else recording(update, record)

        ended = {"state": CANCELLED, "finished_at": now, "recorded_at": now, "cancelled_by": by}
        doc: Document | None = await self.runs.find_one_and_update(
            {"_id": fire_id, "state": {"$in": [PENDING, RETRYING, WAITING]}},
            audited(
                {
                    "$set": {**ended, "last_error": f"cancelled by {by}"},
                    "$unset": {"next_attempt_at": "", "open_key": "", **_PARKED_FIELDS},
                }
            ),
            return_document=ReturnDocument.AFTER,
        )
        if doc is not None:
            return doc, True
        doc = await self.runs.find_one_and_update(
            {"_id": fire_id, "state": RUNNING},
            audited({"$set": {"cancel_requested": True, "cancelled_by": by, "recorded_at": now}}),
            return_document=ReturnDocument.AFTER,
        )
        if doc is not None:
            return doc, False
        current = await self.get(fire_id)
        if current is not None:
            raise RunConflict(f"run {fire_id!r} has already ended ({current['state']})")
        if fire is None:
            raise RunNotFound(fire_id)
        try:  # published, never claimed: the worker that receives it finds it cancelled
            doc = {
                **_new_run(fire, ended, now),
                "attempts": 0,
                "first_started_at": None,
                "last_error": f"cancelled by {by}",
            }
            await self.runs.insert_one(doc if record is None else with_record(doc, record))
            return doc, True
        except DuplicateKeyError:  # claimed meanwhile: cancel that
            return await self.cancel(fire_id, now, by, record=record)

    async def replay(
        self, fire_id: str, now: dt.datetime, key: str | None = None, record: Document | None = None
    ) -> Document | None:
        """Move a dead run back to ``retrying`` with a fresh attempt budget; the run as it
        is now, or None when it is not dead (or not there). With the ``key`` of a
        schedule's overlap policy (open_key), the replayed run is open under it, and
        RunConflict is raised while another run of the key is open."""
        update: Document = {
            "state": RETRYING,
            "attempts": 0,
            "next_attempt_at": now,
            "recorded_at": now,
        }
        if key is not None:
            update["open_key"] = key
        change: Document = {"$set": update, "$inc": {"replays": 1}}
        try:
            doc: Document | None = await self.runs.find_one_and_update(
                {"_id": fire_id, "state": DEAD},
                change if record is None else recording(change, record),
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:
            assert key is not None  # only open_key is unique besides _id
            holder = (await self.open_runs([key])).get(key, "")
            raise RunConflict(
                f"run {fire_id!r} is held back by its schedule's overlap "
                f"policy: the run of fire {holder!r} is open; replay it once "
                "that run has ended"
            ) from None
        return doc

    async def replay_dead(
        self,
        fire_id: str,
        now: dt.datetime,
        broker: Publishes,
        key: str | None = None,
        record: Document | None = None,
    ) -> Document:
        """Replay a dead run: back to ``retrying`` with a fresh attempt budget, and its fire
        published again under a new broker message id (the original one is still inside
        the broker's duplicate window, and would be dropped). If the message cannot be
        sent, the run is dead again, saying why. Returns the run as replayed.

        Raises RunNotFound, RunConflict (not dead, it kept no event to replay, or its
        overlap ``key`` has another run open) or BrokerRefused.
        """
        doc = await self.replay(fire_id, now, key, record)
        if doc is None:
            current = await self.get(fire_id)
            if current is None:
                raise RunNotFound(fire_id)
            raise RunConflict(
                f"run {fire_id!r} is {current['state']}; only a {DEAD} run can be retried"
            )
        replays = int(doc["replays"])
        event = _stored_event(doc.get("event"))
        if event is None:  # written by something other than a worker
            await self.unreplay(fire_id, replays, "no event kept to replay", now)
            raise RunConflict(f"run {fire_id!r} keeps no event to replay")
        event["data"] = {**event["data"], "replay": replays}
        message = FireMessage(
            fire_id=f"{fire_id}#replay-{replays}",
            target=doc["target"],
            term=int(event["data"].get("term", 0)),
            body=json.dumps(event, separators=(",", ":")).encode(),
        )
        [error] = await broker.publish([message], REPLAY_PUBLISH_TIMEOUT_S)
        if error is not None:
            await self.unreplay(fire_id, replays, f"replay not published: {error!r}", now)
            raise BrokerRefused(f"the broker did not take the replay of {fire_id!r}: {error}")
        return doc

    async def unreplay(self, fire_id: str, replays: int, error: str, now: dt.datetime) -> None:
        """Undo ``replay`` whose message could not be sent: dead again, saying why."""
        await self.runs.update_one(
            {"_id": fire_id, "state": RETRYING, "attempts": 0, "replays": replays},
            {
                "$set": {"state": DEAD, "last_error": error, "recorded_at": now},
                "$unset": {"next_attempt_at": "", "open_key": ""},
            },
        )

    # -- reads ----------------------------------------------------------------------------

    async def get(self, fire_id: str) -> Document | None:
        doc: Document | None = await self.runs.find_one({"_id": fire_id})
        return doc

    async def for_schedule(self, schedule_id: str, limit: int) -> list[Document]:
        """A schedule's runs, latest nominal time first."""
        return [
            d
            async for d in self.runs.find({"schedule_id": schedule_id}, {"event": 0})
            .sort([("nominal_at", DESCENDING), ("_id", DESCENDING)])
            .limit(limit)
        ]

    async def counts(
        self, schedule_id: str, nominals: list[dt.datetime]
    ) -> dict[dt.datetime, dict[str, int]]:
        return await state_counts(self.runs, schedule_id, nominals)

    async def latest_ended(self, schedule_id: str, limit: int) -> list[Document]:
        """The schedule's latest ``limit`` ended runs, latest nominal time first."""
        return [
            d
            async for d in self.runs.find(
                {"schedule_id": schedule_id, "state": {"$in": list(ENDED)}},
                {"state": 1, "finished_at": 1, "last_error": 1},
            )
            .sort([("nominal_at", DESCENDING), ("_id", DESCENDING)])
            .limit(limit)
        ]

    async def dead_since(self, since: dt.datetime, limit: int) -> list[Document]:
        """Runs that died (their last write) at or after ``since``, oldest first (the
        runs_by_state index)."""
        return [
            d
            async for d in self.runs.find(
                {"state": DEAD, "recorded_at": {"$gte": since}}, {"event": 0}
            )
            .sort("recorded_at", ASCENDING)
            .limit(limit)
        ]

    async def last_success(self, schedule_id: str) -> dt.datetime | None:
        """When the schedule's latest succeeded run (by nominal time) finished."""
        async for doc in (
            self.runs.find({"schedule_id": schedule_id, "state": SUCCEEDED}, {"finished_at": 1})
            .sort([("nominal_at", DESCENDING), ("_id", DESCENDING)])
            .limit(1)
        ):
            finished: dt.datetime | None = as_utc(doc.get("finished_at"))
            return finished
        return None

    async def last_dead(self, schedule_id: str, count: int) -> bool:
        """Whether the schedule's latest ``count`` ended runs (latest nominal time first)
        are all dead."""
        ended = await self.latest_ended(schedule_id, count)
        return len(ended) == count and all(d["state"] == DEAD for d in ended)

    async def for_fires(self, fire_ids: list[str]) -> dict[str, Document]:
        return {d["_id"]: d async for d in self.runs.find({"_id": {"$in": fire_ids}}, {"event": 0})}

    async def page(
        self,
        state: str | None,
        after: str | None,
        limit: int,
        schedule_ids: list[str] | None = None,
    ) -> tuple[list[Document], str | None]:
        """Runs (in one state, or all; of these schedules, or all), most recently changed
        first; a page, and the fire id to pass as ``after`` for the next (None at the end).
        Raises LookupError when ``after`` names no run (expired since, or never there)."""
        query: Document = {} if state is None else {"state": state}
        if schedule_ids is not None:
            query["schedule_id"] = {"$in": schedule_ids}
        if after is not None:
            query.update(await older_than(self.runs, "recorded_at", after))
        docs = [
            d
            async for d in self.runs.find(query, {"event": 0})
            .sort([("recorded_at", DESCENDING), ("_id", DESCENDING)])
            .limit(limit + 1)
        ]
        more = len(docs) > limit
        docs = docs[:limit]
        return docs, (str(docs[-1]["_id"]) if more else None)

    async def running(self) -> list[Document]:
        """Every run now claimed (few: at most each worker's concurrency)."""
        return [
            d
            async for d in self.runs.find(
                {"state": RUNNING}, {"target": 1, "heartbeat_at": 1, "lease_until": 1}
            )
        ]
