"""An operator's operations on a schedule's fires and runs, composed of the stores' writes:
run a schedule now, retry a dead run, cancel a run, and read back a schedule's fields as
they were at a revision. Each raises the domain's errors (core/errors.py); the API reads
the request, checks who may, and answers around them (api/schedules.py, api/run_now.py,
api/runs.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

from hascheduler.core import history
from hascheduler.core.errors import RunConflict, ScheduleNotFound
from hascheduler.core.fanout import FanOut
from hascheduler.core.fields import UNKNOWN_NAMESPACE
from hascheduler.core.history import Actor
from hascheduler.core.instants import as_utc
from hascheduler.core.models import Schedule, TriggerIn
from hascheduler.core.overlap import ALLOW
from hascheduler.core.triggers import fire_id
from hascheduler.storage.audit_log import with_record
from hascheduler.storage.fire_records import (
    BUFFERED,
    FAILED,
    REQUESTED,
    SKIPPED,
    request_documents,
    requested_fire,
)
from hascheduler.storage.fires import Ledger
from hascheduler.storage.operator_writes import Publishes
from hascheduler.storage.reservations import open_key
from hascheduler.storage.run_records import Document, FireRef
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore


async def trigger(
    ledger: Ledger,
    schedule: Schedule,
    wanted: TriggerIn,
    who: Actor,
    now: dt.datetime,
    key: str | None,
    tenants_now: Callable[[FanOut], Awaitable[list[str]]],
    traceparent: str | None,
) -> tuple[str, bool]:
    """Request a fire of ``schedule`` now (``<id>@manual-<instant>``, the leader publishes
    it): its fire id, and whether this request made it (False: the earlier request with
    the same idempotency ``key`` did). A paused or completed schedule only with ``force``
    (RunConflict); a fan-out fire once per tenant ``tenants_now`` finds its filter selects."""
    if (schedule.paused or schedule.completed) and not wanted.force:
        state = "paused" if schedule.paused else "completed (its max_fires are used)"
        raise RunConflict(
            f'schedule {schedule.id!r} is {state}; send "force": true to run it anyway'
        )
    earlier = None if key is None else await ledger.requested_with_key(f"{schedule.id}/{key}")
    if earlier is not None:
        return requested_fire(earlier), False
    tenants = None if schedule.fan_out is None else await tenants_now(schedule.fan_out)
    docs = request_documents(
        schedule.id,
        schedule.namespace,
        now,
        who.name,
        wanted.payload,
        wanted.overlap,
        key,
        tenants,
        traceparent,
        wanted.priority,
    )
    detail = {
        "fire_id": requested_fire(docs[0]),
        "force": wanted.force,
        "overlap": wanted.overlap,
        "payload_given": wanted.payload is not None,
        "tenants": len(tenants) if tenants is not None else None,
    }
    docs[0] = with_record(
        docs[0],
        history.of_incarnation(
            history.record(
                history.TRIGGER, who, now, schedule.namespace, schedule.id, None, detail=detail
            ),
            schedule.created_at,
        ),
    )
    doc, created = await ledger.request(docs)
    return requested_fire(doc), created


async def retry(
    runs: RunLedger,
    store: ScheduleStore,
    broker: Publishes,
    fire: str,
    who_in: Callable[[str], Actor],
    now: dt.datetime,
) -> Document:
    """Replay a dead run (RunLedger.replay_dead), under its schedule's overlap policy:
    never beside another open run of its key (RunConflict). ``who_in``: the actor, given
    the namespace the change is recorded in."""
    run = await runs.get(fire)
    key, record = None, None
    if run is not None:
        schedule_id = str(run["schedule_id"])
        schedule = await making_schedule(store, schedule_id, run.get("namespace"))
        namespace = recorded_namespace(run.get("namespace"), schedule)
        if schedule is not None and schedule.overlap != ALLOW:
            key = open_key(schedule.id, run.get("tenant"))
        who, detail = who_in(namespace), {"fire_id": fire}
        made = history.record(history.RETRY, who, now, namespace, schedule_id, None, detail=detail)
        record = history.of_incarnation(made, schedule.created_at if schedule else None)
    return await runs.replay_dead(fire, now, broker, key, record)


async def making_schedule(store: ScheduleStore, schedule_id: str, kept: object) -> Schedule | None:
    """The live schedule a fire or run (its namespace ``kept`` with it, if one is) was made
    by: None once it is deleted, or its id reused in another namespace."""
    try:
        schedule = await store.get(schedule_id)
    except ScheduleNotFound:
        return None
    return schedule if not isinstance(kept, str) or schedule.namespace == kept else None


def recorded_namespace(kept: object, schedule: Schedule | None) -> str:
    """The namespace a change to a fire or run is recorded in: kept with it, else its
    schedule's."""
    if isinstance(kept, str):
        return kept
    return schedule.namespace if schedule is not None else UNKNOWN_NAMESPACE


async def cancel(
    ledger: Ledger,
    runs: RunLedger,
    store: ScheduleStore,
    fire: str,
    who_in: Callable[[str], Actor],
    now: dt.datetime,
) -> tuple[Document, bool]:
    """Cancel a fire's run (RunLedger.cancel): the run, and whether it ended now (else
    its worker was asked to stop it). A fire published but not yet claimed by a worker is
    cancelled too; one still waiting (buffered, requested) is not published at all."""
    schedule_id = fire.partition("@")[0]
    kept = await ledger.namespace_of(fire) or await runs.namespace_of(fire)
    schedule = await making_schedule(store, schedule_id, kept)
    namespace = recorded_namespace(kept, schedule)
    who = who_in(namespace)
    ref = None
    entry = await ledger.get(fire)
    if entry is not None and entry.get("state") not in (SKIPPED, FAILED):
        if entry["state"] in (BUFFERED, REQUESTED):
            await ledger.withdraw(fire, f"cancelled by {who.name}")
        nominal, tenant = as_utc(entry["nominal_at"]), entry.get("tenant")
        ref = FireRef(
            fire,
            entry["schedule_id"],
            schedule.target if schedule is not None else "",
            nominal,
            {},
            b"",
            fire=fire_id(entry["schedule_id"], nominal) if tenant else "",
            tenant=tenant,
        )
    record = history.of_incarnation(
        history.record(
            history.CANCEL, who, now, namespace, schedule_id, None, detail={"fire_id": fire}
        ),
        schedule.created_at if schedule is not None else None,
    )
    return await runs.cancel(fire, now, who.name, ref, record)


def revision_fields(record: Document, current: Schedule) -> dict[str, Any]:
    """A schedule's fields as ``record`` (its audit record of a revision) left them, to be
    restored over ``current``: its pause and completion stay as they are now, and a
    payload the trail keeps redacted stays as it is now."""
    fields = {k: v for k, v in record["after"].items() if k not in ("pause", "completed")}
    if any(
        isinstance(v, str) and v.startswith("redacted:")
        for v in (fields.get("payload") or {}).values()
    ):
        fields["payload"] = current.payload
    return fields
