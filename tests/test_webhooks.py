"""Webhooks against HTTP endpoints in the test that fail, time out, answer slowly or are not
there: a replica, a real nats-server and a worker make the events; each is delivered at
least once, signed, with its attempts visible, while a schedule beside them fires on time."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from pymongo import AsyncMongoClient

from hascheduler.core import history
from hascheduler.core.egress import PUBLIC_ONLY
from hascheduler.core.webhooks import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    Event,
    Subscription,
    sign,
    verify,
)
from hascheduler.replica.webhooks import NO_ANSWER
from hascheduler.storage.fire_records import claim_document
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.webhooks import Deliveries, WebhookStore
from tests.dispatching import unreachable_db
from tests.servers import (
    ServerProcess,
    free_port,
    start_cli,
    start_nats,
    start_replica,
    with_database,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]

SECRET = "a-test-secret-0123456789"


@dataclass
class Endpoint:
    """What one path of the receiver did: each request's body, whether its signature
    held, and how it answered."""

    behaviour: str
    received: list[dict[str, Any]] = field(default_factory=list)
    tries: Counter[str] = field(default_factory=Counter)  # attempts per delivery id


class Receiver:
    """/flaky answers 500 to a delivery's first two attempts, /hang never answers a
    delivery's first attempt within the timeout, /slow takes 1.5 s, /huge always answers
    502 with 20 MB."""

    def __init__(self) -> None:
        self.endpoints = {name: Endpoint(name) for name in ("flaky", "hang", "slow", "huge")}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()  # what /hang's first attempts wait for

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/{name}", self._receive)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _receive(self, request: web.Request) -> web.Response:
        endpoint = self.endpoints[request.match_info["name"]]
        body = await request.read()
        delivery = request.headers[DELIVERY_HEADER]
        endpoint.tries[delivery] += 1
        attempt = endpoint.tries[delivery]
        if endpoint.behaviour == "hang" and attempt == 1:
            await self._closing.wait()  # no answer while the test runs
        if endpoint.behaviour == "slow":
            await asyncio.sleep(1.5)  # the slowness under test, not a wait for a state
        if endpoint.behaviour == "flaky" and attempt <= 2:
            return web.Response(status=500, text="not now")
        if endpoint.behaviour == "huge":  # 20 MB of an error page, every time
            return web.Response(status=502, body=b"x" * 20_000_000)
        endpoint.received.append(
            {
                "delivery": delivery,
                "attempt": attempt,
                "event": json.loads(body),
                "signed": verify(SECRET, request.headers[SIGNATURE_HEADER], body, time.time()),
                "content_type": request.headers["Content-Type"],
            }
        )
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = await Receiver().start()
    yield r
    await r.close()


@pytest.mark.long(16)
async def test_every_event_is_delivered_signed_through_failing_and_slow_endpoints(
    mongo_uri: str, receiver: Receiver, tmp_path: Path
) -> None:
    db_name = f"hooks_{uuid.uuid4().hex[:8]}"
    uri = with_database(mongo_uri, db_name)
    nats = start_nats()
    replica = await asyncio.to_thread(
        start_replica,
        uri,
        "hooks",
        "--broker",
        nats.uri,
        "--late-after",
        "1",
        # The receivers listen on loopback, which the egress policy refuses by default.
        "--egress-allow",
        "127.0.0.0/8",
    )
    worker: ServerProcess | None = None
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[db_name]
    try:
        worker = await asyncio.to_thread(
            start_cli,
            [
                "worker",
                "--broker",
                nats.uri,
                "--mongodb-uri",
                uri,
                "--app",
                "tests.helpers.record_handler:app",
                "--durable",
                "hooks",
                "--worker-id",
                "w-hooks",
                "--concurrency",
                "4",
            ],
            "worker ",
            30.0,
            {"RECORD_FIRES_TO": str(tmp_path / "attempts.txt")},
        )
        async with aiohttp.ClientSession(base_url=replica.uri) as http:

            async def post(path: str, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
                async with http.post(path, json=body) as r:
                    assert r.status == status, await r.text()
                    answer: dict[str, Any] = await r.json()
                    return answer

            every = ["run.dead", "fire.skipped", "fire.failed", "schedule.paused", "schedule.late"]
            made = await post(
                "/webhooks",
                {"id": "flaky", "url": receiver.url + "/flaky", "events": every, "secret": SECRET},
            )
            assert made["secret"] == SECRET  # shown once, in this answer
            await post(
                "/webhooks",
                {
                    "id": "hang",
                    "url": receiver.url + "/hang",
                    "events": ["run.dead"],
                    "secret": SECRET,
                },
            )
            await post(
                "/webhooks",
                {
                    "id": "slow",
                    "url": receiver.url + "/slow",
                    "events": ["schedule.paused"],
                    "secret": SECRET,
                },
            )
            await post(
                "/webhooks",
                {
                    "id": "huge",
                    "url": receiver.url + "/huge",
                    "events": ["run.dead"],
                    "secret": SECRET,
                },
            )
            # Nobody listens there: its deliveries are retried, never delivered.
            await post(
                "/webhooks",
                {
                    "id": "gone",
                    "url": f"http://127.0.0.1:{free_port()}/x",
                    "events": every,
                    "secret": SECRET,
                },
            )
            async with http.get("/webhooks/flaky") as r:
                assert "secret" not in {k for k, v in (await r.json()).items() if v}

            async def schedule(sid: str, target: str, every_s: float, **extra: Any) -> None:
                await post(
                    "/schedules",
                    {
                        "id": sid,
                        "name": sid,
                        "target": target,
                        "trigger": {"kind": "interval", "every": every_s},
                        **extra,
                    },
                )

            # Fires on time beside it all: the witness that deliveries never slow firing.
            await schedule("tick", "jobs.tick", 1)
            # Each run takes 2 s at a fire a second: the fires meanwhile are skipped.
            await schedule("busy", "jobs.busy", 1, overlap="skip", payload={"sleep": 2})
            # Every run dies at once (PermanentFailure); pause it after the first.
            await schedule("doomed", "jobs.doomed", 3600, payload={"permanent": True})
            await post("/schedules/doomed/trigger", {}, 202)
            # Nothing runs its target: its objective (a success within a second) is missed.
            await schedule("unserved", "nobody.runs", 3600, expect={"success_within": "PT1S"})

            def kinds(endpoint: str) -> set[str]:
                return {
                    e["event"]["type"].removeprefix("io.hascheduler.")
                    for e in receiver.endpoints[endpoint].received
                }

            await wait_until(
                lambda: {"run.dead", "fire.skipped"} <= kinds("flaky"),
                60,
                "a dead run and a skipped fire delivered to the flaky endpoint",
            )
            await post("/schedules/busy/pause", {"note": "enough"}, 200)
            await wait_until(
                lambda: {"schedule.paused", "schedule.late"} <= kinds("flaky"),
                60,
                "the pause and the missed objective delivered",
            )
            await wait_until(
                lambda: receiver.endpoints["hang"].received,
                30,
                "the dead run delivered to the endpoint that hung at first",
            )
            await wait_until(
                lambda: receiver.endpoints["slow"].received,
                30,
                "the pause delivered to the slow endpoint",
            )

            async def deliveries(hook: str) -> list[dict[str, Any]]:
                async with http.get(f"/webhooks/{hook}/deliveries") as r:
                    assert r.status == 200
                    items: list[dict[str, Any]] = (await r.json())["items"]
                    return items

            flaky = await deliveries("flaky")
            gone = await wait_until(
                lambda: _retried(deliveries("gone")), 30, "the dead endpoint's deliveries retried"
            )
            hang = await deliveries("hang")
            huge = await wait_until(
                lambda: _retried(deliveries("huge")), 30, "the 20 MB answers' deliveries retried"
            )
            tick_fires = [
                f async for f in db.fires.find({"schedule_id": "tick", "state": "published"})
            ]
    finally:
        if worker is not None:
            worker.stop(signal.SIGTERM)
        replica.stop(signal.SIGTERM)
        nats.stop()
        await client.drop_database(db_name)
        await client.close()

    # Every delivery a receiver accepted was signed, as CloudEvents.
    for endpoint in receiver.endpoints.values():
        for got in endpoint.received:
            assert got["signed"], got
            assert got["content_type"] == "application/cloudevents+json"
            assert got["event"]["specversion"] == "1.0"
    flaky_events = {e["event"]["type"]: e["event"] for e in receiver.endpoints["flaky"].received}
    dead = flaky_events["io.hascheduler.run.dead"]
    assert dead["subject"] == "doomed"
    assert "no longer exists" in dead["data"]["error"]
    skipped = [
        e["event"]
        for e in receiver.endpoints["flaky"].received
        if e["event"]["type"] == "io.hascheduler.fire.skipped"
    ]
    assert ("busy", "overlap") in {(e["subject"], e["data"]["reason"]) for e in skipped}
    assert all(e["data"]["fire_id"].startswith("busy@") for e in skipped)
    assert flaky_events["io.hascheduler.schedule.paused"]["data"]["note"] == "enough"
    late = flaky_events["io.hascheduler.schedule.late"]
    assert (late["subject"], late["data"]["status"]) == ("unserved", "objective_missed")
    # The flaky endpoint's deliveries took three attempts, each visible.
    accepted = [d for d in flaky if d["state"] == "delivered"]
    assert accepted
    assert all(d["attempts"] == 3 for d in accepted), accepted
    assert [a["status"] for a in accepted[0]["history"]] == [500, 500, 204]
    # The endpoint that hung: its first attempt timed out, the second was delivered.
    assert hang[0]["state"] == "delivered"
    assert hang[0]["history"][0]["error"] == NO_ANSWER
    # The one nobody answers (a closed port) says the same as the one that hung (an open
    # one): the deliveries are no port scanner.
    assert all(d["state"] == "pending" for d in gone)
    assert all(d["last_error"] == NO_ANSWER for d in gone), gone
    # An endpoint answering 20 MB: its status kept, nothing of what it said.
    assert all(d["state"] == "pending" for d in huge)
    assert all(d["last_error"] == "answered 502" for d in huge), huge
    # Meanwhile the tick fired on time, every fire.
    # Bound: a delivery in the fire path would make a fire as late as the hanging
    # endpoint's timeout (5 s) or the 20 MB answers; 2 s leaves room for a loaded machine.
    late_s = sorted((f["published_at"] - f["due_at"]).total_seconds() for f in tick_fires)
    assert len(late_s) > 10
    assert late_s[-1] < 2.0, late_s[-5:]


async def _retried(items: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await items
    return found if found and all(d["attempts"] >= 2 for d in found) else []


async def test_a_fire_recorded_failed_is_one_delivery_per_webhook_found_once(
    mongo_uri: str,
) -> None:
    """The leader marks a failed (or skipped) fire in its ledger write only while a webhook
    wants that event; the mark becomes a delivery and is cleared; found again (a new leader
    reading the same marks) it makes no second delivery."""
    from hascheduler.replica.webhooks import WebhookService

    db_name = f"hookunit_{uuid.uuid4().hex[:8]}"
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[db_name]
    try:
        ledger = Ledger(db.fires)
        await ledger.ensure_indexes(3600)
        store, deliveries = WebhookStore(db.webhooks), Deliveries(db.webhook_deliveries)
        await deliveries.ensure_indexes()
        now = dt.datetime.now(dt.UTC)
        service = WebhookService(
            store,
            deliveries,
            ledger,
            RunLedger(unreachable_db().runs),  # a test without runs
            ScheduleStore(unreachable_db().schedules),  # nor schedules to look up
            {},
            lambda: now,
            PUBLIC_ONLY,
        )
        nominal = now.replace(microsecond=0)
        await ledger.claim([claim_document(s, nominal, nominal, 1, now) for s in ("a", "b")])
        # No webhook wants failed fires yet: no mark.
        await ledger.mark_failed(f"a@{_iso(nominal)}", 1, 10, "refused", now)
        await store.create(
            {
                "_id": "w",
                "url": "http://127.0.0.1:9/",
                "events": ["fire.failed"],
                "namespace": "default",
                "schedule_id": None,
                "secret": SECRET,
                "created_at": now,
            },
            history.record(history.WEBHOOK_CREATE, history.Actor("test"), now, "default", "", None),
        )
        await service.find()
        assert ledger.notices.wanted == frozenset({"failed"})
        await ledger.mark_failed(f"b@{_iso(nominal)}", 1, 10, "refused", now)
        assert [d["_id"] for d in await ledger.noticed_entries(10)] == [f"b@{_iso(nominal)}"]
        await service.find()
        assert await ledger.noticed_entries(10) == []
        made = await deliveries.of("w", 10)
        assert [(d["type"], d["schedule_id"], d["state"]) for d in made] == [
            ("fire.failed", "b", "pending")
        ]
        delivery = await db.webhook_deliveries.find_one({"_id": made[0]["_id"]})
        assert delivery is not None
        event = json.loads(delivery["body"])
        assert event["data"]["error"] == "refused"
        # The same event again (a leader that died before clearing the mark): one delivery.
        again = Event(made[0]["event_id"], "fire.failed", "default", "b", now, {})
        assert (
            await deliveries.add(
                [again], [Subscription("w", frozenset({"fire.failed"}), "default")], now
            )
            == 0
        )
    finally:
        await client.drop_database(db_name)
        await client.close()


def _iso(moment: dt.datetime) -> str:
    from hascheduler.core.triggers import iso_utc

    return iso_utc(moment)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "t=abc,v1=00",
        "v1=00",
        "t=1",
        "NOW,v1=" + "0" * 64,
        "SIGNED_AN_HOUR_AGO",
    ],
)
def test_a_signature_that_does_not_hold_is_refused(header: str) -> None:
    """(The instants are read in the test, never in its id: parallel workers collect the
    same ids.)"""
    body = b'{"id":"e"}'
    header = header.replace("NOW", f"t={int(time.time())}")
    if header == "SIGNED_AN_HOUR_AGO":  # a genuine signature, replayed an hour later
        header = sign(SECRET, int(time.time()) - 3600, body)
    assert not verify(SECRET, header, body, time.time())
    good = sign(SECRET, int(time.time()), body)
    assert verify(SECRET, good, body, time.time())
    assert not verify(SECRET, good, body + b" ", time.time())
    assert not verify("another-secret-0123456", good, body, time.time())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/x", "events": ["run.dead"]}, "url"),
        ({"url": "http://", "events": ["run.dead"]}, "url"),
        ({"url": "http://h/" + "x" * 3000, "events": ["run.dead"]}, "url"),
        ({"url": "http://h/x y", "events": ["run.dead"]}, "url"),
        ({"url": "http://h/x", "events": []}, "events"),
        ({"url": "http://h/x", "events": ["run.alive"]}, "events"),
        ({"url": "http://h/x", "events": ["run.dead", "run.dead"]}, "events"),
        ({"url": "http://h/x", "events": ["run.dead"], "secret": "short"}, "secret"),
        ({"url": "http://h/x", "events": ["run.dead"], "namespace": "A/B"}, "namespace"),
        ({"url": "http://h/x", "events": ["run.dead"], "schedule_id": "../x"}, "schedule_id"),
        ({"url": "http://h/x", "events": ["run.dead"], "schedule_id": "nope"}, "schedule_id"),
        ({"url": "http://h/x", "events": ["run.dead"], "extra": 1}, "extra"),
    ],
)
async def test_a_bad_webhook_is_refused_naming_the_field(
    api_replica: ServerProcess, body: dict[str, Any], field: str
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(api_replica.uri + "/webhooks", json=body) as r,
    ):
        assert r.status == 422, await r.text()
        assert field in {e["field"].split(".")[0] for e in (await r.json())["errors"]}


@pytest.fixture(scope="module")
def api_replica(mongo_uri: str) -> Any:
    replica = start_replica(
        with_database(mongo_uri, f"hookapi_{uuid.uuid4().hex[:8]}"),
        "hookapi",
        "--egress-allow",
        "127.0.0.0/8",
    )
    yield replica
    replica.stop(signal.SIGKILL)


def test_a_namespace_holds_a_bounded_number_of_webhooks(api_replica: ServerProcess) -> None:
    from hascheduler.api.webhooks import MAX_WEBHOOKS_PER_NAMESPACE

    with httpx.Client(base_url=api_replica.uri) as http:
        for i in range(MAX_WEBHOOKS_PER_NAMESPACE):
            made = http.post(
                "/webhooks",
                json={"url": f"https://h/{i}", "events": ["run.dead"], "namespace": "crowded"},
            )
            assert made.status_code == 201, made.text
        refused = http.post(
            "/webhooks", json={"url": "https://h/x", "events": ["run.dead"], "namespace": "crowded"}
        )
        assert refused.status_code == 409
        assert refused.json()["errors"][0]["field"] == "namespace"
        # Another namespace is not crowded by it.
        assert (
            http.post(
                "/webhooks",
                json={"url": "https://h/x", "events": ["run.dead"], "namespace": "spacious"},
            ).status_code
            == 201
        )


def test_the_client_manages_webhooks(api_replica: ServerProcess) -> None:
    from hascheduler.client import Client, NotFound

    with Client(api_replica.uri) as client:
        made = client.create_webhook(
            {"id": "c1", "url": "https://hooks.example/x", "events": ["run.dead", "schedule.late"]}
        )
        assert made.secret is not None
        assert len(made.secret) >= 32  # generated, shown once
        assert client.get_webhook("c1").secret is None
        assert [w.id for w in client.webhooks("default").items] == ["c1"]
        assert client.webhook_deliveries("c1") == {"items": []}
        client.delete_webhook("c1")
        with pytest.raises(NotFound):
            client.get_webhook("c1")


def _cli(api: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "webhooks", *args, "--api", api],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_cli_adds_lists_and_deletes_webhooks(api_replica: ServerProcess) -> None:
    made = _cli(
        api_replica.uri,
        "add",
        "--id",
        "cli-1",
        "--url",
        "https://hooks.example/y",
        "--event",
        "run.dead",
        "--event",
        "fire.failed",
    )
    assert made.returncode == 0, made.stderr
    assert "secret (shown once): " in made.stdout
    listed = _cli(api_replica.uri, "list")
    assert "cli-1" in listed.stdout
    assert "run.dead,fire.failed" in listed.stdout
    assert "EVENT" in _cli(api_replica.uri, "deliveries", "cli-1").stdout
    # Refusals: exit 2 with the API's reason (a field named), or argparse's.
    bad_url = _cli(api_replica.uri, "add", "--url", "ftp://x/y", "--event", "run.dead")
    assert bad_url.returncode == 2
    assert "url" in bad_url.stderr
    assert (
        _cli(api_replica.uri, "add", "--url", "https://h/x", "--event", "run.alive").returncode == 2
    )
    assert _cli(api_replica.uri, "show", "nobody").returncode == 2
    assert _cli(api_replica.uri, "deliveries", "cli-1", "--limit", "0").returncode == 2
    assert _cli(api_replica.uri, "delete", "cli-1").returncode == 0
    assert "cli-1" not in _cli(api_replica.uri, "list").stdout


async def test_the_leaders_webhook_work_stops_with_its_term_and_leaves_no_marks(
    mongo_uri: str,
) -> None:
    """The leader's half of webhooks is a service of the term: while the term holds it finds
    (the marks a webhook wants are made), and once the term no longer holds it stops and
    the ledger's writes mark nothing more, with no poll of who leads."""
    from hascheduler.replica.term import LeadershipLost, Term
    from hascheduler.replica.webhooks import WebhookDuty, WebhookService
    from hascheduler.storage.lease import Lease, LeaseTimings

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[f"hookduty_{uuid.uuid4().hex[:8]}"]
    try:
        ledger = Ledger(db.fires)
        await ledger.ensure_indexes(3600)
        store, deliveries = WebhookStore(db.webhooks), Deliveries(db.webhook_deliveries)
        await deliveries.ensure_indexes()
        now = dt.datetime.now(dt.UTC)
        await store.create(
            {
                "_id": "w",
                "url": "http://127.0.0.1:9/",
                "events": ["fire.failed"],
                "namespace": "default",
                "schedule_id": None,
                "secret": SECRET,
                "created_at": now,
            },
            history.record(history.WEBHOOK_CREATE, history.Actor("test"), now, "default", "", None),
        )
        service = WebhookService(
            store,
            deliveries,
            ledger,
            RunLedger(unreachable_db().runs),  # a test without runs
            ScheduleStore(unreachable_db().schedules),  # nor schedules to look up
            {},
            lambda: dt.datetime.now(dt.UTC),
            PUBLIC_ONLY,
        )
        lease = Lease(db.leases, "scheduler", "a", LeaseTimings())
        view = await lease.acquire_or_renew()
        assert view is not None
        term = await Term(view.term, lease, {}).__aenter__()
        duty = asyncio.create_task(WebhookDuty(service).run(term))
        await wait_until(
            lambda: ledger.notices.wanted == frozenset({"failed"}), 5, "the duty's first look"
        )
        assert service.leading
        lease.step_down()  # the term no longer holds
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(duty, 5)
        assert not service.leading
        assert ledger.notices.wanted == frozenset()
        nominal = now.replace(microsecond=0)
        await ledger.claim([claim_document("a", nominal, nominal, view.term, now)])
        await ledger.mark_failed(f"a@{_iso(nominal)}", view.term, 10, "refused", now)
        assert await ledger.noticed_entries(10) == []
    finally:
        await client.drop_database(db.name)
        await client.close()
