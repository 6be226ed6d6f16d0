"""Concurrency slots and start budgets: every read and write of the ``slots`` and ``rates``
collections (docs/WORKERS.md, "Flow control").

A key of limit N has slot documents ``<key>#0`` .. ``<key>#N-1``; a run holds one while it
runs (``holder``: its fire id; ``until``: its lease, renewed with the run's). Taking one is
a single conditional write, so two workers never hold the same slot, and at most N runs of
a key hold a slot at once: the worker takes the slot *before* it claims the run. A slot
whose lease lapsed (its worker died) is free again. Slots are made when first wanted
(``ensure``) and expire an hour after their last use, so 100,000 keys used once leave
nothing behind. ``contended`` marks a key with parked runs: only then does a release look
for one to wake.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Sequence
from typing import Any, Protocol

from pymongo import ASCENDING, UpdateOne
from pymongo.errors import DuplicateKeyError, OperationFailure

from hascheduler.core.flow import Paced, Wanted
from hascheduler.core.instants import as_utc
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.streams import aggregate

UNUSED_SLOT_EXPIRY_S = 3600


class SlotsCollection(Protocol):
    async def insert_many(self, documents: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def update_many(self, filter: Any, update: Any, *args: Any,
                          **kwargs: Any) -> Any: ...
    async def update_one(self, filter: Any, update: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def bulk_write(self, requests: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def create_index(self, keys: Any, **kwargs: Any) -> Any: ...
    def find(self, *args: Any, **kwargs: Any) -> Any: ...
    def aggregate(self, pipeline: Any, *args: Any, **kwargs: Any) -> Any: ...


def _free(want: Wanted, now: dt.datetime) -> dict[str, Any]:
    """A slot of the key within its limit that nobody holds, or whose holder's lease lapsed."""
    return {"key": want.key, "i": {"$lt": want.limit},
            "$or": [{"holder": None}, {"until": {"$lt": now}}]}


class SlotStore:
    def __init__(self, slots: SlotsCollection) -> None:
        self.slots = slots

    async def ensure_indexes(self) -> None:
        await self.slots.create_index([("key", ASCENDING), ("i", ASCENDING)], name="key")
        await self.slots.create_index([("holder", ASCENDING)], name="holder")
        # A held slot's lease is always ahead: only slots unused for an hour expire.
        with contextlib.suppress(OperationFailure):
            await self.slots.create_index([("until", ASCENDING)], name="unused",
                                          expireAfterSeconds=UNUSED_SLOT_EXPIRY_S)

    async def take(self, wants: Sequence[tuple[str, Wanted]], now: dt.datetime,
                   lease_s: float) -> set[str]:
        """Give each fire (fire id, its slot wanted) a slot of its key; the fire ids that
        hold one now. A fire holding one already (its run redelivered, or woken) keeps
        it, lease renewed. Two round trips for the common case (every key with room)."""
        if not wants:
            return set()
        until = now + dt.timedelta(seconds=lease_s)
        ids = [fire_id for fire_id, _ in wants]
        held = await self._renew(ids, until)
        rest = [(f, w) for f, w in wants if f not in held]
        if rest:
            got = await self._take(rest, now, until)
            short = [(f, w) for f, w in rest if f not in got]
            # A key never used (or unused for an hour, or whose limit was raised) lacks
            # slot documents: made now, then taken again.
            if short and await self._ensure([w for _, w in short], now):
                got |= await self._take(short, now, until)
            held |= got
        return held

    async def _renew(self, fire_ids: list[str], until: dt.datetime) -> set[str]:
        result = await self.slots.update_many({"holder": {"$in": fire_ids}},
                                              {"$set": {"until": until}})
        if not result.matched_count:
            return set()
        return {d["holder"] async for d in self.slots.find({"holder": {"$in": fire_ids}},
                                                           {"holder": 1})}

    async def _take(self, wants: Sequence[tuple[str, Wanted]], now: dt.datetime,
                    until: dt.datetime) -> set[str]:
        result = await self.slots.bulk_write(
            [UpdateOne(_free(w, now), {"$set": {"holder": f, "until": until}})
             for f, w in wants], ordered=False)
        if not result.modified_count:
            return set()
        return {d["holder"] async for d in self.slots.find(
            {"holder": {"$in": [f for f, _ in wants]}}, {"holder": 1})}

    async def _ensure(self, wants: list[Wanted], now: dt.datetime) -> bool:
        """Make the missing slot documents of these keys, in one write (the ids of those
        that exist are refused); whether any was missing."""
        docs = [{"_id": f"{w.key}#{i}", "key": w.key, "i": i, "holder": None, "until": now,
                 "template": w.template}
                for w in {w.key: w for w in wants}.values() for i in range(w.limit)]
        return len(await insert_new(self.slots, docs)) < len(docs)

    async def contend(self, key: str) -> None:
        """A run of ``key`` is parked: the key's releases look for it."""
        await self.slots.update_many({"key": key}, {"$set": {"contended": True}})

    async def uncontend(self, key: str) -> None:
        await self.slots.update_many({"key": key}, {"$unset": {"contended": ""}})

    async def release(self, fire_ids: Sequence[str], now: dt.datetime) -> set[str]:
        """Free the slots these fires hold; the keys among them with parked runs."""
        if not fire_ids:
            return set()
        contended = {d["key"] async for d in self.slots.find(
            {"holder": {"$in": list(fire_ids)}}, {"key": 1, "contended": 1})
            if d.get("contended")}
        await self.slots.update_many({"holder": {"$in": list(fire_ids)}},
                                     {"$set": {"holder": None, "until": now}})
        return contended

    async def renew(self, fire_ids: Sequence[str], until: dt.datetime) -> None:
        """The heartbeat: these fires' runs still run."""
        if fire_ids:
            await self.slots.update_many({"holder": {"$in": list(fire_ids)}},
                                         {"$set": {"until": until}})

    async def lapsed(self, now: dt.datetime, limit: int = 100) -> list[tuple[str, str]]:
        """Slots still named for a run whose lease lapsed (its worker died, or a woken run
        never arrived), of keys with parked runs: (key, holder) to free and wake for."""
        return [(d["key"], d["holder"]) async for d in self.slots.find(
            {"until": {"$lt": now}, "holder": {"$ne": None}, "contended": True},
            {"key": 1, "holder": 1}).limit(limit)]

    async def free_lapsed(self, key: str, holder: str, now: dt.datetime) -> bool:
        result = await self.slots.update_one(
            {"key": key, "holder": holder, "until": {"$lt": now}},
            {"$set": {"holder": None, "until": now}})
        return bool(result.modified_count)

    async def in_flight(self) -> dict[str, int]:
        """Slots held now, by the template of their key (the metrics' label)."""
        return {str(d["_id"]): int(d["n"]) for d in await aggregate(self.slots, [
            {"$match": {"holder": {"$ne": None}}},
            {"$group": {"_id": "$template", "n": {"$sum": 1}}}])}


