"""Concurrency slots and start budgets: every read and write of the ``slots`` and ``rates``
collections (docs/WORKERS.md, "Flow control").

A concurrency key is one document: ``n``, how many runs hold a slot of it, ``holders``,
each holder's lease (by a digest of its fire id: a fire id may hold dots) renewed with its
run's, and ``limit``, the limit its latest take declared (what a release wakes under).
Taking a slot is one conditional write (``n`` below the limit, this fire not among the
holders: ``n`` up by one, the fire added), so at most N runs of a key hold one at once,
whichever workers ask: the worker takes the slot *before* it claims the run. A holder
whose lease lapsed (its worker died) is dropped by the next take that finds the key full,
or by the sweep. Documents are made by the first take (an upsert) and expire an hour
after their last use, so 100,000 keys used once leave nothing behind. ``contended`` marks
a key with parked runs: only then does a release look for one to wake.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence

from pymongo import ASCENDING, ReturnDocument, UpdateOne
from pymongo.errors import DuplicateKeyError, OperationFailure

from hascheduler.core.flow import Paced, Wanted
from hascheduler.core.instants import as_utc
from hascheduler.storage.bulk import refused_upserts
from hascheduler.storage.collection import Collection
from hascheduler.storage.streams import aggregate

UNUSED_SLOT_EXPIRY_S = 3600


def holder(fire_id: str) -> str:
    """A fire's name among a key's holders: a field name, so no dots or dollar signs."""
    return hashlib.blake2b(fire_id.encode(), digest_size=12).hexdigest()


class SlotStore:
    def __init__(self, slots: Collection) -> None:
        self.slots = slots

    async def ensure_indexes(self) -> None:
        await self.slots.create_index(
            [("contended", ASCENDING), ("until_min", ASCENDING)],
            name="contended",
            partialFilterExpression={"contended": True},
        )
        # ``until`` is the key's last take or renewal: a key in use never expires.
        with contextlib.suppress(OperationFailure):
            await self.slots.create_index(
                [("until", ASCENDING)], name="unused", expireAfterSeconds=UNUSED_SLOT_EXPIRY_S
            )

    async def take(
        self, wants: Sequence[tuple[str, Wanted]], now: dt.datetime, lease_s: float
    ) -> set[str]:
        """Give each fire (fire id, the slot it wants) a slot of its key; the fire ids
        that hold one now. A fire holding one already (its run redelivered, or woken)
        keeps it, lease renewed. One round trip when every key has room."""
        if not wants:
            return set()
        until = now + dt.timedelta(seconds=lease_s)
        # The fires of one key in one write when the key has room for them all (a batch
        # is mostly of few keys); one write each for the rest.
        groups: dict[str, list[tuple[str, Wanted]]] = {}
        for fire_id, want in wants:
            groups.setdefault(want.key, []).append((fire_id, want))
        # (Only a group the limit could hold: on a key not yet made, the upsert inserts.)
        batched = [
            g
            for g in groups.values()
            if 1 < len(g) <= g[0][1].limit and len({f for f, _ in g}) == len(g)
        ]
        refused_groups = await refused_upserts(
            self.slots, [self._take_all(g, until) for g in batched]
        )
        taken = {g[0][1].key for i, g in enumerate(batched) if i not in refused_groups}
        held = {f for f, w in wants if w.key in taken}
        single = [(f, w) for f, w in wants if w.key not in taken]
        refused = await refused_upserts(self.slots, [self._take(f, w, until) for f, w in single])
        held |= {f for i, (f, _) in enumerate(single) if i not in refused}
        if not refused:
            return held
        # Refused: the key is full, or the fire holds a slot of it already. Read those
        # keys once: renew the fire's own, drop holders whose lease lapsed, and try again.
        again = [single[i] for i in sorted(refused)]
        docs = {
            d["_id"]: d
            async for d in self.slots.find(
                {"_id": {"$in": list({w.key for _, w in again})}}, {"holders": 1}
            )
        }
        retry: list[tuple[str, Wanted]] = []
        for fire_id, want in again:
            holders = (docs.get(want.key) or {}).get("holders") or {}
            # Renewed only while still there: a lapsed one may have been dropped since the
            # read, its slot taken by another run.
            if (
                holder(fire_id) in holders
                and (
                    await self.slots.update_one(
                        {"_id": want.key, f"holders.{holder(fire_id)}": {"$exists": True}},
                        {"$set": {f"holders.{holder(fire_id)}": until, "until": until}},
                    )
                ).matched_count
            ):
                held.add(fire_id)
            else:
                retry.append((fire_id, want))
        lapsed = {
            (w.key, h, as_utc(u))
            for _, w in retry
            for h, u in ((docs.get(w.key) or {}).get("holders") or {}).items()
            if as_utc(u) < now
        }
        if retry and lapsed:
            for key, name, lease in lapsed:
                await self.free_lapsed(key, name, lease)
            still = await refused_upserts(self.slots, [self._take(f, w, until) for f, w in retry])
            held |= {f for i, (f, _) in enumerate(retry) if i not in still}
        return held

    @staticmethod
    def _take_all(group: list[tuple[str, Wanted]], until: dt.datetime) -> UpdateOne:
        """One slot for each of these fires of one key, or none (the limit is the
        first's: they come from one declaration)."""
        names = [f"holders.{holder(f)}" for f, _ in group]
        want = group[0][1]
        return UpdateOne(
            {
                "_id": want.key,
                "n": {"$lte": want.limit - len(group)},
                **{name: {"$exists": False} for name in names},
            },
            {
                "$inc": {"n": len(group)},
                "$set": {
                    **dict.fromkeys(names, until),
                    "until": until,
                    "template": want.template,
                    "limit": want.limit,
                },
                "$min": {"until_min": until},
            },
            upsert=True,
        )

    @staticmethod
    def _take(fire_id: str, want: Wanted, until: dt.datetime) -> UpdateOne:
        name = f"holders.{holder(fire_id)}"
        return UpdateOne(
            {"_id": want.key, "n": {"$lt": want.limit}, name: {"$exists": False}},
            {
                "$inc": {"n": 1},
                "$set": {
                    name: until,
                    "until": until,
                    "template": want.template,
                    "limit": want.limit,
                },
                "$min": {"until_min": until},
            },
            upsert=True,
        )

    async def contend(self, key: str) -> None:
        """A run of ``key`` is parked: the key's releases look for it."""
        await self.slots.update_one({"_id": key}, {"$set": {"contended": True}})

    async def uncontend(self, key: str) -> None:
        await self.slots.update_one({"_id": key}, {"$unset": {"contended": ""}})

    async def release(self, freed: Mapping[str, str], now: dt.datetime) -> dict[str, int]:
        """Free the slots these fires (fire id -> key) hold; the keys among them with
        parked runs (read after the release: a run parked before it is seen), each with
        the limit its latest take declared."""
        if not freed:
            return {}
        by_key: dict[str, list[str]] = {}
        for fire_id, key in freed.items():
            by_key.setdefault(key, []).append(holder(fire_id))
        if len(by_key) == 1:  # the common case: freed and read back in one round trip
            [(key, names)] = by_key.items()
            doc = await self.slots.find_one_and_update(
                {"_id": key, **{f"holders.{n}": {"$exists": True} for n in names}},
                {"$unset": {f"holders.{n}": "" for n in names}, "$inc": {"n": -len(names)}},
                projection={"contended": 1, "limit": 1},
                return_document=ReturnDocument.AFTER,
            )
            if doc is not None:
                return {key: int(doc.get("limit") or 1)} if doc.get("contended") else {}
        # A key's holders in one write while each is still there (the common case);
        # any gone already (lapsed, and freed by another worker) one by one.
        result = await self.slots.bulk_write(
            [
                UpdateOne(
                    {"_id": key, **{f"holders.{n}": {"$exists": True} for n in names}},
                    {"$unset": {f"holders.{n}": "" for n in names}, "$inc": {"n": -len(names)}},
                )
                for key, names in by_key.items()
            ],
            ordered=False,
        )
        if result.modified_count < len(by_key):
            await self.slots.bulk_write(
                [
                    UpdateOne(
                        {"_id": key, f"holders.{n}": {"$exists": True}},
                        {"$unset": {f"holders.{n}": ""}, "$inc": {"n": -1}},
                    )
                    for key, names in by_key.items()
                    for n in names
                ],
                ordered=False,
            )
        return {
            d["_id"]: int(d.get("limit") or 1)
            async for d in self.slots.find(
                {"_id": {"$in": list(set(freed.values()))}, "contended": True}, {"limit": 1}
            )
        }

    async def renew(self, held: Mapping[str, str], until: dt.datetime) -> None:
        """The heartbeat: these fires' runs (fire id -> key) still run."""
        if held:
            await self.slots.bulk_write(
                [
                    UpdateOne(
                        {"_id": key, f"holders.{holder(fire_id)}": {"$exists": True}},
                        {"$set": {f"holders.{holder(fire_id)}": until, "until": until}},
                    )
                    for fire_id, key in held.items()
                ],
                ordered=False,
            )

    async def lapsed(
        self, now: dt.datetime, count: int = 100
    ) -> list[tuple[str, str, dt.datetime]]:
        """Holders whose lease lapsed (their worker died, or a woken run never arrived)
        of keys with parked runs: (key, holder, its lease) to free and wake for. A key
        whose earliest lease is past but whose holders all renewed has that bound
        corrected."""
        found: list[tuple[str, str, dt.datetime]] = []
        async for doc in self.slots.find(
            {"contended": True, "until_min": {"$lt": now}}, {"holders": 1}
        ).limit(count):
            leases = {h: as_utc(u) for h, u in (doc.get("holders") or {}).items()}
            gone = [(doc["_id"], h, u) for h, u in leases.items() if u < now]
            found += gone
            if not gone:
                await self.slots.update_one(
                    {"_id": doc["_id"]},
                    {
                        "$set": {
                            "until_min": min(leases.values(), default=now + dt.timedelta(hours=1))
                        }
                    },
                )
        return found

    async def free_lapsed(self, key: str, name: str, lease: dt.datetime) -> bool:
        """Drop a holder whose lease lapsed, unless it was renewed meanwhile."""
        result = await self.slots.update_one(
            {"_id": key, f"holders.{name}": lease},
            {"$unset": {f"holders.{name}": ""}, "$inc": {"n": -1}},
        )
        return bool(result.modified_count)

    async def in_flight(self) -> dict[str, int]:
        """Slots held now, by the template of their key (the metrics' label)."""
        return {
            str(d["_id"]): int(d["n"])
            for d in await aggregate(
                self.slots,
                [
                    {"$match": {"n": {"$gt": 0}}},
                    {"$group": {"_id": "$template", "n": {"$sum": "$n"}}},
                ],
            )
        }


class RateStore:
    """Start budgets: every read and write of the ``rates`` collection. A key's document
    holds ``tat``, the earliest instant its next run may start (GCRA's theoretical arrival
    time, with no burst): a start at ``now >= tat`` moves it to ``now + interval`` in one
    conditional write, so two workers never both start a run in one interval. ``waiting``
    marks a key with parked runs, for the wakers (worker/flow.py)."""

    def __init__(self, rates: Collection) -> None:
        self.rates = rates

    async def ensure_indexes(self) -> None:
        await self.rates.create_index(
            [("waiting", ASCENDING), ("tat", ASCENDING)],
            name="due",
            partialFilterExpression={"waiting": True},
        )
        with contextlib.suppress(OperationFailure):
            await self.rates.create_index(
                [("tat", ASCENDING)], name="unused", expireAfterSeconds=UNUSED_SLOT_EXPIRY_S
            )

    async def take(self, paced: Paced, now: dt.datetime) -> float:
        """Start one run of the key now if its budget allows: 0.0; else the seconds until
        it will (the key's ``tat``)."""
        for _ in range(2):
            try:
                await self.rates.find_one_and_update(
                    {"_id": paced.key, "tat": {"$lte": now}},
                    {
                        "$set": {
                            "tat": now + dt.timedelta(seconds=paced.interval_s),
                            "template": paced.template,
                        }
                    },
                    upsert=True,
                )
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
        async for doc in (
            self.rates.find({"waiting": True}, {"tat": 1}).sort("tat", ASCENDING).limit(1)
        ):
            return str(doc["_id"]), as_utc(doc["tat"])
        return None
