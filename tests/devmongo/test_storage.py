"""Storage, index planning and change log, in process (pure logic, no sockets)."""

from __future__ import annotations

import copy
import datetime
import itertools
import math
import random
import re
import unittest.mock
from typing import Any

import pytest
from bson import Code, Int64, ObjectId, Timestamp
from hascheduler_dev.devmongo import engine
from hascheduler_dev.devmongo.changes import ChangeLog, ClusterClock, decode_token, describe_update
from hascheduler_dev.devmongo.cursors import ChangeStreamCursor
from hascheduler_dev.devmongo.errors import DuplicateKey, MongoError
from hascheduler_dev.devmongo.storage import Catalog, Collection, _same_types, _simple_filter
from hascheduler_dev.devmongo.values import index_values, key_of, sort_key, type_rank


def make_collection(n: int = 0, capacity: int = 10_000) -> Collection:
    catalog = Catalog(ChangeLog(ClusterClock(), capacity))
    coll = catalog.collection("db", "c")
    for i in range(n):
        coll.insert(
            {
                "_id": i,
                "n": i,
                "tag": f"t{i % 10}",
                "at": datetime.datetime(2030, 1, 1) + datetime.timedelta(seconds=i),
            }
        )
    return coll


def test_a_partial_index_the_filter_implies_narrows_without_a_condition_on_its_fields() -> None:
    """The fires asked to run now ({"state": "requested"}, sorted on nominal_at) are read
    from their partial index on nominal_at, not by scanning every fire; and among many
    claims of one term, the few due for a retry come from a range on next_attempt_at."""
    coll = make_collection(1000)
    coll.create_index({"key": {"at": 1}, "name": "t3_at", "partialFilterExpression": {"tag": "t3"}})
    coll.create_index({"key": {"n": 1}, "name": "t3_n", "partialFilterExpression": {"tag": "t3"}})
    coll.create_index({"key": {"tag": 1}, "name": "tag"})
    for filter_, narrowed_to in (
        ({"tag": "t3"}, 100),
        ({"tag": "t3", "n": {"$lt": 100}}, 10),
        ({"tag": "t4", "n": {"$lt": 100}}, 100),
    ):
        assert len(list(coll.candidates(filter_))) == narrowed_to, filter_
        scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
        assert [rid for rid, _ in coll.find(op(), filter_)] == scanned
    coll.delete(next(rid for rid, doc in coll.docs.items() if doc["tag"] == "t3"))
    assert len(list(coll.candidates({"tag": "t3"}))) == 99
    # Writes that leave the partial filter's field alone, and writes that move a document
    # into or out of the index, keep it exact.
    t3 = [rid for rid, doc in coll.docs.items() if doc["tag"] == "t3"]
    coll.replace(t3[0], {**coll.docs[t3[0]], "n": -1}, replacement=False)
    coll.replace(t3[1], {**coll.docs[t3[1]], "tag": "t4"}, replacement=False)
    t4 = next(rid for rid, doc in coll.docs.items() if doc["tag"] == "t4")
    coll.replace(t4, {**coll.docs[t4], "tag": "t3", "n": 5000}, replacement=False)
    for filter_ in (
        {"tag": "t3"},
        {"tag": "t3", "n": {"$lt": 100}},
        {"tag": "t3", "n": {"$gt": 1000}},
    ):
        scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
        assert [rid for rid, _ in coll.find(op(), filter_)] == scanned, filter_
    assert len(list(coll.candidates({"tag": "t3"}))) == 99


def op() -> engine.Operation:
    return engine.Operation(datetime.datetime(2030, 1, 1), Timestamp(1, 1))


@pytest.mark.parametrize(
    ("filter_", "narrowed_to"),
    [
        ({"_id": 5}, 1),
        ({"_id": {"$in": [1, 2, 3]}}, 3),
        ({"tag": "t3"}, 100),
        ({"n": {"$gte": 990}}, 10),
        ({"n": {"$gt": 10, "$lte": 20}}, 10),
        # The smaller of an equality's 100 and a range's 50.
        ({"$and": [{"tag": "t1"}, {"n": {"$lt": 50}}]}, 50),
        ({"at": {"$lt": datetime.datetime(2030, 1, 1, 0, 0, 5)}}, 5),
    ],
)
def test_indexed_filters_do_not_scan(filter_: dict[str, Any], narrowed_to: int) -> None:
    coll = make_collection(1000)
    coll.create_index({"key": {"tag": 1}})
    coll.create_index({"key": {"n": 1}})
    coll.create_index({"key": {"at": 1}})
    assert len(list(coll.candidates(filter_))) == narrowed_to
    # The narrowed candidates give exactly what a full scan gives.
    scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
    assert [rid for rid, _ in coll.find(op(), filter_)] == scanned


@pytest.mark.parametrize(
    ("filter_", "narrowed_to"),
    [
        ({"state": "claimed", "term": 2}, 10),  # the partial index, by key
        ({"state": "claimed", "term": {"$lt": 2}}, 20),  # ... by range
        ({"state": {"$in": ["claimed"]}, "term": 1}, 10),
        ({"state": "published", "term": 1}, 1000),  # not implied: never the index
        ({"term": 1}, 1000),
        ({"state": {"$in": ["claimed", "published"]}, "term": 1}, 1000),
        ({"state": {"$ne": "published"}, "term": 1}, 1000),
    ],
)
def test_partial_index_is_used_only_when_the_filter_implies_it(
    filter_: dict[str, Any], narrowed_to: int
) -> None:
    coll = make_collection()
    coll.create_index(
        {
            "key": {"term": 1},
            "name": "claimed_by_term",
            "partialFilterExpression": {"state": "claimed"},
        }
    )
    for i in range(1000):  # 30 claimed (10 per term), the rest published
        coll.insert({"_id": i, "term": i % 3, "state": "claimed" if i < 30 else "published"})
    assert len(list(coll.candidates(filter_))) == narrowed_to
    scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
    assert [rid for rid, _ in coll.find(op(), filter_)] == scanned
    # Publishing a claim takes it out of the index; nothing else moves in.
    rid, doc = coll.find(op(), {"_id": 0})[0]
    coll.replace(rid, {**doc, "state": "published"}, replacement=True)
    assert [d["_id"] for _, d in coll.find(op(), {"state": "claimed", "term": 0})] == list(
        range(3, 30, 3)
    )
    claimed = coll.indexes["claimed_by_term"].entries[(key_of(0),)]
    assert isinstance(claimed, set)
    assert len(claimed) == 9