class RatesCollection(Protocol):
    async def find_one_and_update(self, filter: Any, update: Any, *args: Any,
                                  **kwargs: Any) -> Any: ...
    async def find_one(self, filter: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def update_one(self, filter: Any, update: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def create_index(self, keys: Any, **kwargs: Any) -> Any: ...
    def find(self, *args: Any, **kwargs: Any) -> Any: ...


class RateStore:
    """Start budgets: every read and write of the ``rates`` collection. A key's document
    holds ``tat``, the earliest instant its next run may start (GCRA's theoretical arrival
    time, with no burst): a start at ``now >= tat`` moves it to ``now + interval`` in one
    conditional write, so two workers never both start a run in one interval. ``waiting``
    marks a key with parked runs, for the wakers (worker/flow.py)."""

    def __init__(self, rates: RatesCollection) -> None:
        self.rates = rates

    async def ensure_indexes(self) -> None:
        await self.rates.create_index([("waiting", ASCENDING), ("tat", ASCENDING)],
                                      name="due", partialFilterExpression={"waiting": True})
        with contextlib.suppress(OperationFailure):
            await self.rates.create_index([("tat", ASCENDING)], name="unused",
                                          expireAfterSeconds=UNUSED_SLOT_EXPIRY_S)

    async def take(self, paced: Paced, now: dt.datetime) -> float:
        """Start one run of the key now if its budget allows: 0.0; else the seconds until
        it will (the key's ``tat``)."""
        for _ in range(2):
            try:
                await self.rates.find_one_and_update(
                    {"_id": paced.key, "tat": {"$lte": now}},
                    {"$set": {"tat": now + dt.timedelta(seconds=paced.interval_s),
                              "template": paced.template}}, upsert=True)
                return 0.0
            except DuplicateKeyError:  # the key exists, its next start still ahead
                doc = await self.rates.find_one({"_id": paced.key}, {"tat": 1})
                if doc is not None:
                    tat: dt.datetime = as_utc(doc["tat"])
                    return max(0.001, (tat - now).total_seconds())
        return paced.interval_s  # expired and made again between the two: try later

    async def contend(self, key: str) -> None:
        await self.rates.update_one({"_id": key}, {"$set": {"waiting": True}})

    async def uncontend(self, key: str) -> None:
        await self.rates.update_one({"_id": key}, {"$unset": {"waiting": ""}})

    async def next_due(self) -> tuple[str, dt.datetime] | None:
        """The key with parked runs whose next start is earliest: (key, that instant)."""
        async for doc in self.rates.find({"waiting": True}, {"tat": 1}).sort(
                "tat", ASCENDING).limit(1):
            return str(doc["_id"]), as_utc(doc["tat"])
        return None
