"""Webhooks' configuration and deliveries in MongoDB (the leader delivers them:
replica/webhooks.py).

A delivery is one event for one webhook, keyed ``<webhook id>:<event id>``: the same event
found again (a poll's overlap, a new leader looking back) makes no second delivery. It
waits ``pending`` until an attempt is answered 2xx (``delivered``) or MAX_ATTEMPTS have
failed (``failed``); each attempt is kept (the last ATTEMPTS_KEPT) with its status, error
and duration, for ``GET /webhooks/{id}/deliveries``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from pymongo import ASCENDING, DESCENDING
from pymongo.errors import DuplicateKeyError

from hascheduler.core.webhooks import (
    MAX_ATTEMPTS,
    Event,
    Subscription,
    body_of,
    delivery_id,
    retry_in_s,
)
from hascheduler.storage.audit_log import DELETED, LIVE, OUTBOX, recording, with_record
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"
ATTEMPTS_KEPT = 20
RETENTION_S = 7 * 86_400.0
CURSORS = "_cursors"  # a document in the deliveries collection per kind of event read


class WebhookExists(Exception):
    pass


class WebhookStore:
    def __init__(self, webhooks: Collection) -> None:
        self.webhooks = webhooks

    async def ensure_indexes(self) -> None:
        await self.webhooks.create_index([("namespace", ASCENDING)], name="namespace")

    async def create(self, doc: dict[str, Any], record: dict[str, Any]) -> None:
        """Raises WebhookExists. ``record``: the audit trail's, in the same write."""
        try:
            await self.webhooks.insert_one(with_record(doc, record))
        except DuplicateKeyError:
            raise WebhookExists(doc["_id"]) from None

    async def get(self, webhook_id: str) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = await self.webhooks.find_one(
            {"_id": webhook_id, **LIVE}, {OUTBOX: 0}
        )
        return doc

    async def in_namespaces(self, namespaces: list[str] | None) -> list[dict[str, Any]]:
        query = {**LIVE} if namespaces is None else {"namespace": {"$in": namespaces}, **LIVE}
        return [d async for d in self.webhooks.find(query, {OUTBOX: 0}).sort("_id", ASCENDING)]

    async def delete(self, webhook_id: str, record: dict[str, Any]) -> bool:
        """A tombstone carrying ``record`` until the trail has it (the relay then removes
        it); whether there was a webhook to delete."""
        done = await self.webhooks.update_one(
            {"_id": webhook_id, **LIVE}, recording({"$set": {DELETED: True}}, record)
        )
        return bool(done.modified_count)

    async def subscriptions(self) -> tuple[list[Subscription], dict[str, dict[str, Any]]]:
        """Every webhook as what it receives, and each one's document (url, secret)."""
        docs = {d["_id"]: d async for d in self.webhooks.find({**LIVE}, {OUTBOX: 0})}
        return [
            Subscription(i, frozenset(d["events"]), d["namespace"], d.get("schedule_id"))
            for i, d in docs.items()
        ], docs


class Deliveries:
    def __init__(self, deliveries: Collection) -> None:
        self.deliveries = deliveries

    async def ensure_indexes(self) -> None:
        await self.deliveries.create_index(
            [("next_at", ASCENDING)], name="due", partialFilterExpression={"state": PENDING}
        )
        await self.deliveries.create_index(
            [("webhook_id", ASCENDING), ("created_at", DESCENDING)], name="by_webhook"
        )
        await self.deliveries.create_index(
            [("created_at", ASCENDING)], name="retention", expireAfterSeconds=int(RETENTION_S)
        )

    async def add(
        self, events: Iterable[Event], subscriptions: list[Subscription], now: dt.datetime
    ) -> int:
        """A pending delivery of each event to each webhook that receives it (none made
        twice); how many are new."""
        docs = [
            {
                "_id": delivery_id(s.webhook_id, e.id),
                "webhook_id": s.webhook_id,
                "event_id": e.id,
                "type": e.type,
                "schedule_id": e.schedule_id,
                "body": body_of(e),
                "state": PENDING,
                "attempts": 0,
                "history": [],
                "created_at": now,
                "next_at": now,
            }
            for e in events
            for s in subscriptions
            if s.covers(e)
        ]
        if not docs:
            return 0
        return len(docs) - len(await insert_new(self.deliveries, docs))

    async def due(self, now: dt.datetime, limit: int, besides: set[str]) -> list[dict[str, Any]]:
        """Pending deliveries whose next attempt is due, oldest first, but ``besides``
        (in flight already)."""
        query: dict[str, Any] = {"state": PENDING, "next_at": {"$lte": now}}
        if besides:
            query["_id"] = {"$nin": sorted(besides)}
        return [
            d async for d in self.deliveries.find(query).sort("next_at", ASCENDING).limit(limit)
        ]

    async def attempted(
        self,
        doc: dict[str, Any],
        now: dt.datetime,
        status: int | None,
        error: str | None,
        duration_s: float,
    ) -> str:
        """Record one attempt (2xx: delivered; else retried after the backoff, or failed
        after MAX_ATTEMPTS); the delivery's state after it."""
        attempts = int(doc["attempts"]) + 1
        ok = status is not None and 200 <= status < 300
        state = DELIVERED if ok else (FAILED if attempts >= MAX_ATTEMPTS else PENDING)
        entry = {"at": now, "status": status, "error": error, "duration_s": round(duration_s, 4)}
        sets: dict[str, Any] = {
            "state": state,
            "attempts": attempts,
            "last_at": now,
            "last_status": status,
            "last_error": error,
        }
        if state == PENDING:
            sets["next_at"] = now + dt.timedelta(seconds=retry_in_s(attempts))
        await self.deliveries.update_one(
            {"_id": doc["_id"], "state": PENDING},
            {"$set": sets, "$push": {"history": {"$each": [entry], "$slice": -ATTEMPTS_KEPT}}},
        )
        return state

    async def of(self, webhook_id: str, limit: int) -> list[dict[str, Any]]:
        """A webhook's deliveries, newest first."""
        return [
            d
            async for d in self.deliveries.find({"webhook_id": webhook_id}, {"body": 0})
            .sort("created_at", DESCENDING)
            .limit(limit)
        ]

    async def forget(self, webhook_id: str) -> None:
        await self.deliveries.delete_many({"webhook_id": webhook_id})

    async def cursor(self, kind: str, default: dt.datetime) -> dt.datetime:
        """How far the events of ``kind`` were read (``default`` the first time)."""
        doc = await self.deliveries.find_one({"_id": f"{CURSORS}:{kind}"})
        if doc is None:
            return default
        at: dt.datetime = doc["at"]
        return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)

    async def advance(self, kind: str, at: dt.datetime) -> None:
        await self.deliveries.update_one(
            {"_id": f"{CURSORS}:{kind}"}, {"$set": {"at": at}}, upsert=True
        )