@pytest.mark.parametrize(
    ("filter_", "narrowed_to"),
    [
        ({"open_key": "k3"}, 1),  # implies $exists: the index
        ({"open_key": {"$in": ["k1", "k2", "gone"]}}, 2),
        ({"open_key": {"$in": ["k1", None]}}, 1000),  # null matches the missing
        ({"open_key": None}, 1000),
        ({"open_key": {"$ne": "k1"}}, 1000),
    ],
)
def test_an_exists_partial_index_serves_the_equalities_that_imply_it(
    filter_: dict[str, Any], narrowed_to: int
) -> None:
    """As the runs ledger's one-open-run index: a query pinning the field to values that
    are not null implies the field exists, so it is served by the index instead of a scan
    of every document (at 10,000 fires a second that scan was most of the server's time)."""
    coll = make_collection()
    coll.create_index(
        {
            "key": {"open_key": 1},
            "name": "one_open_run",
            "unique": True,
            "partialFilterExpression": {"open_key": {"$exists": True}},
        }
    )
    for i in range(1000):  # 10 open runs, the others ended (no open_key)
        coll.insert({"_id": i, **({"open_key": f"k{i}"} if i < 10 else {})})
    assert len(list(coll.candidates(filter_))) == narrowed_to
    scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
    assert [rid for rid, _ in coll.find(op(), filter_)] == scanned


def test_range_respects_type_brackets_and_multikey_arrays() -> None:
    coll = make_collection()
    coll.create_index({"key": {"v": 1}})
    for i, v in enumerate([1, 2.5, "3", True, None, [0, 9], datetime.datetime(2020, 1, 1)]):
        coll.insert({"_id": i, "v": v})
    found = sorted(doc["_id"] for _, doc in coll.find(op(), {"v": {"$gt": 1, "$lt": 5}}))
    # 2.5 by value; [0, 9] because one element is > 1 and another < 5 (MongoDB semantics);
    # never "3", True or the date.
    assert found == [1, 5]


def test_numbers_share_keys_booleans_do_not() -> None:
    assert key_of(1) == key_of(1.0) == key_of(Int64(1))
    assert key_of(True) != key_of(1)
    assert sort_key(None) < sort_key(0) < sort_key("a") < sort_key({}) < sort_key(ObjectId())


def test_unique_index_checks_every_array_element_and_rolls_back() -> None:
    coll = make_collection()
    coll.create_index({"key": {"tags": 1}, "unique": True})
    coll.insert({"_id": 1, "tags": ["a", "b"]})
    with pytest.raises(DuplicateKey) as caught:
        coll.insert({"_id": 2, "tags": ["c", "b"]})
    assert caught.value.extra["keyPattern"] == {"tags": 1}
    assert len(coll.docs) == 1
    assert coll.find(op(), {"tags": "c"}) == []  # no trace of the failed insert
    coll.insert({"_id": 3, "tags": ["c"]})


def test_creating_a_unique_index_over_duplicates_fails() -> None:
    coll = make_collection()
    coll.insert({"_id": 1, "k": 1})
    coll.insert({"_id": 2, "k": 1})
    with pytest.raises(DuplicateKey):
        coll.create_index({"key": {"k": 1}, "unique": True})
    assert set(coll.indexes) == {"_id_"}


def test_ttl_index_finds_only_dates_past_expiry() -> None:
    coll = make_collection()
    coll.create_index({"key": {"exp": 1}, "expireAfterSeconds": 60})
    now = datetime.datetime(2030, 1, 1, 12, 0)
    coll.insert({"_id": "old", "exp": now - datetime.timedelta(seconds=61)})
    coll.insert({"_id": "fresh", "exp": now - datetime.timedelta(seconds=59)})
    coll.insert({"_id": "text", "exp": "2000-01-01"})
    assert [coll.docs[rid]["_id"] for rid in coll.expired(now)] == ["old"]


def test_update_description_uses_dotted_paths() -> None:
    old = {"_id": 1, "a": {"b": 1, "c": 2}, "gone": True, "same": [1]}
    new = {"_id": 1, "a": {"b": 5, "c": 2}, "same": [1], "added": 1}
    assert describe_update(old, new) == {
        "updatedFields": {"a.b": 5, "added": 1},
        "removedFields": ["gone"],
        "truncatedArrays": [],
    }


def test_tokens_order_like_events_and_the_ring_forgets_the_oldest() -> None:
    log = ChangeLog(ClusterClock(), capacity=3)
    events = [log.append("db", "c", "insert", i) for i in range(5)]
    tokens = [e.token["_data"] for e in events]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 5
    assert [decode_token(e.token)[0] for e in events] == [1, 2, 3, 4, 5]
    assert [e.seq for e in log.after(2)] == [3, 4, 5]
    with pytest.raises(MongoError) as lost:
        list(log.after(1))
    assert lost.value.code == 286
    with pytest.raises(MongoError) as bad:
        decode_token({"_data": "nonsense"})
    assert bad.value.code == 260


def test_cluster_clock_strictly_increases() -> None:
    clock = ClusterClock()
    ticks = [clock.tick() for _ in range(1000)]
    assert all(a < b for a, b in itertools.pairwise(ticks))
    assert clock.current == ticks[-1]
    log = ChangeLog(clock, capacity=10)
    events = [log.append("db", "c", "insert", i) for i in range(5)]
    assert all(ticks[-1] < a.cluster_time < b.cluster_time for a, b in itertools.pairwise(events))
    assert log.seq_at_time(events[2].cluster_time) == events[1].seq


