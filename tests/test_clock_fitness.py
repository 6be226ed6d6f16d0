"""A replica that cannot bound its offset from the database's clock within its tolerance
does not lead, and says why in /readyz and its log (invariant 12)."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from pathlib import Path

import aiohttp
import pytest
from pymongo import AsyncMongoClient

from hascheduler.storage.lease_history import LeaseHistory
from tests.servers import start_replica, with_database
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(60)]


async def test_a_replica_whose_clock_is_not_known_well_enough_never_leads(mongo_uri: str) -> None:
    db_name = f"fitness_{uuid.uuid4().hex[:8]}"
    uri = with_database(mongo_uri, db_name)
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    strict = None
    try:
        # Every lease term of the test, from the database's change stream.
        async with LeaseHistory(client[db_name]) as history:
            # Round trips bound the offset to half a millisecond at best: a microsecond's
            # tolerance can never be met. The lease is free all along, until a second
            # replica, with the default tolerance, starts and takes it.
            strict = start_replica(
                uri,
                "strict",
                "--clock-tolerance",
                "0.000001",
                "--renew-interval",
                "0.2",
                "--renew-deadline",
                "0.5",
                "--lease-ttl",
                "1",
            )
            async with aiohttp.ClientSession() as http:

                async def unfit() -> dict[str, object] | None:
                    async with http.get(strict.uri + "/readyz") as r:
                        body = await r.json()
                    return body if body.get("unfit_to_lead") else None

                body = await wait_until(unfit, 20, "the strict replica to say why it may not lead")
            assert "tolerance of 0 ms" in str(body["unfit_to_lead"]), body
            clock = body["clock"]
            assert isinstance(clock, dict)

            # The same reason, though the error it names may have grown by a millisecond
            # between the elector's last attempt and this reading.
            def phrased(reason: object) -> str:
                return re.sub(r"within \d+ ms", "within N ms", str(reason))

            assert clock["problem"] is not None
            assert phrased(clock["problem"]) == phrased(body["unfit_to_lead"])
            fit = await asyncio.to_thread(start_replica, uri, "fit")
            try:
                lease = await wait_until(
                    lambda: client[db_name].leases.find_one({}), 20, "the fit replica to lead"
                )
                assert lease["holder"] == "fit"
                await history.settle()
            finally:
                fit.stop(signal.SIGKILL)
        # The strict replica had the free lease to take from its start until the fit one
        # was up, and never did.
        assert {t.holder for t in history.terms.values()} == {"fit"}
    finally:
        if strict is not None:
            strict.stop(signal.SIGKILL)
        await client.drop_database(db_name)
        await client.close()
    assert strict.log_path is not None
    assert "unfit_to_lead" in await asyncio.to_thread(Path(strict.log_path).read_text)
