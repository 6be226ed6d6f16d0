"""CRUD, indexes and catalog commands through real drivers over real sockets."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from hascheduler.storage.streams import open_change_stream
from tests.drivers import Driver
from tests.servers import start_devmongo
from tests.waiting import wait_until


async def test_insert_find_update_delete_round_trip(db: Any) -> None:
    coll = db.things
    result = await coll.insert_one({"name": "a", "n": 1, "when": datetime.datetime(2030, 1, 1)})
    await coll.insert_many([{"name": "b", "n": 2}, {"name": "c", "n": 3, "tags": ["x", "y"]}])

    got = await coll.find_one({"_id": result.inserted_id})
    assert got == {
        "_id": result.inserted_id,
        "name": "a",
        "n": 1,
        "when": datetime.datetime(2030, 1, 1),
    }
    assert [d["name"] async for d in coll.find({"n": {"$gte": 2}}).sort("n", -1)] == ["c", "b"]
    assert [d["name"] async for d in coll.find({"tags": "y"})] == ["c"]
    assert [d async for d in coll.find({}, {"_id": 0, "name": 1}).sort("n", 1).skip(1)] == [
        {"name": "b"},
        {"name": "c"},
    ]

    updated = await coll.update_many({"n": {"$lt": 3}}, {"$inc": {"n": 10}, "$set": {"k.v": 1}})
    assert (updated.matched_count, updated.modified_count) == (2, 2)
    assert sorted([d["n"] async for d in coll.find()]) == [3, 11, 12]
    unchanged = await coll.update_one({"name": "c"}, {"$set": {"n": 3}})
    assert (unchanged.matched_count, unchanged.modified_count) == (1, 0)

    upserted = await coll.update_one({"name": "d"}, {"$setOnInsert": {"n": 4}}, upsert=True)
    assert upserted.upserted_id is not None
    assert (await coll.find_one({"name": "d"}))["n"] == 4

    replaced = await coll.replace_one({"name": "d"}, {"name": "d", "replaced": True})
    assert replaced.modified_count == 1
    assert await coll.find_one({"name": "d"}, {"_id": 0}) == {"name": "d", "replaced": True}

    assert (await coll.delete_one({"name": "a"})).deleted_count == 1
    assert (await coll.delete_many({})).deleted_count == 3
    assert await coll.count_documents({}) == 0


async def test_an_update_stores_its_instants_as_the_server_does(db: Any) -> None:
    # Milliseconds, UTC: what the update's own values become, in $set, in a $push's
    # $each, and in an upsert's insert; the instants already stored stay as they were.
    at = datetime.datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)
    stored = datetime.datetime(2030, 1, 1, 12, 0, 0, 123000)
    coll = db.instants
    await coll.create_index("state")
    await coll.insert_one({"_id": 1, "state": "a", "first": at, "history": []})
    await coll.update_one(
        {"_id": 1, "state": "a"},
        {
            "$set": {"at": at, "state": "b"},
            "$push": {"history": {"$each": [{"at": at}], "$slice": -5}},
        },
    )
    await coll.update_one({"_id": 2}, {"$set": {"at": at}}, upsert=True)
    one, two = [d async for d in coll.find().sort("_id", 1)]
    for value in (one["first"], one["at"], one["history"][0]["at"], two["at"]):
        assert value.replace(tzinfo=None) == stored
    assert one["state"] == "b"


async def test_a_push_grows_the_array_at_its_end_as_mongodb_does(db: Any) -> None:
    coll = db.pushes
    await coll.insert_many([{"_id": 1}, {"_id": 2, "h": [0]}, {"_id": 3, "h": "text"}])

    async def h(_id: int) -> Any:
        return (await coll.find_one({"_id": _id}))["h"]

    await coll.update_one({"_id": 1}, {"$push": {"h": 1}})  # a missing field: created
    assert await h(1) == [1]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [2, 3]}}})
    assert await h(1) == [1, 2, 3]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [4, 5], "$slice": -3}}})
    assert await h(1) == [3, 4, 5]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [6], "$slice": 2}}})
    assert await h(1) == [3, 4]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [], "$position": 0}}})
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [9], "$position": 0}}})
    assert await h(1) == [9, 3, 4]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"a": {"b": 1}}}, "$set": {"n": 1}})
    assert await h(1) == [9, 3, 4, {"a": {"b": 1}}]
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [1], "$slice": 0}}})
    assert await h(1) == []

    # One update to many documents: each grows its own array.
    await coll.update_many({"_id": {"$in": [1, 2]}}, {"$push": {"h": {"$each": [7]}}})
    await coll.update_one({"_id": 2}, {"$push": {"h": 8}})
    assert (await h(1), await h(2)) == ([7], [0, 7, 8])

    with pytest.raises(OperationFailure) as not_an_array:
        await coll.update_one({"_id": 3}, {"$push": {"h": 1}})
    assert not_an_array.value.code == 2
    with pytest.raises(OperationFailure) as conflict:
        await coll.update_one({"_id": 2}, {"$push": {"h": 1}, "$set": {"h": []}})
    assert conflict.value.code == 40
    assert (await h(2), await h(3)) == ([0, 7, 8], "text")


async def test_update_pipeline_with_now_and_date_arithmetic(db: Any) -> None:
    coll = db.pipes
    await coll.insert_one({"_id": 1, "term": 4, "drop": "me"})
    before = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    await coll.update_one(
        {"_id": 1},
        [
            {"$set": {"expires_at": {"$add": ["$$NOW", 10_000]}, "term": {"$add": ["$term", 1]}}},
            {"$unset": "drop"},
        ],
    )
    doc = await coll.find_one({"_id": 1})
    assert doc["term"] == 5
    assert "drop" not in doc
    delta = (doc["expires_at"] - before).total_seconds()
    assert 9.0 <= delta <= 12.0, delta

    await coll.update_one({"_id": 1}, [{"$replaceWith": {"_id": "$_id", "only": "$term"}}])
    assert await coll.find_one({"_id": 1}) == {"_id": 1, "only": 5}


async def test_expr_with_now_filters_on_server_clock(db: Any) -> None:
    coll = db.leases
    past = datetime.datetime(2000, 1, 1)
    future = datetime.datetime(2100, 1, 1)
    await coll.insert_many(
        [
            {"_id": "expired", "expires_at": past},
            {"_id": "held", "expires_at": future},
            {"_id": "never-set"},
        ]
    )
    expired = {d["_id"] async for d in coll.find({"$expr": {"$lt": ["$expires_at", "$$NOW"]}})}
    # A missing field orders below every date, as in MongoDB.
    assert expired == {"expired", "never-set"}


async def test_find_one_and_update_variants(db: Any) -> None:
    coll = db.fam
    await coll.insert_many([{"_id": i, "group": "g", "rank": i} for i in range(5)])
    before = await coll.find_one_and_update(
        {"group": "g"}, {"$set": {"picked": True}}, sort=[("rank", -1)]
    )
    assert before["_id"] == 4
    assert "picked" not in before
    after = await coll.find_one_and_update(
        {"_id": 3},
        {"$inc": {"rank": 10}},
        projection={"rank": 1},
        return_document=ReturnDocument.AFTER,
    )
    assert after == {"_id": 3, "rank": 13}
    created = await coll.find_one_and_update(
        {"_id": "new"}, {"$set": {"x": 1}}, upsert=True, return_document=ReturnDocument.AFTER
    )
    assert created == {"_id": "new", "x": 1}
    removed = await coll.find_one_and_delete({"_id": 0})
    assert removed["_id"] == 0
    assert await coll.find_one({"_id": 0}) is None
    assert await coll.find_one_and_update({"_id": "absent"}, {"$set": {"x": 1}}) is None


async def test_unique_index_violation_is_duplicate_key_error(db: Any) -> None:
    coll = db.uniq
    await coll.create_index([("tenant", 1), ("slug", 1)], unique=True, name="tenant_slug")
    await coll.insert_one({"tenant": "t", "slug": "s"})
    with pytest.raises(DuplicateKeyError) as caught:
        await coll.insert_one({"tenant": "t", "slug": "s"})
    details = caught.value.details
    assert details is not None
    assert details["keyPattern"] == {"tenant": 1, "slug": 1}
    assert details["keyValue"] == {"tenant": "t", "slug": "s"}
    with pytest.raises(DuplicateKeyError):
        await coll.insert_one({"_id": (await coll.find_one())["_id"]})
    # An update that would collide is refused and leaves the document as it was.
    other = await coll.insert_one({"tenant": "t", "slug": "other"})
    with pytest.raises(DuplicateKeyError):
        await coll.update_one({"_id": other.inserted_id}, {"$set": {"slug": "s"}})
    assert (await coll.find_one({"_id": other.inserted_id}))["slug"] == "other"
    # Unordered bulk inserts keep going past the duplicate.
    with pytest.raises(BulkWriteError) as bulk:
        await coll.insert_many(
            [{"tenant": "t", "slug": "s"}, {"tenant": "u", "slug": "s"}], ordered=False
        )
    assert bulk.value.details["nInserted"] == 1
    assert bulk.value.details["writeErrors"][0]["code"] == 11000
    assert await coll.count_documents({}) == 3


async def test_ttl_documents_disappear(db: Any) -> None:
    coll = db.ttl
    await coll.create_index("expire_at", expireAfterSeconds=0)
    now = datetime.datetime.now(datetime.UTC)
    await coll.insert_many(
        [
            {"_id": "old", "expire_at": now - datetime.timedelta(seconds=5)},
            {"_id": "young", "expire_at": now + datetime.timedelta(hours=1)},
            {"_id": "no-date", "expire_at": "not a date"},
        ]
    )

    async def only_survivors() -> bool:
        return {d["_id"] async for d in coll.find()} == {"young", "no-date"}

    # mongod's TTL monitor runs every 60 s; the development server sweeps every second.
    await wait_until(only_survivors, 90.0, "the TTL monitor to delete the expired document")


async def test_indexes_and_catalog_commands(
    db: Any, client: Any, db_name: str, driver: Driver
) -> None:
    coll = db.cat
    await db.create_collection("cat")
    with pytest.raises(OperationFailure) as exists:
        await db.command("create", "cat")
    assert exists.value.code == 48
    assert await coll.create_index([("a", 1)]) == "a_1"
    assert await coll.create_index([("b", -1)], name="by_b", sparse=True) == "by_b"
    names = {i["name"] for i in await driver.list_indexes(coll)}
    assert names == {"_id_", "a_1", "by_b"}
    await coll.drop_index("a_1")
    assert {i["name"] for i in await driver.list_indexes(coll)} == {"_id_", "by_b"}
    with pytest.raises(OperationFailure) as missing:
        await coll.drop_index("nope")
    assert missing.value.code == 27

    assert "cat" in await db.list_collection_names()
    dbs = await client.list_database_names()
    assert db_name in dbs
    await coll.drop()
    assert "cat" not in await db.list_collection_names()


async def test_count_distinct_aggregate(db: Any, driver: Driver) -> None:
    coll = db.agg
    await coll.insert_many(
        [
            {"k": "a", "v": 1, "tags": ["x"]},
            {"k": "a", "v": 2},
            {"k": "b", "v": 5, "tags": ["x", "z"]},
        ]
    )
    assert await coll.count_documents({"k": "a"}) == 2
    assert await coll.count_documents({"k": "a"}, skip=1) == 1
    assert await coll.count_documents({}, skip=1, limit=1) == 1
    assert await coll.count_documents({"k": "a"}, skip=5) == 0
    assert await coll.count_documents({"k": "zz"}) == 0
    assert sorted(await coll.distinct("tags")) == ["x", "z"]
    grouped = await driver.aggregate(
        coll,
        [
            {"$match": {"v": {"$gt": 0}}},
            {"$group": {"_id": "$k", "total": {"$sum": "$v"}}},
            {"$sort": {"_id": 1}},
        ],
    )
    assert grouped == [{"_id": "a", "total": 3}, {"_id": "b", "total": 5}]


async def test_cursor_batches_and_kill(db: Any) -> None:
    coll = db.batches
    await coll.insert_many([{"i": i} for i in range(250)])
    seen = [d["i"] async for d in coll.find().sort("i", 1).batch_size(7)]
    assert seen == list(range(250))
    cursor = coll.find().batch_size(10)
    first = await cursor.next()
    assert first["i"] == 0
    await cursor.close()


async def test_pages_in_id_order_match_a_full_sort(db: Any) -> None:
    """A find sorted by _id with a limit walks the _id index and stops at the limit; its
    pages, with or without a residual filter, either direction, are a full sort's."""
    coll = db.paged
    await coll.insert_many(
        [{"_id": f"s-{i:03d}", "team": "a" if i % 3 else "b", "i": i} for i in reversed(range(200))]
    )
    await coll.insert_one({"_id": 7, "team": "a"})  # another type sorts before strings
    everything = sorted(
        [d async for d in coll.find()], key=lambda d: (isinstance(d["_id"], str), d["_id"])
    )
    queries: list[tuple[dict[str, Any], int]] = [
        ({}, 1),
        ({"team": "a"}, 1),
        ({"team": "b"}, -1),
        ({"i": {"$gte": 50}}, -1),
    ]
    for query, direction in queries:
        want = [
            d
            for d in everything
            if all(
                d.get(k) == v if not isinstance(v, dict) else d.get("i", -1) >= v["$gte"]
                for k, v in query.items()
            )
        ]
        if direction == -1:
            want.reverse()
        got: list[Any] = []
        bound: dict[str, Any] = {}
        while True:
            page = [d async for d in coll.find({**query, **bound}).sort("_id", direction).limit(17)]
            got += page
            if len(page) < 17:
                break
            bound = {"_id": {"$gt" if direction == 1 else "$lt": page[-1]["_id"]}}
        assert got == want, query
    skipped = [d["_id"] async for d in coll.find({"team": "a"}).sort("_id", 1).skip(5).limit(3)]
    assert skipped == [d["_id"] for d in everything if d.get("team") == "a"][5:8]