def test_a_collection_stream_passes_over_other_collections_unread() -> None:
    """A stream on one collection moves past the events of the others without reading
    them (the fires ledger's writes, past a schedules mirror's stream), and still sees its
    collection's events, its database's drop, and the loss of its place in the ring."""
    log = ChangeLog(ClusterClock(), capacity=100)
    stream = ChangeStreamCursor(1, "db.schedules", changes=log, db="db", coll="schedules")
    whole_db = ChangeStreamCursor(2, "db", changes=log, db="db")
    for i in range(50):
        log.append("db", "fires", "insert", i, {"_id": i})
    last = log.append("other", "schedules", "insert", key_id=0, full_document={"_id": 0})
    with unittest.mock.patch.object(ChangeLog, "after", side_effect=AssertionError):
        assert stream.collect(None) == []
    assert stream.position == last.seq
    assert stream.post_batch_token([]) == last.token
    assert len(whole_db.collect(None)) == 50  # a database's stream reads its every event
    mine = log.append("db", "schedules", "insert", key_id="s", full_document={"_id": "s"})
    log.append("db", "fires", "insert", key_id="f", full_document={"_id": "f"})
    assert [e["documentKey"] for e in stream.collect(None)] == [{"_id": "s"}]
    assert stream.position > mine.seq
    log.append("db", None, "dropDatabase")
    assert [e["operationType"] for e in stream.collect(None)] == ["invalidate"]
    behind = ChangeStreamCursor(
        3, "db.schedules", changes=log, db="db", coll="schedules", position=mine.seq
    )
    for i in range(100):
        log.append("db", "fires", "delete", i)
    with pytest.raises(MongoError) as lost:
        behind.collect(None)
    assert lost.value.code == 286


def test_update_that_changes_nothing_emits_no_event() -> None:
    coll = make_collection()
    coll.insert({"_id": 1, "a": 1})
    before = coll.changes.last_seq
    rid = next(iter(coll.docs))
    new = engine.apply_update(op(), coll.docs[rid], {"_id": 1}, {"$set": {"a": 1}}, False)
    assert coll.replace(rid, new, replacement=False) is False
    assert coll.changes.last_seq == before


@pytest.mark.parametrize(
    "filter_",
    [
        {"_id": {"$in": [1, 2, 3, 999]}, "n": {"$gt": 1}},
        {"_id": {"$in": [1, 2, 3]}, "tag": "t2"},
        {"_id": 5, "n": 5},
        {"_id": 5, "n": 6},
        {"_id": {"$in": [1, 2, 3], "$nin": [2]}},
        {"tag": {"$in": ["t1", "t2"]}, "n": {"$lt": 30}},
        {"_id": {"$in": [1.0, 2]}},
    ],
)
def test_exactly_decided_conditions_give_what_a_scan_gives(filter_: dict[str, Any]) -> None:
    coll = make_collection(100)
    coll.create_index({"key": {"tag": 1}})
    scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
    assert [rid for rid, _ in coll.find(op(), filter_)] == scanned


@pytest.mark.parametrize(
    "update",
    [
        {"$set": {"a": 2, "new": [1, {"x": 1}]}},
        {"$unset": {"a": "", "absent": ""}},
        {"$set": {"when": datetime.datetime(2031, 1, 1, tzinfo=datetime.UTC)}, "$unset": {"b": 1}},
        {"$set": {"b": {"c": 3}}},
    ],
)
def test_top_level_fast_path_matches_the_general_engine(update: dict[str, Any]) -> None:
    doc = {"_id": 1, "a": 1, "b": {"c": 1, "d": 2}, "z": True}
    fast = engine.apply_update(op(), doc, {"_id": 1}, update, False)
    general = engine._scratch._apply_update_document  # the engine's own path
    slow = copy.deepcopy(doc)
    general(slow, {"_id": 1}, update, False)
    slow = engine.mm_helpers.patch_datetime_awareness_in_document(slow)
    assert fast == slow
    assert list(fast) == list(slow)
    assert doc == {"_id": 1, "a": 1, "b": {"c": 1, "d": 2}, "z": True}, "input untouched"


def _general_match(filter_: dict[str, Any], doc: dict[str, Any]) -> bool:
    """mongomock's matcher alone, without the engine's fast path for plain equalities."""
    from mongomock import filtering

    return bool(filtering.filter_applies(filter_, doc))  # type: ignore[no-untyped-call]


_VALUES: list[Any] = [
    1,
    1.0,
    Int64(1),
    2,
    True,
    False,
    "1",
    "a",
    None,
    [1],
    [],
    {"a": 1},
    datetime.datetime(2030, 1, 1),
    float("nan"),
    ObjectId("0" * 24),
]


@pytest.mark.parametrize("want", _VALUES, ids=repr)
def test_plain_equality_fast_path_agrees_with_the_general_matcher(want: Any) -> None:
    docs = [{"_id": i, "v": v, "w": "x"} for i, v in enumerate(_VALUES)] + [{"_id": "none"}]
    for doc in docs:
        have = doc.get("v")
        # mongomock equates True with 1; MongoDB never matches a boolean to a number.
        bool_vs_number = {type(have), type(want)} & {bool} and {type(have), type(want)} & {
            int,
            float,
            Int64,
        }
        for filter_ in ({"v": want}, {"v": want, "w": "x"}, {"w": "y", "v": want}):
            expected = False if bool_vs_number else _general_match(filter_, doc)
            assert engine.matches(filter_, doc) == expected, (filter_, doc)


_IN_LISTS: list[list[Any]] = [
    [1],
    [1.0, "a"],
    [Int64(2), 2.5],
    [True],
    [False, 0],
    ["1", "b", ObjectId("0" * 24)],
    [datetime.datetime(2030, 1, 1), 2],
    [],
    ["a"] * 3,
]


