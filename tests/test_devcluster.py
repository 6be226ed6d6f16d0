"""The local cluster: the stream audit (pure) and the `hascheduler dev` controls."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from hascheduler_dev.devcluster.supervisor import EPHEMERAL_RANGE, LOWEST_PORT, free_port

from hascheduler.brokers.nats.reader import stream_leader
from hascheduler.core.audit import audit
from hascheduler.core.catchup import plan_catchups
from hascheduler.core.entries import entry_from_document
from hascheduler.core.fire_queue import next_due
from hascheduler.core.triggers import jitter_offset
from tests.servers import DevCluster, start_nats
from tests.waiting import wait_until_sync

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def schedule(sid: str, every: float, jitter: float = 0.0, paused: bool = False) -> dict[str, Any]:
    return {
        "_id": sid,
        "revision": 1,
        "paused": paused,
        "jitter": jitter,
        "catchup": "all",
        "catchup_window": 3600.0,
        "target": "t",
        "trigger": {"kind": "interval", "every": every, "start_at": T0},
    }


def event(sid: str, seconds: float) -> dict[str, Any]:
    nominal = T0 + dt.timedelta(seconds=seconds)
    return {"data": {"schedule_id": sid, "nominal_at": nominal.isoformat()}}


def test_audit_counts_each_due_fire_once() -> None:
    schedules = [schedule("a", 2), schedule("b", 5, jitter=1.0), schedule("p", 1, paused=True)]
    since, until = T0 + dt.timedelta(seconds=1), T0 + dt.timedelta(seconds=11)
    # a: 2, 4, 6, 8, 10; b: 5 (+ jitter < 1 s), 10 only if its jitter keeps it <= 11
    events = [event("a", s) for s in (2, 4, 6, 8, 10)] + [event("b", 5), event("b", 10)]
    report = audit(schedules, events, since, until)
    assert report.ok, report.as_dict()
    assert report.expected == report.delivered == 7


@pytest.mark.parametrize("jitter", [0.0, 3.0])
@pytest.mark.parametrize("trigger", ["anchored", "cron"])
def test_the_audit_expects_what_the_scheduler_fires_from_a_schedules_creation(
    trigger: str, jitter: float
) -> None:
    """One rule (made_since): a schedule's fires are those due strictly after its creation
    (an interval anchored at its creation does not fire at that instant). The audit over
    a window starting before, at and after the creation expects exactly what the live
    queue and a catch-up fire."""
    created = T0 + dt.timedelta(seconds=30)
    doc = {
        **schedule("s", 1, jitter),
        "created_at": created,
        "trigger": (
            {"kind": "interval", "every": 5.0, "start_at": created}
            if trigger == "anchored"
            else {"kind": "cron", "cron": "* * * * *", "timezone": "UTC"}
        ),
    }
    entry = entry_from_document(doc)
    until = created + dt.timedelta(minutes=5)
    watermark = created - dt.timedelta(minutes=5)
    caught, _ = plan_catchups([("s", entry)], watermark, until, {"s": created})
    fired = {d.nominal for d in caught}
    queued, after = set(), created
    while (due := next_due("s", entry, after)) is not None and due.fire_at <= until:
        queued.add(due.nominal)
        after = due.fire_at
    assert fired == queued
    assert min(fired) > created - dt.timedelta(seconds=jitter)
    for since in (created - dt.timedelta(seconds=20), created, created + dt.timedelta(seconds=7)):
        events = [
            {"data": {"schedule_id": "s", "nominal_at": n.isoformat()}}
            for n in fired
            if since <= n + jitter_offset("s", n, jitter) <= until
        ]
        report = audit([doc], events, since, until)
        assert report.ok, (since, report.as_dict())
        assert report.expected == len(events) > 0


def test_audit_finds_missing_duplicated_and_unexpected() -> None:
    schedules = [schedule("a", 2)]
    since, until = T0 + dt.timedelta(seconds=1), T0 + dt.timedelta(seconds=9)
    events = [event("a", 2), event("a", 2), event("a", 6), event("a", 8), event("a", 7)]
    report = audit(schedules, events, since, until).as_dict()
    assert (report["missing"], report["duplicated"], report["unexpected"]) == (1, 1, 1)
    assert report["examples"]["missing"] == [["a", "2030-01-01T00:00:04.000+00:00"]]
    assert not report["ok"]


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hascheduler.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_dev_controls_refuse_bad_input_and_a_missing_cluster(tmp_path: Path) -> None:
    bad = run_cli("dev", "scale", "many", cwd=tmp_path)
    assert bad.returncode == 2
    assert "'many' is not a whole number" in bad.stderr
    bad = run_cli("dev", "kill-leader", "--signal", "HUP", cwd=tmp_path)
    assert bad.returncode == 2
    assert "invalid choice: 'HUP'" in bad.stderr
    for size, message in (
        ("0", "0 is not from 1 to 7 nats-servers"),
        ("99", "99 is not from 0 to 20"),
        ("3x", "'3x' is not a whole"),
    ):
        bad = run_cli("dev", "--nats-cluster", size, cwd=tmp_path)
        assert bad.returncode == 2
        assert message in bad.stderr
    none = run_cli("dev", "status", "--state-dir", str(tmp_path / "nothing"), cwd=tmp_path)
    assert none.returncode == 1
    assert "no running cluster found" in none.stderr
    # --broker means a broker URL, as for serve.
    bad = run_cli("dev", "--broker", "log", cwd=tmp_path)
    assert bad.returncode == 2
    assert "unsupported broker URL 'log'" in bad.stderr


def test_the_audit_command_refuses_bad_input(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    window = ["--since", now.isoformat(), "--until", (now + dt.timedelta(seconds=1)).isoformat()]
    uri = ["--mongodb-uri", "mongodb://127.0.0.1:9/"]
    cases = [
        (
            ["--since", "yesterday", "--until", now.isoformat(), *uri, "--broker", "nats://x:1"],
            "'yesterday' is not an ISO-8601 instant",
        ),
        (
            ["--since", "2030-01-01T00:00:00", "--until", now.isoformat()],
            "'2030-01-01T00:00:00' is not an ISO-8601 instant with a UTC offset",
        ),
        ([*window, "--broker", "nats://x:1"], "--mongodb-uri (or HASCHEDULER_MONGODB_URI)"),
        ([*window, *uri, "--broker", "log:"], "log keeps no fires to audit"),
        (
            ["--since", window[3], "--until", window[1], *uri, "--broker", "nats://x:1"],
            "--since must be before --until",
        ),
        (
            [*window, "--mongodb-uri", "mongodb://h:99999/", "--broker", "nats://x:1"],
            "--mongodb-uri: Port must be an integer",
        ),
        (
            [*window, "--mongodb-uri", "http://h/", "--broker", "nats://x:1"],
            "--mongodb-uri: Invalid URI scheme",
        ),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HASCHEDULER_")}
    for args, message in cases:
        bad = run_cli("audit", *args, cwd=tmp_path, env=env)
        assert bad.returncode == 2, (args, bad.stderr)
        assert message in bad.stderr, (args, bad.stderr)


@pytest.mark.devmongo_only
@pytest.mark.timeout(120)
def test_dev_cluster_controls_against_a_running_cluster(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    dev = DevCluster(str(state), "--replicas", "2", "--broker", "log:")
    try:
        assert set(dev.replicas) == {"r1", "r2"}
        assert all(url.startswith("http://") for url in dev.replicas.values())
        where = ("--state-dir", str(state))
        status = json.loads(run_cli("dev", "status", "--json", *where, cwd=tmp_path).stdout)
        assert len(status["replicas"]) == 2
        assert status["leader"] in {"r1", "r2"}

        short = run_cli(
            "dev", "kill-leader", "--signal", "STOP", "--stop-for", "1", *where, cwd=tmp_path
        )
        assert short.returncode == 1
        assert "stop_for_s: must be from the lease ttl" in short.stderr
        stopped = run_cli(
            "dev",
            "kill-leader",
            "--signal",
            "STOP",
            "--stop-for",
            "5",
            "--json",
            *where,
            cwd=tmp_path,
        )
        assert stopped.returncode == 0, stopped.stderr
        result = json.loads(stopped.stdout)
        assert result["new_leader"] != result["killed"]
        assert result["new_term"] > result["old_term"]

        bad = run_cli(
            "dev",
            "audit",
            "--since",
            "yesterday",
            "--until",
            "2030-01-01T00:00:00Z",
            *where,
            cwd=tmp_path,
        )
        assert bad.returncode == 1
        assert "since: must be an ISO-8601 instant" in bad.stderr
        no_stream = run_cli(
            "dev",
            "audit",
            "--since",
            "2030-01-01T00:00:00Z",
            "--until",
            "2030-01-01T00:01:00Z",
            *where,
            cwd=tmp_path,
        )
        assert no_stream.returncode == 1
        assert "auditing needs a broker (started with --broker log:)" in no_stream.stderr
        no_workers = run_cli("dev", "scale-workers", "2", *where, cwd=tmp_path)
        assert no_workers.returncode == 1
        assert "workers need a broker (started with --broker log:)" in no_workers.stderr
    finally:
        returncode = dev.stop()
    assert returncode == 0
    assert not (state / "state.json").exists()


@pytest.mark.long(28)
@pytest.mark.timeout(180)
def test_dev_runs_fires_on_its_workers_and_the_cli_finds_it(tmp_path: Path) -> None:
    """`hascheduler dev --workers 2 --nats-cluster 3`: fires run to outcomes the CLI shows
    without --api; a worker that exits is started again, and so is the NATS node leading
    the fire stream (replicated 3 ways) when it is SIGKILLed, with nothing lost or
    duplicated (`dev audit`); `scale-workers` changes the count."""
    state = tmp_path / ".hascheduler-dev"  # the default, seen from tmp_path
    env = {k: v for k, v in os.environ.items() if k != "HASCHEDULER_API"}
    dev = DevCluster(
        str(state), "--replicas", "1", "--workers", "2", "--nats-cluster", "3", env=env
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )

    def status() -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(cli("dev", "status", "--json").stdout)
        return answer

    def wait_replaced(kind: str, name: str, old_pid: int) -> dict[str, Any]:
        def replaced() -> dict[str, Any] | None:
            found = {c.get("id", c.get("name")): c for c in status()[kind]}
            child = found.get(name)
            return child if child and child["alive"] and child["pid"] != old_pid else None

        return wait_until_sync(replaced, 30, f"{name} to be started again", 0.2)

    try:
        before = status()
        assert [w["id"] for w in before["workers"]] == ["w1", "w2"]
        nodes = sorted(c["name"] for c in before["others"] if c["name"].startswith("nats-"))
        assert nodes == ["nats-1", "nats-2", "nats-3"]
        assert before["nats_uri"].count(",") == 2
        added = cli(
            "schedules",
            "add",
            "--id",
            "tick",
            "--name",
            "tick",
            "--target",
            "demo.tick",
            "--every",
            "1",
        )
        assert added.returncode == 0, added.stderr
        since = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)

        def succeeded(count: int) -> list[dict[str, Any]] | None:
            listed = cli("runs", "list", "--schedule", "tick", "--json")
            assert listed.returncode == 0, listed.stderr
            done = [r for r in json.loads(listed.stdout)["items"] if r["state"] == "succeeded"]
            return done if len(done) >= count else None

        runs = wait_until_sync(lambda: succeeded(3), 60, "three runs to succeed", 0.5)
        assert {r["worker_id"] for r in runs} <= {"w1", "w2"}
        assert all(r["attempts"] == 1 for r in runs)
        shown = cli("runs", "show", runs[0]["id"])
        assert json.loads(shown.stdout)["state"] == "succeeded"
        table = cli("runs", "list", "--state", "succeeded")
        assert runs[0]["id"] in table.stdout
        assert "ATTEMPTS" in table.stdout
        not_dead = cli("runs", "retry", runs[0]["id"])
        assert not_dead.returncode == 2
        assert "only a dead run" in not_dead.stderr

        others = {c["name"]: c for c in before["others"]}
        workers = {w["id"]: w for w in before["workers"]}
        os.kill(workers["w1"]["pid"], signal.SIGKILL)
        wait_replaced("workers", "w1", workers["w1"]["pid"])
        leader, replicas = asyncio.run(stream_leader(before["nats_uri"]))
        assert replicas == 3
        assert leader is not None
        assert leader in nodes
        killed_at = dt.datetime.now(dt.UTC)
        os.kill(others[leader]["pid"], signal.SIGKILL)
        again = wait_replaced("others", leader, others[leader]["pid"])
        assert again["address"] == others[leader]["address"]  # its port and store again
        count = len(succeeded(1) or [])
        wait_until_sync(lambda: succeeded(count + 3), 60, "runs after the restarts", 0.5)
        until = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
        assert since < killed_at < until

        last: list[dict[str, Any]] = []

        def clean() -> dict[str, Any] | None:
            done = cli(
                "dev", "audit", "--since", since.isoformat(), "--until", until.isoformat(), "--json"
            )
            last[:] = [json.loads(done.stdout)]
            return last[0] if done.returncode == 0 else None

        # A fire due while the stream elects a leader meets "no stream answered" (503) and
        # is retried every 2 s at most until one does: it arrives seconds late, and the
        # killed node's restart can stretch that further.
        try:
            report = wait_until_sync(clean, 45, "every fire of the window in the stream", 1.0)
        except AssertionError:
            raise AssertionError(last) from None
        assert report["delivered"] == report["expected"] >= 3, report
        # The same count straight from MongoDB and the stream, as the demos' last step.
        alone = cli(
            "audit",
            "--since",
            since.isoformat(),
            "--until",
            until.isoformat(),
            "--mongodb-uri",
            before["mongodb_uri"],
            "--broker",
            before["nats_uri"],
            "--json",
        )
        assert alone.returncode == 0, alone.stderr
        assert json.loads(alone.stdout) == report
        # A window from before the schedule existed (the natural choice) and one from its
        # creation: the audit expects nothing before it, nor at its instant.
        created = dt.datetime.fromisoformat(
            json.loads(cli("schedules", "get", "tick").stdout)["created_at"]
        )
        for start in (created - dt.timedelta(seconds=5), created):
            early = cli(
                "dev", "audit", "--since", start.isoformat(), "--until", until.isoformat(), "--json"
            )
            assert early.returncode == 0, early.stdout
        too_few = cli(
            "audit",
            "--since",
            since.isoformat(),
            "--until",
            until.isoformat(),
            "--mongodb-uri",
            before["mongodb_uri"],
            "--broker",
            before["nats_uri"],
            "--min-expected",
            str(report["expected"] + 1),
        )
        assert too_few.returncode == 1
        assert f"fewer than --min-expected {report['expected'] + 1}" in too_few.stderr

        scaled = cli("dev", "scale-workers", "3", "--json")
        assert [w["id"] for w in json.loads(scaled.stdout)["workers"]] == ["w1", "w2", "w3"]
        scaled = cli("dev", "scale-workers", "1")
        assert scaled.stdout.strip() == "workers: w1"
        assert cli("dev", "scale-workers", "99").returncode == 2
    finally:
        returncode = dev.stop()
    assert returncode == 0
    gone = cli("schedules", "list")
    assert gone.returncode == 1
    assert "no API named (--api or HASCHEDULER_API), and no local cluster" in gone.stderr


def test_dev_uses_a_nats_server_given_by_url(tmp_path: Path) -> None:
    server = start_nats()
    state = tmp_path / "dev"
    dev = DevCluster(str(state), "--replicas", "1", "--broker", server.uri)
    try:
        status = json.loads(
            run_cli("dev", "status", "--json", "--state-dir", str(state), cwd=tmp_path).stdout
        )
        assert status["nats_uri"] == server.uri
        assert {c["name"] for c in status["others"]} == {"devmongo"}  # no broker of its own
        assert [w["id"] for w in status["workers"]] == ["w1"]
    finally:
        returncode = dev.stop()
        server.stop()
    assert returncode == 0


@pytest.mark.long(18)
def test_dev_fires_through_a_rabbitmq_of_its_own(tmp_path: Path) -> None:
    """`hascheduler dev --broker rabbitmq`: a RabbitMQ node as its child (Debian's server,
    its state under the state directory), the replicas publishing to it, its worker running
    the fires, every fire also in the dev queue (`dev audit` reads it); stopped with the
    cluster, port mapper and all."""
    state = tmp_path / "dev"
    dev = DevCluster(str(state), "--replicas", "2", "--broker", "rabbitmq")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--state-dir", str(state), cwd=tmp_path)

    try:
        status = json.loads(cli("dev", "status", "--json").stdout)
        assert status["amqp_uri"].startswith("amqp://guest:guest@127.0.0.1:")
        assert status["nats_uri"] is None
        assert [w["id"] for w in status["workers"]] == ["w1"]
        rabbit = next(c for c in status["others"] if c["name"] == "rabbitmq")
        assert rabbit["address"].startswith("amqp://127.0.0.1:")
        api = next(iter(dev.replicas.values()))
        added = run_cli(
            "schedules",
            "--api",
            api,
            "add",
            "--id",
            "tick",
            "--name",
            "tick",
            "--target",
            "demo.tick",
            "--every",
            "1",
            cwd=tmp_path,
        )
        assert added.returncode == 0, added.stderr
        since = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)

        def audited() -> dict[str, Any] | None:
            until = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
            if until <= since + dt.timedelta(seconds=3):
                return None
            done = cli(
                "dev", "audit", "--since", since.isoformat(), "--until", until.isoformat(), "--json"
            )
            report: dict[str, Any] = json.loads(done.stdout)
            assert done.returncode == 0, report
            return report

        report = wait_until_sync(audited, 30, "three seconds of fires audited", 0.5)
        assert report["delivered"] == report["expected"] >= 3, report

        def succeeded() -> list[dict[str, Any]] | None:
            listed = run_cli(
                "runs", "--api", api, "list", "--schedule", "tick", "--json", cwd=tmp_path
            )
            assert listed.returncode == 0, listed.stderr
            done = [r for r in json.loads(listed.stdout)["items"] if r["state"] == "succeeded"]
            return done if len(done) >= 3 else None

        runs = wait_until_sync(succeeded, 30, "three runs on RabbitMQ to succeed", 0.5)
        assert {r["worker_id"] for r in runs} == {"w1"}
        assert all(r["attempts"] == 1 for r in runs)
        scaled = cli("dev", "scale-workers", "2", "--json")
        assert scaled.returncode == 0, scaled.stderr
        assert [w["id"] for w in json.loads(scaled.stdout)["workers"]] == ["w1", "w2"]
    finally:
        returncode = dev.stop()
    assert returncode == 0
    # No process of the node (its command line names its directory) outlived the cluster.
    left = subprocess.run(
        ["pgrep", "-f", str(state / "rabbitmq")], capture_output=True, text=True, check=False
    )
    assert left.returncode == 1, left.stdout


def test_ports_for_children_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    """A port in the ephemeral range can be taken by an outgoing connection's source port
    before the child binds it: a nats-server of the stream-cluster test failed so."""
    first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))  # an ephemeral port, held
        ports = [free_port() for _ in range(100)]
        assert busy.getsockname()[1] not in ports
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= port < first_ephemeral for port in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


HANDLER = """\
from pathlib import Path
from hascheduler.worker import WorkerApp