async def test_transactions_get_a_clear_error(client: Any, db: Any, driver: Driver) -> None:
    await db.tx.insert_one({"a": 1})
    session = await driver.start_session(client)
    try:
        await driver.start_transaction(session)  # client-side only; the server sees it next
        with pytest.raises(OperationFailure) as caught:
            await db.tx.insert_one({"a": 2}, session=session)
        assert caught.value.code == 20
        assert "transactions are not supported" in str(caught.value)
    finally:
        await driver.end_session(session)
    assert await db.tx.count_documents({}) == 1


async def test_bad_commands_get_mongod_error_shapes(db: Any) -> None:
    with pytest.raises(OperationFailure) as unknown:
        await db.command("noSuchCommand")
    assert unknown.value.code == 59
    with pytest.raises(OperationFailure) as bad_filter:
        await db.c.find_one({"$bogus": 1})
    assert bad_filter.value.code == 2
    await db.c.insert_one({"_id": 1})
    with pytest.raises(OperationFailure) as bad_update:
        await db.c.update_one({"_id": 1}, {"$set": {"_id": 5}})
    assert bad_update.value.code == 66
    assert await db.c.find_one() == {"_id": 1}
    # The connection survives every error above.
    assert (await db.command("ping"))["ok"] == 1.0


async def test_direct_connection_and_replica_set_discovery(mongo_uri: str, driver: Driver) -> None:
    host = mongo_uri.split("//", 1)[1].split("/", 1)[0]
    for uri in (mongo_uri, f"mongodb://{host}/?directConnection=true"):
        client = driver.client(uri)
        try:
            hello = await client.admin.command("hello")
            assert hello["isWritablePrimary"] is True
            await client.t_direct.c.insert_one({"via": uri})
            assert await client.t_direct.c.count_documents({"via": uri}) == 1
        finally:
            await client.drop_database("t_direct")
            await driver.close(client)