@pytest.mark.parametrize("wants", _IN_LISTS, ids=repr)
def test_an_in_list_fast_path_agrees_with_the_general_matcher(wants: list[Any]) -> None:
    """$in over plain scalars is decided by a lookup of the value's equality key: the same
    answer as comparing it with each listed value, for every type a document may hold
    (numbers of any width equal, a boolean never a number, an array by its elements)."""
    docs = [
        {"_id": i, "v": v, "w": "x"}
        for i, v in enumerate([*_VALUES, [2, "b"], [[1]], Int64(1), 2.0])
    ] + [{"_id": "none", "w": "x"}]
    for filter_ in (
        {"v": {"$in": wants}},
        {"w": "x", "v": {"$in": wants}},
        {"v": {"$in": wants}, "w": {"$exists": True}},
    ):
        check = _simple_filter(filter_)
        assert check is not None, filter_
        for doc in docs:
            have = doc.get("v", [])
            elements = [have, *have] if isinstance(have, list) else [have]
            pairs = [(e, w) for e in elements for w in wants]
            if isinstance(have, list) and any(
                bool in {type(e), type(w)} and e == w for e, w in pairs
            ):
                continue  # an array: the general matcher's, which equates True with 1
            assert check(doc) == any(key_of(e) == key_of(w) for e, w in pairs), (filter_, doc)


@pytest.mark.parametrize("wants", [[None], [float("nan")], [[1]], [{"a": 1}], 3])
def test_an_in_list_of_anything_else_takes_the_general_matcher(wants: Any) -> None:
    assert _simple_filter({"v": {"$in": wants}}) is None


_RANGE_VALUES: list[Any] = [
    0,
    1,
    1.5,
    Int64(2),
    True,
    False,
    "",
    "a",
    "b",
    None,
    [1],
    {"a": 1},
    datetime.datetime(2029, 1, 1),
    datetime.datetime(2030, 1, 1),
    float("nan"),
    ObjectId("0" * 24),
    ObjectId("1" * 24),
]


@pytest.mark.parametrize("op", ["$lt", "$lte", "$gt", "$gte"])
@pytest.mark.parametrize("bound", _RANGE_VALUES, ids=repr)
def test_plain_range_fast_path_agrees_with_mongodb_type_bracketing(op: str, bound: Any) -> None:
    docs = [{"_id": i, "v": v, "w": "x"} for i, v in enumerate(_RANGE_VALUES)] + [{"_id": "none"}]
    for doc in docs:
        have = doc.get("v")
        for filter_ in (
            {"v": {op: bound}},
            {"w": "x", "v": {op: bound}},
            {"v": {op: bound}, "w": "y"},
        ):
            got = engine.matches(filter_, doc)
            if engine._plain_conditions(filter_, doc) is None:
                continue  # the general matcher answered: not this test's subject
            # MongoDB compares within one type (numbers together, booleans apart).
            same_type = type_rank(have) == type_rank(bound)
            expected = same_type and _general_match(filter_, doc)
            assert got == expected, (filter_, doc)
    assert engine._plain_conditions({"v": {"$lte": 2}}, {"v": 1}) is True, "fast path taken"


@pytest.mark.parametrize(
    "filter_",
    [
        {"state": "claimed", "term": 1},
        {"state": "claimed", "term": 1.0},
        {"state": {"$in": ["claimed", "published"]}, "term": 2},
        {"state": "claimed"},
        {"_id": {"$in": list(range(0, 60, 3))}, "state": "claimed", "term": 1},
    ],
)
@pytest.mark.parametrize("with_array", [False, True])
def test_compound_index_decides_only_what_it_can(filter_: dict[str, Any], with_array: bool) -> None:
    coll = make_collection()
    coll.create_index({"key": {"state": 1, "term": 1}})
    for i in range(60):
        coll.insert({"_id": i, "state": ["claimed", "published"][i % 2], "term": i % 3})
    coll.insert({"_id": 100, "state": "claimed", "term": True})
    if with_array:  # an array under the second field: its keys no longer decide exactly
        coll.insert({"_id": 101, "state": "claimed", "term": [1, 2]})
    scanned = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
    assert [rid for rid, _ in coll.find(op(), filter_)] == scanned


@pytest.mark.parametrize(
    "partial",
    [
        {"state": "claimed"},
        {"key": {"$exists": True}},
        {"state": "claimed", "key": {"$exists": True}},
        {"state": {"$in": ["claimed"]}},
        {"n": 3},
    ],
)
def test_a_partial_index_holds_what_the_general_matcher_selects(partial: dict[str, Any]) -> None:
    """The plain check made for simple filters agrees with the general matcher, arrays
    and numbers included."""
    from hascheduler_dev.devmongo.storage import Index

    index = Index("p", [("x", 1)], partial_filter=partial)
    docs: list[dict[str, Any]] = [
        {"state": "claimed"},
        {"state": "published"},
        {"state": ["claimed", "x"]},
        {"key": None},
        {"key": "k", "state": "claimed"},
        {},
        {"n": 3},
        {"n": 3.0},
        {"state": 1},
    ]
    for doc in docs:
        assert index.applies_to(doc) == engine.matches(partial, doc), doc


def test_the_ttl_sweep_deletes_in_chunks_and_spares_a_document_refreshed_meanwhile() -> None:
    """The sweep yields between chunks (a big one held every client, a lease renewal too);
    a document whose TTL field was moved forward during a yield is not deleted. The sweep
    is stepped by hand: each send runs it to its next yield."""
    from hascheduler_dev.devmongo.node import TTL_CHUNK, Node
    from hascheduler_dev.devmongo.settings import Settings

    node = Node(Settings())
    coll = node.catalog.collection("db", "c")
    coll.create_index({"key": {"at": 1}, "expireAfterSeconds": 0})
    now = node.operation().now
    n = 2 * TTL_CHUNK + 50
    for i in range(n):
        coll.insert({"_id": i, "at": now - datetime.timedelta(seconds=60)})
    coll.insert({"_id": "fresh", "at": now + datetime.timedelta(hours=1)})
    sweep = node.reap_expired_documents()
    sweep.send(None)  # the first chunk, up to its first yield
    assert len(coll.docs) == n + 1 - TTL_CHUNK
    rid = next(r for r, d in coll.docs.items() if d["_id"] == n - 1)
    coll.replace(
        rid, {**coll.docs[rid], "at": now + datetime.timedelta(hours=1)}, replacement=False
    )
    removed = None
    while removed is None:
        try:
            sweep.send(None)
        except StopIteration as stop:
            removed = stop.value
    assert removed == n - 1
    assert {d["_id"] for d in coll.docs.values()} == {n - 1, "fresh"}


