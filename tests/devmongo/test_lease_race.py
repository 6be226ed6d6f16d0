"""Two processes race for one lease document 200 times: every round has one winner."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from typing import Any

from tests.drivers import Driver

ROUNDS = 200


async def test_compare_and_swap_on_server_clock_has_one_winner_per_round(
    db: Any, db_name: str, mongo_uri: str, driver: Driver
) -> None:
    await db.lease.insert_one(
        {"_id": "L", "round": 0, "holder": None, "expires_at": datetime.datetime(1970, 1, 1)}
    )
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.helpers.lease_contender",
            mongo_uri,
            db_name,
            name,
            str(ROUNDS),
            driver.name,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for name in ("alpha", "beta")
    ]
    results = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))

    all_won = sorted(r for result in results for r in result["won"])
    assert all_won == list(range(1, ROUNDS + 1)), "a round had no winner or two winners"
    assert [r["stolen"] for r in results] == [0, 0], results
    # There was a race: together the contenders lost some attempts.
    assert sum(r["attempts"] for r in results) > ROUNDS
    final = await db.lease.find_one({"_id": "L"})
    assert final["round"] == ROUNDS