@pytest.mark.devmongo_only
async def test_idle_cursor_is_killed_after_the_cursor_timeout(driver: Driver) -> None:
    server = start_devmongo("--cursor-timeout", "0.5")
    client = driver.client(server.uri)
    try:
        coll = client.idle.c
        await coll.insert_many([{"i": i} for i in range(10)])
        reply = await client.idle.command({"find": "c", "batchSize": 2})
        cursor_id = reply["cursor"]["id"]
        assert cursor_id != 0

        async def no_open_cursors() -> bool:
            status = await client.admin.command("serverStatus")
            return bool(status["devmongo"]["openCursors"] == 0)

        # serverStatus does not touch the cursor, so it sits idle until the reaper kills it.
        await wait_until(no_open_cursors, 15.0, "the idle cursor to be killed")
        with pytest.raises(OperationFailure) as caught:
            await client.idle.command({"getMore": cursor_id, "collection": "c"})
        assert caught.value.code == 43
    finally:
        await driver.close(client)
        assert server.stop() == 0


async def test_array_filters_update_only_matching_elements(db: Any) -> None:
    coll = db.grades
    await coll.insert_many(
        [
            {"_id": 1, "grades": [95, 92, 90]},
            {"_id": 2, "grades": [98, 100, 102]},
            {"_id": 3, "scores": [{"grade": 80, "mean": 75}, {"grade": 85, "mean": 90}]},
        ]
    )
    result = await coll.update_many(
        {"grades": {"$exists": True}},
        {"$set": {"grades.$[element]": 100}},
        array_filters=[{"element": {"$gte": 100}}],
    )
    assert result.modified_count == 1
    assert (await coll.find_one({"_id": 2}))["grades"] == [98, 100, 100]
    assert (await coll.find_one({"_id": 1}))["grades"] == [95, 92, 90]

    await coll.update_one(
        {"_id": 3},
        {"$inc": {"scores.$[s].mean": 5}, "$set": {"checked": True}},
        array_filters=[{"s.grade": {"$gte": 85}}],
    )
    assert await coll.find_one({"_id": 3}) == {
        "_id": 3,
        "scores": [{"grade": 80, "mean": 75}, {"grade": 85, "mean": 95}],
        "checked": True,
    }

    await coll.update_one({"_id": 1}, {"$mul": {"grades.$[]": 2}})
    assert (await coll.find_one({"_id": 1}))["grades"] == [190, 184, 180]

    after = await coll.find_one_and_update(
        {"_id": 2},
        {"$max": {"grades.$[low]": 99}},
        array_filters=[{"low": {"$lt": 99}}],
        return_document=True,
    )
    assert after["grades"] == [99, 100, 100]


