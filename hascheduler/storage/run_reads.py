"""The runs ledger's reads (storage/runs.py): a run, a schedule's runs, pages, counts,
what is running and what waits. A room of ``RunLedger``."""

from __future__ import annotations

import datetime as dt

from pymongo import ASCENDING, DESCENDING

from hascheduler.core.instants import as_utc
from hascheduler.core.run_states import DEAD, ENDED, RUNNING, SUCCEEDED, WAITING
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_reads import state_counts
from hascheduler.storage.fire_records import of_schedule
from hascheduler.storage.pages import older_than
from hascheduler.storage.run_records import Document
from hascheduler.storage.streams import aggregate


class RunReads:
    runs: Collection

    async def namespace_of(self, fire_id: str) -> str | None:
        """The namespace kept with a run (None: no run, or one written before it was)."""
        doc = await self.runs.find_one({"_id": fire_id}, {"namespace": 1})
        kept = doc.get("namespace") if doc is not None else None
        return kept if isinstance(kept, str) else None

    async def get(self, fire_id: str) -> Document | None:
        doc: Document | None = await self.runs.find_one({"_id": fire_id})
        return doc

    async def for_schedule(
        self, schedule_id: str, limit: int, namespace: str | None = None
    ) -> list[Document]:
        """A schedule's runs, latest nominal time first."""
        return [
            d
            async for d in self.runs.find(of_schedule(schedule_id, namespace), {"event": 0})
            .sort([("nominal_at", DESCENDING), ("_id", DESCENDING)])
            .limit(limit)
        ]

    async def counts(
        self, schedule_id: str, nominals: list[dt.datetime], namespace: str | None = None
    ) -> dict[dt.datetime, dict[str, int]]:
        return await state_counts(self.runs, schedule_id, nominals, namespace)

    async def latest_ended(
        self, schedule_id: str, limit: int, namespace: str | None = None
    ) -> list[Document]:
        """The schedule's latest ``limit`` ended runs, latest nominal time first."""
        return [
            d
            async for d in self.runs.find(
                {**of_schedule(schedule_id, namespace), "state": {"$in": list(ENDED)}},
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

    async def last_success(
        self, schedule_id: str, namespace: str | None = None
    ) -> dt.datetime | None:
        """When the schedule's latest succeeded run (by nominal time) finished."""
        async for doc in (
            self.runs.find(
                {**of_schedule(schedule_id, namespace), "state": SUCCEEDED}, {"finished_at": 1}
            )
            .sort([("nominal_at", DESCENDING), ("_id", DESCENDING)])
            .limit(1)
        ):
            finished: dt.datetime | None = as_utc(doc.get("finished_at"))
            return finished
        return None

    async def last_dead(self, schedule_id: str, count: int, namespace: str | None = None) -> bool:
        """Whether the schedule's latest ``count`` ended runs (latest nominal time first)
        are all dead."""
        ended = await self.latest_ended(schedule_id, count, namespace)
        return len(ended) == count and all(d["state"] == DEAD for d in ended)

    async def for_fires(self, fire_ids: list[str]) -> dict[str, Document]:
        return {d["_id"]: d async for d in self.runs.find({"_id": {"$in": fire_ids}}, {"event": 0})}

    async def page(
        self,
        state: str | None,
        after: str | None,
        limit: int,
        schedule_ids: list[str] | None = None,
        namespaces: list[str] | None = None,
    ) -> tuple[list[Document], str | None]:
        """Runs (in one state, or all; of ``namespaces``, or all), most recently changed
        first; a page, and the fire id to pass as ``after`` for the next (None at the end).
        A run is of the namespace kept with it; one written before that was kept, of its
        schedule's (one of ``schedule_ids``). Raises LookupError when ``after`` names no
        run (expired since, or never there)."""
        query: Document = {} if state is None else {"state": state}
        if namespaces is not None:
            query["$or"] = [
                {"namespace": {"$in": namespaces}},
                {"namespace": None, "schedule_id": {"$in": schedule_ids or []}},
            ]
        elif schedule_ids is not None:
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

    async def open_runs(self, keys: list[str]) -> dict[str, str]:
        """The open run of each of these keys that has one: key -> its fire id."""
        if not keys:
            return {}
        return {
            d["open_key"]: d["_id"]
            async for d in self.runs.find({"open_key": {"$in": keys}}, {"open_key": 1})
        }
