"""HTTP API status codes and validation, against a real store on a MongoDB server."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pymongo import AsyncMongoClient

from hascheduler.api.routes import create_app
from hascheduler.core.constants import MAX_PAYLOAD_BYTES, MAX_REQUEST_BYTES
from hascheduler.replica.mirror import Mirror
from hascheduler.storage.audit_log import LIVE, AuditLog
from hascheduler.storage.schedules import ScheduleStore

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


def cron_schedule(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "weekly report",
        "trigger": {"kind": "cron", "cron": "0 9 * * mon", "timezone": "Europe/Paris"},
        "target": "reports.weekly",
        "payload": {"format": "pdf"},
        "labels": {"team": "ops"},
    }
    body.update(overrides)
    return body


@pytest.fixture
async def mongo(mongo_uri: str, db_name: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    yield client[db_name]
    await client.drop_database(db_name)
    await client.close()


def api_app(mongo: Any, **options: Any) -> Any:
    audit = AuditLog(mongo.audit, [mongo.schedules, mongo.fires, mongo.runs, mongo.backfills])
    return create_app(
        ScheduleStore(mongo.schedules, audit=audit),
        Mirror(mongo.schedules),
        "test",
        audit,
        clock=lambda: NOW,
        **options,
    )


@pytest.fixture
async def api(mongo: Any) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(api_app(mongo))) as client:
        yield client


async def stored_count(mongo: Any) -> int:
    return int(await mongo.schedules.count_documents(LIVE))


async def test_create_get_and_location(api: TestClient[Any, Any]) -> None:
    created = await api.post("/schedules", json=cron_schedule(id="weekly"))
    assert created.status == 201
    assert created.headers["Location"] == "/schedules/weekly"
    assert created.headers["ETag"] == '"1"'
    body = await created.json()
    assert body["revision"] == 1
    assert body["created_at"] == body["updated_at"] == "2030-01-01T12:00:00Z"
    fetched = await api.get("/schedules/weekly")
    assert fetched.status == 200
    assert await fetched.json() == body
    generated = await api.post("/schedules", json=cron_schedule())
    assert generated.status == 201
    assert (await generated.json())["id"]


BAD_SCHEDULES = [
    ("trigger.cron", {"trigger": {"kind": "cron", "cron": "61 * * * *"}}),
    ("trigger.cron", {"trigger": {"kind": "cron", "cron": "* * *"}}),
    (
        "trigger.timezone",
        {"trigger": {"kind": "cron", "cron": "* * * * *", "timezone": "Mars/Base"}},
    ),
    ("trigger.every", {"trigger": {"kind": "interval", "every": 0}}),
    ("trigger.every", {"trigger": {"kind": "interval", "every": -5}}),
    ("trigger.every", {"trigger": {"kind": "interval", "every": "P1M"}}),
    ("trigger.at", {"trigger": {"kind": "at", "at": "2029-12-31T00:00:00Z"}}),
    ("trigger.at", {"trigger": {"kind": "at", "at": "2031-01-01T00:00:00"}}),
    # Within the millisecond of now (12:00:00): stored, it would be its creation time.
    ("trigger.at", {"trigger": {"kind": "at", "at": "2030-01-01T12:00:00.000400Z"}}),
    ("trigger.kind", {"trigger": {"kind": "sometimes"}}),
    ("payload", {"payload": {"blob": "x" * (MAX_PAYLOAD_BYTES + 10)}}),
    ("surprise", {"surprise": True}),
    ("name", {"name": ""}),
    ("target", {"target": "has spaces"}),
    ("id", {"id": "no/slashes"}),
    ("jitter", {"jitter": -1}),
    ("catchup", {"catchup": "sometimes"}),
    # Valid syntax that can never fire.
    ("trigger.cron", {"trigger": {"kind": "cron", "cron": "0 0 30 2 *"}}),
    ("trigger.cron", {"trigger": {"kind": "cron", "cron": "0 0 31 4,6,9,11 *"}}),
    ("trigger.cron", {"trigger": {"kind": "cron", "cron": "@reboot"}}),
    # Below the default floor of one second between fires.
    ("trigger.every", {"trigger": {"kind": "interval", "every": 0.5}}),
    ("trigger.every", {"trigger": {"kind": "interval", "every": "PT0.2S"}}),
    # A window that would replay 2.6 million fires after an outage.
    (
        "catchup_window",
        {
            "catchup": "all",
            "catchup_window": 30 * 86400,
            "trigger": {"kind": "interval", "every": 1},
        },
    ),
    (
        "catchup_window",
        {
            "catchup": "all",
            "catchup_window": 30 * 86400,
            "trigger": {"kind": "cron", "cron": "* * * * * *"},
        },
    ),
    # JSON types as written: no numbers for instants, no strings for numbers.
    ("trigger.start_at", {"trigger": {"kind": "interval", "every": 60, "start_at": 0}}),
    ("trigger.at", {"trigger": {"kind": "at", "at": "1900000000"}}),
    ("jitter", {"jitter": "5"}),
    ("paused", {"paused": 1}),
    # A concurrency key that cannot render for the schedule's fires.
    ("concurrency", {"concurrency": {"key": "{payload.account}", "limit": 2}}),
    ("concurrency", {"concurrency": {"key": "{tenant}", "limit": 2}}),
    ("concurrency.key", {"concurrency": {"key": "{nope}", "limit": 2}}),
    ("concurrency.limit", {"concurrency": {"key": "{target}", "limit": 0}}),
    ("concurrency.limit", {"concurrency": {"key": "{target}", "limit": 10_001}}),
]


@pytest.mark.parametrize(
    ("field", "change"), BAD_SCHEDULES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_SCHEDULES)]
)
async def test_each_bad_schedule_is_422_naming_the_field_and_nothing_is_stored(
    api: TestClient[Any, Any], mongo: Any, field: str, change: dict[str, Any]
) -> None:
    response = await api.post("/schedules", json=cron_schedule(**change))
    assert response.status == 422
    body = await response.json()
    assert field in [e["field"] for e in body["errors"]], body
    assert await stored_count(mongo) == 0


async def test_body_problems_get_their_own_status(api: TestClient[Any, Any], mongo: Any) -> None:
    wrong_type = await api.post(
        "/schedules", data="name=x", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert wrong_type.status == 415
    broken = await api.post(
        "/schedules", data="{not json", headers={"Content-Type": "application/json"}
    )
    assert broken.status == 400
    not_object = await api.post("/schedules", json=[1, 2])
    assert not_object.status == 422
    huge = await api.post(
        "/schedules",
        data="x" * (MAX_REQUEST_BYTES + 1),
        headers={"Content-Type": "application/json"},
    )
    assert huge.status == 413
    assert await stored_count(mongo) == 0


async def test_missing_ids_are_404_for_every_verb(api: TestClient[Any, Any]) -> None:
    assert (await api.get("/schedules/nope")).status == 404
    assert (await api.put("/schedules/nope", json=cron_schedule())).status == 404
    assert (await api.patch("/schedules/nope", json={"name": "x"})).status == 404
    assert (await api.delete("/schedules/nope")).status == 404
    assert (await api.post("/schedules/nope/pause")).status == 404
    assert (await api.post("/schedules/nope/resume")).status == 404
    assert (await api.get("/schedules/nope/next")).status == 404


async def test_conflicts_are_409(api: TestClient[Any, Any]) -> None:
    assert (await api.post("/schedules", json=cron_schedule(id="a"))).status == 201
    duplicate = await api.post("/schedules", json=cron_schedule(id="a"))
    assert duplicate.status == 409
    stale = await api.put(
        "/schedules/a", json=cron_schedule(name="new"), headers={"If-Match": '"7"'}
    )
    assert stale.status == 409
    assert (await stale.json())["current_revision"] == 1
    bad_header = await api.delete("/schedules/a", headers={"If-Match": "yesterday"})
    assert bad_header.status == 400


async def test_concurrent_updates_with_the_same_revision_exactly_one_wins(
    api: TestClient[Any, Any],
) -> None:
    await api.post("/schedules", json=cron_schedule(id="race"))
    responses = await asyncio.gather(
        *(
            api.put(
                "/schedules/race",
                json=cron_schedule(name=f"writer {i}"),
                headers={"If-Match": '"1"'},
            )
            for i in range(10)
        )
    )
    statuses = sorted(r.status for r in responses)
    assert statuses == [200] + [409] * 9
    final = await (await api.get("/schedules/race")).json()
    assert final["revision"] == 2


async def test_put_patch_pause_resume_delete_bump_the_revision(api: TestClient[Any, Any]) -> None:
    await api.post("/schedules", json=cron_schedule(id="s"))
    put = await api.put(
        "/schedules/s", json=cron_schedule(name="renamed"), headers={"If-Match": '"1"'}
    )
    assert (await put.json())["revision"] == 2
    patched = await api.patch(
        "/schedules/s",
        json={"jitter": 5, "labels": {"team": None, "tier": "gold"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    body = await patched.json()
    assert (body["revision"], body["jitter"], body["labels"]) == (3, 5.0, {"tier": "gold"})
    assert body["name"] == "renamed"
    paused = await (await api.post("/schedules/s/pause")).json()
    assert (paused["paused"], paused["revision"]) == (True, 4)
    resumed = await (await api.post("/schedules/s/resume")).json()
    assert (resumed["paused"], resumed["revision"]) == (False, 5)
    bad_patch = await api.patch("/schedules/s", json={"trigger": {"kind": "interval", "every": 0}})
    assert bad_patch.status == 422
    assert (await api.delete("/schedules/s", headers={"If-Match": '"5"'})).status == 204
    assert (await api.get("/schedules/s")).status == 404


async def test_list_filters_and_paginates(api: TestClient[Any, Any]) -> None:
    for i in range(7):
        await api.post(
            "/schedules",
            json=cron_schedule(id=f"s{i}", labels={"team": "a" if i % 2 else "b"}, paused=i == 3),
        )
    page = await (await api.get("/schedules?limit=3")).json()
    assert [s["id"] for s in page["items"]] == ["s0", "s1", "s2"]
    rest = await (await api.get(f"/schedules?limit=10&after={page['next']}")).json()
    assert [s["id"] for s in rest["items"]] == ["s3", "s4", "s5", "s6"]
    assert rest["next"] is None
    team_a = await (await api.get("/schedules?label=team=a")).json()
    assert [s["id"] for s in team_a["items"]] == ["s1", "s3", "s5"]
    paused = await (await api.get("/schedules?paused=true")).json()
    assert [s["id"] for s in paused["items"]] == ["s3"]
    assert (await api.get("/schedules?limit=0")).status == 422
    assert (await api.get("/schedules?paused=maybe")).status == 422


async def test_next_fire_times_nominal_and_jittered(api: TestClient[Any, Any]) -> None:
    await api.post("/schedules", json=cron_schedule(id="j", jitter=30))
    preview = await (await api.get("/schedules/j/next?count=3")).json()
    times = preview["times"]
    assert [t["nominal"] for t in times] == [
        "2030-01-07T08:00:00Z",
        "2030-01-14T08:00:00Z",
        "2030-01-21T08:00:00Z",
    ]
    for t in times:
        assert t["fire_id"] == f"j@{t['nominal'][:-1]}.000Z"
        offset = (
            dt.datetime.fromisoformat(t["fire_at"]) - dt.datetime.fromisoformat(t["nominal"])
        ).total_seconds()
        assert 0 <= offset < 30
    again = await (await api.get("/schedules/j/next?count=3")).json()
    assert again == preview, "jitter is deterministic"
    assert (await api.get("/schedules/j/next?count=0")).status == 422
    assert (await api.get("/schedules/j/next?after=yesterday")).status == 422


async def test_interval_start_defaults_to_creation_and_keeps_its_phase(
    api: TestClient[Any, Any],
) -> None:
    created = await api.post(
        "/schedules", json=cron_schedule(id="i", trigger={"kind": "interval", "every": "PT90S"})
    )
    body = await created.json()
    assert body["trigger"]["start_at"] == "2030-01-01T12:00:00Z"
    assert body["trigger"]["every"] == 90.0
    preview = await (await api.get("/schedules/i/next?count=2&after=2030-01-01T13:00:10Z")).json()
    assert [t["nominal"] for t in preview["times"]] == [
        "2030-01-01T13:01:30Z",
        "2030-01-01T13:03:00Z",
    ]


async def test_the_floor_between_fires_is_the_replicas_setting(mongo: Any) -> None:
    app = api_app(mongo, min_fire_interval_s=10)
    async with TestClient(TestServer(app)) as client:
        for trigger, status in [
            ({"kind": "cron", "cron": "*/5 * * * * *"}, 422),
            ({"kind": "cron", "cron": "*/10 * * * * *"}, 201),
            ({"kind": "interval", "every": 9.5}, 422),
            ({"kind": "interval", "every": "PT10S"}, 201),
            ({"kind": "interval", "every": "9s"}, 422),
            ({"kind": "interval", "every": "1m30s"}, 201),
        ]:
            response = await client.post("/schedules", json=cron_schedule(trigger=trigger))
            assert response.status == status, await response.text()
            if status == 422:
                errors = (await response.json())["errors"]
                assert "floor" in errors[0]["message"]


async def test_every_route_is_in_the_openapi_document_and_undeclared_methods_are_405(
    api: TestClient[Any, Any],
) -> None:
    spec = await (await api.get("/openapi.json")).json()
    documented = {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method != "parameters"
    }
    served = {
        (r.method, r.resource.canonical)
        for r in api.app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    assert documented == served
    refused = await api.request("TRACE", "/schedules")
    assert refused.status == 405
    assert set(refused.headers["Allow"].split(",")) == {"GET", "POST"}
    assert (await refused.json())["status"] == 405


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ('"1"', 200),
        ("1", 200),
        ('W/"1"', 200),
        ("*", 200),
        ('"0"', 400),
        ("0001", 400),
        ('"1", "2"', 400),
        ("one", 400),
    ],
)
async def test_if_match_is_read_as_the_document_says(
    api: TestClient[Any, Any], header: str, status: int
) -> None:
    await api.post("/schedules", json=cron_schedule(id="m"))
    response = await api.post("/schedules/m/pause", headers={"If-Match": header})
    assert response.status == status, await response.text()


async def test_health_openapi_and_docs(api: TestClient[Any, Any]) -> None:
    assert (await (await api.get("/healthz")).json())["status"] == "alive"
    not_ready = await api.get("/readyz")
    assert not_ready.status == 503  # this app's mirror is not running
    spec = await (await api.get("/openapi.json")).json()
    assert spec["openapi"] == "3.1.0"
    assert {"ScheduleIn", "Schedule", "Problem"} <= set(spec["components"]["schemas"])
    docs = await api.get("/docs")
    assert docs.status == 200
    assert "openapi.json" in await docs.text()


@pytest.mark.parametrize(
    ("field", "payload"),
    [
        ("payload", {"bad\u0000key": 1}),
        ("payload", {"deep": [{"n": 2**64}]}),
    ],
)
async def test_payloads_bson_cannot_store_are_422(
    api: TestClient[Any, Any], mongo: Any, field: str, payload: Any
) -> None:
    response = await api.post("/schedules", json=cron_schedule(payload=payload))
    assert response.status == 422
    assert field in [e["field"] for e in (await response.json())["errors"]]
    assert await stored_count(mongo) == 0


async def test_previews_past_the_calendars_end_stop_cleanly(api: TestClient[Any, Any]) -> None:
    await api.post(
        "/schedules",
        json=cron_schedule(id="far", trigger={"kind": "interval", "every": 315_360_000}),
    )
    response = await api.get("/schedules/far/next?count=1000&after=9999-06-01T00:00:00Z")
    assert response.status == 200
    assert (await response.json())["times"] == []
    too_long = await api.post(
        "/schedules", json=cron_schedule(trigger={"kind": "interval", "every": 1e300})
    )
    assert too_long.status == 422


@pytest.mark.parametrize("label", ["=v", "k", "bad\u0000key=v", "has space=v", "x" * 129 + "=v"])
async def test_a_label_filter_whose_key_is_no_label_key_is_422(
    api: TestClient[Any, Any], label: str
) -> None:
    response = await api.get("/schedules", params={"label": label})
    assert response.status == 422
    assert (await response.json())["errors"][0]["field"] == "label"


@pytest.mark.parametrize(
    ("after", "status"),
    [
        ("2030-01-01T09:00:00Z", 200),
        ("2030-01-01T09:00:00.5+02:00", 200),
        ("2030-01-01T09:00:00", 422),
        ("2030-01-01 09:00:00+00:00", 422),
        ("1900000000", 422),
        ("9999-12-31T23:59:59Z", 200),
    ],
)
async def test_preview_after_takes_rfc3339_as_the_document_says(
    api: TestClient[Any, Any], after: str, status: int
) -> None:
    await api.post("/schedules", json=cron_schedule(id="p"))
    response = await api.get("/schedules/p/next", params={"after": after, "count": 3})
    assert response.status == status, await response.text()


async def test_an_unknown_query_parameter_is_400_naming_it(api: TestClient[Any, Any]) -> None:
    """Ignored, a misspelt filter answered as if it filtered (GET /runs?schedule=X gave
    every schedule's runs); refused, it names itself and what the route takes. Declared
    ones still pass, on every route that takes any and on one that takes none."""
    for path, unknown in (
        ("/schedules?labels=a%3Db", "labels"),
        ("/schedules?limit=5&pausd=true", "pausd"),
        ("/healthz?verbose=1", "verbose"),
    ):
        r = await api.get(path)
        assert r.status == 400, (path, await r.text())
        body = await r.json()
        assert body["errors"][0]["field"] == unknown
        assert "unknown query parameter" in body["errors"][0]["message"]
    r = await api.get("/schedules?limit=5&paused=true")
    assert r.status == 200
    r = await api.get("/healthz")
    assert r.status == 200
