"""Where features meet, one team's token reaches nothing of another's: fan-out sources
granted by namespace, never hascheduler's own collections (against a replica with an
access file of two teams)."""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import DuplicateKeyError

from hascheduler.api.access import (
    AccessConfigError,
    Action,
    create_token,
    entry_line,
)
from hascheduler.api.access_file import read_access_file
from hascheduler.core import constants, history
from hascheduler.core.claims import Claim
from hascheduler.core.constants import OWN_COLLECTIONS
from hascheduler.core.egress import PUBLIC_ONLY
from hascheduler.core.fanout import FanOut
from hascheduler.core.models import ScheduleIn
from hascheduler.core.run_states import DEAD
from hascheduler.core.triggers import fire_id
from hascheduler.replica.webhooks import WebhookService
from hascheduler.storage.audit_log import AuditLog
from hascheduler.storage.fire_records import claim_record
from hascheduler.storage.fires import Ledger
from hascheduler.storage.run_records import FireRef, Outcome
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.webhooks import Deliveries, WebhookStore
from tests.servers import ServerProcess, start_replica, with_database
from tests.waiting import wait_until_sync

PACKAGE = Path(__file__).resolve().parent.parent / "hascheduler"
TEAM_A, TEAM_B = "team-a", "team-b"


@dataclass
class Teams:
    url: str
    admin: dict[str, str]  # namespace -> its admin token's secret
    reader: dict[str, str]
    both: str  # an admin token of both namespaces


@pytest.fixture(scope="module")
def teams(mongo_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Teams]:
    """A replica whose access file grants team-a the fan-out source ``customers`` and
    team-b none; an admin and a reader token in each."""
    tokens = {
        (action, ns): create_token(f"{action.value}-{ns}", frozenset({action}), frozenset({ns}))
        for action in (Action.ADMIN, Action.READ)
        for ns in (TEAM_A, TEAM_B)
    }
    both = create_token("admin-both", frozenset({Action.ADMIN}), frozenset({TEAM_A, TEAM_B}))
    path = tmp_path_factory.mktemp("isolation") / "access.yaml"
    path.write_text(
        "tokens:\n"
        + "".join(entry_line(t.entry) + "\n" for t in (*tokens.values(), both))
        + f"namespaces:\n  {TEAM_A}: {{fan_out_sources: [customers]}}\n  {TEAM_B}: {{}}\n"
    )
    db_name = f"isolation_{uuid.uuid4().hex[:8]}"
    with MongoClient[dict[str, Any]](mongo_uri) as client:
        client[db_name].customers.insert_many([{"_id": f"c{i}", "plan": "pro"} for i in range(3)])
    replica = start_replica(
        with_database(mongo_uri, db_name),
        "isolation",
        "--write-rate",
        "0",
        "--access-file",
        str(path),
    )
    try:
        yield Teams(
            replica.uri,
            {ns: tokens[Action.ADMIN, ns].secret for ns in (TEAM_A, TEAM_B)},
            {ns: tokens[Action.READ, ns].secret for ns in (TEAM_A, TEAM_B)},
            both.secret,
        )
    finally:
        replica.stop(signal.SIGKILL)
        with MongoClient[dict[str, Any]](mongo_uri) as client:
            client.drop_database(db_name)


def _fan_out_schedule(namespace: str, collection: str, **fan_out: Any) -> dict[str, Any]:
    return {
        "id": f"fan-{uuid.uuid4().hex[:8]}",
        "name": "fan",
        "target": "isolation.job",
        "namespace": namespace,
        "trigger": {"kind": "cron", "cron": "0 3 * * *", "timezone": "UTC"},
        "fan_out": {"collection": collection, **fan_out},
    }


def _refused_field(answer: httpx.Response) -> str:
    assert answer.status_code == 422, answer.text
    return str(answer.json()["errors"][0]["field"])


@pytest.mark.parametrize("collection", sorted(OWN_COLLECTIONS))
def test_no_collection_hascheduler_writes_is_a_fan_out_source(collection: str) -> None:
    with pytest.raises(ValidationError, match="hascheduler's own collections"):
        FanOut.model_validate({"collection": collection})