@pytest.mark.parametrize(
    ("update", "array_filters", "code"),
    [
        ({"$set": {"grades.$[nope]": 1}}, [{"element": {"$gt": 1}}], 2),  # undefined identifier
        ({"$set": {"grades.0": 1}}, [{"element": {"$gt": 1}}], 9),  # filter not used
        ({"$set": {"missing.$[e]": 1}}, [{"e": 1}], 2),  # path must exist
        ({"$set": {"grades.$[e]": 1}}, [{"e": 1}, {"e": 2}], 9),  # identifier twice
    ],
)
async def test_bad_array_filters_get_mongod_errors(
    db: Any, update: dict[str, Any], array_filters: list[Any], code: int
) -> None:
    await db.af.insert_one({"_id": 1, "grades": [1, 2, 3]})
    with pytest.raises(OperationFailure) as caught:
        await db.af.update_one({"_id": 1}, update, array_filters=array_filters)
    assert caught.value.code == code
    assert await db.af.find_one() == {"_id": 1, "grades": [1, 2, 3]}


@pytest.mark.devmongo_only
async def test_options_the_server_does_not_implement_are_refused_not_ignored(db: Any) -> None:
    coll = db.things
    await coll.insert_many([{"name": "a"}, {"name": "B"}])
    case_insensitive = {"locale": "en", "strength": 2}
    refused: list[Callable[[], Awaitable[Any]]] = [
        lambda: coll.find_one({"name": "b"}, collation=case_insensitive),
        lambda: coll.count_documents({"name": "b"}, collation=case_insensitive),
        lambda: coll.update_one({"name": "b"}, {"$set": {"x": 1}}, collation=case_insensitive),
        lambda: coll.delete_many({"name": "b"}, collation=case_insensitive),
        lambda: coll.update_one(
            {"$expr": {"$eq": ["$name", "$$n"]}}, {"$set": {"x": 1}}, let={"n": "a"}
        ),
        lambda: coll.find_one_and_update(
            {"name": "a"}, {"$set": {"x": 1}}, collation=case_insensitive
        ),
        lambda: coll.create_index("name", collation=case_insensitive),
    ]
    for call in refused:
        with pytest.raises(OperationFailure) as caught:
            await call()
        assert caught.value.code == 115
        assert "does not implement" in str(caught.value)
    unknown = await db.command({"find": "things", "filter": {}, "surprise": 1}, check=False)
    assert (unknown["ok"], unknown["code"]) == (0.0, 40415)
    assert "things" in (await db.list_collection_names())
    # Nothing was changed by the refused writes.
    assert [d async for d in coll.find({"x": {"$exists": True}})] == []