def test_a_partial_index_on_a_boolean_holds_true_and_not_what_python_equates_to_it() -> None:
    # {"flag": true} matches true, or an array holding it; never 1 (True == 1 in Python).
    coll = make_collection()
    coll.create_index(
        {"key": {"n": 1}, "name": "flagged", "partialFilterExpression": {"flag": True}}
    )

    def flagged() -> set[Any]:
        return {coll.docs[rid]["_id"] for rid in coll.candidates({"flag": True})}

    for n, flag in enumerate([True, 1, False, [0, True], "true", None]):
        coll.insert({"_id": n, "n": n, "flag": flag})
    assert flagged() == {0, 3}
    rid = next(r for r, d in coll.docs.items() if d["_id"] == 0)
    coll.replace(rid, {"_id": 0, "n": 0, "flag": 1}, replacement=True)  # True to 1: out
    assert flagged() == {3}
    rid = next(r for r, d in coll.docs.items() if d["_id"] == 1)
    coll.replace(rid, {"_id": 1, "n": 1, "flag": True}, replacement=True)  # 1 to True: in
    assert flagged() == {1, 3}


def test_equalities_left_after_an_id_lookup_match_as_the_general_matcher_does() -> None:
    # What the _id lookup leaves (a term, a state, a flag) is checked by a plain check:
    # 2 equals 2.0, Int64(2) and an array holding 2, never True; a string never 2.
    coll = make_collection()
    values = [2, 2.0, Int64(2), [1, 2], True, "2", None, 3, ["2"], False, 1]
    for i, v in enumerate(values):
        coll.insert({"_id": i, "term": v, "flag": v, "state": v, "here": i % 2 or None})
    ids = {"$in": list(range(len(values)))}
    for filter_ in (
        {"term": 2},
        {"flag": True},
        {"flag": False},
        {"term": 1},
        {"state": "2"},
        {"term": 2, "here": {"$exists": True}},
    ):
        expected = [rid for rid, doc in coll.docs.items() if engine.matches(filter_, doc)]
        assert [rid for rid, _ in coll.find(op(), {"_id": ids, **filter_})] == expected, filter_
    assert [coll.docs[r]["_id"] for r, _ in coll.find(op(), {"_id": ids, "term": 2})] == [
        0,
        1,
        2,
        3,
    ]


def test_an_update_knowing_its_fields_moves_every_index_as_a_rebuild_would() -> None:
    """A PlainUpdate tells replace() the only fields it touched, so only the indexes that
    read them are looked at: after 3,000 random updates each index holds what the same
    index built afresh over the same documents holds, and what changed nothing says so."""
    rng = random.Random(7)
    specs: list[dict[str, Any]] = [
        {"key": {"state": 1}},
        {"key": {"state": 1, "at": -1}},
        {"key": {"term": 1}, "name": "claimed", "partialFilterExpression": {"state": "c"}},
        {"key": {"at": 1}, "name": "flagged", "partialFilterExpression": {"flag": True}},
        {
            "key": {"k": 1},
            "name": "keyed",
            "unique": True,
            "partialFilterExpression": {"k": {"$exists": True}},
        },
        {"key": {"term": -1}, "name": "ranged", "partialFilterExpression": {"term": {"$gt": 2}}},
        {"key": {"b.c": 1}, "sparse": True},
    ]
    values: list[Any] = [
        1,
        1.0,
        True,
        False,
        2,
        3,
        "c",
        "p",
        None,
        [1, 2],
        {"c": 1},
        datetime.datetime(2030, 1, 1),
    ]
    names = ["state", "term", "flag", "at", "b", "other"]
    coll = make_collection()
    for spec in specs:
        coll.create_index(spec)
    for i in range(200):
        coll.insert({"_id": i, **{n: rng.choice(values) for n in names if rng.random() < 0.7}})
    for step in range(3000):
        rid = rng.choice(list(coll.docs))
        sets = {n: rng.choice(values) for n in rng.sample(names, rng.randint(0, 3))}
        unsets = {n: "" for n in rng.sample(names, rng.randint(0, 2)) if n not in sets}
        if rng.random() < 0.2:
            sets["k"] = f"k{rng.randint(0, 400)}"
        elif rng.random() < 0.2:
            unsets["k"] = ""
        update = {op_: fields for op_, fields in (("$set", sets), ("$unset", unsets)) if fields}
        if not update:
            continue
        plan = engine.plain_update_plan(update)
        assert plan is not None
        old = coll.docs[rid]
        new = plan.apply(old)
        try:
            changed = coll.replace(
                rid, new, replacement=False, validated=True, touched=plan.touched
            )
        except DuplicateKey:
            assert coll.docs[rid] is old
            continue
        assert changed == (not (old == new and _same_types(old, new))), (step, update)
    fresh = make_collection()
    for spec in specs:
        fresh.create_index(spec)
    for rid, doc in coll.docs.items():
        fresh._index_new(rid, doc)
    for name, index in coll.indexes.items():
        assert index.entries == fresh.indexes[name].entries, name
        assert index.held == fresh.indexes[name].held, name