app = WorkerApp()


@app.handler("jobs.hello")
def hello(run):
    with Path("ran.txt").open("a") as ran:
        ran.write(run.fire_id + "\\n")
"""


@pytest.mark.long(20)
@pytest.mark.timeout(180)
def test_dev_runs_your_own_handler_and_no_target_it_does_not_handle(tmp_path: Path) -> None:
    """`hascheduler dev --app myjobs:app` from the directory holding myjobs.py: its
    handler runs each fire of its target (the run succeeded is one it ran); a target no
    handler is registered for gets no run at all, never a run recorded succeeded."""
    (tmp_path / "myjobs.py").write_text(HANDLER)
    env = {k: v for k, v in os.environ.items() if k not in ("HASCHEDULER_API", "PYTHONPATH")}
    dev = DevCluster(
        str(tmp_path / ".hascheduler-dev"), "--replicas", "1", "--app", "myjobs:app",
        env=env, cwd=tmp_path,
    )  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip

    try:
        for sid, target in (("hello", "jobs.hello"), ("orphan", "nobody.handles")):
            added = cli(
                "schedules", "add", "--id", sid, "--name", sid, "--target", target, "--every", "1"
            )
            assert added.returncode == 0, added.stderr

        def ran() -> list[str]:
            path = tmp_path / "ran.txt"
            return path.read_text().split() if path.exists() else []

        wait_until_sync(lambda: len(ran()) >= 3, 60, "the handler to run three fires", 0.5)
        listed = json.loads(cli("runs", "list", "--schedule", "hello", "--json").stdout)
        succeeded = {r["id"] for r in listed["items"] if r["state"] == "succeeded"}
        assert succeeded
        assert succeeded <= set(ran())  # each run succeeded is one the handler ran
        orphan = json.loads(cli("runs", "list", "--schedule", "orphan", "--json").stdout)
        assert orphan["items"] == []
        # A second dev in the same directory refuses, naming the first, and touches nothing.
        second = subprocess.run(
            [sys.executable, "-m", "hascheduler.cli", "dev"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert "a cluster is running from .hascheduler-dev (pid" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert cli("dev", "status").returncode == 0
        # A stopped process shows as stopped; no replica at all is refused.
        worker = json.loads(cli("dev", "status", "--json").stdout)["workers"][0]
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            assert "stopped" in cli("dev", "status").stdout
        finally:
            os.kill(worker["pid"], signal.SIGCONT)
        none = cli("dev", "scale", "0")
        assert none.returncode == 2
        assert "at least 1" in none.stderr
        forever = cli("dev", "audit", "--last", "forever")
        assert forever.returncode == 2
        assert "a duration such as" in forever.stderr
        assert cli("dev", "audit", "--last", "30s").returncode == 0
        # Its fires are there to see: published, with no run.
        url = next(iter(dev.replicas.values()))
        fires = httpx.get(f"{url}/schedules/orphan/fires", timeout=10).json()["items"]
        assert fires
        assert {f["state"] for f in fires} <= {"published", "claimed"}
    finally:
        # Ctrl-C: the children in order, each shutdown step in time, no state left.
        assert dev.stop(signal.SIGINT) == 0
    logs = list((tmp_path / ".hascheduler-dev" / "logs").glob("*.log"))
    assert logs
    failed = [p.name for p in logs if "shutdown_step_failed" in p.read_text()]
    assert failed == []
    assert not (tmp_path / ".hascheduler-dev" / "state.json").exists()
