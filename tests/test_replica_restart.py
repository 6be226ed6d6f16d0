"""Every acquisition by a process is a new term: a process restarted under the same
``--replica-id`` (a StatefulSet's pod name, a host name) while the old one is stalled takes
the lease only once it expires, in a new term, and the old process, resumed, is fenced
(real processes: replicas, nats-server and the development MongoDB server)."""

from __future__ import annotations

import datetime as dt
import signal
from typing import Any

import pytest

from tests.test_failover import Harness
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


async def test_a_process_restarted_under_the_same_id_leads_in_a_new_term_fencing_the_old(
    own_harness: Harness,
) -> None:
    h = own_harness
    h.start("old", replica_id="a")

    async def held_by_a() -> bool:
        lease = await h.lease()
        return lease.get("holder") == "a" and lease["expires_at"].replace(
            tzinfo=dt.UTC
        ) > dt.datetime.now(dt.UTC)

    await wait_until(held_by_a, 20, "the old process leading", 0.05)
    await h.create_schedules()
    first = await h.lease()
    old_term = int(first["term"])

    async def fired_by(term: int) -> bool:
        return await h.db.fires.count_documents({"term": term, "state": "published"}) > 3

    await wait_until(lambda: fired_by(old_term), 20, "the old process firing", 0.1)
    h.signal("old", signal.SIGSTOP)
    stopped_at = dt.datetime.now(dt.UTC)
    h.start("new", replica_id="a")

    async def new_term() -> dict[str, Any] | None:
        lease = await h.lease()
        return (
            lease
            if lease.get("term", 0) > old_term
            and lease.get("holder") == "a"
            and lease.get("instance") != first.get("instance")
            else None
        )

    lease = await wait_until(new_term, 30, "the restarted process's own term", 0.05)
    began = lease["acquired_at"].replace(tzinfo=dt.UTC)
    # It waited for the old hold to expire: no sooner than a ttl after the stall began,
    # less the renew interval the old process may have renewed within.
    assert began >= stopped_at + dt.timedelta(
        seconds=h.timings.ttl - h.timings.renew_interval - 0.2
    ), (began, stopped_at)
    await wait_until(lambda: fired_by(lease["term"]), 20, "the new term firing", 0.1)
    h.signal("old", signal.SIGCONT)
    # The old process wakes past its renew deadline: it stops, and writes nothing for its
    # term. Watched over several of its renew intervals and the new term's fires.
    resumed_at = dt.datetime.now(dt.UTC)

    async def new_term_fired_after_the_resume() -> bool:
        return (
            await h.db.fires.count_documents(
                {
                    "term": lease["term"],
                    "state": "published",
                    "published_at": {"$gt": resumed_at + dt.timedelta(seconds=2)},
                }
            )
            > 0
        )

    await wait_until(new_term_fired_after_the_resume, 20, "the new term firing on", 0.1)
    late = await h.db.fires.count_documents(
        {
            "term": old_term,
            "$or": [{"claimed_at": {"$gt": began}}, {"published_at": {"$gt": began}}],
        }
    )
    assert late == 0
    final = await h.lease()
    assert (final["term"], final["instance"]) == (lease["term"], lease["instance"])