def test_an_index_order_gives_what_sorting_every_value_and_record_gives() -> None:
    """The first field's order keeps distinct values, each with its records: after random
    inserts, updates and deletes (values that repeat, mixed types, arrays, NaN), every
    range, its count, its members, and the whole order forwards and backwards are what
    sorting each (value, record) pair gives."""
    rng = random.Random(11)
    values: list[Any] = [
        1,
        2,
        2.0,
        Int64(3),
        True,
        "a",
        "b",
        None,
        datetime.datetime(2030, 1, 1),
        datetime.datetime(2030, 1, 2),
        [1, "a"],
        {"x": 1},
        float("nan"),
        float("-inf"),
    ]
    coll = make_collection()
    coll.create_index({"key": {"v": 1, "w": 1}})
    index = coll.indexes["v_1_w_1"]
    index.range((0,), True, (0,), True)  # a range scan: the order is kept from here on
    for step in range(4000):
        rids = list(coll.docs)
        roll = rng.random()
        if roll < 0.45 or not rids:
            coll.insert({"_id": step, "v": rng.choice(values), "w": rng.randint(0, 3)})
        elif roll < 0.85:
            rid = rng.choice(rids)
            coll.replace(rid, {**coll.docs[rid], "v": rng.choice(values)}, replacement=True)
        else:
            coll.delete(rng.choice(rids))

    def placed(sk: tuple[Any, ...]) -> tuple[Any, ...]:  # NaN is held with -Infinity
        nan = len(sk) == 2 and isinstance(sk[1], float) and sk[1] != sk[1]
        return (sk[0], float("-inf")) if nan else sk

    pairs = sorted(
        (placed(sort_key(v)), rid) for rid, doc in coll.docs.items() for v in index_values(doc, "v")
    )
    keys = sorted({sk for sk, _ in pairs})
    assert any(sk[1:] == (float("-inf"),) for sk in keys)  # the NaNs among them
    for low, high in itertools.combinations_with_replacement(keys, 2):
        for lo_inc, hi_inc in itertools.product((True, False), repeat=2):
            want = [
                rid
                for sk, rid in pairs
                if (low < sk or (lo_inc and low == sk)) and (sk < high or (hi_inc and sk == high))
            ]
            assert list(index.range(low, lo_inc, high, hi_inc)) == want, (low, high)
            assert index.range_size(low, lo_inc, high, hi_inc) == len(want)
            assert index.range_members(low, lo_inc, high, hi_inc) == set(want)
    order = index._sorted()
    assert list(order) == [rid for _, rid in pairs]
    assert list(reversed(order)) == [rid for _, rid in reversed(pairs)]


def test_a_wide_range_beside_a_narrow_equality_is_not_counted_through() -> None:
    """Valid but expensive: a range over 50,000 distinct values beside an equality that
    names one document. The planner's count of the range stops once past the equality's
    one candidate, and the plan reads that one."""
    coll = make_collection()
    coll.create_index({"key": {"at": 1}})
    coll.create_index({"key": {"tag": 1}})
    base = datetime.datetime(2030, 1, 1)
    for i in range(50_000):
        coll.insert(
            {
                "_id": i,
                "at": base + datetime.timedelta(milliseconds=i),
                "tag": "needle" if i == 4_321 else f"t{i % 7}",
            }
        )
    index = coll.indexes["at_1"]
    wide = (sort_key(base), True, sort_key(base + datetime.timedelta(days=1)), True)
    assert index.range_size(*wide) == 50_000
    assert index.range_size(*wide, at_most=1) == 2  # stopped just past what it beat
    walked: list[int] = []
    count = type(index._sorted()).count

    def counting(self: Any, *args: Any) -> int:
        walked.append(result := count(self, *args))
        return result

    with unittest.mock.patch.object(type(index._sorted()), "count", counting):
        found = coll.candidates({"tag": "needle", "at": {"$gte": base}})
    assert [coll.docs[rid]["_id"] for rid in found] == [4_321]
    assert walked  # the range was sized
    assert max(walked) <= 2, walked


def test_a_long_in_list_over_many_candidates_is_looked_up_not_compared() -> None:
    """Valid but expensive: the overlap policy's query for the waiting fires of 1,000
    schedules ({"state": "buffered", "schedule_id": {"$in": [1,000 ids]}}) over their 5,000
    fires. Each fire's schedule is looked up among the ids: the general matcher, which
    compares a value with every listed one, is never called."""
    coll = make_collection()
    coll.create_index(
        {
            "key": {"schedule_id": 1, "nominal_at": 1},
            "name": "buffered",
            "partialFilterExpression": {"state": "buffered"},
        }
    )
    ids = [f"s{i:04d}" for i in range(1000)]
    for i in range(5000):
        coll.insert(
            {
                "_id": f"f{i}",
                "schedule_id": ids[i % 1000],
                "state": "buffered",
                "nominal_at": datetime.datetime(2030, 1, 1) + datetime.timedelta(seconds=i),
            }
        )
    coll.insert({"_id": "other", "schedule_id": "elsewhere", "state": "buffered"})
    filter_ = {"state": "buffered", "schedule_id": {"$in": ids}}
    with unittest.mock.patch.object(engine, "matches", side_effect=AssertionError):
        found = coll.find(op(), filter_)
    assert len(found) == 5000
    assert "other" not in {doc["_id"] for _, doc in found}


@pytest.mark.parametrize(
    "stages",
    [
        [{"$match": {"ns.coll": {"$in": ["leases", "fires"]}}}],
        [{"$match": {"operationType": "update"}}, {"$match": {"documentKey._id": "b"}}],
        [{"$match": {"fullDocument.term": {"$gte": 2}}}],
        [{"$match": {"$or": [{"ns.coll": "runs"}, {"updateDescription.updatedFields.term": 3}]}}],
        [{"$match": {"$expr": {"$eq": ["$operationType", "insert"]}}}],  # the pipeline's
        [{"$match": {"ns.coll": "fires"}}, {"$project": {"operationType": 1}}],  # the pipeline's
    ],
    ids=repr,
)
def test_a_streams_match_stages_select_what_the_pipeline_engine_selects(
    stages: list[dict[str, Any]],
) -> None:
    """Streams whose stages are only $match filters (no $expr) match each event directly;
    they show exactly the events the pipeline engine would."""
    log = ChangeLog(ClusterClock(), capacity=100)
    for coll, key, term in (
        ("fires", "a", 1),
        ("runs", "b", 2),
        ("leases", "b", 3),
        ("fires", "b", 3),
    ):
        log.append("db", coll, "insert", key_id=key, full_document={"_id": key, "term": term})
        log.append(
            "db",
            coll,
            "update",
            key_id=key,
            full_document={"_id": key, "term": term + 1},
            before={"_id": key, "term": term},
        )
    stream = ChangeStreamCursor(1, "db", changes=log, db="db", stages=stages)
    shown = stream.collect(None)
    rendered = [stream._render(e) for e in log.after(0)]
    assert shown == [out for doc in rendered for out in engine.run_pipeline([doc], stages)]
    assert 0 < len(shown) < len(rendered)
    direct = all(list(stage) == ["$match"] for stage in stages) and "$expr" not in repr(stages)
    assert bool(stream._filters) == direct


