"""Fan-out sources (pure): what is accepted, which fields are mirrored, which documents
match (checked against the server's own matching), tenant keys and fire ids."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from bson import ObjectId
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hascheduler.core.fanout import FanOut, matches, tenant_fire_id, tenant_key


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"collection": ""}, "collection"),
        ({"collection": "a$b"}, "collection"),
        ({"collection": "system.users"}, "collection"),
        ({"collection": "schedules"}, "collection"),
        ({"collection": "runs"}, "collection"),
        ({"collection": "x" * 121}, "collection"),
        ({"collection": "t", "filter": {"$where": "1"}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$gt": 1}}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$in": []}}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$in": [{"x": 1}]}}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$in": [1], "$exists": True}}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$exists": 1}}}, "filter"),
        ({"collection": "t", "filter": {"a": {"b": 1}}}, "filter"),
        ({"collection": "t", "filter": {"a": [1, 2]}}, "filter"),
        ({"collection": "t", "filter": {"a": float("nan")}}, "filter"),
        ({"collection": "t", "filter": {"a": 2**70}}, "filter"),
        ({"collection": "t", "filter": {"a": "x" * 300}}, "filter"),
        ({"collection": "t", "filter": {f"f{i}": 1 for i in range(17)}}, "filter"),
        ({"collection": "t", "filter": {"a..b": 1}}, "filter"),
        ({"collection": "t", "filter": {"a": {"$in": list(range(1001))}}}, "filter"),
        ({"collection": "t", "key": "$id"}, "key"),
        ({"collection": "t", "key": ""}, "key"),
        ({"collection": "t", "other": 1}, "other"),
    ],
)
def test_a_source_that_cannot_be_used_is_refused_naming_the_part(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        FanOut.model_validate(body)
    assert refused.value.errors()[0]["loc"][0] == field


def test_a_source_keeps_its_conditions_and_mirrors_only_what_it_needs() -> None:
    source = FanOut.model_validate(
        {
            "collection": "tenants",
            "key": "slug",
            "filter": {
                "plan": {"$in": ["pro", "team"]},
                "active": True,
                "deleted_at": {"$exists": False},
            },
        }
    )
    assert source.fields() == ["active", "deleted_at", "plan", "slug"]
    assert source.source() == ("tenants", ("active", "deleted_at", "plan", "slug"))
    assert FanOut.model_validate({"collection": "tenants"}).fields() == ["_id"]


def test_tenant_keys_are_text_or_skipped() -> None:
    oid = ObjectId()
    assert tenant_key({"_id": oid}, "_id") == str(oid)
    assert tenant_key({"_id": 42}, "_id") == "42"
    assert tenant_key({"org": {"slug": "acme"}}, "org.slug") == "acme"
    for unusable in (
        {"_id": True},
        {"_id": 1.5},
        {"_id": None},
        {},
        {"_id": "a\nb"},
        {"_id": "x" * 201},
        {"_id": ""},
        {"_id": ["a"]},
    ):
        assert tenant_key(unusable, "_id") is None


def test_a_path_through_a_scalar_is_missing_as_mongodb_reads_it() -> None:
    source = FanOut.model_validate({"collection": "t", "filter": {"c.d": None}})
    assert matches(source, {"c": None})
    assert matches(source, {"c": 5})
    assert not matches(source, {"c": {"d": 1}})


def test_a_boolean_never_equals_a_number_as_in_mongodb() -> None:
    source = FanOut.model_validate({"collection": "t", "filter": {"b": True, "n": 1}})
    assert matches(source, {"b": True, "n": 1.0})
    assert not matches(source, {"b": 1, "n": 1})
    assert not matches(source, {"b": True, "n": True})


def test_a_tenant_fire_id_extends_the_fire_id() -> None:
    nominal = dt.datetime.now(dt.UTC).replace(microsecond=0)
    assert tenant_fire_id("report", nominal, "acme") == (
        f"report@{nominal.isoformat().replace('+00:00', '.000Z')}/acme"
    )


# Matching, checked against the development server's own evaluation of the same filter.
# Two places where mongomock (under the development server) differs from MongoDB are kept
# out of the draw and pinned by the tests above instead: a path through a scalar, and a
# boolean against a number (MongoDB: different types never equal; mongomock: True == 1).
numbers = st.one_of(
    st.none(), st.integers(-3, 3), st.sampled_from([1.0, 2.5]), st.sampled_from(["a", "b", ""])
)
flags = st.one_of(st.none(), st.booleans())
documents = st.fixed_dictionaries(
    {},
    optional={
        "a": numbers | st.dictionaries(st.just("d"), numbers, max_size=1),
        "b": flags,
        "c": st.dictionaries(st.just("d"), numbers, max_size=1),
    },
)


def condition(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        values,
        st.lists(values, min_size=1, max_size=3).map(lambda vs: {"$in": vs}),
        st.booleans().map(lambda b: {"$exists": b}),
    )


filters = st.fixed_dictionaries(
    {}, optional={"a": condition(numbers), "b": condition(flags), "c.d": condition(numbers)}
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(filters, st.lists(documents, max_size=8))
async def test_matching_agrees_with_the_server(
    db: Any, filter: dict[str, Any], docs: list[dict[str, Any]]
) -> None:
    source = FanOut.model_validate({"collection": "tenants", "filter": filter})
    tenants = db.tenants
    await tenants.delete_many({})
    if docs:
        await tenants.insert_many([{"_id": i, **d} for i, d in enumerate(docs)])
    served = {d["_id"] async for d in tenants.find(source.filter, {"_id": 1})}
    mine = {i for i, d in enumerate(docs) if matches(source, d)}
    assert mine == served, (source.filter, docs)
