"""One contender in the lease compare-and-swap race (run as its own process).

Usage: python -m tests.helpers.lease_contender URI DB NAME ROUNDS DRIVER

Loops until the shared round counter reaches ROUNDS. Each acquisition is one
findAndModify whose filter admits the lease only when it has expired on the server's
clock ($$NOW); the winner checks it still holds the lease, then releases it. Prints a JSON
line: the rounds it won, how many times it found its lease taken while it held it
("stolen", must stay 0), and how many attempts it made.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys

from pymongo import ReturnDocument

from tests.drivers import DRIVERS

EPOCH = datetime.datetime(1970, 1, 1)


async def contend(uri: str, db_name: str, name: str, rounds: int, driver_name: str) -> None:
    driver = DRIVERS[driver_name]
    client = driver.client(uri)
    coll = client[db_name].lease
    won: list[int] = []
    stolen = attempts = 0
    try:
        while True:
            attempts += 1
            doc = await coll.find_one_and_update(
                {"_id": "L", "round": {"$lt": rounds}, "$expr": {"$lt": ["$expires_at", "$$NOW"]}},
                [
                    {
                        "$set": {
                            "holder": name,
                            "round": {"$add": ["$round", 1]},
                            "expires_at": {"$add": ["$$NOW", 60_000]},
                        }
                    }
                ],
                return_document=ReturnDocument.AFTER,
            )
            if doc is None:
                current = await coll.find_one({"_id": "L"})
                if current is None or current["round"] >= rounds:
                    break
                await asyncio.sleep(0)
                continue
            won.append(doc["round"])
            # Still ours? A second holder here means the compare-and-swap let two in.
            if await coll.find_one({"_id": "L", "holder": name, "round": doc["round"]}) is None:
                stolen += 1
            released = await coll.update_one(
                {"_id": "L", "holder": name, "round": doc["round"]}, {"$set": {"expires_at": EPOCH}}
            )
            if released.modified_count != 1:
                stolen += 1
    finally:
        await driver.close(client)
    print(json.dumps({"name": name, "won": won, "stolen": stolen, "attempts": attempts}))


if __name__ == "__main__":
    uri, db_name, name, rounds, driver_name = sys.argv[1:6]
    asyncio.run(contend(uri, db_name, name, int(rounds), driver_name))