def test_a_sort_on_plain_values_orders_as_the_general_sort() -> None:
    """Sorts on top-level fields holding plain scalars (or nothing) order by the values'
    sort keys, as mongomock's sort (a comparator object per value, 26 us a document)
    orders them: mixed types by MongoDB's type order, missing as null, ties stable, a
    compound sort with mixed directions."""
    from mongomock import aggregate as mm_aggregate

    rng = random.Random(5)
    pool: list[Any] = [
        None,
        0,
        1,
        2.5,
        -3,
        Int64(2),
        "",
        "a",
        "b",
        "ab",
        True,
        False,
        datetime.datetime(2030, 1, 1),
        datetime.datetime(2029, 6, 1),
        ObjectId("0" * 24),
        ObjectId("f" * 24),
    ]
    docs = []
    for i in range(400):
        doc: dict[str, Any] = {"_id": i}
        for name in ("a", "b"):
            if rng.random() < 0.9:
                doc[name] = rng.choice(pool)
        docs.append(doc)
    for sort in ({"a": 1}, {"a": -1}, {"b": 1, "a": -1}, {"a": -1, "b": 1}, {"a": 1.0}):
        assert engine.plain_sort(docs, sort) is not None, sort
        expected = mm_aggregate._handle_sort_stage(docs, None, sort)  # type: ignore[no-untyped-call]
        assert [d["_id"] for d in engine.sort_documents(docs, sort)] == [
            d["_id"] for d in expected
        ], sort
    for unplain in (
        [*docs, {"_id": "arr", "a": [3, 1]}],
        [*docs, {"_id": "nan", "a": math.nan}],
        [*docs, {"_id": "doc", "a": {"x": 1}}],
    ):
        assert engine.plain_sort(unplain, {"a": 1}) is None  # the general sort's
    assert engine.plain_sort(docs, {"a.b": 1}) is None


def test_the_first_in_order_under_a_costly_filter_reads_candidates_only_until_found() -> None:
    """Valid but expensive: the next of 10,000 parked runs of a key to wake (a filter with
    $or, sorted by rank, one wanted). The candidates are ordered first and matched until
    one is found, and the answers equal matching all and sorting them."""
    coll = make_collection()
    coll.create_index({"key": {"wait_key": 1, "wait_rank": 1}, "name": "parked"})
    rng = random.Random(3)
    woken = datetime.datetime(2030, 1, 1)
    for i in range(10_000):
        coll.insert(
            {
                "_id": i,
                "wait_key": "k",
                "wait_rank": rng.random(),
                "state": "waiting" if i % 3 else "running",
                "woken_at": None if i % 7 else woken,
            }
        )
    filter_ = {
        "wait_key": "k",
        "state": "waiting",
        "$or": [{"woken_at": None}, {"woken_at": {"$lt": woken}}],
    }
    general = engine.matches
    calls = 0

    def counted(f: dict[str, Any], doc: dict[str, Any]) -> bool:
        nonlocal calls
        calls += 1
        return general(f, doc)

    for sort, count in (
        ({"wait_rank": 1}, 1),
        ({"wait_rank": -1}, 5),
        ({"state": -1, "wait_rank": 1}, 3),
    ):
        everything = engine.sort_documents([d for _, d in coll.find(op(), filter_)], sort)
        calls = 0
        with unittest.mock.patch.object(engine, "matches", counted):
            found = coll.find_sorted(op(), filter_, sort, count)
        assert [d["_id"] for _, d in found] == [d["_id"] for d in everything[:count]]
        assert all(coll.docs[rid] is d for rid, d in found)
        assert calls < 100, (sort, calls)


def test_an_insert_deciding_partial_filters_inline_indexes_as_a_build_would() -> None:
    """An insert decides a partial filter of one top-level equality to a string or an
    integer, or one $exists, without asking the index; 2,000 random documents (values of
    every type an equality might confuse: True and 1, 2.0 and 2, [2], missing, null) end
    up in each index exactly as in the same index built afterwards over them, which asks
    every index's full filter; a duplicate on a unique partial index leaves no trace."""
    rng = random.Random(9)
    specs: list[dict[str, Any]] = [
        {"key": {"state": 1, "at": -1}},
        {"key": {"term": 1}, "name": "claimed", "partialFilterExpression": {"state": "c"}},
        {"key": {"at": 1}, "name": "second", "partialFilterExpression": {"term": 2}},
        {"key": {"b": 1}, "name": "first", "partialFilterExpression": {"term": 1}},
        {"key": {"term": -1}, "name": "flagged", "partialFilterExpression": {"flag": True}},
        {
            "key": {"k": 1},
            "name": "keyed",
            "unique": True,
            "partialFilterExpression": {"k": {"$exists": True}},
        },
        {"key": {"b.c": 1}, "sparse": True},
    ]
    values: list[Any] = [
        1,
        1.0,
        True,
        False,
        2,
        2.0,
        Int64(2),
        [2],
        [1, "c"],
        "c",
        "p",
        None,
        {"c": 1},
        datetime.datetime(2030, 1, 1),
    ]
    names = ["state", "term", "flag", "at", "b"]
    coll = make_collection()
    for spec in specs:
        coll.create_index(spec)
    refused = 0
    for i in range(2000):
        doc = {"_id": i, **{n: rng.choice(values) for n in names if rng.random() < 0.7}}
        if rng.random() < 0.3:
            doc["k"] = rng.choice([f"k{rng.randint(0, 300)}", None])
        try:
            coll.insert(doc)
        except DuplicateKey:
            refused += 1
            assert all(d["_id"] != i for d in coll.docs.values())
    assert refused > 0
    fresh = make_collection()
    for rid, doc in coll.docs.items():
        fresh.docs[rid] = doc
    for spec in specs:
        fresh.create_index(spec)
    for name, index in coll.indexes.items():
        if name != "_id_":  # the fresh one's was made before its documents were put in
            assert index.entries == fresh.indexes[name].entries, name
            assert index.held == fresh.indexes[name].held, name
    assert coll.indexes["second"].held > 0
    assert coll.indexes["claimed"].held > 0


