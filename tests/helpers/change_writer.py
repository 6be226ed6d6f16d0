"""Writes a known sequence of changes from its own process.

Usage: python -m tests.helpers.change_writer URI DB COLL COUNT [DELAY_S]

For i in 0..COUNT-1: insert {_id: i}, update it (a dotted $set), replace every third,
delete every fourth. Prints the expected (operationType, _id) sequence as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys

from pymongo import AsyncMongoClient


def event_count(count: int) -> int:
    """How many events ``write`` produces for ``count`` documents."""
    return 2 * count + len(range(0, count, 3)) + len(range(0, count, 4))


async def write(uri: str, db: str, coll_name: str, count: int, delay_s: float) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(uri)
    coll = client[db][coll_name]
    expected: list[tuple[str, int]] = []
    try:
        for i in range(count):
            await coll.insert_one({"_id": i, "v": 0})
            expected.append(("insert", i))
            await coll.update_one({"_id": i}, {"$set": {"v": 1, "nested.k": i}})
            expected.append(("update", i))
            if i % 3 == 0:
                await coll.replace_one({"_id": i}, {"v": "replaced"})
                expected.append(("replace", i))
            if i % 4 == 0:
                await coll.delete_one({"_id": i})
                expected.append(("delete", i))
            if delay_s:
                await asyncio.sleep(delay_s)
    finally:
        await client.close()
    print(json.dumps(expected))


if __name__ == "__main__":
    uri, db, coll_name, count = sys.argv[1:5]
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    asyncio.run(write(uri, db, coll_name, int(count), delay))