def test_every_collection_the_product_writes_is_named_one_of_its_own() -> None:
    """Each ``db[NAME]`` in the package names a constant of OWN_COLLECTIONS: a collection
    added without it could be read back through a fan-out."""
    written: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
                owner = node.value
                if isinstance(owner, ast.Name | ast.Attribute) and (
                    (owner.id if isinstance(owner, ast.Name) else owner.attr)
                    in ("db", "database", "_db")
                ):
                    written.add(node.slice.id)
    assert written, "no collection found: the scan is broken"
    names = {name: getattr(constants, name, None) for name in written}
    names["MARKS"] = constants.LEASE_HISTORY_MARKS  # storage/lease_history.py's alias
    assert {name for name, value in names.items() if value not in OWN_COLLECTIONS} == set()


def test_an_access_file_grants_fan_out_sources_by_namespace(tmp_path: Path) -> None:
    path = tmp_path / "access.yaml"
    path.write_text("namespaces:\n  a: {fan_out_sources: [customers, accounts]}\n  b: {}\n")
    _, rules = read_access_file(str(path))
    assert rules["a"].fan_out_sources == frozenset({"customers", "accounts"})
    assert rules["b"].fan_out_sources == frozenset()
    for bad, said in (
        ("[webhooks]", "own collections"),
        ("customers", "a list"),
        ("['a b']", "not a collection name"),
    ):
        path.write_text(f"namespaces:\n  a: {{fan_out_sources: {bad}}}\n")
        with pytest.raises(AccessConfigError, match=said):
            read_access_file(str(path))


def test_a_fan_out_reads_only_what_its_namespace_is_granted(teams: Teams) -> None:
    """team-a may fan out over ``customers``; never over a collection of hascheduler's
    (another team's webhook secrets, its audit records), nor one it is not granted;
    team-b, granted none, over nothing. A change into a source not granted is refused
    too, and the open /readyz names no source."""
    with httpx.Client(base_url=teams.url) as http:
        a = {"Authorization": f"Bearer {teams.admin[TEAM_A]}"}
        b = {"Authorization": f"Bearer {teams.admin[TEAM_B]}"}
        made = http.post("/schedules", json=_fan_out_schedule(TEAM_A, "customers"), headers=a)
        assert made.status_code == 201, made.text
        for collection in ("webhooks", "audit", "webhook_deliveries", "runs"):
            stolen = _fan_out_schedule(
                TEAM_A, collection, filter={"namespace": TEAM_B}, key="secret"
            )
            assert _refused_field(http.post("/schedules", json=stolen, headers=a)).startswith(
                "fan_out"
            )
        for namespace, headers in ((TEAM_A, a), (TEAM_B, b)):
            ungranted = _fan_out_schedule(
                namespace, "accounts" if namespace == TEAM_A else "customers"
            )
            answer = http.post("/schedules", json=ungranted, headers=headers)
            assert _refused_field(answer) == "fan_out.collection"
            assert namespace in answer.text
        moved = http.patch(
            f"/schedules/{made.json()['id']}",
            json={"fan_out": {"collection": "accounts"}},
            headers=a,
        )
        assert _refused_field(moved) == "fan_out.collection"
        wait_until_sync(lambda: http.get("/readyz").status_code == 200, 30, "the replica ready")
        assert "customers" not in http.get("/readyz").text


