"""What a fan-out selects now, read from its source collection: the API counts it when a
schedule is written and lists it for a fan-out fire run now. (The leader reads its source
mirrors instead: replica/tenants.py.)"""

from __future__ import annotations

from typing import Any

from hascheduler.core.fanout import FanOut, tenant_key


class TenantDocuments:
    def __init__(self, database: Any) -> None:
        self.database = database

    async def count(self, fan_out: FanOut, limit: int) -> int:
        """The documents ``fan_out`` selects, counted up to ``limit``."""
        return int(
            await self.database[fan_out.collection].count_documents(fan_out.filter, limit=limit)
        )

    async def keys(self, fan_out: FanOut, limit: int) -> list[str] | None:
        """The tenant keys ``fan_out`` selects now, sorted (documents without a usable key
        left out, as the leader does); None when it selects more than ``limit``
        documents."""
        cursor = (
            self.database[fan_out.collection]
            .find(fan_out.filter, {fan_out.key: 1})
            .limit(limit + 1)
        )
        docs = [doc async for doc in cursor]
        if len(docs) > limit:
            return None
        return sorted({k for k in (tenant_key(d, fan_out.key) for d in docs) if k is not None})
