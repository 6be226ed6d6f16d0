"""The audit trail on real replicas: every kind of change gives exactly one record with its
actor and diff, a refused change gives none, a replica killed mid-write leaves record and
change both or neither, a schedule goes back to any revision of its history, namespaces'
rules (a reason required, a quota) hold."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pymongo import MongoClient

from hascheduler.api.access import Action, create_token, entry_line
from hascheduler.client import Client, Conflict, NotFound
from hascheduler.storage.audit_log import OUTBOX, PENDING
from tests.servers import ServerProcess, start_replica, with_database
from tests.waiting import wait_until_sync

ADMIN = "audit-admin-token-0123"


class Replica:
    def __init__(self, mongo_uri: str, tmp_path: Path, *args: str) -> None:
        self.db_name = f"audit_{uuid.uuid4().hex[:8]}"
        self.mongo_uri = mongo_uri
        ops = create_token("ops", frozenset({Action.ADMIN}), frozenset({"*"}))
        self.ops = ops.secret
        self.access = tmp_path / "access.yaml"
        self.access.write_text(
            "tokens:\n"
            + entry_line(ops.entry)
            + "\n"
            + yaml.safe_dump(
                {"namespaces": {"billing": {"require_reason": True, "max_schedules": 3}}}
            )
        )
        self.args = ("--write-rate", "0", "--access-file", str(self.access), *args)
        self.client: MongoClient[dict[str, Any]] = MongoClient(mongo_uri)
        self.process = self.start()

    def start(self) -> ServerProcess:
        return start_replica(
            with_database(self.mongo_uri, self.db_name),
            f"audit-{uuid.uuid4().hex[:4]}",
            *self.args,
            env={"HASCHEDULER_WRITE_TOKENS": ADMIN},
        )

    @property
    def url(self) -> str:
        return self.process.uri

    def db(self) -> Any:
        return self.client[self.db_name]

    def close(self) -> None:
        self.process.stop(signal.SIGKILL)
        self.client.drop_database(self.db_name)
        self.client.close()


@pytest.fixture
def replica(mongo_uri: str, tmp_path: Path) -> Iterator[Replica]:
    made = Replica(mongo_uri, tmp_path)
    try:
        yield made
    finally:
        made.close()


def cron(schedule_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "name": schedule_id,
        "target": "audit.job",
        "trigger": {"kind": "cron", "cron": "0 4 * * *", "timezone": "UTC"},
        **extra,
    }


def records(api: Client, schedule_id: str) -> list[dict[str, Any]]:
    return list(reversed(list(api.history(schedule_id))))  # oldest first


def test_every_kind_of_change_is_recorded_once_with_its_actor_and_diff(
    replica: Replica, tmp_path: Path
) -> None:
    with Client(replica.url, replica.ops, reason="quarter close") as api:
        api.create_schedule(cron("s", payload={"k": 1}))
        api.patch_schedule("s", {"jitter": 5})
        api.replace_schedule("s", {k: v for k, v in cron("s", jitter=7).items() if k != "id"})
        api.pause("s", note="maintenance")
        api.resume("s")
        fire = api.trigger("s", force=True).fire_id
        api.cancel_run(fire)
        end = dt.datetime.now(dt.UTC).replace(microsecond=0)
        backfill = api.backfill("s", end - dt.timedelta(days=3), end)
        api.cancel_backfill(backfill["id"])
        api.restore("s", 1)
        with pytest.raises(Conflict):  # a refused write is no change: no record
            api.replace_schedule("s", {k: v for k, v in cron("s").items() if k != "id"}, if_match=1)
        with pytest.raises(Conflict):
            api.create_schedule(cron("s"))
        got = records(api, "s")
        actions = [r["action"] for r in got]
        assert actions[:5] == ["create", "update", "update", "pause", "resume"]
        assert sorted(actions[5:]) == sorted(["trigger", "cancel", "backfill", "cancel", "restore"])
        assert {r["actor"] for r in got} == {"ops"}
        assert all(r["from"] == "127.0.0.1" and r["at"] for r in got)
        by_action = {r["action"]: r for r in got}
        assert got[0]["before"] is None
        assert got[0]["after"]["payload"] == {"k": 1}
        assert got[1]["changed"] == ["jitter"]
        assert (got[1]["before"]["jitter"], got[1]["after"]["jitter"]) == (0.0, 5.0)
        assert by_action["pause"]["reason"] == "quarter close"
        assert by_action["pause"]["after"]["pause"]["note"] == "maintenance"
        assert by_action["trigger"]["detail"]["fire_id"] == fire
        assert by_action["restore"]["after"]["jitter"] == 0.0
        assert api.get_schedule("s").jitter == 0.0
        # Each change that made a revision has its record, numbered as the revision.
        revisions = [r["revision"] for r in got if r["revision"] is not None]
        assert revisions == list(range(1, api.get_schedule("s").revision + 1))

        api.delete_schedule("s")
        assert records(api, "s")[-1]["action"] == "delete"
        assert records(api, "s")[-1]["after"] is None
        with pytest.raises(NotFound):
            api.get_schedule("s")
        api.create_schedule(cron("s"))  # the id is free once the delete is recorded
        # Its history starts anew: the id reused is another schedule. The trail keeps both.
        assert [r["action"] for r in records(api, "s")] == ["create"]
        trail = [r["action"] for r in api.audit(schedule_id="s")]
        assert trail.count("create") == 2
        assert "delete" in trail

    # apply's writes are recorded as the changes they are, by the token's actor, the
    # client's word that it was apply kept as detail.via (a header cannot relabel them).
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump_all([cron("a1", labels={"team": "x"}), cron("a2", labels={"team": "x"})])
    )
    run = [
        sys.executable,
        "-m",
        "hascheduler.cli",
        "apply",
        "--api",
        replica.url,
        "-f",
        str(path),
        "--prune",
        "--selector",
        "team=x",
        "--reason",
        "from CI",
    ]
    env = {"HASCHEDULER_TOKEN": replica.ops, "PATH": "/usr/bin:/bin"}
    assert subprocess.run(run, env=env, check=False, capture_output=True).returncode == 0
    path.write_text(yaml.safe_dump_all([cron("a1", labels={"team": "x"}, jitter=2)]))
    assert subprocess.run(run, env=env, check=False, capture_output=True).returncode == 0
    with Client(replica.url, replica.ops) as api:
        applied = list(api.audit(actor="ops", since=end - dt.timedelta(minutes=5)))
        via_apply = [r for r in applied if r["detail"].get("via") == "apply"]
        by_schedule = {(r["schedule_id"], r["action"]) for r in via_apply}
        assert by_schedule == {
            ("a1", "create"),
            ("a2", "create"),
            ("a1", "update"),
            ("a2", "delete"),
        }
        assert all(r["reason"] == "from CI" for r in via_apply)
        assert all(r["actor"] == "ops" for r in via_apply)


def test_a_namespace_can_require_a_reason_and_cap_its_schedules(replica: Replica) -> None:
    with httpx.Client(
        base_url=replica.url, headers={"Authorization": f"Bearer {replica.ops}"}
    ) as http:
        refused = http.post("/schedules", json=cron("b0", namespace="billing"))
        assert refused.status_code == 422
        assert refused.json()["errors"][0]["field"] == "X-Reason"
        for i in range(3):
            assert (
                http.post(
                    "/schedules",
                    json=cron(f"b{i}", namespace="billing"),
                    headers={"X-Reason": "billing run"},
                ).status_code
                == 201
            )
        over = http.post(
            "/schedules", json=cron("b3", namespace="billing"), headers={"X-Reason": "one more"}
        )
        assert over.status_code == 422
        assert "max_schedules" in over.json()["title"]
        assert http.post("/schedules/b0/pause", json={}).status_code == 422  # no reason
        assert (
            http.post("/schedules/b0/pause", json={"note": "end of quarter"}).status_code == 200
        )  # the note is the reason
        history = http.get("/schedules/b0/history").json()["items"]
        assert [r["reason"] for r in history] == ["end of quarter", "billing run"]
        assert http.post("/schedules", json=cron("d0")).status_code == 201  # default: free


def test_a_replica_killed_mid_write_leaves_change_and_record_both_or_neither(
    replica: Replica,
) -> None:
    writers = 8
    with Client(replica.url, ADMIN) as api:
        for i in range(writers):
            api.create_schedule(cron(f"k{i}"))

    def hammer(i: int) -> bool:
        """Whether the kill cut this writer off mid-stream."""
        with httpx.Client(
            base_url=replica.url, timeout=5, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as http:
            for n in range(1000):
                try:
                    http.patch(f"/schedules/k{i}", json={"jitter": n % 50})
                except httpx.HTTPError:
                    return True
        return False

    with concurrent.futures.ThreadPoolExecutor(writers) as pool:
        futures = [pool.submit(hammer, i) for i in range(writers)]
        db = replica.db()
        wait_until_sync(
            lambda: db.schedules.count_documents({"revision": {"$gte": 5}}) >= writers // 2,
            60,
            "writes under way",
        )
        replica.process.stop(signal.SIGKILL)
        assert any(future.result() for future in futures)  # writes were in flight
    replica.process = replica.start()  # another replica copies what was left pending
    wait_until_sync(
        lambda: db.schedules.count_documents({PENDING: True}) == 0, 30, "the outboxes copied"
    )
    for doc in db.schedules.find({}, {OUTBOX: 1, "revision": 1}):
        revisions = sorted(r["revision"] for r in db.audit.find({"schedule_id": doc["_id"]}))
        assert revisions == list(range(1, doc["revision"] + 1)), doc["_id"]


def test_restore_any_revision_and_redacted_payloads(mongo_uri: str, tmp_path: Path) -> None:
    redacting = Replica(mongo_uri, tmp_path, "--audit-redact-payloads")
    try:
        with Client(redacting.url, ADMIN) as api:
            api.create_schedule(cron("r", payload={"password": "hunter2"}))
            for jitter in (1, 2, 3):
                api.patch_schedule("r", {"jitter": jitter})
            got = records(api, "r")
            assert "hunter2" not in str(got)
            assert got[0]["after"]["payload"]["password"].startswith("redacted:")
            for revision in (2, 1, 4):
                restored = api.restore("r", revision)
                assert restored.jitter == [0.0, 1.0, 2.0, 3.0][revision - 1]
                assert restored.payload == {"password": "hunter2"}  # kept as it is now
            with pytest.raises(NotFound, match="no revision 99"):
                api.restore("r", 99)
        indexes = redacting.db().audit.index_information()
        assert indexes["retention"]["expireAfterSeconds"] == 400 * 86400
    finally:
        redacting.close()


def hascheduler(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", **({"HASCHEDULER_TOKEN": token} if token else {})}
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_cli_creates_tokens_a_replica_honours_and_revokes_within_seconds(
    replica: Replica,
) -> None:
    made = hascheduler(
        "token",
        "create",
        "--name",
        "billing-ci",
        "--actions",
        "read,trigger",
        "--namespaces",
        "billing",
        "--json",
    )
    assert made.returncode == 0, made.stderr
    token = yaml.safe_load(made.stdout)
    assert token["secret"] not in str(token["entry"])
    original = replica.access.read_text()
    replica.access.write_text(
        original.replace("tokens:\n", "tokens:\n" + entry_line(token["entry"]) + "\n")
    )
    listed = ["schedules", "list", "--api", replica.url, "--namespace", "billing"]
    wait_until_sync(
        lambda: hascheduler(*listed, token=token["secret"]).returncode == 0,
        10,
        "the new token accepted",
    )
    refused = hascheduler(
        "schedules",
        "add",
        "--api",
        replica.url,
        "--namespace",
        "billing",
        "--name",
        "x",
        "--target",
        "t",
        "--cron",
        "0 1 * * *",
        token=token["secret"],
    )
    assert refused.returncode == 2
    assert "billing-ci may not write anywhere: it may read, trigger in billing" in refused.stderr
    replica.access.write_text(original)  # revoked
    wait_until_sync(
        lambda: hascheduler(*listed, token=token["secret"]).returncode != 0,
        10,
        "the revoked token refused",
    )
    assert "HTTP 401" in hascheduler(*listed, token=token["secret"]).stderr


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--name", "a b", "--actions", "read", "--namespaces", "x"], "--name 'a b'"),
        (["--name", "a", "--actions", "read,fly", "--namespaces", "x"], "--actions"),
        (["--name", "a", "--actions", "read", "--namespaces", "../etc"], "--namespaces"),
        (["--name", "a", "--actions", "", "--namespaces", "x"], "--actions"),
    ],
)
def test_token_create_refuses_bad_input(args: list[str], complaint: str) -> None:
    done = hascheduler("token", "create", *args)
    assert done.returncode == 2
    assert complaint in done.stderr


def test_the_audit_log_command_reads_the_trail(replica: Replica) -> None:
    with Client(replica.url, replica.ops, reason="set up") as api:
        api.create_schedule(cron("logged"))
        api.pause("logged")
    shown = hascheduler(
        "audit-log", "--api", replica.url, "--schedule", "logged", token=replica.ops
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:4] == ["AT", "ACTOR", "FROM", "ACTION"]
    assert [line.split()[3] for line in lines[1:]] == ["pause", "create"]
    assert all("ops" in line and "set up" in line for line in lines[1:])
    as_json = hascheduler(
        "audit-log", "--api", replica.url, "--actor", "nobody", "--json", token=replica.ops
    )
    assert yaml.safe_load(as_json.stdout) == {"items": []}
    for bad in (["--since", "yesterday"], ["--namespace", "A/B"], ["--limit", "0"]):
        done = hascheduler("audit-log", "--api", replica.url, *bad, token=replica.ops)
        assert done.returncode == 2, (bad, done.stdout)
    history = hascheduler("schedules", "history", "logged", "--api", replica.url, token=replica.ops)
    assert history.returncode == 0
    assert len(history.stdout.splitlines()) == 3