@pytest.mark.parametrize(
    "push",
    [
        {"h": {"$each": "not a list"}},
        {"h": {"$each": [1], "$slice": "x"}},
        {"h": {"$each": [1], "$slice": True}},
        {"h": {"$each": [1], "$slice": 1.5}},
        {"h": {"$each": [1], "$slice": -1, "$unknown": 1}},
        {"": 1},
        {"$h": 1},
    ],
)
async def test_a_malformed_push_is_refused_and_leaves_the_document(db: Any, push: Any) -> None:
    coll = db.hostile_pushes
    await coll.insert_one({"_id": 1, "h": [0]})
    with pytest.raises(OperationFailure):
        await coll.update_one({"_id": 1}, {"$push": push})
    assert await coll.find_one({"_id": 1}) == {"_id": 1, "h": [0]}


async def test_valid_but_expensive_pushes_stay_bounded(db: Any) -> None:
    # A $slice far past the array's length keeps all of it; a push of 100,000 values at
    # once is stored whole; a bounded history stays bounded however many pushes come.
    coll = db.big_pushes
    await coll.insert_one({"_id": 1, "h": []})
    await coll.update_one(
        {"_id": 1}, {"$push": {"h": {"$each": list(range(100_000)), "$slice": -(2**62)}}}
    )
    assert len((await coll.find_one({"_id": 1}))["h"]) == 100_000
    await coll.update_one({"_id": 1}, {"$push": {"h": {"$each": [-1], "$slice": -3}}})
    assert (await coll.find_one({"_id": 1}))["h"] == [99_998, 99_999, -1]


