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
claim (``mine`` in storage/run_records.py: the worker id and the attempt number), so a
worker that stalled past its lease and was taken over changes nothing when it wakes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import Sequence

from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne
from pymongo.errors import DuplicateKeyError, OperationFailure

from hascheduler.core.flow import Paced, Wanted
from hascheduler.core.run_states import PARKED, PENDING, RETRYING, RUNNING, WAITING
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.operator_writes import OperatorWrites
from hascheduler.storage.reservations import Reservations
from hascheduler.storage.run_records import (
    PARKED_FIELDS,
    Document,
    FireRef,
    Outcome,
    RunClaim,
    blocked,
    claimed_by,
    mine,
    new_run,
    parked_fields,
)

ONE_OPEN_RUN = "one_open_run"  # the unique index on open_key


class RunLedger(Reservations, OperatorWrites):
    """The runs ledger: a worker's writes here; the leader's reservations
    (storage/reservations.py), an operator's writes (storage/operator_writes.py) and the
    reads (storage/run_reads.py) are rooms of their own."""

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
        running = claimed_by(worker_id, now, lease_s)
        taken = {
            e["index"]
            for e in await insert_new(self.runs, [new_run(f, running, now) for f in fires])
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
            await self.runs.insert_one(new_run(fire, claimed_by(worker_id, now, lease_s), now))
            return RunClaim("claimed", attempt=1)
        except DuplicateKeyError:
            return await self._claim_existing(fire, worker_id, now, lease_s)

    async def _claim_existing(
        self, fire: FireRef, worker_id: str, now: dt.datetime, lease_s: float
    ) -> RunClaim:
        running = claimed_by(worker_id, now, lease_s)
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
                    **PARKED_FIELDS,
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
        return blocked(current, now)

    async def park(
        self, parking: Sequence[tuple[FireRef, Wanted | Paced, int]], now: dt.datetime
    ) -> dict[str, RunClaim]:
        """Park the runs of these fires (each with what it waits for, and its priority):
        ``waiting`` on the key (no slot of it was free, or no start in its rate budget),
        keeping the event for the worker that wakes it. By fire id: RunClaim("parked"), or
        the state that stops it as ``claim`` says (running elsewhere, ended, a retry not
        yet due). The new ones (the common case) in one write."""
        parked = {
            fire.fire_id: parked_fields(fire, on, priority, now) for fire, on, priority in parking
        }
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
                **({"namespace": fire.namespace} if fire.namespace is not None else {}),
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
                    answers[fire_id] = blocked(current, now)
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
            [UpdateOne(mine(o.fire_id, o.worker_id, o.attempt), o.update()) for o in outcomes],
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
            mine(fire_id, worker_id, attempt),
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