SYSTEM_VARIABLE_EXPRESSIONS: list[Any] = [
    {"_id": {"$in": [f"f{i}" for i in range(50)]}, "term": 3, "state": "claimed"},
    {"at": "$$NOW", "n": 1},
    {"a": [1, "x", {"b": ["$$CLUSTER_TIME"]}]},
    {"$expr": {"$lt": ["$expires_at", "$$NOW"]}},
    {"$literal": "$$NOW"},
    {"keep": {"$literal": "$$NOW"}, "x": ["$$NOW"]},
    ["$$NOW", {"$literal": ["$$NOW"]}],
    "$$NOW",
    "$NOW",
    {"s": "$$", "t": "$$$NOW"},
    {"nested": [[["$$NOW"]]], "none": None, "when": datetime.datetime(2030, 1, 1)},
    [Code("$$NOW"), 1, None],
    {"code": Code("$$NOW")},
]


@pytest.mark.parametrize("expr", SYSTEM_VARIABLE_EXPRESSIONS)
def test_system_variables_are_substituted_as_a_full_walk_does_and_nothing_is_copied_without(
    expr: Any,
) -> None:
    """The walk returns the expression itself when it names no system variable (a filter's
    long $in list is not rebuilt); otherwise what the full rebuild gives."""
    now = datetime.datetime(2031, 5, 6, 7, 8, 9)
    ts = Timestamp(1, 2)
    got = engine.substitute_system_vars(expr, now, ts)
    assert got == engine._substituted(expr, now, ts)
    if not engine._names_variables(expr):
        assert got is expr
    if engine._substituted(expr, now, ts) != expr:  # never missed where one is named
        assert engine._names_variables(expr)


@pytest.mark.parametrize(
    "filter_",
    [
        {"_id": {"$in": ["a", "b"]}, "term": 2, "state": "claimed"},
        {"a.b": 1, "c": None, "d": datetime.datetime(2030, 1, 1), "e": {"$in": [None, 1.5]}},
        {"x": {"$in": [1], "$nin": [2]}},
        {"x": {"$bogus": 1}},
        {"x": {"$in": 5}},
        {"x": {"$in": [{"$gt": 1}]}},
        {"$and": [{"x": 1}]},
        {"$where": "1"},
        {"x": {"$regex": "(unclosed"}},
        {"x": {"$in": [re.compile("a")]}},
    ],
)
def test_a_filter_is_refused_exactly_when_mongomock_refuses_it(filter_: Any) -> None:
    """Plain filters skip mongomock's validation: each is accepted or refused as
    mongomock's check (the general path) accepts or refuses it."""
    try:
        engine.mm_filtering.filter_applies(filter_, {})
        expected = None
    except engine._MONGOMOCK_ERRORS as exc:
        expected = type(engine._engine_error(exc))
    if expected is None:
        assert engine.check_filter(filter_) is filter_
    else:
        with pytest.raises(expected):
            engine.check_filter(filter_)
    if engine._plainly_valid(filter_):
        assert expected is None


def test_a_plain_update_stores_what_mongomocks_helper_makes_of_each_value() -> None:
    """Scalars are set as given; datetimes (moved to UTC, to the millisecond), documents
    and arrays as the helper rebuilds them, never shared with the command."""
    aware = datetime.datetime(
        2030, 1, 1, 12, 0, 0, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
    )
    inner = {"k": [1, aware]}
    sets = {
        "s": "x",
        "i": 3,
        "f": 1.5,
        "b": True,
        "n": None,
        "l": Int64(7),
        "o": ObjectId(),
        "d": aware,
        "doc": inner,
        "arr": [aware],
    }
    plan = engine.plain_update_plan({"$set": sets})
    assert plan is not None
    for name, value in sets.items():
        assert plan.sets[name] == engine.mm_helpers.patch_datetime_awareness_in_document(value), (
            name
        )
    assert plan.sets["d"] == datetime.datetime(2030, 1, 1, 10, 0, 0, 123000)
    assert plan.sets["doc"] is not inner
    assert plan.sets["doc"]["k"] is not inner["k"]


def test_an_index_answers_as_a_plain_model_through_adds_and_removes() -> None:
    """A key held by one record keeps the record id itself, by more a set: through any
    sequence of adds and removes (keys shared, unshared, emptied, arrays), lookups,
    sizes, members and unique conflicts answer as a dictionary of sets would."""
    from hascheduler_dev.devmongo.storage import Index

    rng = random.Random(7)
    index = Index("x_1", [("x", 1)])
    unique = Index("u_1", [("x", 1)], unique=True)
    model: dict[Any, set[int]] = {}
    docs: dict[int, dict[str, Any]] = {}
    for step in range(400):
        if docs and rng.random() < 0.45:
            rid = rng.choice(sorted(docs))
            doc = docs.pop(rid)
            index.remove(rid, doc)
            for k in {key_of(v) for v in index_values(doc, "x")}:
                model[k].discard(rid)
        else:
            rid = step
            value = rng.choice([rng.randrange(40), [rng.randrange(40), rng.randrange(40)]])
            doc = docs[rid] = {"_id": rid, "x": value}
            index.add(rid, doc)
            for k in {key_of(v) for v in index_values(doc, "x")}:
                model.setdefault(k, set()).add(rid)
        for v in range(40):
            assert index.lookup((v,)) == model.get(key_of(v), set())
            assert index.lookup_size((v,)) == len(model.get(key_of(v), set()))
        assert index.members() == set(docs)
    unique.entries = index.entries
    for rid, doc in docs.items():  # each held key, as the record itself asks
        others = any(model[key_of(v)] - {rid} for v in index_values(doc, "x"))
        assert (unique.conflict(rid, doc) is not None) == others
    assert {len(model.get(key_of(v), ())) for v in range(40)} >= {0, 1, 2}
    for v in range(40):  # and as a new record would
        assert (unique.conflict(-1, {"x": v}) is not None) == bool(model.get(key_of(v)))
