"""The replicas' heartbeats (GET /cluster): each replica's last word on itself, forgotten
by a TTL index once it stops beating."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pymongo import ASCENDING

from hascheduler.storage.collection import Collection

Document = dict[str, Any]


class Members:
    def __init__(self, members: Collection) -> None:
        self.members = members

    async def ensure_indexes(self, forget_after_s: float) -> None:
        await self.members.create_index(
            "seen_at", name="forget_dead_members", expireAfterSeconds=int(forget_after_s)
        )

    async def beat(self, replica_id: str, state: Mapping[str, Any], at: dt.datetime) -> None:
        """``replica_id`` says ``state`` of itself at ``at``."""
        await self.members.update_one(
            {"_id": replica_id}, {"$set": {**state, "seen_at": at}}, upsert=True
        )

    async def leave(self, replica_id: str) -> None:
        await self.members.delete_one({"_id": replica_id})

    async def seen_since(self, since: dt.datetime) -> list[Document]:
        """The replicas heard from since ``since``, by id."""
        return [
            d async for d in self.members.find({"seen_at": {"$gte": since}}).sort("_id", ASCENDING)
        ]