async def test_a_deleted_schedules_events_go_to_its_own_namespace(mongo_uri: str) -> None:
    """A fire recorded failed and a run that died keep their schedule's namespace: with
    the schedule gone from the mirror, their events go to its namespace's webhook, not to
    one of ``default``."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[f"gone_{uuid.uuid4().hex[:8]}"]
    try:
        ledger, runs = Ledger(db.fires), RunLedger(db.runs)
        await ledger.ensure_indexes(3600)
        store, deliveries = WebhookStore(db.webhooks), Deliveries(db.webhook_deliveries)
        await deliveries.ensure_indexes()
        now = dt.datetime.now(dt.UTC)
        for namespace in ("default", TEAM_B):
            await store.create(
                {
                    "_id": namespace,
                    "url": "http://127.0.0.1:9/",
                    "events": ["fire.failed", "run.dead"],
                    "namespace": namespace,
                    "schedule_id": None,
                    "secret": "s" * 32,
                    "created_at": now,
                },
                history.record(
                    history.WEBHOOK_CREATE, history.Actor("test"), now, namespace, "", None
                ),
            )
        service = WebhookService(
            store,
            deliveries,
            ledger,
            runs,
            ScheduleStore(db.schedules),
            {},
            lambda: now,
            PUBLIC_ONLY,
        )
        await service.find()  # learns which events are wanted: the ledger marks them
        nominal = now.replace(microsecond=0)
        failed = Claim(fire_id("gone", nominal), "gone", nominal, nominal)
        await ledger.claim([claim_record(failed, 1, now, now, namespace=TEAM_B)])
        await ledger.mark_failed(failed.fire_id, 1, 10, "refused", now)
        dead = FireRef(
            fire_id("gone", nominal - dt.timedelta(minutes=1)),
            "gone",
            "t.x",
            nominal,
            {},
            b"{}",
            namespace=TEAM_B,
        )
        claim = await runs.claim(dead, "w1", now, 30.0)
        await runs.record([Outcome(dead.fire_id, "w1", claim.attempt, now, now, DEAD, "boom")])
        await service.find()
        assert await deliveries.of("default", 10) == []
        made = await deliveries.of(TEAM_B, 10)
        assert sorted(d["type"] for d in made) == ["fire.failed", "run.dead"]
    finally:
        await client.drop_database(db.name)
        await client.close()


def test_a_reused_id_is_another_schedule_whose_history_is_not_the_first_ones(
    teams: Teams,
) -> None:
    """team-b's schedule is deleted and its id reused in team-a: team-a reads none of
    team-b's fires, history or revisions through it and cannot restore team-b's fields
    into its own; team-b still reads its deleted schedule's fire."""
    sid = f"reused-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=teams.url) as http:
        a = {"Authorization": f"Bearer {teams.admin[TEAM_A]}"}
        b = {"Authorization": f"Bearer {teams.admin[TEAM_B]}"}
        first = _schedule(sid, TEAM_B, payload={"secret": "team-b's"})
        assert http.post("/schedules", json=first, headers=b).status_code == 201
        patched = http.patch(f"/schedules/{sid}", json={"name": "b's two"}, headers=b)
        assert patched.status_code == 200, patched.text
        fired = http.post(f"/schedules/{sid}/trigger", json={}, headers=b)
        assert fired.status_code == 202, fired.text
        fire = fired.json()["fire_id"]
        wait_until_sync(
            lambda: http.get(f"/fires/{fire}", headers=b).json().get("state") == "published",
            30,
            "team-b's fire published",
        )
        assert http.delete(f"/schedules/{sid}", headers=b).status_code == 204
        again = http.post("/schedules", json=_schedule(sid, TEAM_A), headers=a)
        assert again.status_code == 201, again.text

        assert http.get(f"/schedules/{sid}/fires", headers=a).json()["items"] == []
        assert http.get(f"/fires/{fire}", headers=a).status_code == 404
        assert http.get(f"/fires/{fire}", headers=b).status_code == 200
        history = http.get(f"/schedules/{sid}/history", headers=a).json()["items"]
        assert {r["namespace"] for r in history} == {TEAM_A}
        assert [r["revision"] for r in history] == [1]
        restored = http.post(f"/schedules/{sid}/restore", json={"revision": 2}, headers=a)
        assert restored.status_code in (404, 409), restored.text
        assert "team-b's" not in restored.text
        assert http.get(f"/schedules/{sid}", headers=a).json()["payload"] == {}


def _schedule(schedule_id: str, namespace: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "isolation.job",
        "namespace": namespace,
        "trigger": {"kind": "cron", "cron": "0 3 * * *", "timezone": "UTC"},
        **fields,
    }


