"""hascheduler.client against a real replica process: every route, every typed error,
pagination over 10,000 schedules, a retry across a replica restart."""

from __future__ import annotations

import datetime as dt
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from hascheduler.client import (
    AsyncClient,
    Client,
    Conflict,
    HaschedulerError,
    Invalid,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from hascheduler.core.models import ScheduleIn
from tests.conftest import API_READ_TOKEN, API_WRITE_TOKEN, ApiReplica
from tests.servers import ServerProcess

pytestmark = [pytest.mark.timeout(240)]

WRITE, READ = API_WRITE_TOKEN, API_READ_TOKEN


def body(schedule_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "client.test",
        "trigger": {"kind": "cron", "cron": "0 9 * * MON", "timezone": "Europe/Paris"},
        **extra,
    }


def test_every_route_through_the_blocking_client(api_replica: ApiReplica) -> None:
    with Client(api_replica.url, WRITE) as api:
        created = api.create_schedule(ScheduleIn.model_validate(body("report")))
        assert (created.id, created.revision, created.trigger.kind) == ("report", 1, "cron")
        assert api.get_schedule("report") == created
        assert [s.id for s in api.schedules()] == ["report"]
        fetched = api.get_schedule("report")
        fetched.name = "weekly report"
        updated = api.update_schedule(fetched)  # If-Match: the revision fetched
        assert (updated.name, updated.revision) == ("weekly report", 2)
        replaced = api.replace_schedule("report", body("report", jitter=5), if_match=2)
        assert (replaced.jitter, replaced.name, replaced.revision) == (5, "report", 3)
        patched = api.patch_schedule("report", {"labels": {"team": "billing"}})
        assert patched.labels == {"team": "billing"}
        assert [s.id for s in api.schedules(labels={"team": "billing"})] == ["report"]
        assert list(api.schedules(labels={"team": "other"})) == []
        paused = api.pause("report", note="quarter close")
        assert paused.paused
        assert paused.pause is not None
        assert paused.pause.note == "quarter close"
        assert [s.id for s in api.schedules(paused=True)] == ["report"]
        assert not api.resume("report").paused
        preview = api.next_fires("report", count=3)
        assert len(preview.times) == 3
        assert all(t.nominal.weekday() == 0 for t in preview.times)

        fired = api.trigger("report", payload={"why": "now"}, idempotency_key="k-1")
        again = api.trigger("report", payload={"why": "now"}, idempotency_key="k-1")
        assert fired.created
        assert not again.created
        assert again.fire_id == fired.fire_id
        assert api.get_fire(fired.fire_id)["id"] == fired.fire_id
        assert "items" in api.schedule_fires("report")
        assert api.schedule_runs("report")["items"] == []
        # Its end in the past by the server's clock (which this one may lead by a little).
        end = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        backfill = api.backfill("report", end - dt.timedelta(days=30), end)
        assert backfill["total"] >= 4
        assert api.get_backfill(backfill["id"])["id"] == backfill["id"]
        assert api.cancel_backfill(backfill["id"])["id"] == backfill["id"]
        assert list(api.runs()) == []
        with pytest.raises(NotFound):
            api.get_run(fired.fire_id)
        # No worker took the fire run now: cancelling it records its run cancelled.
        assert api.cancel_run(fired.fire_id)["state"] == "cancelled"
        assert api.get_run(fired.fire_id)["state"] == "cancelled"
        assert [r["id"] for r in api.runs(state="cancelled")] == [fired.fire_id]
        with pytest.raises(Conflict):
            api.retry_run(fired.fire_id)  # only a dead run is replayed
        assert api.leader()["answered_by"] == f"client-{api_replica.port}"
        assert api.cluster()["members"]
        assert api.readiness()["ready"] is True

        api.delete_schedule("report")
        with pytest.raises(NotFound):
            api.get_schedule("report")


def test_every_typed_error(api_replica: ApiReplica) -> None:
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(body("taken"))
        with pytest.raises(Invalid) as invalid:
            api.create_schedule(body("bad", trigger={"kind": "cron", "cron": "61 * * * *"}))
        assert invalid.value.status == 422
        assert any("trigger" in e["field"] for e in invalid.value.errors), invalid.value.errors
        with pytest.raises(Conflict):
            api.create_schedule(body("taken"))
        stale = api.get_schedule("taken")
        api.patch_schedule("taken", {"jitter": 1})
        with pytest.raises(Conflict) as conflict:
            api.update_schedule(stale)
        assert conflict.value.current_revision == 2
        with pytest.raises(NotFound):
            api.pause("nobody")
    with Client(api_replica.url, READ) as reader:
        assert reader.get_schedule("taken").id == "taken"
        with pytest.raises(Unauthorized) as refused:
            reader.delete_schedule("taken")
        assert refused.value.status == 403
    with Client(api_replica.url, "a-wrong-token") as stranger, pytest.raises(Unauthorized):
        stranger.get_schedule("taken")
    with Client("http://127.0.0.1:9", WRITE, attempts=2) as nowhere, pytest.raises(Unavailable):
        nowhere.leader()


def test_rate_limited_writes_wait_their_retry_after(
    mongo_uri: str, api_nats: ServerProcess
) -> None:
    limited = ApiReplica(mongo_uri, api_nats, "--write-rate", "1", "--write-burst", "1")
    try:
        with Client(limited.url, WRITE, attempts=1) as once:
            once.create_schedule(body("first"))
            with pytest.raises(RateLimited) as caught:
                once.create_schedule(body("second"))
            assert caught.value.retry_after >= 1
        with Client(limited.url, WRITE, attempts=3) as patient:
            started = time.monotonic()
            assert patient.create_schedule(body("second")).id == "second"
            assert time.monotonic() - started >= 0.5  # it waited for the bucket
    finally:
        limited.process.stop(signal.SIGKILL)


def test_pages_of_ten_thousand_schedules(api_replica: ApiReplica, mongo_uri: str) -> None:
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(body("s00000"))
        with MongoClient[dict[str, Any]](mongo_uri) as raw:
            schedules = raw[api_replica.db_name].schedules
            template = schedules.find_one({"_id": "s00000"})
            assert template is not None
            schedules.insert_many(
                [{**template, "_id": f"s{i:05d}", "name": f"s{i:05d}"} for i in range(1, 10_000)]
            )
        ids = [s.id for s in api.schedules(page_size=500)]
    assert ids == [f"s{i:05d}" for i in range(10_000)]


async def test_the_async_client_pages_writes_and_raises_alike(api_replica: ApiReplica) -> None:
    async with AsyncClient(api_replica.url, WRITE) as api:
        for i in range(5):
            await api.create_schedule(body(f"a{i}"))
        assert [s.id async for s in api.schedules(page_size=2)] == [f"a{i}" for i in range(5)]
        paused = await api.pause("a0", note="async")
        assert paused.paused
        assert (await api.next_fires("a1", count=2)).schedule_id == "a1"
        with pytest.raises(Conflict):
            await api.create_schedule(body("a0"))
        await api.delete_schedule("a4")
        with pytest.raises(NotFound):
            await api.get_schedule("a4")
        assert [r async for r in api.runs(state="dead")] == []


def test_a_read_is_retried_across_a_replica_restart(api_replica: ApiReplica) -> None:
    with Client(api_replica.url, WRITE, attempts=10) as api:
        api.create_schedule(body("survivor"))
        api_replica.process.stop(signal.SIGKILL)
        restarted: list[ServerProcess] = []
        back = threading.Thread(target=lambda: restarted.append(api_replica.start()))
        back.start()
        try:
            # The replica is down when the call is made: the client retries until it is up.
            assert api.get_schedule("survivor").id == "survivor"
        finally:
            back.join()
            api_replica.process = restarted[0]


def test_the_api_and_token_come_from_the_environment(
    api_replica: ApiReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HASCHEDULER_API", api_replica.url)
    monkeypatch.setenv("HASCHEDULER_TOKEN", WRITE)
    with Client() as api:
        assert api.create_schedule(body("from-env")).id == "from-env"
    monkeypatch.delenv("HASCHEDULER_API")
    with pytest.raises(ValueError, match="HASCHEDULER_API"):
        Client()


def test_the_first_script_runs_as_written(
    api_replica: ApiReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/CLIENT.md's first script, as written there: ``Client()`` finds the API."""
    monkeypatch.setenv("HASCHEDULER_API", api_replica.url)
    monkeypatch.setenv("HASCHEDULER_TOKEN", WRITE)
    doc = (Path(__file__).resolve().parent.parent / "docs" / "CLIENT.md").read_text()
    script = re.findall(r"```python\n(.*?)```", doc, re.S)[0]
    namespace: dict[str, Any] = {}
    exec(compile(script, "first_script", "exec"), namespace)
    with Client(api_replica.url, WRITE) as api:
        assert api.get_schedule("hello").target == "demo.hello"


def test_many_schedules_in_one_request_all_checked_before_any_is_written(
    api_replica: ApiReplica,
) -> None:
    with Client(api_replica.url, WRITE) as api:
        api.create_schedule(body("taken"))
        answer = api.create_schedules([body(f"b{i}") for i in range(3)] + [body("taken")])
        assert answer.created == ["b0", "b1", "b2"]
        assert answer.existing == ["taken"]
        assert api.get_schedule("taken").revision == 1  # left as it was
        with pytest.raises(Invalid) as bad:
            api.create_schedules([body("c0"), body("c1", jitter=-1)])
        fields = [e["field"] for e in bad.value.errors]
        assert any("schedules" in f and "1" in f and "jitter" in f for f in fields), fields
        with pytest.raises(NotFound):
            api.get_schedule("c0")  # nothing of a refused batch is written
        with pytest.raises(Invalid) as too_many:
            api.create_schedules(
                [{"name": "n", "target": "t", "trigger": {"kind": "cron", "cron": "0 0 * * *"}}]
                * 501
            )
        assert any("schedules" in e["field"] for e in too_many.value.errors)
        with pytest.raises(HaschedulerError) as too_big:
            api.create_schedules(
                [body(f"big{i}", payload={"blob": "x" * 60_000}) for i in range(3)]
            )
        assert too_big.value.status == 413
