"""The leader's writes to the runs ledger (overlap policies, invariant 11): a ``pending``
run reserved for each governed fire, which the unique ``open_key`` refuses while another
run of its key is open, and its withdrawal. A room of ``RunLedger`` (storage/runs.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from hascheduler.core.claims import Claim as FireClaim
from hascheduler.core.run_states import PENDING
from hascheduler.core.triggers import fire_id as fire_id_of
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.run_reads import RunReads


def open_key(schedule_id: str, tenant: str | None) -> str:
    """The key whose runs an overlap policy holds to one open at a time."""
    return schedule_id if tenant is None else f"{schedule_id}/{tenant}"


class Reservations(RunReads):
    async def reserve(
        self,
        claims: Sequence[FireClaim],
        targets: Mapping[str, str],
        now: dt.datetime,
        term: int,
        name_blockers: bool = True,
    ) -> dict[str, str]:
        """Open a ``pending`` run for each claimed fire (at most one per key), unless its
        key has another open run, reserved by ``term``. Returns, for each fire refused, its
        key's open run's fire id (with ``name_blockers`` False, "": no query for them); a
        fire whose run exists already (published before) is not refused, and its
        reservation, if still pending, becomes this term's (``adopt``)."""
        docs = []
        for claim in claims:
            doc = {
                "_id": claim.fire_id,
                "schedule_id": claim.schedule_id,
                "target": targets[claim.schedule_id],
                "nominal_at": claim.nominal_at,
                "attempts": 0,
                "state": PENDING,
                "first_started_at": None,
                "replays": 0,
                "recorded_at": now,
                "open_key": open_key(claim.schedule_id, claim.tenant),
                "term": term,
            }
            if claim.tenant is not None:
                doc.update(
                    fire=fire_id_of(claim.schedule_id, claim.nominal_at), tenant=claim.tenant
                )
            docs.append(doc)
        if not docs:
            return {}
        refused = await insert_new(self.runs, docs)
        held = {
            docs[e["index"]]["_id"]: docs[e["index"]]["open_key"]
            for e in refused
            if "open_key" in (e.get("keyPattern") or {})
        }
        own = [
            docs[e["index"]]["_id"]
            for e in refused
            if "open_key" not in (e.get("keyPattern") or {})
        ]
        if held:
            # A fire whose own run exists (ended since, another open now) may be refused
            # on the key rather than on its id, whichever index the server checks first:
            # it was let through before, and is not refused.
            for fire_id in await self.with_runs(list(held)):
                del held[fire_id]
                own.append(fire_id)
        await self.adopt(own, term)
        if not held or not name_blockers:
            return dict.fromkeys(held, "")
        blockers = await self.open_runs(sorted(set(held.values())))
        return {fire: blockers.get(key, "") for fire, key in held.items()}

    async def with_runs(self, fire_ids: list[str]) -> set[str]:
        """Those of ``fire_ids`` that have a run (reserved, running or ended)."""
        if not fire_ids:
            return set()
        return {
            d["_id"] async for d in self.runs.find({"_id": {"$in": sorted(fire_ids)}}, {"_id": 1})
        }

    async def adopt(self, fire_ids: list[str], term: int) -> None:
        """Fires ``term`` lets through on a run of their own made before (by an older term
        that reserved them and was deposed): their reservations still pending become this
        term's, so the older term's withdrawal (``withdraw``) leaves them."""
        if fire_ids:
            await self.runs.update_many(
                {
                    "_id": {"$in": sorted(fire_ids)},
                    "state": PENDING,
                    "term": {"$not": {"$gte": term}},
                },
                {"$set": {"term": term}},
            )

    async def unreserve(self, fire_id: str, term: int) -> None:
        """The fire was never published (it failed): its reservation goes, unless a newer
        term has made it its own."""
        await self.runs.delete_one(
            {"_id": fire_id, "state": PENDING, "term": {"$not": {"$gt": term}}}
        )

    async def withdraw(self, fire_ids: list[str], term: int) -> None:
        """``term`` was deposed while reserving these fires' runs: what it reserved goes (a
        newer term may have decided the fires already, skipping them, and a reservation
        that landed after would hold their key for ever); what a newer term made its own
        stays."""
        if fire_ids:
            await self.runs.delete_many(
                {"_id": {"$in": sorted(fire_ids)}, "state": PENDING, "term": term}
            )

    async def pending(self, fire_ids: list[str]) -> set[str]:
        """Those of ``fire_ids`` whose run is reserved and not yet started."""
        if not fire_ids:
            return set()
        return {
            d["_id"]
            async for d in self.runs.find(
                {"_id": {"$in": sorted(fire_ids)}, "state": PENDING}, {"_id": 1}
            )
        }

    async def withdraw_stale(self, fire_ids: list[str]) -> None:
        """Reservations whose fires no term will publish (recorded skipped, failed or
        buffered, which reserves nothing): they hold their keys for nothing."""
        if fire_ids:
            await self.runs.delete_many({"_id": {"$in": sorted(fire_ids)}, "state": PENDING})