def _apply(teams: Teams, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", "apply", "--api", teams.url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HASCHEDULER_TOKEN": teams.both},
        check=False,
    )


def test_apply_prunes_only_in_the_namespaces_it_names(teams: Teams, tmp_path: Path) -> None:
    """With a token that writes in two namespaces, ``--prune`` deletes only in
    ``--namespace`` (or, without it, in the namespaces the files name): never another
    team's schedule that merely carries the same label. The dry run says the scope."""
    tag = uuid.uuid4().hex[:6]
    label = {"labels": {"owner": tag}}
    with httpx.Client(
        base_url=teams.url, headers={"Authorization": f"Bearer {teams.both}"}
    ) as http:
        for sid, namespace in ((f"a-old-{tag}", TEAM_A), (f"b-{tag}", TEAM_B)):
            made = http.post("/schedules", json=_schedule(sid, namespace, **label))
            assert made.status_code == 201, made.text
        declared = {k: v for k, v in _schedule(f"a-new-{tag}", TEAM_A, **label).items()}
        del declared["namespace"]  # --namespace says where
        path = tmp_path / "a.yaml"
        path.write_text(json.dumps(declared))
        prune = ("-f", str(path), "--prune", "--selector", f"owner={tag}")

        dry = _apply(teams, *prune, "--namespace", TEAM_A, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"in {TEAM_A}" in dry.stdout
        assert f"- delete a-old-{tag}" in dry.stdout
        assert f"b-{tag}" not in dry.stdout

        done = _apply(teams, *prune, "--namespace", TEAM_A)
        assert done.returncode == 0, done.stderr
        assert http.get(f"/schedules/a-new-{tag}").json()["namespace"] == TEAM_A
        assert http.get(f"/schedules/a-old-{tag}").status_code == 404
        assert http.get(f"/schedules/b-{tag}").status_code == 200

        # Without --namespace: the files' namespaces (team-a's, named in the file).
        path.write_text(json.dumps({**declared, "namespace": TEAM_A}))
        again = _apply(teams, *prune, "--dry-run")
        assert again.returncode == 0, again.stderr
        assert f"in {TEAM_A}\n" in again.stdout
        assert f"b-{tag}" not in again.stdout

        # A declaration outside --namespace is refused before any write.
        path.write_text(json.dumps({**declared, "namespace": TEAM_B}))
        outside = _apply(teams, *prune, "--namespace", TEAM_A)
        assert outside.returncode == 2
        assert "outside --namespace" in outside.stderr


async def test_an_id_freed_by_the_relay_while_it_is_created_again_is_free(
    mongo_uri: str,
) -> None:
    """A create of a deleted schedule's id meets its tombstone; the relay removes the
    tombstone before the create looks for it: the id is free, and the create goes on
    (it answered 409 "already exists", a test in three)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    db = client[f"tomb_{uuid.uuid4().hex[:8]}"]
    audit = AuditLog(db.audit, [db.schedules])

    class TombstoneGoneMeanwhile:
        """The schedules, whose next insert meets a tombstone the relay then removes."""

        armed = False

        def __getattr__(self, name: str) -> Any:
            return getattr(db.schedules, name)

        async def insert_one(self, doc: dict[str, Any]) -> Any:
            if self.armed:
                self.armed = False
                await audit.relay()
                raise DuplicateKeyError("E11000 the tombstone, gone since")
            return await db.schedules.insert_one(doc)

    schedules = TombstoneGoneMeanwhile()
    store = ScheduleStore(schedules, audit=audit)  # type: ignore[arg-type]
    now = dt.datetime.now(dt.UTC)
    try:
        new = ScheduleIn.model_validate(_schedule("s", TEAM_A), context={"now": now})
        await store.create(new, now)
        await store.delete("s", now=now)
        schedules.armed = True
        assert (await store.create(new, now)).id == "s"
    finally:
        await client.drop_database(db.name)
        await client.close()


def test_a_webhook_made_and_deleted_is_in_its_namespaces_trail_without_its_secret(
    teams: Teams,
) -> None:
    a = {"Authorization": f"Bearer {teams.admin[TEAM_A]}"}
    with httpx.Client(base_url=teams.url) as http:
        made = http.post(
            "/webhooks",
            json={
                "url": "https://bot:s3cret@hooks.example.com/a",
                "events": ["run.dead"],
                "namespace": TEAM_A,
                "secret": "a" * 32,
            },
            headers=a,
        )
        assert made.status_code == 201, made.text
        hook = made.json()["id"]
        assert http.delete(f"/webhooks/{hook}", headers=a).status_code == 204
        reader = {"Authorization": f"Bearer {teams.reader[TEAM_A]}"}
        trail = http.get("/audit", headers=reader).json()["items"]
        mine = [r for r in trail if r["detail"].get("webhook_id") == hook]
        assert [(r["action"], r["actor"], r["namespace"]) for r in mine] == [
            ("webhook.delete", f"admin-{TEAM_A}", TEAM_A),
            ("webhook.create", f"admin-{TEAM_A}", TEAM_A),
        ]
        assert "s3cret" not in json.dumps(mine)
        assert "a" * 32 not in json.dumps(mine)
        other = {"Authorization": f"Bearer {teams.reader[TEAM_B]}"}
        assert hook not in http.get("/audit", headers=other).text


def test_a_client_cannot_relabel_its_change(teams: Teams) -> None:
    """X-Change-Origin is the client's word about itself: the record keeps the change as
    what it was, by the token's name; only a word the trail knows is kept, as via."""
    a = {"Authorization": f"Bearer {teams.admin[TEAM_A]}"}
    with httpx.Client(base_url=teams.url) as http:
        for origin, via in (("apply", "apply"), ("system\nforged", None)):
            sid = f"label-{uuid.uuid4().hex[:6]}"
            made = http.post(
                "/schedules",
                json=_schedule(sid, TEAM_A),
                headers={**a, "X-Change-Origin": origin.replace("\n", " ")},
            )
            assert made.status_code == 201, made.text
            [record] = http.get(f"/schedules/{sid}/history", headers=a).json()["items"]
            assert (record["action"], record["actor"]) == ("create", f"admin-{TEAM_A}")
            assert record["detail"].get("via") == via


def test_tokens_and_rules_the_access_file_changes_are_recorded(
    mongo_uri: str, tmp_path: Path
) -> None:
    """A token added or revoked, and a namespace's rules changed, by editing the access
    file: each is in the trail (actor access-file) once the replica has read it."""
    ops = create_token("ops", frozenset({Action.ADMIN}), frozenset({"*"}))
    newcomer = create_token("newcomer", frozenset({Action.READ}), frozenset({TEAM_A}))
    path = tmp_path / "access.yaml"
    path.write_text(f"tokens:\n{entry_line(ops.entry)}\n")
    db_name = f"accessrec_{uuid.uuid4().hex[:8]}"
    replica = start_replica(
        with_database(mongo_uri, db_name), "accessrec", "--access-file", str(path)
    )
    try:
        path.write_text(
            f"tokens:\n{entry_line(ops.entry)}\n{entry_line(newcomer.entry)}\n"
            f"namespaces:\n  {TEAM_A}: {{require_reason: true}}\n"
        )
        headers = {"Authorization": f"Bearer {ops.secret}"}

        def actions() -> list[tuple[str, str]]:
            items = httpx.get(f"{replica.uri}/audit", headers=headers, timeout=10).json()["items"]
            return sorted(
                (r["action"], r["namespace"]) for r in items if r["actor"] == "access-file"
            )

        wait_until_sync(lambda: len(actions()) == 2, 20, "the file's changes recorded")
        assert actions() == [("namespace.rules", TEAM_A), ("token.add", TEAM_A)]
        path.write_text(f"tokens:\n{entry_line(ops.entry)}\n")
        wait_until_sync(lambda: len(actions()) == 4, 20, "the revocation recorded")
        assert ("token.revoke", TEAM_A) in actions()
    finally:
        replica.stop(signal.SIGKILL)
        with MongoClient[dict[str, Any]](mongo_uri) as client:
            client.drop_database(db_name)


@dataclass
class Guarded:
    replica: ServerProcess
    writer: str  # may write in team-a, not read
    tokens: list[str]  # two admins of team-a, behind one address


@pytest.fixture(scope="module")
def guarded(mongo_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    """A replica with /metrics for read tokens only and a write limit of one write a
    second per token."""
    writer = create_token("writer", frozenset({Action.WRITE}), frozenset({TEAM_A}))
    admins = [
        create_token(f"admin-{i}", frozenset({Action.ADMIN}), frozenset({TEAM_A})) for i in (1, 2)
    ]
    path = tmp_path_factory.mktemp("guarded") / "access.yaml"
    path.write_text("tokens:\n" + "".join(entry_line(t.entry) + "\n" for t in (writer, *admins)))
    db_name = f"guarded_{uuid.uuid4().hex[:8]}"
    replica = start_replica(
        with_database(mongo_uri, db_name),
        "guarded",
        "--access-file",
        str(path),
        "--metrics-need-token",
        "--write-rate",
        "0.2",
        "--write-burst",
        "2",
    )
    try:
        yield Guarded(replica, writer.secret, [t.secret for t in admins])
    finally:
        replica.stop(signal.SIGKILL)
        with MongoClient[dict[str, Any]](mongo_uri) as client:
            client.drop_database(db_name)


def test_a_write_only_token_gets_no_document_back(guarded: Guarded) -> None:
    w = {"Authorization": f"Bearer {guarded.writer}"}
    with httpx.Client(base_url=guarded.replica.uri) as http:
        sid = f"wo-{uuid.uuid4().hex[:6]}"
        made = http.post("/schedules", json=_schedule(sid, TEAM_A, payload={"k": "v"}), headers=w)
        assert made.status_code == 201, made.text
        assert made.json() == {"id": sid, "revision": 1}
        patched = http.patch(f"/schedules/{sid}", json={}, headers=w)
        assert patched.json() == {"id": sid, "revision": patched.json()["revision"]}
        assert "payload" not in patched.text
        assert http.get(f"/schedules/{sid}", headers=w).status_code == 403


def test_metrics_can_need_a_token(guarded: Guarded) -> None:
    with httpx.Client(base_url=guarded.replica.uri) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        writer = {"Authorization": f"Bearer {guarded.writer}"}
        assert http.get("/metrics", headers=writer).status_code == 403
        admin = {"Authorization": f"Bearer {guarded.tokens[0]}"}
        answer = http.get("/metrics", headers=admin)
        assert answer.status_code == 200
        assert "hascheduler_" in answer.text


def test_one_token_spending_its_writes_leaves_another_behind_the_same_address_its_own(
    guarded: Guarded,
) -> None:
    first, second = ({"Authorization": f"Bearer {t}"} for t in guarded.tokens)
    with httpx.Client(base_url=guarded.replica.uri) as http:

        def create(headers: dict[str, str]) -> int:
            body = _schedule(f"wl-{uuid.uuid4().hex[:6]}", TEAM_A)
            return http.post("/schedules", json=body, headers=headers).status_code

        codes = [create(first) for _ in range(4)]
        assert codes[:2] == [201, 201]
        assert 429 in codes[2:]
        assert create(second) == 201


def test_an_over_long_authorization_header_is_never_logged(guarded: Guarded) -> None:
    secret = "SECRET" + uuid.uuid4().hex
    headers = {"Authorization": f"Bearer hst_0123456789abcdef_{secret}{'A' * 9000}"}
    answer = httpx.get(f"{guarded.replica.uri}/schedules", headers=headers, timeout=10)
    assert answer.status_code in (400, 431)
    log_path = guarded.replica.log_path
    assert log_path is not None

    def logged() -> str:
        return Path(log_path).read_text(errors="replace")

    wait_until_sync(lambda: "http_request_malformed" in logged(), 10, "the refusal logged")
    assert secret not in logged()
