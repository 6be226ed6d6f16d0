"""What the fire ledger records (storage/fires.py): a fire's states, the documents its
writes insert, a claim read back, and the fence every leader's write matches."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from hascheduler.core.catchup import SkippedRange
from hascheduler.core.claims import Claim
from hascheduler.core.instants import as_utc
from hascheduler.core.triggers import fire_id, iso_utc

CLAIMED = "claimed"
PUBLISHED = "published"
SKIPPED = "skipped"
FAILED = "failed"
BUFFERED = "buffered"
REQUESTED = "requested"
STATES = (REQUESTED, CLAIMED, BUFFERED, PUBLISHED, SKIPPED, FAILED)
NOTICE = "notice"  # an entry a webhook is to be told of (Notices)

Document = dict[str, Any]


def claim_record(
    claim: Claim,
    term: int,
    now: dt.datetime,
    next_attempt_at: dt.datetime,
    backfill: str | None = None,
    namespace: str | None = None,
) -> Document:
    """A claim as its ledger document: inserted, it is the claim (made by ``backfill``,
    when a backfill's). ``namespace``: its schedule's, kept with the entry for life (its
    events and readers after the schedule is deleted)."""
    doc = {
        "_id": claim.fire_id,
        "schedule_id": claim.schedule_id,
        "nominal_at": claim.nominal_at,
        "due_at": claim.due_at,
        "term": term,
        "state": CLAIMED,
        "claimed_at": now,
        "recorded_at": now,
        "attempts": claim.attempts,
        "next_attempt_at": next_attempt_at,
    }
    if claim.tenant is not None:
        doc["tenant"] = claim.tenant
    if backfill is not None:
        doc["backfill"] = backfill
    if namespace is not None:
        doc["namespace"] = namespace
    return doc


def claim_of(doc: Document) -> Claim:
    """A claim read back from the ledger (a retry, an adoption, a fire run now)."""
    return Claim(
        doc["_id"],
        doc["schedule_id"],
        as_utc(doc["nominal_at"]),
        as_utc(doc["due_at"]),
        doc.get("tenant"),
        int(doc.get("attempts", 0)),
        doc.get("payload"),
        doc.get("overlap"),
        doc.get("manual") is True,
        doc["trace"] if isinstance(doc.get("trace"), str) else None,
        doc["priority"] if isinstance(doc.get("priority"), int) else None,
    )


def manual_fire_id(schedule_id: str, now: dt.datetime) -> str:
    return f"{schedule_id}@manual-{iso_utc(now)}"


def request_documents(
    schedule_id: str,
    namespace: str,
    now: dt.datetime,
    by: str,
    payload: dict[str, Any] | None,
    overlap: str | None,
    idempotency_key: str | None,
    tenants: list[str] | None = None,
    trace: str | None = None,
    priority: int | None = None,
) -> list[Document]:
    """A fire run now, as the API inserts it for the leader to claim and publish: one
    document, or for a fan-out one per tenant (``<fire id>/<tenant>``, as a fire of its
    trigger). The first carries the idempotency key."""
    fire = manual_fire_id(schedule_id, now)
    base: Document = {
        "schedule_id": schedule_id,
        "namespace": namespace,
        "nominal_at": now,
        "due_at": now,
        "state": REQUESTED,
        "manual": True,
        "requested_by": by,
        "recorded_at": now,
        "attempts": 0,
    }
    if payload is not None:
        base["payload"] = payload
    if overlap is not None:
        base["overlap"] = overlap
    if priority is not None:
        base["priority"] = priority
    if trace is not None:  # the request's traceparent: the fire's publish continues it
        base["trace"] = trace
    docs = (
        [{"_id": fire, **base}]
        if tenants is None
        else [{"_id": f"{fire}/{tenant}", **base, "tenant": tenant} for tenant in tenants]
    )
    if idempotency_key is not None and docs:
        docs[0]["idempotency_key"] = f"{schedule_id}/{idempotency_key}"
    return docs


def requested_fire(doc: Document) -> str:
    """The id of the fire run now that ``doc`` belongs to (a fan-out's has one document
    per tenant)."""
    fire = str(doc["_id"])
    tenant = doc.get("tenant")
    return fire[: -len(tenant) - 1] if isinstance(tenant, str) else fire


def claim_document(
    schedule_id: str, nominal: dt.datetime, due: dt.datetime, term: int, now: dt.datetime
) -> Document:
    """The document of a plain fire's claim made at ``now``."""
    return claim_record(
        Claim(fire_id(schedule_id, nominal), schedule_id, nominal, due), term, now, now
    )


def skipped_range_document(
    schedule_id: str,
    skipped: SkippedRange,
    term: int,
    now: dt.datetime,
    backfill: str | None = None,
    namespace: str | None = None,
) -> Document:
    """What one catch-up skipped for one schedule, as one entry: its first nominal time
    (``nominal_at``, so the history sorts it in place), its last, their count and why
    (and the backfill whose times they were, if one's; its schedule's namespace)."""
    doc: Document = {
        "_id": f"{fire_id(schedule_id, skipped.first)}..{iso_utc(skipped.last)}",
        "schedule_id": schedule_id,
        "nominal_at": skipped.first,
        "last_nominal_at": skipped.last,
        "count": skipped.count,
        "term": term,
        "state": SKIPPED,
        "reason": skipped.reason,
        "recorded_at": now,
    }
    if backfill is not None:
        doc["backfill"] = backfill
    if namespace is not None:
        doc["namespace"] = namespace
    return doc


def of_schedule(schedule_id: str, namespace: str | None) -> Document:
    """A schedule's entries (or runs): those kept with its ``namespace``, or written before
    a namespace was kept with them; None: whatever their namespace. An id reused in another
    namespace after a delete is another schedule, whose history is not this one's."""
    query: Document = {"schedule_id": schedule_id}
    if namespace is not None:
        query["namespace"] = {"$in": [namespace, None]}
    return query


def own(term: int, fire_ids: Iterable[str]) -> Document:
    """The fence: this term's claims among ``fire_ids``, still claimed."""
    return {"_id": {"$in": sorted(fire_ids)}, "term": term, "state": CLAIMED}


def stale(fire_ids: Iterable[str], term: int) -> Document:
    """Claims among ``fire_ids`` left unpublished by ``term`` or an older term."""
    return {"_id": {"$in": sorted(fire_ids)}, "state": CLAIMED, "term": {"$lte": term}}