@pytest.mark.devmongo_only
async def test_commands_holding_the_server_past_slowms_are_logged(driver: Driver) -> None:
    """Everything waits behind a command on the single-threaded server, a lease renewal
    too: one that holds it past --slowms is logged with what it asked, as mongod logs slow
    operations. A change stream's getMore waits for events; its wait is not logged."""
    server = start_devmongo("--slowms", "0")
    client = driver.client(server.uri)
    try:
        coll = client.slow.c
        await coll.insert_many([{"i": i} for i in range(3)])
        assert [d["i"] async for d in coll.find({"i": {"$in": [1, 2]}}).sort("i", 1)] == [1, 2]
        async with await open_change_stream(coll, max_await_time_ms=300) as stream:
            assert await stream.try_next() is None  # one awaited getMore, nothing new
    finally:
        await driver.close(client)
        assert server.stop() == 0
    assert server.log_path is not None
    lines = (await asyncio.to_thread(Path(server.log_path).read_text)).splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    slow = [e for e in events if e.get("event") == "slow_command"]
    assert {"command": "insert", "ns": "slow.c"} | {"shape": "3 documents "} in [
        {k: e[k] for k in ("command", "ns", "shape")} for e in slow
    ]
    found = [e for e in slow if e["command"] == "find"]
    assert [e["shape"] for e in found] == ["{'i': {'$in': [1, 2]}}"]
    assert all(isinstance(e["ms"], float) and e["ms"] >= 0 for e in slow)
    assert not [e for e in slow if e["command"] == "getMore"]
