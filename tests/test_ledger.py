"""The fire ledger against the development server: claims are unique, and the term fence
holds for every write (a deposed leader's late write changes nothing)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError

from hascheduler.core.catchup import SkippedRange
from hascheduler.core.triggers import fire_id
from hascheduler.storage.fire_records import (
    CLAIMED,
    FAILED,
    PUBLISHED,
    REQUESTED,
    SKIPPED,
    claim_document,
    request_documents,
    requested_fire,
    skipped_range_document,
)
from hascheduler.storage.fires import Ledger
from tests.servers import with_database

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.fixture
async def ledger(mongo_uri: str) -> AsyncIterator[Ledger]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        with_database(mongo_uri, f"ledger_{uuid.uuid4().hex[:8]}"), tz_aware=True
    )
    ledger = Ledger(client.get_default_database().fires)
    await ledger.ensure_indexes(3600)
    yield ledger
    await client.drop_database(client.get_default_database())
    await client.close()


async def state(ledger: Ledger, schedule_id: str) -> dict[str, Any]:
    doc = await ledger.fires.find_one({"_id": fire_id(schedule_id, at(10))})
    assert doc is not None
    return dict(doc)


async def test_a_claim_is_made_once(ledger: Ledger) -> None:
    first = [claim_document(s, at(10), at(10), 1, at(9)) for s in ("a", "b")]
    assert await ledger.claim(first) == set()
    again = [claim_document(s, at(10), at(10), 2, at(9)) for s in ("b", "c")]
    assert await ledger.claim(again) == {fire_id("b", at(10))}
    assert (await state(ledger, "b"))["term"] == 1


async def test_every_write_is_fenced_by_the_term(ledger: Ledger) -> None:
    await ledger.claim([claim_document(s, at(10), at(10), 2, at(9)) for s in ("p", "f", "r", "s")])
    # A deposed leader (term 1) writes late: nothing changes.
    await ledger.mark_published([fire_id("p", at(10))], 1, at(11), 1)
    await ledger.mark_failed(fire_id("f", at(10)), 1, 10, "boom", at(11))
    await ledger.retry_later(fire_id("r", at(10)), 1, 3, "boom", at(20))
    await ledger.skip([fire_id("s", at(10))], 1, "late")
    for schedule_id in ("p", "f", "r", "s"):
        doc = await state(ledger, schedule_id)
        assert (doc["state"], doc["attempts"]) == (CLAIMED, 0), doc
    # The holder of term 2 moves each one.
    await ledger.mark_published([fire_id("p", at(10))], 2, at(11), 1)
    await ledger.mark_failed(fire_id("f", at(10)), 2, 10, "boom", at(11))
    await ledger.retry_later(fire_id("r", at(10)), 2, 3, "boom", at(20))
    await ledger.skip([fire_id("s", at(10))], 2, "paused")
    assert (await state(ledger, "p"))["state"] == PUBLISHED
    assert (await state(ledger, "f"))["state"] == FAILED
    assert (await state(ledger, "r"))["next_attempt_at"] == at(20)
    assert (await state(ledger, "s"))["reason"] == "paused"
    # A published fire is not moved again, even by its own term.
    await ledger.skip([fire_id("p", at(10))], 2, "too late")
    assert (await state(ledger, "p"))["state"] == PUBLISHED


async def test_adoption_takes_unpublished_claims_of_this_term_and_older_only(
    ledger: Ledger,
) -> None:
    """Of the claims the caller's pending publishes do not hold: an older term's, and this
    term's own left by a lead that stopped firing; never a newer term's or a published."""
    docs = {
        s: claim_document(s, at(10), at(10), term, at(9))
        for s, term in (("old", 1), ("newer", 3), ("mine", 2), ("done", 1))
    }
    docs["done"]["state"] = PUBLISHED
    await ledger.fires.insert_many(list(docs.values()))
    ids = {str(d["_id"]) for d in docs.values()}
    # A claim published, or taken by a newer term, since the caller found it is left
    # alone, and the ids taken say so.
    assert await ledger.adopt(ids, 2, at(12)) == {fire_id("old", at(10)), fire_id("mine", at(10))}
    assert (await state(ledger, "old"))["term"] == 2
    assert (await state(ledger, "old"))["claimed_at"] == at(12)
    assert (await state(ledger, "newer"))["term"] == 3
    assert (await state(ledger, "done"))["term"] == 1
    # All of them still left (the usual case): taken in the one write.
    more = {s: claim_document(s, at(20), at(20), 1, at(19)) for s in ("a", "b")}
    await ledger.fires.insert_many(list(more.values()))
    assert await ledger.adopt({str(d["_id"]) for d in more.values()}, 2, at(22)) == {
        fire_id("a", at(20)),
        fire_id("b", at(20)),
    }
    assert (await ledger.fires.find_one({"_id": fire_id("b", at(20))}) or {})["term"] == 2
    assert await ledger.adopt(set(), 2, at(23)) == set()


async def test_adopt_due_waits_for_the_due_time_and_the_grace(ledger: Ledger) -> None:
    await ledger.fires.insert_many(
        [
            claim_document("due", at(10), at(10), 1, at(9)),
            claim_document("ahead", at(30), at(30), 1, at(9)),  # not due yet
            claim_document("fresh", at(10), at(10), 1, at(11.5)),  # within the grace
        ]
    )
    assert await ledger.adopt_due(2, at(12), claimed_before=at(11)) == 1
    assert (await ledger.fires.find_one({"schedule_id": "due"}) or {})["term"] == 2
    retries = [
        c async for batch in ledger.due_for_retry(2, at(12), limit=10, batch=10) for c in batch
    ]
    assert [c.schedule_id for c in retries] == ["due"]
    # Never this term's own claims (its publishes in flight).
    await ledger.fires.insert_one(claim_document("own", at(10), at(10), 2, at(9)))
    assert await ledger.adopt_due(2, at(12), claimed_before=at(11)) == 0


async def test_the_claims_due_for_a_retry_come_in_batches_up_to_the_limit(ledger: Ledger) -> None:
    await ledger.fires.insert_many(
        [claim_document(f"s{i}", at(10), at(10), 2, at(9)) for i in range(25)]
    )
    await ledger.fires.insert_one(claim_document("later", at(20), at(20), 2, at(9)))
    await ledger.fires.insert_one(claim_document("other term", at(10), at(10), 1, at(9)))
    await ledger.fires.update_many({}, {"$set": {"next_attempt_at": at(10)}})
    await ledger.fires.update_one({"schedule_id": "later"}, {"$set": {"next_attempt_at": at(20)}})
    batches = [batch async for batch in ledger.due_for_retry(2, at(12), limit=22, batch=10)]
    assert [len(batch) for batch in batches] == [10, 10, 2]
    read = [c.schedule_id for batch in batches for c in batch]
    assert len(set(read)) == 22
    assert set(read) <= {f"s{i}" for i in range(25)}


async def test_a_new_lead_reads_the_claims_left_latest_due_first(ledger: Ledger) -> None:
    """A dead leader published in due order: its latest claims are the likeliest
    unpublished, so a new lead takes them first, across batches, up to its limit: the
    unpublished claims of the terms up to its own (its own: a previous lead of the same
    term) made and due by the start of its lead, and nothing else."""
    await ledger.fires.insert_many(
        [claim_document(f"s{i}", at(i), at(i), 1, at(0)) for i in range(1, 26)]
    )
    await ledger.fires.insert_many(
        [
            claim_document("own", at(26), at(26), 2, at(0)),  # a previous lead's
            claim_document("ahead", at(40), at(40), 1, at(0)),  # not due yet
            claim_document("just made", at(20), at(20), 2, at(31)),  # this lead's own
            claim_document("newer", at(20), at(20), 3, at(0)),  # a later term's
            {**claim_document("published", at(27), at(27), 1, at(0)), "state": PUBLISHED},
        ]
    )
    batches = [batch async for batch in ledger.left_due(2, at(30), limit=100, batch=10)]
    assert [len(batch) for batch in batches] == [10, 10, 6]
    assert [c.schedule_id for batch in batches for c in batch] == ["own"] + [
        f"s{i}" for i in range(25, 0, -1)
    ]
    limited = [batch async for batch in ledger.left_due(2, at(30), limit=15, batch=10)]
    assert [c.schedule_id for batch in limited for c in batch] == ["own"] + [
        f"s{i}" for i in range(25, 11, -1)
    ]


async def test_a_skipped_range_is_recorded_once(ledger: Ledger) -> None:
    doc = skipped_range_document("s", SkippedRange(at(1), at(9), 9, "policy 'none'"), 2, at(10))
    await ledger.record_skipped([doc])
    await ledger.record_skipped([doc])  # the same range planned again
    stored = [d async for d in ledger.fires.find({"state": SKIPPED})]
    assert len(stored) == 1
    assert (stored[0]["count"], stored[0]["last_nominal_at"]) == (9, at(9))
    assert [d["_id"] for d in await ledger.history("s", 10)] == [doc["_id"]]
    assert [d["_id"] for d in await ledger.recent(at(0), 10)] == [doc["_id"]]


async def test_fire_times_step_past_a_fan_outs_tenants_and_count_them(ledger: Ledger) -> None:
    # Fires at 1..4 s: 3 and 1 fan out to 500 tenants each, 4 and 2 are plain.
    docs = []
    for second in (1, 2, 3, 4):
        doc = claim_document("s", at(second), at(second), 1, at(0))
        if second % 2:
            docs += [
                {**doc, "_id": f"{doc['_id']}/t{i:03d}", "tenant": f"t{i:03d}"} for i in range(500)
            ]
        else:
            docs.append(doc)
    docs.append(claim_document("other", at(5), at(5), 1, at(0)))
    assert await ledger.claim(docs) == set()
    await ledger.mark_published(
        [f"{fire_id('s', at(3))}/t{i:03d}" for i in range(400)], 1, at(3), 1
    )
    await ledger.skip([f"{fire_id('s', at(3))}/t499"], 1, "tenant no longer selected")

    assert await ledger.fire_times("s", 10) == [at(4), at(3), at(2), at(1)]
    assert await ledger.fire_times("s", 2) == [at(4), at(3)]
    assert await ledger.fire_times("none", 3) == []
    assert await ledger.counts("s", [at(3), at(4), at(9)]) == {
        at(3): {PUBLISHED: 400, CLAIMED: 99, SKIPPED: 1},
        at(4): {CLAIMED: 1},
        at(9): {},
    }


async def test_a_fan_out_run_now_is_one_request_per_tenant_under_one_idempotency_key(
    ledger: Ledger,
) -> None:
    docs = request_documents("s", "default", at(0), "ci", {"k": 1}, "skip", "deploy-1", ["a", "b"])
    fire = "s@manual-2030-01-01T00:00:00.000Z"
    assert [d["_id"] for d in docs] == [f"{fire}/a", f"{fire}/b"]
    assert [d.get("idempotency_key") for d in docs] == ["s/deploy-1", None]
    first, created = await ledger.request(docs)
    assert (requested_fire(first), created) == (fire, True)
    assert (
        await ledger.fires.count_documents(
            {"state": REQUESTED, "payload": {"k": 1}, "overlap": "skip"}
        )
        == 2
    )

    # The same key later: the first request's fire, and nothing inserted.
    retried, created = await ledger.request(
        request_documents("s", "default", at(5), "ci", None, None, "deploy-1", ["a", "b", "c"])
    )
    assert (requested_fire(retried), created) == (fire, False)
    assert await ledger.fires.count_documents({}) == 2
    # Without a key, the same instant twice is a duplicate fire, not a retry.
    plain = request_documents("p", "default", at(0), "ci", None, None, None)
    assert (requested_fire((await ledger.request(plain))[0])) == "p@manual-2030-01-01T00:00:00.000Z"
    with pytest.raises(BulkWriteError):
        await ledger.request(request_documents("p", "default", at(0), "ci", None, None, None))
